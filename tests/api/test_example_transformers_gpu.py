"""GPU tests of examples/transformers_quest.py: with every block selected, decoding through
flash_attn_sparse gives the logits of the model's own SDPA attention over 64 teacher-forced steps
(eagerly on a DynamicCache, and replayed as a CUDA graph on a StaticCache), and free-running greedy
decoding its tokens up to the first near tie (a step whose top-2 logits lie within twice that
difference: a random bf16 model has them, and there a choice flips by rounding alone); at 1/8
density each decode call equals float32 attention over the blocks it lists, with the static
cache's unused rows poisoned."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "transformers_quest.py"
_spec = importlib.util.spec_from_file_location("transformers_quest", EXAMPLE)
quest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quest)

STEPS = 64


@pytest.fixture(scope="module")
def model():
    return quest.build_model(hidden=1024, layers=4, vocab=32000, max_positions=4096)


def report(label, result, steps=STEPS):
    print(f"\n{label}: {quest.describe(result, steps)}")


def assert_same_decoding(result):
    """Teacher-forced logits within 5% of the largest logit (bf16 attention, 4 layers); the free
    run identical at least until the first near tie (else the attention, not rounding, parted it)."""
    assert result["max_logit_diff"] < 0.05 * result["max_abs_logit"], result["max_logit_diff"]
    assert result["identical_prefix"] >= result["first_near_tie"], (result["reference"], result["quest"])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fa2", "auto"])
def test_every_block_decodes_the_tokens_of_sdpa(model, backend):
    prompt = torch.randint(0, 32000, (2, 350), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    result = quest.compare_full_density(model, prompt, STEPS, block_size=128, backend=backend)
    report(f"DynamicCache, eager, backend={backend}", result)
    assert_same_decoding(result)


@pytest.mark.gpu
def test_every_block_decodes_the_tokens_of_sdpa_in_a_cuda_graph(model):
    prompt = torch.randint(0, 32000, (2, 333), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    result = quest.compare_full_density(model, prompt, STEPS, block_size=64, backend="fa2",
                                        make_cache=quest.static_cache_maker(model), graphed=True)
    report("StaticCache + CUDA graph, block 64", result)
    assert_same_decoding(result)


def attention_over_lists(q, k, v, blocks, seqused_k, scale):
    """float32 attention of q (b, 1, h, d) over the listed blocks of k, v (b, L, hk, d)."""
    batch, _, heads, _ = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    num_blocks = math.ceil(seqlen_k / blocks.block_size)
    listed = torch.zeros(batch, heads_k, num_blocks + 1, dtype=torch.bool, device=q.device)
    for cnt, idx in ((blocks.full_cnt, blocks.full_idx), (blocks.mask_cnt, blocks.mask_idx)):
        in_list = torch.arange(idx.shape[-1], device=q.device) < cnt[:, :, 0, None]
        listed.scatter_(-1, torch.where(in_list, idx[:, :, 0], num_blocks).long(), True)
    visible = listed[..., :num_blocks].repeat_interleave(blocks.block_size, dim=-1)[..., :seqlen_k]
    visible &= torch.arange(seqlen_k, device=q.device) < seqused_k.view(batch, 1, 1)
    group = heads // heads_k
    kf = torch.nan_to_num(k.float()).repeat_interleave(group, dim=2).transpose(1, 2)  # poisoned rows are masked
    vf = torch.nan_to_num(v.float()).repeat_interleave(group, dim=2).transpose(1, 2)
    scores = (q.float().transpose(1, 2) @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible.repeat_interleave(group, dim=1).unsqueeze(2), float("-inf"))
    return (scores.softmax(dim=-1) @ vf).transpose(1, 2), visible


@pytest.mark.gpu
@torch.no_grad()
def test_sparse_decode_equals_attention_over_its_lists(model, monkeypatch):
    from transformers import StaticCache
    calls = []
    kernel = quest.flash_attn_with_sparse_block_table

    def recording_kernel(q, k, v, blocks, **options):
        out, lse = kernel(q, k, v, blocks, **options)
        calls.append((q.clone(), k, v, blocks, options["seqused_k"].clone(), options["softmax_scale"], out))
        return out, lse

    monkeypatch.setattr(quest, "flash_attn_with_sparse_block_table", recording_kernel)
    block_size, length, steps = 64, 1500, 40
    max_length = length + steps + 8
    top_k = math.ceil(length / block_size / 8) - 1
    quest.install_quest(model, quest.QuestSettings(top_k=top_k, block_size=block_size, max_length=max_length,
                                                   backend="fa2"))
    cache = StaticCache(config=model.config, max_cache_len=max_length)
    prompt = torch.randint(0, 32000, (2, length), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    decoder = quest.GreedyDecoder(model, cache, prompt)
    for layer in cache.layers:  # rows not yet written: a kernel reading them would return NaN
        layer.keys[:, :, length:] = float("nan")
        layer.values[:, :, length:] = float("nan")
    decoder.decode(steps)
    model.set_attn_implementation("sdpa")
    assert len(calls) == steps * model.config.num_hidden_layers
    for q, k, v, blocks, seqused_k, scale, out in calls[::7]:
        expected, visible = attention_over_lists(q, k, v, blocks, seqused_k, scale)
        listed_keys = visible.sum(dim=-1)
        assert (listed_keys < seqused_k.view(-1, 1)).all(), "the lists should be sparse"
        assert (blocks.full_cnt == top_k).all() and (blocks.mask_cnt == 1).all()
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_dense_baseline_in_a_cuda_graph_decodes_the_tokens_of_sdpa(model):
    """The benchmark's dense baseline (SDPA over a StaticCache masked by position), graphed."""
    prompt = torch.randint(0, 32000, (2, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    result = quest.compare_full_density(model, prompt, 32, attention=quest.DENSE_ATTENTION,
                                        make_cache=quest.static_cache_maker(model), graphed=True)
    report("dense baseline, StaticCache + CUDA graph", result, steps=32)
    assert_same_decoding(result)
