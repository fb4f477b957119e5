"""CPU tests of examples/transformers_quest.py: the Quest summaries, scores and block selection
against brute force, without host syncs, and the whole integration on a tiny CPU Llama with the
attention kernel replaced by a float64 reference over the lists it is given."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "transformers_quest.py"
_spec = importlib.util.spec_from_file_location("transformers_quest", EXAMPLE)
quest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quest)

SYNCING = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
           "masked_select", "unique", "argwhere"}


class NoHostSync(TorchFunctionMode):
    """Fails on every tensor operation that reads values back to the host or has a data-dependent shape."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCING:
            raise AssertionError(f"host sync: Tensor.{name}")
        if name == "__getitem__" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                         for i in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            raise AssertionError("host sync: boolean-mask indexing")
        return func(*args, **(kwargs or {}))


def test_no_host_sync_mode_catches_syncs():
    x = torch.ones(3)
    for read in (lambda: x.sum().item(), lambda: bool(x[0]), lambda: x[x > 0], lambda: x.nonzero()):
        with NoHostSync(), pytest.raises(AssertionError, match="host sync"):
            read()


def brute_summaries(keys, count, block_size, num_blocks):
    batch, heads_k, _, dim = keys.shape
    mins, maxs = torch.zeros(batch, heads_k, num_blocks, dim), torch.zeros(batch, heads_k, num_blocks, dim)
    for block in range(num_blocks):
        rows = keys[:, :, block * block_size:min((block + 1) * block_size, count)]
        if rows.shape[2]:
            mins[:, :, block], maxs[:, :, block] = rows.min(dim=2).values, rows.max(dim=2).values
    return mins, maxs


@pytest.mark.parametrize("count", [1, 16, 37, 64, 70])
def test_block_summaries_match_brute_force(count):
    torch.manual_seed(count)
    keys = torch.randn(2, 3, 80, 8)
    keys[:, :, count:] = 1e6  # rows past the count (an empty static cache) must not count
    with NoHostSync():
        mins, maxs = quest.block_summaries(keys, torch.tensor([count]), 16, 6)
    ref_min, ref_max = brute_summaries(keys, count, 16, 6)
    assert torch.equal(mins, ref_min) and torch.equal(maxs, ref_max)


def test_appending_keeps_summaries_exact_across_blocks():
    torch.manual_seed(1)
    keys = torch.randn(2, 2, 64, 8)
    mins, maxs = quest.block_summaries(keys, torch.tensor([13]), 16, 4)
    mins[:, :, 1:] = -5.0  # stale values in blocks not yet started: the first key replaces them
    maxs[:, :, 1:] = 5.0
    with NoHostSync():
        for position in range(13, 64):
            quest.append_to_summaries(mins, maxs, keys[:, :, position:position + 1], torch.tensor([position]), 16)
    ref_min, ref_max = brute_summaries(keys, 64, 16, 4)
    assert torch.equal(mins, ref_min) and torch.equal(maxs, ref_max)


def test_scores_are_the_quest_bound_summed_over_the_group():
    torch.manual_seed(2)
    batch, heads, heads_k, dim, block_size, blocks = 2, 6, 2, 8, 16, 4
    keys = torch.randn(batch, heads_k, blocks * block_size, dim)
    query = torch.randn(batch, heads, 1, dim)
    mins, maxs = brute_summaries(keys, keys.shape[2], block_size, blocks)
    with NoHostSync():
        scores = quest.quest_scores(query, mins, maxs)
    assert scores.shape == (batch, heads_k, 1, blocks)
    group = heads // heads_k
    for b in range(batch):
        for h in range(heads_k):
            for n in range(blocks):
                bound = sum(max(query[b, i, 0, d] * mins[b, h, n, d], query[b, i, 0, d] * maxs[b, h, n, d])
                            for i in range(h * group, (h + 1) * group) for d in range(dim))
                assert scores[b, h, 0, n].item() == pytest.approx(bound.item(), rel=1e-5, abs=1e-5)
                # an upper bound of every head's largest q.k in the block, hence of their sum
                block_keys = keys[b, h, n * block_size:(n + 1) * block_size]
                best = sum((block_keys @ query[b, i, 0]).max() for i in range(h * group, (h + 1) * group))
                assert scores[b, h, 0, n] >= best - 1e-4


