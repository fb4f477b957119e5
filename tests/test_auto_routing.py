"""auto's choice among fa2 / fa3 / fa4 (routing.choose), on the CPU: each backend's own refusal
is replaced by "takes it" or by a reason, as on an SM90 with or without each build, so the rule
itself is what these tests check (the crossovers behind it: docs/performance.md)."""

import pytest
import torch

from flash_attn_sparse import SparseBlocks, calls, interface, ops, routing
from flash_attn_sparse.backends import fa3, fa4


@pytest.fixture
def builds(monkeypatch):
    """Which backends take calls: set builds.fa3 / builds.fa4 to None (takes it) or a reason."""
    class Builds:
        fa3 = None
        fa4 = None
    monkeypatch.setattr(fa3, "refusal", lambda call: Builds.fa3)
    monkeypatch.setattr(fa4, "refusal", lambda call: Builds.fa4)
    monkeypatch.setattr(calls, "require_cuda", lambda q: None)
    monkeypatch.setattr(routing, "num_sms", lambda index: 132)
    monkeypatch.setattr(ops, "compiled_head_dims", lambda: ((64, 128), False))  # a dev FA-2 build
    return Builds


def call(batch, seqlen_q, seqlen_k, heads, heads_k, list_blocks, *, list_heads=None, causal=False,
         requested="auto"):
    """A fixed-length call whose lists hold `list_blocks` entries per row (their capacity)."""
    q = torch.zeros(batch, seqlen_q, heads, 128, dtype=torch.bfloat16)
    k = v = torch.zeros(batch, seqlen_k, heads_k, 128, dtype=torch.bfloat16)
    tiles, list_heads = -(-seqlen_q // 128), list_heads or heads
    cnt = torch.full((batch, list_heads, tiles), list_blocks, dtype=torch.int32)
    idx = torch.arange(list_blocks, dtype=torch.int32).expand(batch, list_heads, tiles, list_blocks).contiguous()
    mask = (torch.zeros_like(cnt), torch.zeros_like(idx)) if causal else (None, None)
    blocks = SparseBlocks(cnt, idx, *mask, block_size=128, q_block_size=128)
    return calls.SparseCall(q, k, v, blocks, causal=causal, softmax_scale=None, backend=requested)


PREFILL = dict(batch=1, seqlen_q=4096, seqlen_k=16384, heads=8, heads_k=8)  # 128 key blocks
DECODE = dict(batch=8, seqlen_q=16, seqlen_k=32768, heads=32, heads_k=8, list_heads=8)


def test_prefill_goes_to_fa3_when_causal_or_at_most_a_sixteenth_listed(builds):
    assert routing.choose(call(**PREFILL, list_blocks=128))[0] == "fa4"
    assert routing.choose(call(**PREFILL, list_blocks=32))[0] == "fa4"  # 1/4: FA-4 ahead
    backend, why = routing.choose(call(**PREFILL, list_blocks=8))
    assert backend == "fa3" and "at most 8 of 128 blocks" in why
    backend, why = routing.choose(call(**PREFILL, list_blocks=64, causal=True))
    assert backend == "fa3" and "causal" in why


def test_prefill_with_gqa_heads_fa4_packs_stays_on_fa4(builds):
    gqa = dict(PREFILL, heads=32, heads_k=8, list_heads=8)
    assert routing.choose(call(**gqa, list_blocks=8))[0] == "fa4"
    assert routing.choose(call(**gqa, list_blocks=8, causal=True))[0] == "fa4"
    assert routing.choose(call(**dict(gqa, list_heads=32), list_blocks=8))[0] == "fa3"  # per query head: unpacked


def test_decode_stays_on_fa4_and_goes_from_fa2_to_fa3_from_32_packed_rows(builds):
    """FA3_MIN_PACKED_ROWS (run 143): FA-3 led FA-2 from Sq8 at H32/8 (32 packed rows), not below."""
    assert routing.choose(call(**DECODE, list_blocks=16))[0] == "fa4"  # packed query heads
    builds.fa4 = "no runtime"
    backend, why = routing.choose(call(**DECODE, list_blocks=16))
    assert backend == "fa3" and "64 query rows of a K/V head packed" in why and "no runtime" in why
    assert routing.choose(call(**dict(DECODE, seqlen_q=8), list_blocks=16))[0] == "fa3"
    assert routing.choose(call(**dict(DECODE, seqlen_q=4), list_blocks=16))[0] == "fa2"  # 16 packed rows
    assert routing.choose(call(**dict(DECODE, seqlen_q=1), list_blocks=16))[0] == "fa2"
    assert routing.choose(call(**dict(DECODE, list_heads=32), list_blocks=16))[0] == "fa2"  # per query head: unpacked
    builds.fa3 = "flash_attn_3 is not importable"
    assert routing.choose(call(**DECODE, list_blocks=16)) == ("fa2", "no runtime")


def test_without_fa4_prefill_goes_to_fa3_and_without_fa3_the_rule_is_unchanged(builds):
    builds.fa4 = "no runtime"
    backend, why = routing.choose(call(**PREFILL, list_blocks=128))
    assert backend == "fa3" and "1.8x FA-2" in why and "no runtime" in why
    builds.fa3 = "flash_attn_3 is not importable"
    assert routing.choose(call(**PREFILL, list_blocks=8)) == ("fa2", "no runtime")
    builds.fa4 = None
    assert routing.choose(call(**PREFILL, list_blocks=8))[0] == "fa4"
    assert routing.choose(call(**PREFILL, list_blocks=8, causal=True))[0] == "fa4"


def test_under_torch_compile_prefill_and_packed_decode_go_to_fa3_and_single_rows_to_fa2(builds, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert routing.choose(call(**PREFILL, list_blocks=128))[0] == "fa3"
    assert routing.choose(call(**DECODE, list_blocks=16))[0] == "fa3"
    assert routing.choose(call(**dict(DECODE, seqlen_q=1), list_blocks=16)) == ("fa2", "traced by torch.compile")
    builds.fa3 = "flash_attn_3 is not importable"
    assert routing.choose(call(**PREFILL, list_blocks=128)) == ("fa2", "traced by torch.compile")


def test_a_requested_backend_is_kept_or_refused_with_its_reason(builds):
    assert routing.choose(call(**PREFILL, list_blocks=8, requested="fa4")) == ("fa4", "requested")
    assert routing.choose(call(**DECODE, list_blocks=16, requested="fa3")) == ("fa3", "requested")
    builds.fa3 = "no fa3 here"
    with pytest.raises(Exception, match="'fa3' cannot run this call: no fa3 here"):
        routing.choose(call(**PREFILL, list_blocks=8, requested="fa3"))


def test_outside_a_graph_capture_short_fa4_calls_go_where_auto_would_send_them_without_fa4(builds, monkeypatch):
    """FA4_EAGER_MIN_GPU_US: eagerly a call costs the longer of its host and GPU time, and FA-4's
    host time is 10-20x the others', so auto's FA-4 choice runs elsewhere when FA-4's modelled GPU
    time is too short to hide it; the crossover shapes (B1 H32/8) fall as runs 119 and 125
    measured them eagerly."""
    monkeypatch.setattr(fa4, "num_sms", lambda index: 132)
    gqa = dict(batch=1, heads=32, heads_k=8, list_heads=8)
    decode = call(**DECODE, list_blocks=16)
    backend, why = routing.choose(decode)
    assert backend == "fa4"
    eager_backend, eager_why = routing.eager_choice(decode, backend, fa4.num_splits(decode))
    assert eager_backend == "fa3" and "host time" in eager_why  # 64 packed rows (run 143: eager fa3 0.037 ms, fa2 0.040)
    single_rows = call(**dict(DECODE, seqlen_q=1), list_blocks=16)
    assert routing.eager_choice(single_rows, "fa4", fa4.num_splits(single_rows))[0] == "fa2"
    causal_4k = call(**gqa, seqlen_q=4096, seqlen_k=4096, list_blocks=2, causal=True)  # 1/16
    assert routing.eager_choice(causal_4k, "fa4", 1)[0] == "fa3"
    # 1/4 (run 125: eager fa3 0.117 ms, fa4 0.377): lists of 16 at capacity, but a causal tile's
    # list holds no more blocks than precede its diagonal, 12 on average here.
    causal_4k_quarter = call(**gqa, seqlen_q=4096, seqlen_k=4096, list_blocks=8, causal=True)
    assert causal_4k_quarter.max_list_length() == 16
    assert fa4.modelled_time_us(causal_4k_quarter, 1) < 0.8 * fa4.split_time_us(1, **fa4._call_work(causal_4k_quarter))
    assert routing.eager_choice(causal_4k_quarter, "fa4", 1)[0] == "fa3"
    causal_16k = call(**gqa, seqlen_q=16384, seqlen_k=16384, list_blocks=32, causal=True)  # eagerly level (run 125)
    assert routing.eager_choice(causal_16k, "fa4", 1) is None
    long_prefill = call(**gqa, seqlen_q=4096, seqlen_k=16384, list_blocks=32)  # 1/4: eager fa4 0.451 ms, fa3 0.480
    assert fa4.modelled_time_us(long_prefill, 1) > routing.FA4_EAGER_MIN_GPU_US
    assert routing.eager_choice(long_prefill, "fa4", 1) is None
    assert routing.eager_choice(call(**DECODE, list_blocks=16, requested="fa4"), "fa4", 1) is None  # asked for
    assert routing.eager_choice(decode, "fa2", 1) is None
    builds.fa3 = "flash_attn_3 is not importable"
    assert routing.eager_choice(causal_4k, "fa4", 1)[0] == "fa2"
    # A head dim the FA-2 build lacks (dev: 64 and 128) stays on FA-4, eagerly too.
    monkeypatch.setattr(ops, "compiled_head_dims", lambda: ((128,), False))
    assert routing.eager_choice(causal_4k, "fa4", 1)[0] == "fa2"
    monkeypatch.setattr(ops, "compiled_head_dims", lambda: ((64,), False))
    assert routing.eager_choice(causal_4k, "fa4", 1) is None

    def no_extension():
        raise ImportError("No module named 'flash_attn_2_cuda'")
    monkeypatch.setattr(ops, "compiled_head_dims", no_extension)
    assert routing.eager_choice(causal_4k, "fa4", 1) is None


def test_outside_a_graph_capture_host_bound_fa3_calls_go_to_fa2(builds, monkeypatch):
    """FA3_EAGER_MIN_GPU_US: where FA-4's modelled GPU time is under 12 us a call is bound by its
    host time, and FA-2's host path is the shorter (runs 143 and 146, B1 H32/8 eagerly: Sq32 decode
    fa2 0.0214 ms, fa3 0.0221; Sq256 Sk16k 1/16 fa2 0.0280, fa3 0.0229)."""
    monkeypatch.setattr(fa4, "num_sms", lambda index: 132)
    b1_decode = call(**dict(DECODE, batch=1, seqlen_q=32), list_blocks=16)  # modelled 8 us
    assert routing.choose(b1_decode)[0] == "fa4"
    eager_backend, why = routing.eager_choice(b1_decode, "fa4", fa4.num_splits(b1_decode))
    assert eager_backend == "fa2" and "FA4_EAGER_MIN_GPU_US" in why
    builds.fa4 = "no runtime"
    assert routing.choose(b1_decode)[0] == "fa3"  # under graph replay FA-3 leads (0.0116 vs 0.0158 ms)
    eager_backend, why = routing.eager_choice(b1_decode, "fa3", 0)
    assert eager_backend == "fa2" and "FA3_EAGER_MIN_GPU_US" in why
    assert routing.eager_choice(call(**DECODE, list_blocks=16), "fa3", 0) is None  # B8: modelled 17 us
    short_prefill = call(batch=1, seqlen_q=128, seqlen_k=16384, heads=32, heads_k=8, list_heads=8, list_blocks=8)
    assert routing.choose(short_prefill)[0] == "fa3" and routing.eager_choice(short_prefill, "fa3", 0)[0] == "fa2"
    longer_prefill = call(batch=1, seqlen_q=256, seqlen_k=16384, heads=32, heads_k=8, list_heads=8, list_blocks=8)
    assert routing.eager_choice(longer_prefill, "fa3", 0) is None  # modelled 14 us
    assert routing.eager_choice(call(**dict(DECODE, batch=1, seqlen_q=32), list_blocks=16, requested="fa3"), "fa3", 0) is None
    monkeypatch.setattr(ops, "compiled_head_dims", lambda: ((64,), False))  # no FA-2 kernels for d 128: FA-3 keeps it
    assert routing.eager_choice(b1_decode, "fa3", 0) is None


def test_a_decision_runs_its_eager_choice_unless_the_stream_is_capturing(builds, monkeypatch):
    """One cached decision serves both: eager calls launch the eager backend, captured ones FA-4."""
    from flash_attn_sparse import backends
    monkeypatch.setattr(fa4, "num_sms", lambda index: 132)
    ran = []
    for name in ("fa2", "fa4"):
        fake = type(name, (), {"num_splits": staticmethod(lambda c: 1),
                               "run": staticmethod(lambda c, splits, out, name=name: ran.append(name) or (out, None))})
        monkeypatch.setitem(backends.BACKENDS, name, fake)
    decode = call(**dict(DECODE, seqlen_q=1), list_blocks=16)  # eagerly FA-2's (4 packed rows)
    decision = interface.Decision(decode)
    assert (decision.backend, decision.eager.backend) == ("fa4", "fa2")
    monkeypatch.setattr(interface, "capturing", lambda: False)
    decision.run(decode)
    monkeypatch.setattr(interface, "capturing", lambda: True)
    decision.run(decode)
    assert ran == ["fa2", "fa4"]
    assert interface.Decision(call(**DECODE, list_blocks=16, requested="fa4")).eager is None
