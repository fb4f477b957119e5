"""blocks_from_csr: FlashInfer-style block-CSR to SparseBlocks, against a Python loop."""

import pytest
import torch

import flash_attn_sparse as fas
from flash_attn_sparse import SparseInputError
from flash_attn_sparse.options import CallOptions


def random_csr(rows, key_blocks, seed, dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    lists = [torch.randperm(key_blocks, generator=g)[:int(torch.randint(0, key_blocks + 1, (1,), generator=g))].tolist()
             for _ in range(rows)]
    indptr = torch.tensor([0] + [len(row) for row in lists], dtype=dtype).cumsum(0).to(dtype)
    indices = torch.tensor([i for row in lists for i in row], dtype=dtype)
    return lists, indptr, indices


@pytest.mark.parametrize("batch,heads,m_blocks,width", [(1, 1, 4, None), (2, 3, 2, None), (2, 2, 3, 8), (1, 2, 1, None)])
@pytest.mark.parametrize("kind", ["full", "mask"])
def test_rows_match_a_python_loop(batch, heads, m_blocks, width, kind):
    lists, indptr, indices = random_csr(batch * heads * m_blocks, 8, seed=batch * 10 + heads)
    blocks = fas.blocks_from_csr(indptr, indices, block_size=128, q_block_size=64, num_heads=heads, batch=batch,
                                 kind=kind, max_row_length=width)
    cnt, idx = (blocks.full_cnt, blocks.full_idx) if kind == "full" else (blocks.mask_cnt, blocks.mask_idx)
    assert cnt.dtype == idx.dtype == torch.int32
    assert cnt.shape == (batch, heads, m_blocks) and idx.shape[-1] == (width or max(indices.numel(), 1))
    for b in range(batch):
        for h in range(heads):
            for m in range(m_blocks):
                row = lists[(b * heads + h) * m_blocks + m]
                assert cnt[b, h, m] == len(row)
                assert idx[b, h, m, :len(row)].tolist() == row
                assert not idx[b, h, m, len(row):].any(), "entries past the count are zero"
    if kind == "mask":
        assert not blocks.full_cnt.any()
    assert (blocks.block_size, blocks.q_block_size) == (128, 64)


def test_int64_and_every_row_empty():
    blocks = fas.blocks_from_csr(torch.zeros(5, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), block_size=64,
                                 q_block_size=128, num_heads=2, batch=2)
    assert blocks.full_cnt.shape == (2, 2, 1) and not blocks.full_cnt.any() and blocks.full_idx.shape == (2, 2, 1, 1)


def test_the_result_passes_the_call_checks():
    _, indptr, indices = random_csr(2 * 4, 8, seed=3)
    blocks = fas.blocks_from_csr(indptr, indices, block_size=128, q_block_size=128, num_heads=4, batch=2)
    q = torch.randn(2, 100, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 1024, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(SparseInputError, match="^q: must be on a CUDA device"):  # every other check passed
        fas.flash_attn_with_sparse_block_table(q, k, k, blocks, validate="full")


@pytest.mark.parametrize("bad,match", [
    (dict(indptr=torch.zeros(4, dtype=torch.float32)), "^indptr: "),
    (dict(num_heads=3), "^indptr: must hold batch"),
    (dict(kind="dense"), "^kind: "),
    (dict(max_row_length=-1), "^max_row_length: "),
])
def test_bad_arguments_are_named(bad, match):
    args = dict(indptr=torch.tensor([0, 1, 1], dtype=torch.int32), indices=torch.tensor([3], dtype=torch.int32),
                block_size=128, q_block_size=128, num_heads=1, batch=1)
    args.update(bad)
    with pytest.raises(SparseInputError, match=match):
        fas.blocks_from_csr(args.pop("indptr"), args.pop("indices"), **args)


# --- FlexAttention BlockMasks with broadcast batch / head dims (B=None, H=None) ---------------

def test_a_broadcast_flex_block_mask_converts_and_passes_the_call_checks(monkeypatch):
    from torch.nn.attention.flex_attention import create_block_mask

    from flash_attn_sparse import calls
    block_mask = create_block_mask(lambda b, h, q, k: q >= k, B=None, H=None, Q_LEN=512, KV_LEN=512, device="cpu")
    blocks = fas.blocks_from_flex_block_mask(block_mask)
    assert blocks.full_cnt.shape == (1, 1, 4) and blocks.num_heads == 1
    q = torch.randn(3, 512, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(3, 512, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(SparseInputError, match="^q: must be on a CUDA device"):  # every other check passed
        fas.flash_attn_with_sparse_block_table(q, k, k, blocks, causal=True, validate="full")
    seen = []
    monkeypatch.setattr(calls, "require_cuda", lambda q: seen.append(q))
    call = calls.SparseCall(q, k, k, blocks, CallOptions(causal=True))
    for name in ("full_cnt", "full_idx", "mask_cnt", "mask_idx"):
        view, source = getattr(call.blocks, name), getattr(blocks, name)
        assert view.shape[0] == 3 and view.stride(0) == 0 and view.data_ptr() == source.data_ptr()
    assert seen


def test_lists_of_another_batch_extent_are_still_refused():
    blocks = fas.SparseBlocks(torch.ones(2, 1, 1, dtype=torch.int32), torch.zeros(2, 1, 1, 1, dtype=torch.int32))
    q = torch.randn(3, 16, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(3, 512, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(SparseInputError, match="^full_cnt: batch extent must be 3, got 2"):
        fas.flash_attn_with_sparse_block_table(q, k, k, blocks)