def listed(cnt, idx, b, h):
    return idx[b, h, 0, :cnt[b, h, 0]].tolist()


@pytest.mark.parametrize("count, top_k", [(1, 3), (48, 2), (50, 2), (100, 3), (100, 0), (100, 99)])
def test_selection_is_top_k_plus_the_tail_block(count, top_k):
    torch.manual_seed(count + top_k)
    batch, heads_k, block_size, blocks = 2, 3, 16, 8
    scores = torch.randn(batch, heads_k, 1, blocks)
    scores[..., -1] = 1e9  # a block past the count never wins, however high its score
    with NoHostSync():
        selection = quest.select_blocks(scores, torch.tensor([count]), top_k, block_size)
    tail = (count - 1) // block_size
    for b in range(batch):
        for h in range(heads_k):
            ranked = sorted(range(tail), key=lambda n: -scores[b, h, 0, n].item())
            assert listed(selection.full_cnt, selection.full_idx, b, h) == sorted(ranked[:top_k])
            assert listed(selection.mask_cnt, selection.mask_idx, b, h) == [tail]
    assert selection.block_size == block_size


def reference_sparse_attention(q, k, v, blocks, *, softmax_scale, causal, seqused_k, backend):
    """float64 attention of q (b, 1, h, d) over the listed blocks of k, v (b, L, hk, d); no host
    sync either, so that the decode step runs whole under NoHostSync."""
    batch, _, heads, _ = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    num_blocks = math.ceil(seqlen_k / blocks.block_size)
    listed_blocks = torch.zeros(batch, heads_k, num_blocks + 1, dtype=torch.bool)
    for cnt, idx in ((blocks.full_cnt, blocks.full_idx), (blocks.mask_cnt, blocks.mask_idx)):
        in_list = torch.arange(idx.shape[-1]) < cnt[:, :, 0, None]
        listed_blocks.scatter_(-1, torch.where(in_list, idx[:, :, 0], num_blocks).long(), True)
    visible = listed_blocks[..., :num_blocks].repeat_interleave(blocks.block_size, dim=-1)[..., :seqlen_k]
    visible = visible & (torch.arange(seqlen_k) < seqused_k.view(batch, 1, 1))
    group = heads // heads_k
    visible = visible.repeat_interleave(group, dim=1).unsqueeze(2)  # (b, h, 1, L)
    scores = q.double().transpose(1, 2) @ k.double().repeat_interleave(group, dim=2).permute(0, 2, 3, 1)
    probs = (scores * softmax_scale).masked_fill(~visible, float("-inf")).softmax(dim=-1)
    out = probs @ v.double().repeat_interleave(group, dim=2).transpose(1, 2)
    reference_sparse_attention.calls.append((q, k, blocks, seqused_k))
    return out.transpose(1, 2).to(q.dtype), None


@pytest.fixture
def cpu_kernel(monkeypatch):
    reference_sparse_attention.calls = []
    monkeypatch.setattr(quest, "flash_attn_with_sparse_block_table", reference_sparse_attention)
    return reference_sparse_attention


def tiny_model():
    return quest.build_model(hidden=64, layers=2, heads=4, heads_k=2, head_dim=16, vocab=97, max_positions=256,
                             device="cpu", dtype=torch.float32, seed=3)


@pytest.mark.parametrize("static", [False, True], ids=["DynamicCache", "StaticCache"])
def test_full_density_decodes_the_tokens_of_sdpa(cpu_kernel, static):
    model = tiny_model()
    prompt = torch.randint(0, 97, (2, 27), generator=torch.Generator().manual_seed(0))
    result = quest.compare_full_density(model, prompt, 24, block_size=16,
                                        make_cache=quest.static_cache_maker(model) if static else None)
    assert torch.equal(result["reference"], result["quest"]) and torch.equal(result["reference"], result["forced"])
    assert result["max_logit_diff"] < 1e-4 and result["identical_prefix"] == 25
    assert len(cpu_kernel.calls) == 2 * 24 * 2  # every step of every layer, free and forced, went through the lists


