"""Paged K/V with sparse lists: a vLLM-style page table and per-(batch, K/V head) block lists.

Every paged call is compared bitwise with the same call on the contiguous K/V it was paged from
(same kernel, same keys in the same order, so the same arithmetic), and with the fp64 oracle
under FlashAttention's tolerance convention. Physical pages are a random permutation; unused
pages, unused page-table entries and keys past seqused_k hold NaN, so a read of any of them
shows up in the output.
"""

import random
import zlib

import pytest
import torch

import flash_attn_sparse as fas
from contract import backend_present
from flash_attn_sparse import SparseBlocks
from flash_attn_sparse.reference import visibility_from_lists
from helpers import assert_close_to_reference, gather_speculative, missed_and_spec, random_qkv

pytestmark = [pytest.mark.gpu, pytest.mark.stage5]

BATCH, HEADS, HEADS_K = 3, 8, 2
SEQUSED = [1531, 1000, 777]  # none a multiple of any page size tested


def cdiv(a, b):
    return -(-a // b)


def poison_past(k, v, seqused):
    """NaN in the keys each sequence does not use, so reading one shows."""
    for b, used in enumerate(seqused):
        k[b, used:] = float("nan")
        v[b, used:] = float("nan")


def garbage_past(page_table, seqused, page_size):
    """Ids no cache holds in each row's columns past seqused (an engine's stale entries): never read."""
    for b, used in enumerate(seqused):
        tail = page_table[b, cdiv(used, page_size):]
        tail.copy_(torch.tensor([-7, 2**30, -(2**31), 2**31 - 1], dtype=torch.int32).repeat(cdiv(tail.numel(), 4))[:tail.numel()])


def page_out(k, v, page_size, generator, extra_pages=5, interleaved=False):
    """Paged caches holding k, v (batch, n_cols * page_size, heads_k, dim): sequence b's column j
    is physical page page_table[b, j], the pages a random permutation; the extra pages are NaN.
    interleaved: one (num_pages, 2, page_size, heads_k, dim) buffer, k and v views of it (a page
    stride of twice the page)."""
    batch, seqlen, heads_k, dim = k.shape
    n_cols = seqlen // page_size
    num_pages = batch * n_cols + extra_pages
    perm = torch.randperm(num_pages, generator=generator).to(k.device)
    page_table = perm[:batch * n_cols].view(batch, n_cols).to(torch.int32).contiguous()
    if interleaved:
        kv = torch.full((num_pages, 2, page_size, heads_k, dim), float("nan"), dtype=k.dtype, device=k.device)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        k_cache = torch.full((num_pages, page_size, heads_k, dim), float("nan"), dtype=k.dtype, device=k.device)
        v_cache = torch.full_like(k_cache, float("nan"))
    k_cache[page_table.flatten().long()] = k.reshape(batch * n_cols, page_size, heads_k, dim)
    v_cache[page_table.flatten().long()] = v.reshape(batch * n_cols, page_size, heads_k, dim)
    return k_cache, v_cache, page_table


def random_lists(seqused, seqlen_q, block_size, causal, rng):
    """Per-(batch, K/V head) lists, permuted and gapped. Non-causal: about half the blocks, the
    partial tail block always among them. Causal: the blocks holding the diagonal as "mask"
    blocks, a shuffled half of the fully historical ones as "full" blocks."""
    full, mask = [], []
    for used in seqused:
        n_blocks = cdiv(used, block_size)
        per_b_full, per_b_mask = [], []
        for _ in range(HEADS_K):
            if causal:
                historical = max(used - seqlen_q + 1, 0) // block_size
                f = rng.sample(range(historical), historical // 2)
                m = list(range(historical, n_blocks))
                rng.shuffle(m)
            else:
                f = rng.sample(range(n_blocks - 1), (n_blocks - 1) // 2) + [n_blocks - 1]
                rng.shuffle(f)
                m = []
            per_b_full.append([f])
            per_b_mask.append([m])
        full.append(per_b_full)
        mask.append(per_b_mask)
    return full, mask


def check_against_reference(out, lse, q, k, v, full, mask, seqused, block_size, causal):
    """Per sequence, over its first seqused keys (the clean ones)."""
    seqlen_q = q.shape[1]
    q_block = cdiv(seqlen_q, 128) * 128
    for b, used in enumerate(seqused):
        visible = visibility_from_lists(full[b], mask[b] if mask else None, block_size, q_block, seqlen_q, used, HEADS, causal,
                                        device=q.device)
        assert_close_to_reference(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k[b:b + 1, :used], v[b:b + 1, :used], visible)


def assert_bitwise_equal(a, b, what):
    diff = (a.double() - b.double()).abs().nan_to_num(0).max().item()
    assert torch.equal(a, b), f"{what}: paged differs from contiguous, max diff {diff:.3e}"


# FA-2 takes pages that divide a block or are a multiple of it; FA-3 too, pages of whole 128-key
# blocks by TMA, smaller ones by cp.async where the build has those kernels (not the dev profile's).
PAGED_CASES = [("fa2", 16, 128), ("fa2", 64, 64), ("fa2", 256, 64), ("fa2", 48, 16), ("fa3", 128, 128), ("fa3", 256, 128),
               ("fa3", 16, 128), ("fa3", 64, 128)]


def backend_pages(backend, page_size):
    """Skips where the backend is not built, or its build has no kernels for these pages."""
    backend_present(backend)
    if backend == "fa3" and page_size % 128:
        from flash_attn_sparse.backends import fa3_ops
        if "PAGEDKV" in fa3_ops.disabled():
            pytest.skip("this flash_attn_3 build has no kernels for pages under 128 keys (FLASH_ATTENTION_DISABLE_PAGEDKV)")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim,dtype", [(64, torch.float16), (64, torch.bfloat16), (128, torch.float16), (128, torch.bfloat16)],
                         ids=["d64-fp16", "d64-bf16", "d128-fp16", "d128-bf16"])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["nosplit", "split3"])
@pytest.mark.parametrize("seqlen_q", [1, 16, 128])
@pytest.mark.parametrize("backend,page_size,block_size", PAGED_CASES,
                         ids=[f"{b}-page{p}-block{s}" for b, p, s in PAGED_CASES])
def test_paged_equals_contiguous(backend, page_size, block_size, seqlen_q, num_splits, head_dim, dtype, causal):
    """Also seqused_k shorter than the cache, and garbage ids in the table past it."""
    backend_pages(backend, page_size)
    seed = zlib.crc32(repr((page_size, block_size, seqlen_q, num_splits, head_dim, dtype, causal)).encode())
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_cols = cdiv(max(SEQUSED), page_size) + 1  # one spare (NaN) column in every row of the table
    q, k, v = random_qkv(BATCH, seqlen_q, n_cols * page_size, HEADS, HEADS_K, head_dim, dtype, generator=g)
    clean_k, clean_v = k.clone(), v.clone()
    poison_past(k, v, SEQUSED)
    k_cache, v_cache, page_table = page_out(k, v, page_size, torch.Generator().manual_seed(seed))
    garbage_past(page_table, SEQUSED, page_size)
    full, mask = random_lists(SEQUSED, seqlen_q, block_size, causal, random.Random(seed))
    blocks = SparseBlocks.from_lists(full, mask if causal else None, block_size=block_size, device="cuda")
    seqused_k = torch.tensor(SEQUSED, dtype=torch.int32, device="cuda")

    out, lse = fas.flash_attn_with_sparse_block_table(q, k_cache, v_cache, blocks, causal=causal, num_splits=num_splits,
                                                      seqused_k=seqused_k, page_table=page_table, validate="full",
                                                      backend=backend)
    ref_out, ref_lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=causal, num_splits=num_splits,
                                                              seqused_k=seqused_k, backend=backend)
    assert_bitwise_equal(out, ref_out, "out")
    assert_bitwise_equal(lse, ref_lse, "lse")
    check_against_reference(out, lse, q, clean_k, clean_v, full, mask, SEQUSED, block_size, causal)


