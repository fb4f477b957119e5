"""Quest-style sparse decoding of a Hugging Face transformers Llama model through flash_attn_sparse.

The model is built from a LlamaConfig with random weights (nothing is downloaded). Prefill is
dense (torch SDPA, causal). Each decode step, per layer and per K/V head: the min and max of the
keys of every block (kept on the device, updated as tokens are appended) bound q.k from above
(summed over the query heads of the group); the top-k blocks plus the current tail block are
listed with `blocks_from_scores` and attended with `flash_attn_with_sparse_block_table`. No step
reads a value back to the host, so a decode step can be captured in a CUDA graph.

Registered as transformers attention functions (`AttentionInterface.register`):
  QUEST_ATTENTION  - dense prefill, Quest decode (install_quest sets each layer's settings);
  DENSE_ATTENTION  - the dense baseline over a StaticCache: dense prefill, SDPA decode over the
                     whole cache masked by position (query heads packed per K/V head).
Both read the positions from the `position_ids` keyword that Llama passes on; batch rows share
them (no padding), and prefill starts at position 0 (no chunked prefill).

  python examples/transformers_quest.py              # full density vs the model's own SDPA, 64 steps
                                                     # (free running and teacher-forced, compare_full_density)
  python examples/transformers_quest.py --bench --context 32768 --density 0.125
"""

import argparse
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from flash_attn_sparse import SparseBlocks, blocks_from_scores, flash_attn_with_sparse_block_table

QUEST_ATTENTION = "quest_sparse"  # no "flash"/"sdpa" in the names: transformers reads those as its own
DENSE_ATTENTION = "dense_masked_by_position"


# --- Quest selection: plain torch ops, no host sync, CPU or CUDA ------------------------------

def block_summaries(keys: Tensor, key_count: Tensor, block_size: int, num_blocks: int) -> Tuple[Tensor, Tensor]:
    """Elementwise (min, max) of the keys of each block, each (batch, heads_k, num_blocks, head_dim).

    keys: (batch, heads_k, seqlen, head_dim); key_count: int tensor (1,), the keys in use (those
    past it, e.g. a static cache's empty rows, are ignored). Blocks without keys get 0.
    """
    batch, heads_k, seqlen, head_dim = keys.shape
    padded = num_blocks * block_size
    keys = F.pad(keys[:, :, :padded], (0, 0, 0, padded - min(seqlen, padded)))
    in_use = (torch.arange(padded, device=keys.device) < key_count).view(1, 1, padded, 1)
    blocked = (batch, heads_k, num_blocks, block_size, head_dim)
    mins = torch.where(in_use, keys, float("inf")).view(blocked).amin(dim=3)
    maxs = torch.where(in_use, keys, float("-inf")).view(blocked).amax(dim=3)
    has_keys = in_use.view(1, 1, num_blocks, block_size, 1).any(dim=3)
    return torch.where(has_keys, mins, 0), torch.where(has_keys, maxs, 0)


def append_to_summaries(mins: Tensor, maxs: Tensor, new_key: Tensor, position: Tensor, block_size: int) -> None:
    """Folds the key at `position` (int tensor (1,)), new_key (batch, heads_k, 1, head_dim), into
    its block's summary in place. The first key of a block replaces the summary (so that blocks
    need not be reset), later ones take the elementwise min / max."""
    block = torch.div(position, block_size, rounding_mode="floor").long()
    first_of_block = (position % block_size == 0).view(1, 1, 1, 1)
    for summary, combine in ((mins, torch.minimum), (maxs, torch.maximum)):
        current = summary.index_select(2, block)
        summary.index_copy_(2, block, torch.where(first_of_block, new_key, combine(current, new_key)))