@torch.no_grad()
def test_teacher_forcing_feeds_the_given_tokens_and_records_the_models_choices():
    """GreedyDecoder(forced=...) reads forced[:, i - 1] at step i: its logits are the model's over
    prompt + forced tokens (one causal forward over the whole sequence gives them)."""
    from transformers import DynamicCache
    model = tiny_model()
    prompt = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(5))
    forced = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(6))
    decoder = quest.GreedyDecoder(model, DynamicCache(config=model.config), prompt, keep_logits=True, forced=forced)
    tokens, logits = decoder.decode_until(9)
    sequence = torch.cat([prompt, forced[:, :8]], dim=1)
    whole = model(input_ids=sequence).logits[:, prompt.shape[1] - 1:].float()
    torch.testing.assert_close(logits, whole, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens, whole.argmax(dim=-1))


def test_wrong_attention_fails_the_gpu_tests_rule(cpu_kernel, monkeypatch):
    """The GPU tests' rule (forced logits within 5% of the largest, free run identical to the first
    near tie) holds for exact attention and fails for attention whose output is off by half."""
    model = tiny_model()
    prompt = torch.randint(0, 97, (2, 27), generator=torch.Generator().manual_seed(0))
    exact = quest.compare_full_density(model, prompt, 12, block_size=16)
    monkeypatch.setattr(quest, "flash_attn_with_sparse_block_table",
                        lambda *args, **kwargs: (reference_sparse_attention(*args, **kwargs)[0] * 1.5, None))
    wrong = quest.compare_full_density(model, prompt, 12, block_size=16)
    assert exact["max_logit_diff"] < 0.05 * exact["max_abs_logit"] and exact["identical_prefix"] >= exact["first_near_tie"]
    assert wrong["max_logit_diff"] >= 0.05 * wrong["max_abs_logit"]


@torch.no_grad()
def test_sparse_decode_lists_the_brute_force_quest_blocks(cpu_kernel):
    from transformers import DynamicCache, StaticCache
    model = tiny_model()
    block_size, top_k = 16, 2
    prompt = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    for cache in (DynamicCache(config=model.config), StaticCache(config=model.config, max_cache_len=80)):
        cpu_kernel.calls.clear()
        quest.install_quest(model, quest.QuestSettings(top_k=top_k, block_size=block_size, max_length=80))
        decoder = quest.GreedyDecoder(model, cache, prompt)
        with NoHostSync():
            decoder.decode(30)  # crosses the blocks at 48 and 64
        for q, k, blocks, seqused in cpu_kernel.calls:  # every step of every layer
            count = int(seqused[0])
            keys = k.transpose(1, 2)  # (b, hk, L, d)
            mins, maxs = brute_summaries(keys, count, block_size, math.ceil(count / block_size))
            group = q.shape[2] // k.shape[2]
            tail = (count - 1) // block_size
            for h in range(k.shape[2]):
                heads = q[0, 0, h * group:(h + 1) * group]
                bound = [sum(torch.maximum(heads * mins[0, h, n], heads * maxs[0, h, n]).sum(-1)).item()
                         for n in range(tail)]
                best = sorted(sorted(range(tail), key=lambda n: -bound[n])[:top_k])
                assert listed(blocks.full_cnt, blocks.full_idx, 0, h) == best
                assert listed(blocks.mask_cnt, blocks.mask_idx, 0, h) == [tail]
        assert len(cpu_kernel.calls) == 30 * 2


@torch.no_grad()
def test_dense_baseline_on_a_static_cache_decodes_the_tokens_of_sdpa():
    from transformers import DynamicCache, StaticCache
    model = tiny_model()
    prompt = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(4))
    reference = quest.GreedyDecoder(model, DynamicCache(config=model.config), prompt, keep_logits=True)
    ref_tokens, ref_logits = reference.decode_until(20)
    quest.register_attention_functions()
    model.set_attn_implementation(quest.DENSE_ATTENTION)
    dense = quest.GreedyDecoder(model, StaticCache(config=model.config, max_cache_len=64), prompt, keep_logits=True)
    with NoHostSync():
        dense.decode(19)
    tokens, logits = dense.decode_until(20)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