@pytest.mark.parametrize("backend,page_size,block_size", [("fa2", 16, 64), ("fa2", 128, 128), ("fa2", 512, 128),
                                                          ("fa3", 128, 128), ("fa3", 512, 128), ("fa3", 64, 128)])
def test_paged_without_seqused_k_uses_every_page(backend, page_size, block_size):
    """seqlen_k is then max_pages * page_size; the shared 1-D table form."""
    backend_pages(backend, page_size)
    g = torch.Generator(device="cuda").manual_seed(page_size)
    n_cols = cdiv(1200, page_size)
    seqlen_k = n_cols * page_size
    q, k, v = random_qkv(BATCH, 16, seqlen_k, HEADS, HEADS_K, 128, torch.bfloat16, generator=g)
    k_cache, v_cache, page_table = page_out(k, v, page_size, torch.Generator().manual_seed(page_size))
    n_blocks = cdiv(seqlen_k, block_size)
    ids = random.Random(page_size).sample(range(n_blocks), n_blocks // 3)
    table = torch.tensor(ids, dtype=torch.int32, device="cuda")
    for num_splits in (0, 1, 3):
        out, lse = fas.flash_attn_with_sparse_block_table(q, k_cache, v_cache, table, block_size=block_size,
                                                          num_splits=num_splits, page_table=page_table, backend=backend)
        ref_out, ref_lse = fas.flash_attn_with_sparse_block_table(q, k, v, table, block_size=block_size, num_splits=num_splits,
                                                                  backend=backend)
        assert_bitwise_equal(out, ref_out, "out")
        assert_bitwise_equal(lse, ref_lse, "lse")
    full = [[[ids]] * HEADS_K] * BATCH
    check_against_reference(out, lse, q, k, v, full, None, [seqlen_k] * BATCH, block_size, False)


def test_paged_interleaved_cache_and_shared_prefix_pages():
    """k and v as views of one (num_pages, 2, page_size, heads_k, dim) buffer (page stride = two
    pages), and two sequences sharing their first pages (prefix caching)."""
    page_size, block_size, seqlen_q = 32, 64, 16
    g = torch.Generator(device="cuda").manual_seed(5)
    seqused = [900, 1000, 700]
    n_cols = cdiv(max(seqused), page_size) + 1
    q, k, v = random_qkv(BATCH, seqlen_q, n_cols * page_size, HEADS, HEADS_K, 128, torch.float16, generator=g)
    k[1, :256], v[1, :256] = k[0, :256], v[0, :256]  # sequences 0 and 1 share a 256-key prefix
    clean_k, clean_v = k.clone(), v.clone()
    poison_past(k, v, seqused)
    k_cache, v_cache, page_table = page_out(k, v, page_size, torch.Generator().manual_seed(5), interleaved=True)
    assert k_cache.stride(0) == 2 * page_size * k_cache.stride(1)
    page_table[1, :256 // page_size] = page_table[0, :256 // page_size]
    full, mask = random_lists(seqused, seqlen_q, block_size, True, random.Random(5))
    blocks = SparseBlocks.from_lists(full, mask, block_size=block_size, device="cuda")
    seqused_k = torch.tensor(seqused, dtype=torch.int32, device="cuda")
    for num_splits in (1, 3):
        out, lse = fas.flash_attn_with_sparse_block_table(q, k_cache, v_cache, blocks, causal=True, num_splits=num_splits,
                                                          seqused_k=seqused_k, page_table=page_table, validate="full")
        ref_out, ref_lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=True, num_splits=num_splits,
                                                                  seqused_k=seqused_k)
        assert_bitwise_equal(out, ref_out, "out")
        assert_bitwise_equal(lse, ref_lse, "lse")
    check_against_reference(out, lse, q, clean_k, clean_v, full, mask, seqused, block_size, True)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_paged_key_offsets_past_2_31_elements(backend):
    """Pages at the end of a 4 GiB cache: page * rows_per_page * row_stride exceeds 2^31 elements."""
    backend_present(backend)
    page_size, block_size, heads_k, dim = 256, 128, 1, 128
    num_pages = (2**31 // (page_size * heads_k * dim)) + 64
    k_cache = torch.empty(num_pages, page_size, heads_k, dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.empty_like(k_cache)
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = random_qkv(1, 16, 8 * page_size, 4, heads_k, dim, torch.bfloat16, generator=g)
    page_table = torch.arange(num_pages - 8, num_pages, dtype=torch.int32, device="cuda").flip(0).view(1, 8).contiguous()
    k_cache[page_table[0].long()] = k[0].view(8, page_size, heads_k, dim)
    v_cache[page_table[0].long()] = v[0].view(8, page_size, heads_k, dim)
    table = torch.tensor([15, 0, 7, 8], dtype=torch.int32, device="cuda")
    for num_splits in (1, 2):
        out, lse = fas.flash_attn_with_sparse_block_table(q, k_cache, v_cache, table, block_size=block_size,
                                                          num_splits=num_splits, page_table=page_table, backend=backend)
        ref_out, ref_lse = fas.flash_attn_with_sparse_block_table(q, k, v, table, block_size=block_size, num_splits=num_splits,
                                                                  backend=backend)
        assert_bitwise_equal(out, ref_out, "out")
        assert_bitwise_equal(lse, ref_lse, "lse")
    del k_cache, v_cache
    torch.cuda.empty_cache()


def test_paged_torch_compile_fullgraph_matches_eager():
    g = torch.Generator(device="cuda").manual_seed(3)
    page_size, n_cols = 64, 20
    q, k, v = random_qkv(2, 16, n_cols * page_size, HEADS, HEADS_K, 128, torch.bfloat16, generator=g)
    k_cache, v_cache, page_table = page_out(k, v, page_size, torch.Generator().manual_seed(3))
    table = torch.tensor([3, 9, 0, 4], dtype=torch.int32, device="cuda")
    seqused_k = torch.tensor([1200, 1111], dtype=torch.int32, device="cuda")

    def attend(q, k_cache, v_cache, table, page_table, seqused_k):
        return fas.flash_attn_with_sparse_block_table(q, k_cache, v_cache, table, page_table=page_table, seqused_k=seqused_k)

    eager = attend(q, k_cache, v_cache, table, page_table, seqused_k)
    compiled = torch.compile(attend, fullgraph=True)(q, k_cache, v_cache, table, page_table, seqused_k)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


@pytest.mark.parametrize("page_size", [64, 256])
def test_speculative_over_paged_kv(page_size):
    """The speculative call with the missed blocks in paged caches (two passes: the one launch
    is for unpaged K/V) equals attention over the union, and the same call on the contiguous K/V
    (one launch) up to the merge's rounding."""
    g = torch.Generator(device="cuda").manual_seed(page_size)
    block_size, n_cols, seqlen_q = 128, 4096 // page_size, 16
    q, k, v = random_qkv(BATCH, seqlen_q, n_cols * page_size, HEADS, HEADS_K, 128, torch.bfloat16, generator=g)
    spec, missed = missed_and_spec(n_cols * page_size // block_size, 2, random.Random(page_size))
    k_spec, v_spec, table, reference = gather_speculative(q, k, v, spec, missed, block_size)
    k_cache, v_cache, page_table = page_out(k, v, page_size, torch.Generator().manual_seed(page_size))
    for num_splits in (0, 3):
        out, lse = fas.flash_attn_speculative_sparse(q, k_spec, v_spec, k_cache, v_cache, table, num_splits=num_splits,
                                                     page_table=page_table)
        assert_close_to_reference(out, lse, q, *reference)
        contiguous = fas.flash_attn_speculative_sparse(q, k_spec, v_spec, k, v, table, num_splits=num_splits)
        assert_close_to_reference(contiguous[0], contiguous[1], q, *reference)


def test_partials_over_paged_kv_equal_contiguous_bitwise():
    g = torch.Generator(device="cuda").manual_seed(11)
    page_size, n_cols = 64, 30
    q, k, v = random_qkv(BATCH, 16, n_cols * page_size, HEADS, HEADS_K, 128, torch.bfloat16, generator=g)
    k_cache, v_cache, page_table = page_out(k, v, page_size, torch.Generator().manual_seed(11))
    seqused_k = torch.tensor(SEQUSED, dtype=torch.int32, device="cuda")
    groups = [torch.tensor(t, dtype=torch.int32, device="cuda") for t in ([0, 5, 11], [3], [7, 2])]
    paged = fas.flash_attn_sparse_partials(q, k_cache, v_cache, groups, seqused_k=seqused_k, page_table=page_table)
    contiguous = fas.flash_attn_sparse_partials(q, k, v, groups, seqused_k=seqused_k)
    assert_bitwise_equal(paged[0], contiguous[0], "out_partials")
    assert_bitwise_equal(paged[1], contiguous[1], "lse_partials")


VARLEN_PAGED_CASES = [("fa2", 16, 128), ("fa2", 64, 64), ("fa2", 256, 128), ("fa3", 128, 128), ("fa3", 256, 128),
                      ("fa3", 16, 128)]


@pytest.mark.parametrize("backend,page_size,block_size", VARLEN_PAGED_CASES,
                         ids=[f"{b}-page{p}-block{s}" for b, p, s in VARLEN_PAGED_CASES])
@pytest.mark.parametrize("num_splits", [1, 0], ids=["nosplit", "auto-splits"])
def test_varlen_paged_sparse_with_out_equals_contiguous_varlen(backend, page_size, block_size, num_splits):
    """The engine-shaped call (vLLM: cu_seqlens_q, a page table and out= in one call):
    ragged queries mixing a prefill chunk, decode rows and an empty sequence, over permuted pages
    (unused pages NaN, unused table entries -1), with per-(sequence, K/V head) lists: bitwise the
    contiguous varlen call, and within tolerance of the fp64 oracle per sequence. FA-3 takes the
    key counts as seqused_k (its paged layout has no cu_seqlens_k)."""
    from flash_attn_sparse.metadata import pack_varlen_lists
    backend_pages(backend, page_size)
    g = torch.Generator(device="cuda").manual_seed(27)
    rng = random.Random(27)
    seqlens_q, seqlens_k = [70, 1, 0, 16], [1531, 1000, 0, 777]
    q_block = 128
    full = []
    for sq, sk in zip(seqlens_q, seqlens_k):
        n_blocks, tiles = cdiv(sk, block_size), max(cdiv(sq, q_block), 1)
        full.append([[rng.sample(range(n_blocks), max(n_blocks // 2, min(n_blocks, 1))) for _ in range(tiles)]
                     for _ in range(HEADS_K)])
    blocks = pack_varlen_lists(full, None, block_size, q_block, device="cuda")
    q = torch.randn(sum(seqlens_q), HEADS, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(sum(seqlens_k), HEADS_K, 128, device="cuda", generator=g).bfloat16()
    v = torch.randn_like(k)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    max_pages = max(cdiv(sk, page_size) for sk in seqlens_k)
    num_pages = sum(cdiv(sk, page_size) for sk in seqlens_k) + 3
    perm = torch.randperm(num_pages, generator=g, device="cuda").tolist()
    k_cache = torch.full((num_pages, page_size, HEADS_K, 128), float("nan"), dtype=k.dtype, device="cuda")
    v_cache = torch.full_like(k_cache, float("nan"))
    page_table = torch.full((len(seqlens_k), max_pages), -1, dtype=torch.int32, device="cuda")
    start = 0
    for b, sk in enumerate(seqlens_k):
        for j in range(cdiv(sk, page_size)):
            page, rows = perm.pop(), slice(start + j * page_size, start + min((j + 1) * page_size, sk))
            page_table[b, j] = page
            k_cache[page, :rows.stop - rows.start], v_cache[page, :rows.stop - rows.start] = k[rows], v[rows]
        start += sk
    common = dict(cu_seqlens_q=cu(seqlens_q), cu_seqlens_k=cu(seqlens_k), max_seqlen_q=max(seqlens_q),
                  max_seqlen_k=max(seqlens_k), num_splits=num_splits, backend=backend)
    if backend == "fa3":
        common["seqused_k"] = torch.tensor(seqlens_k, dtype=torch.int32, device="cuda")
    want, want_lse = fas.flash_attn_varlen_with_sparse_blocks(q, k, v, blocks, **common)
    out = torch.full_like(q, float("nan"))
    got, got_lse = fas.flash_attn_varlen_with_sparse_blocks(q, k_cache, v_cache, blocks, page_table=page_table, out=out,
                                                            **common)
    assert got is out
    assert_bitwise_equal(got, want, "out")
    assert_bitwise_equal(got_lse, want_lse, "lse")
    q_start = k_start = 0
    for b, (sq, sk) in enumerate(zip(seqlens_q, seqlens_k)):
        if sq:
            visible = visibility_from_lists(full[b], None, block_size, q_block, sq, sk, HEADS, False, device="cuda")
            assert_close_to_reference(got[q_start:q_start + sq][None], got_lse[:, q_start:q_start + sq][None],
                                      q[q_start:q_start + sq][None], k[k_start:k_start + sk][None],
                                      v[k_start:k_start + sk][None], visible)
        q_start, k_start = q_start + sq, k_start + sk


@pytest.mark.parametrize("backend", ["fa2", "fa3", "auto"])
def test_graph_replay_reads_page_table_seqused_k_and_lists_updated_in_place(backend):
    """A captured paged decode call replayed after the cache pages, the page table, seqused_k and
    the lists are all rewritten in place (an engine's step): each replay equals the eager call
    on the new contents bitwise, and the fp64 oracle."""
    backend_present(backend)
    page_size, block_size, seqlen_q, width = 128, 128, 4, 5
    n_cols = cdiv(max(SEQUSED), page_size) + 1
    rng = random.Random(53)

    def step(seed, seqused):
        """Fresh K/V paged out anew, seqused, and `width` listed blocks per (sequence, K/V head)."""
        g = torch.Generator(device="cuda").manual_seed(seed)
        _, k, v = random_qkv(BATCH, seqlen_q, n_cols * page_size, HEADS, HEADS_K, 128, torch.bfloat16, generator=g)
        clean_k, clean_v = k.clone(), v.clone()
        poison_past(k, v, seqused)
        k_cache, v_cache, page_table = page_out(k, v, page_size, torch.Generator().manual_seed(seed))
        garbage_past(page_table, seqused, page_size)
        full = [[[rng.sample(range(cdiv(used, block_size)), width)] for _ in range(HEADS_K)] for used in seqused]
        blocks = SparseBlocks.from_lists(full, block_size=block_size, device="cuda")
        seqused_k = torch.tensor(seqused, dtype=torch.int32, device="cuda")
        return dict(k_cache=k_cache, v_cache=v_cache, page_table=page_table, blocks=blocks, seqused_k=seqused_k,
                    clean=(clean_k, clean_v), full=full, seqused=seqused)

    g = torch.Generator(device="cuda").manual_seed(53)
    q = torch.randn(BATCH, seqlen_q, HEADS, 128, device="cuda", generator=g).bfloat16()
    live = step(1, SEQUSED)
    out = torch.empty_like(q)
    run = lambda: fas.flash_attn_with_sparse_block_table(  # noqa: E731
        q, live["k_cache"], live["v_cache"], live["blocks"], seqused_k=live["seqused_k"], page_table=live["page_table"],
        backend=backend, out=out)
    run()  # the one-shot cache's plan, made outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = run()
    for seed, seqused in ((2, [700, 1531, 1024]), (3, [640, 1531, 1400])):
        new = step(seed, seqused)
        for name in ("k_cache", "v_cache", "page_table", "seqused_k"):
            live[name].copy_(new[name])
        live["blocks"].full_cnt.copy_(new["blocks"].full_cnt)
        live["blocks"].full_idx.copy_(new["blocks"].full_idx)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, want_lse = fas.flash_attn_with_sparse_block_table(q, new["k_cache"], new["v_cache"], new["blocks"],
                                                                seqused_k=new["seqused_k"], page_table=new["page_table"],
                                                                backend=backend)
        assert_bitwise_equal(out, want, "out")
        assert_bitwise_equal(lse, want_lse, "lse")
        check_against_reference(out, lse, q, *new["clean"], new["full"], None, seqused, block_size, False)