def quest_scores(query: Tensor, mins: Tensor, maxs: Tensor) -> Tensor:
    """Upper bound of q.k over each block, summed over the query heads (and rows) of each K/V head:
    float32 (batch, heads_k, 1, num_blocks). query: (batch, heads, seqlen_q, head_dim), query head
    i reading K/V head i // (heads / heads_k) as transformers' repeat_kv does."""
    batch, heads, seqlen_q, head_dim = query.shape
    heads_k = mins.shape[1]
    q = query.float().reshape(batch, heads_k, (heads // heads_k) * seqlen_q, head_dim)
    # max(q_d * min_d, q_d * max_d) is q_d * max_d where q_d >= 0 and q_d * min_d where q_d < 0.
    bound = q.clamp(min=0) @ maxs.float().transpose(-1, -2) + q.clamp(max=0) @ mins.float().transpose(-1, -2)
    return bound.sum(dim=2, keepdim=True)


def select_blocks(scores: Tensor, key_count: Tensor, top_k: int, block_size: int) -> SparseBlocks:
    """The top_k best-scoring complete blocks plus the tail block (the one holding the last key) of
    each (batch, K/V head) row: the tail as a causal "mask" block, the others "full"."""
    batch = scores.shape[0]
    valid_blocks = torch.div(key_count + block_size - 1, block_size, rounding_mode="floor").long().expand(batch)
    return blocks_from_scores(scores, k=top_k, block_size=block_size, local_blocks=1,
                              num_valid_blocks=valid_blocks, causal_diagonal=True)


# --- the attention functions ------------------------------------------------------------------

@dataclass
class QuestSettings:
    top_k: int  # blocks chosen by score per step, besides the tail block
    block_size: int = 128
    max_length: int = 4096  # capacity of the summaries, in tokens
    backend: str = "auto"


class QuestLayerState:
    """One layer's key summaries, allocated at prefill."""

    def __init__(self, settings: QuestSettings):
        self.settings = settings
        self.mins: Optional[Tensor] = None
        self.maxs: Optional[Tensor] = None

    def refresh(self, key: Tensor, key_count: Tensor) -> None:
        capacity = math.ceil(self.settings.max_length / self.settings.block_size)
        self.mins, self.maxs = block_summaries(key, key_count, self.settings.block_size, capacity)

    def blocks_for(self, query: Tensor, key: Tensor, key_count: Tensor) -> SparseBlocks:
        block_size = self.settings.block_size
        new_key = key.index_select(2, key_count - 1)
        append_to_summaries(self.mins, self.maxs, new_key, key_count - 1, block_size)
        num_blocks = math.ceil(key.shape[2] / block_size)
        if num_blocks > self.mins.shape[2]:
            raise ValueError(f"the cache holds {key.shape[2]} keys, past QuestSettings.max_length={self.settings.max_length}")
        scores = quest_scores(query, self.mins[:, :, :num_blocks], self.maxs[:, :, :num_blocks])
        return select_blocks(scores, key_count, self.settings.top_k, block_size)


def _key_count(kwargs) -> Tensor:
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError("these attention functions need the position_ids keyword (Llama passes it on)")
    return position_ids[0, -1:] + 1


def _dense_prefill(module, query, key, value, scaling, kwargs):
    """Prefill from position 0: causal SDPA over the prompt's keys (a static cache holds more rows)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    seqlen = query.shape[2]
    kwargs = {name: value for name, value in kwargs.items() if name not in ("is_causal", "dropout")}
    return sdpa_attention_forward(module, query, key[:, :, :seqlen], value[:, :, :seqlen], None, scaling=scaling,
                                  is_causal=True, **kwargs)


def quest_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                    scaling: Optional[float] = None, **kwargs):
    """transformers attention function: query (b, heads, seqlen_q, d), key/value (b, heads_k,
    seqlen_k, d) after the cache update; returns ((b, seqlen_q, heads, d), None)."""
    state: QuestLayerState = module.quest_state
    key_count = _key_count(kwargs)
    if query.shape[2] > 1:
        state.refresh(key, key_count)
        return _dense_prefill(module, query, key, value, scaling, kwargs)
    blocks = state.blocks_for(query, key, key_count)
    seqused_k = key_count.to(torch.int32).expand(query.shape[0]).contiguous()
    # transposes are views; the kernels need only a contiguous head dim
    out, _ = flash_attn_with_sparse_block_table(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                                blocks, softmax_scale=scaling, causal=True, seqused_k=seqused_k,
                                                backend=state.settings.backend)
    return out, None


def dense_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                    scaling: Optional[float] = None, **kwargs):
    """The dense baseline over any cache: decode is SDPA over every cached row, those past the
    position masked; the query heads of a K/V head are packed as rows (as transformers' SDPA
    decode does), so SDPA needs no GQA expansion."""
    if query.shape[2] > 1:
        return _dense_prefill(module, query, key, value, scaling, kwargs)
    batch, heads, _, head_dim = query.shape
    heads_k, seqlen_k = key.shape[1], key.shape[2]
    visible = (torch.arange(seqlen_k, device=key.device) < _key_count(kwargs)).view(1, 1, 1, seqlen_k)
    packed = query.reshape(batch, heads_k, heads // heads_k, head_dim)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=visible, scale=scaling)
    return out.reshape(batch, heads, 1, head_dim).transpose(1, 2), None


def register_attention_functions() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(QUEST_ATTENTION, quest_attention)
    AttentionInterface.register(DENSE_ATTENTION, dense_attention)


def install_quest(model, settings: QuestSettings) -> None:
    """Gives every attention layer its summaries and switches the model to Quest attention."""
    register_attention_functions()
    for layer in model.model.layers:
        layer.self_attn.quest_state = QuestLayerState(settings)
    model.set_attn_implementation(QUEST_ATTENTION)


# --- model, greedy decoding, CUDA graphs ------------------------------------------------------

def build_model(hidden: int = 1024, layers: int = 4, heads: int = 32, heads_k: int = 8, head_dim: int = 128,
                vocab: int = 32000, max_positions: int = 40960, device="cuda", dtype=torch.bfloat16, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.75), num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads_k, head_dim=head_dim,
                         vocab_size=vocab, max_position_embeddings=max_positions)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    model = model.to(dtype).eval()
    # The LM head in float32: bf16 logits of a random model tie (top-2 margins of exactly 0), and
    # a tie makes greedy decoding pick by rounding noise rather than by the attention compared.
    model.lm_head.float()
    model.lm_head.register_forward_pre_hook(lambda module, args: (args[0].float(),))
    return model


class GreedyDecoder:
    """Greedy decoding whose step keeps its state on the device: the last token and its position
    live in fixed buffers, so the same step runs eagerly or as a captured CUDA graph. Every
    decoded token (the prefill's first) is recorded on the device, with its logits if asked.
    With `forced` (batch, steps) tokens, step i reads forced[:, i - 1] instead of the last choice
    (teacher forcing): the choices and logits are then those of the given context at every step."""

    def __init__(self, model, cache, prompt: Tensor, keep_logits: bool = False, forced: Optional[Tensor] = None):
        self.model, self.keep_logits, self.forced = model, keep_logits, forced
        # transformers 5.24 renamed past_key_values to cache (the old name warns); 5.17 has the old one
        cache_keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.cache_argument = {cache_keyword: cache}
        batch, length = prompt.shape
        positions = torch.arange(length, device=prompt.device).expand(batch, length)
        logits = self._forward(prompt, positions)
        self.logits = logits.float()
        self.token = logits.argmax(dim=-1, keepdim=True)
        self.position = torch.full((batch, 1), length, dtype=torch.long, device=prompt.device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.tokens, self.logit_history = [], []
        self._record()

    def _forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        out = self.model(input_ids=tokens, position_ids=positions, use_cache=True, logits_to_keep=1,
                         **self.cache_argument)
        return out.logits[:, -1]

    def _step(self) -> None:
        logits = self._forward(self.token, self.position)
        self.logits.copy_(logits)
        self.token.copy_(logits.argmax(dim=-1, keepdim=True))
        self.position.add_(1)

    def _record(self) -> None:
        self.tokens.append(self.token.clone())
        if self.keep_logits:
            self.logit_history.append(self.logits.clone())
        if self.forced is not None:  # the next step reads the given token, not this choice
            step = len(self.tokens) - 1
            self.token.copy_(self.forced[:, step:step + 1])

    def capture(self, warmup_steps: int = 2) -> None:
        """Captures one step in a CUDA graph, after warmup_steps eager steps (recorded: they decode)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup_steps):
                self._step()
                self._record()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()

    def decode(self, steps: int) -> None:
        for _ in range(steps):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
            self._record()

    def decode_until(self, total: int) -> Tuple[Tensor, Optional[Tensor]]:
        """Decodes until `total` tokens are recorded; (batch, total) tokens and their logits."""
        self.decode(total - len(self.tokens))
        logits = torch.stack(self.logit_history, dim=1) if self.keep_logits else None
        return torch.cat(self.tokens, dim=1), logits


@torch.no_grad()
def compare_full_density(model, prompt: Tensor, steps: int, block_size: int = 128, backend: str = "auto",
                         make_cache: Optional[Callable] = None, graphed: bool = False,
                         attention: str = QUEST_ATTENTION) -> dict:
    """Greedy decoding of prefill + `steps` tokens with the model's own SDPA attention (DynamicCache),
    then with `attention` (Quest selecting every block, or DENSE_ATTENTION) on make_cache(max_length)'s
    cache (default a DynamicCache), under a CUDA graph if graphed (needs a StaticCache): once free
    running, once teacher-forced on the reference's tokens, so that every step's logits compare over
    the same context. A random model's top-2 logits can lie within bf16 attention's rounding of each
    other; where they do, the first free-running difference says nothing about the attention, and the
    teacher-forced logits still compare at every later step.

    Returns the tokens (reference, free running, forced), the largest |logit difference| of the
    forced run, the largest |logit| and smallest top-2 margin of the reference, the free run's
    identical prefix length, and the first step (and the count of steps) whose reference top-2
    margin is at most twice the largest logit difference: a near tie, where a choice may flip by
    rounding. Correct attention keeps the free run identical up to the first near tie at least."""
    from transformers import DynamicCache
    model.set_attn_implementation("sdpa")
    reference = GreedyDecoder(model, DynamicCache(config=model.config), prompt, keep_logits=True)
    ref_tokens, ref_logits = reference.decode_until(steps + 1)
    max_length = prompt.shape[1] + steps + 1
    results = {}
    for name, forced in (("free", None), ("forced", ref_tokens)):
        if attention == QUEST_ATTENTION:
            install_quest(model, QuestSettings(top_k=math.ceil(max_length / block_size), block_size=block_size,
                                               max_length=max_length, backend=backend))
        else:
            register_attention_functions()
            model.set_attn_implementation(attention)
        cache = make_cache(max_length) if make_cache else DynamicCache(config=model.config)
        decoder = GreedyDecoder(model, cache, prompt, keep_logits=True, forced=forced)
        if graphed:
            decoder.capture()
        results[name] = decoder.decode_until(steps + 1)
    model.set_attn_implementation("sdpa")
    (free_tokens, _), (forced_tokens, forced_logits) = results["free"], results["forced"]
    top2 = ref_logits.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    max_diff = (forced_logits - ref_logits).abs().max().item()
    same = (free_tokens == ref_tokens).all(dim=0)
    near_tie = margin.min(dim=0).values <= 2 * max_diff  # per step, over the batch
    return {"reference": ref_tokens, "quest": free_tokens, "forced": forced_tokens, "max_logit_diff": max_diff,
            "max_abs_logit": ref_logits.abs().max().item(), "min_reference_margin": margin.min().item(),
            "identical_prefix": int(same.long().cumprod(0).sum().item()),
            "first_near_tie": int(near_tie.long().argmax().item()) if near_tie.any() else steps + 1,
            "near_ties": int(near_tie.sum().item())}


def describe(result: dict, steps: int) -> str:
    """One line on a compare_full_density result."""
    return (f"free running: the first {result['identical_prefix']} of {steps + 1} tokens identical (first near tie: "
            f"step {result['first_near_tie']}); teacher-forced: max |logit diff| {result['max_logit_diff']:.3g} "
            f"(max |logit| {result['max_abs_logit']:.3g}); {result['near_ties']} steps with a reference top-2 margin "
            f"within twice that (smallest {result['min_reference_margin']:.3g})")


def static_cache_maker(model):
    from transformers import StaticCache
    return lambda max_length: StaticCache(config=model.config, max_cache_len=max_length)


@torch.no_grad()
def decode_tokens_per_second(model, prompt: Tensor, steps: int, attention: str, graphed: bool,
                             settings: Optional[QuestSettings] = None) -> float:
    """Decode throughput (tokens/s over the batch) after a prefill of `prompt`, on a StaticCache."""
    max_length = math.ceil((prompt.shape[1] + steps + 8) / 256) * 256
    if attention == QUEST_ATTENTION:
        install_quest(model, QuestSettings(top_k=settings.top_k, block_size=settings.block_size,
                                           max_length=max_length, backend=settings.backend))
    else:
        register_attention_functions()
        model.set_attn_implementation(attention)
    decoder = GreedyDecoder(model, static_cache_maker(model)(max_length), prompt)
    if graphed:
        decoder.capture()
    else:
        decoder.decode(2)  # warm up as the graphed run does
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    decoder.decode(steps)
    end.record()
    end.synchronize()
    return steps * prompt.shape[0] / (start.elapsed_time(end) / 1000)


def bench(args) -> None:
    model = build_model(hidden=args.hidden, layers=args.layers, max_positions=args.context + 1024)
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.context), device="cuda")
    context_blocks = math.ceil(args.context / args.block_size)
    top_k = max(math.ceil(args.density * context_blocks) - 1, 0)
    settings = QuestSettings(top_k=top_k, block_size=args.block_size, backend=args.backend)
    rows = []
    for name, attention in (("dense SDPA", DENSE_ATTENTION), (f"Quest 1/{round(1 / args.density)}", QUEST_ATTENTION)):
        eager = decode_tokens_per_second(model, prompt, args.steps, attention, graphed=False, settings=settings)
        graphed = decode_tokens_per_second(model, prompt, args.steps, attention, graphed=True, settings=settings)
        rows.append((name, eager, graphed))
    print(f"\nLlama {args.layers} layers, hidden {args.hidden}, 32/8 heads, head dim 128, bf16, batch {args.batch}, "
          f"context {args.context}, block {args.block_size}, {top_k + 1} of {context_blocks} blocks per K/V head, "
          f"{args.steps} steps, StaticCache\n")
    print("| attention | eager tokens/s | CUDA graph tokens/s | eager vs dense eager | graph vs dense graph |")
    print("|---|---|---|---|---|")
    for name, eager, graphed in rows:
        print(f"| {name} | {eager:.1f} | {graphed:.1f} | {eager / rows[0][1]:.2f}x | {graphed / rows[0][2]:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", action="store_true", help="tokens/s at --context and --density (else: the exactness check)")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--density", type=float, default=0.125)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--backend", default="auto", choices=("auto", "fa2", "fa4"))
    args = parser.parse_args()
    if args.bench:
        bench(args)
        return
    model = build_model(hidden=1024, layers=4)
    prompt = torch.randint(0, model.config.vocab_size, (2, 350), device="cuda")
    for graphed in (False, True):
        result = compare_full_density(model, prompt, args.steps, block_size=args.block_size, backend=args.backend,
                                      make_cache=static_cache_maker(model) if graphed else None, graphed=graphed)
        print(f"{'StaticCache + CUDA graph' if graphed else 'DynamicCache, eager'}: {describe(result, args.steps)}")


if __name__ == "__main__":
    main()
