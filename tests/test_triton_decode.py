"""The list-parallel decode kernel (triton_decode.py) against the fp32 reference.

On a GPU the compiled kernel runs, fp16 and bf16; on a CPU with Triton importable the same
kernel runs in Triton's interpreter (fp16 only: the interpreter mis-reads bf16), so its
indexing, masking, split and merge logic is tested in CI too. Lists are permuted and gapped,
with out-of-range ids, the partial tail block anywhere in a list, empty lists, duplicate-free
per-head lists of different lengths; outputs are poisoned before each call.
"""

import os
import random

import pytest
import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is made (triton_decode._kernel)

from flash_attn_sparse import SparseBlocks  # noqa: E402
from flash_attn_sparse import triton_decode  # noqa: E402
from flash_attn_sparse.reference import visibility_from_lists  # noqa: E402
from helpers import assert_close_to_reference, poison_allocator, random_qkv  # noqa: E402

DEVICE = "cuda" if GPU else "cpu"
DTYPES = (torch.float16, torch.bfloat16) if GPU else (torch.float16,)
# On a GPU these are GPU tests (`-m gpu` runs them); on a CPU they run in the interpreter.
pytestmark = [pytest.mark.skipif(triton_decode.missing_triton() is not None, reason=str(triton_decode.missing_triton()))] \
    + ([pytest.mark.gpu] if GPU else [])


def random_lists(rng, heads, n_blocks, density, bad_ids=False):
    """Per-head lists in random order, every one holding the tail block somewhere, some empty;
    with bad_ids, ids past the sequence and negative ones mixed in (the kernel skips them)."""
    lists = []
    for h in range(heads):
        if h % 5 == 3:
            lists.append([])
            continue
        keep = max(1, round(n_blocks * density))
        ids = rng.sample(range(n_blocks - 1), min(keep, n_blocks - 1)) + [n_blocks - 1]
        if bad_ids:
            ids += [n_blocks + 2, -1]
        rng.shuffle(ids)
        lists.append(ids)
    return lists


CASES = [
    # batch, seqlen_q, heads, heads_k, seqlen_k, head_dim, block_size, list heads ("kv", "q", "shared"), causal
    (2, 1, 8, 2, 1000, 64, 64, "kv", False),
    (1, 4, 8, 2, 777, 64, 32, "kv", True),
    (2, 3, 4, 4, 1200, 32, 128, "q", False),
    (1, 2, 8, 8, 900, 64, 64, "q", True),
    (3, 1, 6, 2, 500, 32, 16, "shared", False),
    (1, 16, 4, 1, 640, 64, 128, "kv", True),
]
GPU_CASES = [
    (4, 16, 32, 8, 8192, 128, 128, "kv", True),
    (2, 1, 32, 8, 32768, 128, 128, "kv", False),
    (1, 1, 32, 8, 131072, 128, 128, "kv", False),
    (2, 8, 16, 16, 4000, 256, 64, "q", True),
    (2, 4, 16, 2, 3000, 128, 256, "shared", False),
]


@pytest.mark.parametrize("entries", [0, 1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES + (GPU_CASES if GPU else []))
def test_matches_reference(case, dtype, entries):
    batch, seqlen_q, heads, heads_k, seqlen_k, head_dim, block_size, list_heads, causal = case
    rng = random.Random(hash((case, entries)) & 0xFFFF)
    table_heads = {"kv": heads_k, "q": heads, "shared": 1}[list_heads]
    n_blocks = -(-seqlen_k // block_size)
    g = torch.Generator(device=DEVICE).manual_seed(rng.randrange(1 << 30))
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, device=DEVICE, generator=g)
    full = [[[ids] for ids in random_lists(rng, table_heads, n_blocks, 0.3, bad_ids=not causal)] for _ in range(batch)]
    mask = None
    if causal:  # the diagonal as a mask block, out of the full lists
        full = [[[[i for i in rows[0] if i != n_blocks - 1]] for rows in per_b] for per_b in full]
        mask = [[[[n_blocks - 1] if h % 5 != 3 else []] for h in range(table_heads)] for _ in range(batch)]
    blocks = SparseBlocks.from_lists(full, mask, block_size=block_size, device=DEVICE)
    assert triton_decode.unsupported_reason(q, k, blocks, max_seqlen_q=seqlen_q, varlen=False, paged=False) in (
        None, "the list-parallel decode kernel needs an sm80+ GPU")
    poison_allocator(((batch, seqlen_q, heads, head_dim), dtype), ((batch, heads, seqlen_q), torch.float32), device=DEVICE)
    out, lse = triton_decode.run(q, k, v, blocks, softmax_scale=head_dim ** -0.5, causal=causal, entries=entries)
    visible = torch.stack([visibility_from_lists([[[i for i in ids if 0 <= i < n_blocks] for ids in rows] for rows in full[b]],
                                                 mask[b] if mask else None, block_size, blocks.resolved_q_block_size(seqlen_q),
                                                 seqlen_q, seqlen_k, heads, causal, device=DEVICE) for b in range(batch)])
    assert_close_to_reference(out, lse, q, k, v, visible, softmax_scale=head_dim ** -0.5)


def test_seqused_k_shortens_each_sequence():
    """Keys at or past seqused_k[b] are not seen, ids of blocks past it are skipped."""
    rng = random.Random(7)
    batch, seqlen_q, heads, heads_k, seqlen_k, head_dim, block_size = 3, 2, 8, 2, 1024, 64, 64
    dtype = torch.float16
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, device=DEVICE)
    used = [1024, 700, 65]
    full = [[[random_lists(rng, 1, seqlen_k // block_size, 0.5)[0]] for _ in range(heads_k)] for _ in range(batch)]
    blocks = SparseBlocks.from_lists(full, block_size=block_size, device=DEVICE)
    seqused = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    out, lse = triton_decode.run(q, k, v, blocks, softmax_scale=0.125, causal=False, seqused_k=seqused, entries=2)
    for b in range(batch):
        n_used = -(-used[b] // block_size)
        visible = visibility_from_lists([[[i for i in rows[0] if i < n_used]] for rows in full[b]], None, block_size,
                                        blocks.resolved_q_block_size(seqlen_q), seqlen_q, used[b], heads, False,
                                        device=DEVICE)
        assert_close_to_reference(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k[b:b + 1, :used[b]], v[b:b + 1, :used[b]],
                                  visible[None], softmax_scale=0.125)


def test_every_list_empty_gives_zero_and_minus_inf():
    q, k, v = random_qkv(2, 1, 4, 2, 256, 32, torch.float16, device=DEVICE)
    blocks = SparseBlocks.from_lists([[[[]], [[]]], [[[]], [[]]]], block_size=64, device=DEVICE)
    for entries in (0, 1):
        out, lse = triton_decode.run(q, k, v, blocks, softmax_scale=0.2, causal=False, entries=entries)
        assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("capacity, lists, entries", [(64, 8, 1), (1024, 8, 16), (256, 64, 32), (16, 64, 2)])
def test_entries_fill_the_gpu_without_oversubscribing(capacity, lists, entries):
    """One entry per program while lists * capacity programs fit PROGRAMS_PER_SM per SM."""
    assert triton_decode.choose_entries(capacity, lists, num_sms=132) == entries
