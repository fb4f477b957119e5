"""auto's choice (routing.choose), on the CPU: each backend's refusal is replaced by "takes it" or
by a reason, as on an SM90 with or without each build, so the rule itself is what these tests
check: fa3 for prefill-shaped calls and decode whose lists serve whole K/V heads that FA-3 takes,
fa2 for the rest, fa4 only on request, and the same answer whether or not a CUDA graph is being
captured."""

import pytest
import torch

from flash_attn_sparse import SparseBlocks, calls, interface, routing
from flash_attn_sparse.backends import fa2_ops, fa3, fa4
from flash_attn_sparse.options import CallOptions


@pytest.fixture
def builds(monkeypatch):
    """Which backends take calls: set builds.fa3 / builds.fa4 to None (takes it) or a reason."""
    class Builds:
        fa3 = None
        fa4 = None
    monkeypatch.setattr(fa3, "refusal", lambda call: Builds.fa3)
    monkeypatch.setattr(fa4, "refusal", lambda call: Builds.fa4)
    monkeypatch.setattr(calls, "require_cuda", lambda q: None)
    monkeypatch.setattr(fa2_ops, "compiled_head_dims", lambda: ((64, 128), False))  # a dev FA-2 build
    return Builds


def call(batch, seqlen_q, seqlen_k, heads, heads_k, list_blocks, *, list_heads=None, causal=False,
         requested="auto", q_block_size=128):
    """A fixed-length call whose lists hold `list_blocks` entries per row (their capacity)."""
    q = torch.zeros(batch, seqlen_q, heads, 128, dtype=torch.bfloat16)
    k = v = torch.zeros(batch, seqlen_k, heads_k, 128, dtype=torch.bfloat16)
    tiles, list_heads = -(-seqlen_q // q_block_size), list_heads or heads
    cnt = torch.full((batch, list_heads, tiles), list_blocks, dtype=torch.int32)
    idx = torch.arange(list_blocks, dtype=torch.int32).expand(batch, list_heads, tiles, list_blocks).contiguous()
    mask = (torch.zeros_like(cnt), torch.zeros_like(idx)) if causal else (None, None)
    blocks = SparseBlocks(cnt, idx, *mask, block_size=128, q_block_size=q_block_size)
    return calls.SparseCall(q, k, v, blocks, CallOptions(causal=causal, backend=requested))


PREFILL = dict(batch=1, seqlen_q=4096, seqlen_k=16384, heads=8, heads_k=8)
DECODE = dict(batch=8, seqlen_q=16, seqlen_k=32768, heads=32, heads_k=8, list_heads=8)


def test_prefill_goes_to_fa3_where_it_takes_the_call_else_fa2(builds):
    backend, why = routing.choose(call(**PREFILL, list_blocks=32))
    assert backend == "fa3" and "4096 query rows" in why
    assert routing.choose(call(**PREFILL, list_blocks=8, causal=True))[0] == "fa3"
    builds.fa3 = "flash_attn_3 is not importable"
    assert routing.choose(call(**PREFILL, list_blocks=32))[0] == "fa2"


def test_decode_goes_to_fa3_where_its_lists_serve_whole_kv_heads(builds):
    backend, why = routing.choose(call(**DECODE, list_blocks=16))
    assert backend == "fa3" and "16 query rows x 4 query heads of a K/V head packed" in why
    assert routing.choose(call(**dict(DECODE, seqlen_q=1), list_blocks=16))[0] == "fa3"  # 4 packed rows
    assert routing.choose(call(**dict(DECODE, list_heads=32), list_blocks=16))[0] == "fa2"  # per query head: unpacked
    backend, why = routing.choose(call(**dict(DECODE, heads=8), list_blocks=16))  # no GQA: one query head a K/V head
    assert backend == "fa3" and "one query head per K/V head" in why


@pytest.mark.parametrize("group", [3, 5, 6, 7])
@pytest.mark.parametrize("seqlen_q", [7, 13, 16])
def test_groups_that_do_not_divide_the_tile_pack_on_fa3_too(builds, group, seqlen_q):
    """Qwen-style groups (28/4, 40/8, 12/2, 14/2): FA-3 packs every group, so their decode goes
    there as for groups 4 and 8."""
    decode = call(batch=4, seqlen_q=seqlen_q, seqlen_k=32768, heads=8 * group, heads_k=8, list_heads=8, list_blocks=16)
    assert fa3.traits(decode).packed_group == group
    assert routing.choose(decode)[0] == "fa3"


def paged(plain, page_size):
    """The call over a paged cache of `page_size` keys a page (routing reads the layout, not the ids)."""
    cache = torch.zeros(plain.batch * -(-plain.k.shape[1] // page_size), page_size, *plain.k.shape[2:], dtype=plain.k.dtype)
    return plain.rebind(k=cache, v=cache, page_table=torch.zeros(plain.batch, 1, dtype=torch.int32))


def test_paged_calls_in_pages_of_whole_blocks_and_seqused_k_calls_route_as_contiguous_ones(builds):
    for shape, blocks, contiguous_choice in ((PREFILL, 32, "fa3"), (DECODE, 16, "fa3"), (dict(DECODE, list_heads=32), 16, "fa2")):
        plain = call(**shape, list_blocks=blocks)
        assert routing.choose(plain)[0] == contiguous_choice
        seqused = plain.rebind(seqused_k=torch.full((plain.batch,), 100, dtype=torch.int32))
        for same in (seqused, paged(plain, 128), paged(plain, 256)):
            assert routing.choose(same)[0] == contiguous_choice


@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_pages_smaller_than_a_block_route_as_contiguous_ones_where_the_build_has_their_kernels(builds, page_size):
    """FA-3 reads such pages with cp.async loads (0.22-0.53x FA-2's time on the engine-shaped call,
    docs/routing.md): auto sends them where it sends contiguous calls; a build without those kernels
    refuses them (fa3_ops.refusal), which leaves them to fa2."""
    for shape, blocks, contiguous_choice in ((PREFILL, 32, "fa3"), (DECODE, 16, "fa3"), (dict(DECODE, list_heads=32), 16, "fa2")):
        small = paged(call(**shape, list_blocks=blocks), page_size)
        assert routing.choose(small)[0] == contiguous_choice, shape
    builds.fa3 = "this flash_attn_3 build has no kernels for pages of other than a multiple of 128 keys"
    assert routing.choose(paged(call(**PREFILL, list_blocks=32), page_size))[0] == "fa2"


def test_fa4_runs_on_request_only(builds):
    for shape, blocks in ((PREFILL, 32), (DECODE, 16), (dict(DECODE, seqlen_q=1), 16)):
        assert routing.choose(call(**shape, list_blocks=blocks))[0] != "fa4"
        assert routing.choose(call(**shape, list_blocks=blocks, requested="fa4")) == ("fa4", "requested")


def test_a_requested_backend_is_kept_or_refused_with_its_reason(builds):
    assert routing.choose(call(**DECODE, list_blocks=16, requested="fa3")) == ("fa3", "requested")
    assert routing.choose(call(**DECODE, list_blocks=16, requested="fa2")) == ("fa2", "requested")
    builds.fa3 = "no fa3 here"
    with pytest.raises(Exception, match="'fa3' cannot run this call: no fa3 here"):
        routing.choose(call(**PREFILL, list_blocks=8, requested="fa3"))


def test_the_choice_is_the_same_inside_a_capture_and_under_torch_compile(builds, monkeypatch):
    shapes = [(PREFILL, 32), (DECODE, 16), (dict(DECODE, seqlen_q=1), 16), (dict(DECODE, list_heads=32), 16)]
    eager = [routing.choose(call(**shape, list_blocks=blocks)) for shape, blocks in shapes]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert torch.cuda.is_current_stream_capturing()
    assert [routing.choose(call(**shape, list_blocks=blocks)) for shape, blocks in shapes] == eager
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert [routing.choose(call(**shape, list_blocks=blocks)) for shape, blocks in shapes] == eager


def test_fa4_is_refused_by_name_under_torch_compile(monkeypatch):
    monkeypatch.setattr(calls, "require_cuda", lambda q: None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(Exception, match="'fa4' cannot run this call: .*torch.compile"):
        routing.choose(call(**DECODE, list_blocks=16, requested="fa4"))


def test_a_call_runs_one_backend_whatever_the_stream(builds, monkeypatch):
    from flash_attn_sparse import backends
    ran = []
    for name in ("fa2", "fa3"):
        fake = type(name, (), {"num_splits": staticmethod(lambda c: 1), "refusal": staticmethod(lambda c: None),
                               "traits": fa3.traits,
                               "run": staticmethod(lambda c, splits, out, name=name: ran.append(name) or (out, None))})
        monkeypatch.setitem(backends.BACKENDS, name, fake)
    decode = call(**DECODE, list_blocks=16)
    interface.run(decode)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    interface.run(decode)
    assert ran == ["fa3", "fa3"]
