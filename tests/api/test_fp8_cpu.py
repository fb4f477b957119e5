"""FP8 (float8_e4m3fn) on the CPU: the checks of FP8 calls (dtypes, descales, out), the
backends' refusals and auto's FP8 rule, the descales' broadcasting, q's quantization against a
float reference (NaN included), and what the FA-3 backend passes to its (faked) kernels: an e4m3
q and its computed q_descale, the plan's own descales, a bfloat16 out. The kernels themselves:
tests/backends/test_fa3_fp8_gpu.py."""

import pytest
import torch

import flash_attn_sparse as fas
from flash_attn_sparse import SparseBlocks, SparseInputError, calls, interface, routing
from flash_attn_sparse.backends import fa2, fa2_ops, fa3, fa3_ops, fa4
from flash_attn_sparse.fp8 import E4M3_MAX, FP8_DTYPE, normalize_descale, quantize_q, quantized_q_buffers
from flash_attn_sparse.metadata import pack_varlen_lists
from flash_attn_sparse.options import CallOptions
from flash_attn_sparse.reference import dequantize

B, SQ, SK, H, HK, D = 2, 16, 1024, 8, 2, 128
E4M3 = FP8_DTYPE


def qkv(q_dtype=torch.bfloat16, kv_dtype=E4M3, seqlen_q=SQ):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, seqlen_q, H, D, generator=g).to(q_dtype)
    k = torch.randn(B, SK, HK, D, generator=g).to(kv_dtype)
    return q, k, torch.randn(B, SK, HK, D, generator=g).to(kv_dtype)


def table():
    return torch.tensor([0, 5, 2], dtype=torch.int32)


def lists():
    cnt = torch.full((B, HK, 1), 3, dtype=torch.int32)
    idx = torch.tensor([6, 0, 3], dtype=torch.int32).expand(B, HK, 1, 3).contiguous()
    return SparseBlocks(cnt, idx, block_size=128)


def sparse_call(q, k, v, backend="fa3", **descales):
    return calls.SparseCall(q, k, v, lists(), CallOptions(backend=backend), **descales)


@pytest.fixture
def on_cuda(monkeypatch):
    """CPU tensors past the CUDA-device check (the kernels are never reached unless faked)."""
    monkeypatch.setattr(calls, "require_cuda", lambda q: None)
    monkeypatch.setattr(fa2_ops, "compiled_head_dims", lambda: ((64, 128), False))


@pytest.fixture
def fp8_build(monkeypatch, on_cuda):
    """An sm90 with a flash_attn_3 build that has the FP8 units (set builds.disabled to change it)."""
    monkeypatch.setattr(fa3_ops, "_on_sm90", lambda q: True)
    monkeypatch.setitem(fa3_ops._MISSING_BUILD, "answer", None)
    monkeypatch.setitem(fa3_ops._DISABLED, "answer", ())
    monkeypatch.setitem(fa3_ops._DESCALES, "answer", True)


# --- validation -----------------------------------------------------------------------------

BAD = {
    "e4m3 q with bf16 k": (dict(q_dtype=E4M3, kv_dtype=torch.bfloat16), dict(q_descale=1.0), "k",
                           "same dtype"),
    "float32 q with e4m3 k": (dict(q_dtype=torch.float32), dict(k_descale=1.0, v_descale=1.0), "q",
                              "float16, bfloat16 or float8_e4m3fn"),
    "no k_descale": (dict(), dict(v_descale=1.0), "k_descale", "required"),
    "no v_descale": (dict(), dict(k_descale=1.0), "v_descale", "required"),
    "e4m3 q without q_descale": (dict(q_dtype=E4M3), dict(k_descale=1.0, v_descale=1.0), "q_descale", "required"),
    "q_descale with a bf16 q": (dict(), dict(q_descale=1.0, k_descale=1.0, v_descale=1.0), "q_descale",
                                "the package"),
    "descales on a bf16 call": (dict(kv_dtype=torch.bfloat16), dict(k_descale=1.0, v_descale=1.0), "k_descale",
                                "float8_e4m3fn k and v only"),
    "q_descale on a bf16 call": (dict(kv_dtype=torch.bfloat16), dict(q_descale=torch.ones(B, HK)), "q_descale",
                                 "float8_e4m3fn k and v only"),
    "descale per query head": (dict(), dict(k_descale=torch.ones(B, H), v_descale=1.0), "k_descale",
                               f"({B}, {HK})"),
    "descale 1-D": (dict(), dict(k_descale=1.0, v_descale=torch.ones(HK)), "v_descale", "broadcast"),
    "integer descale": (dict(), dict(k_descale=torch.ones(B, HK, dtype=torch.int32), v_descale=1.0), "k_descale",
                        "floating-point"),
    "NaN descale": (dict(), dict(k_descale=float("nan"), v_descale=1.0), "k_descale", "finite"),
    "descale of another type": (dict(), dict(k_descale=[1.0], v_descale=1.0), "k_descale", "list"),
    "descale on another device": (dict(), dict(k_descale=torch.ones(B, HK, device="meta"), v_descale=1.0),
                                  "k_descale", "device"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_fp8_input_is_refused_naming_the_argument(case):
    dtypes, descales, argument, words = BAD[case]
    q, k, v = qkv(**dtypes)
    with pytest.raises(SparseInputError) as raised:
        fas.flash_attn_with_sparse_block_table(q, k, v, table(), **descales)
    assert str(raised.value).startswith(f"{argument}:") and words in str(raised.value), str(raised.value)


def test_v_must_have_ks_dtype():
    q, k, _ = qkv()
    with pytest.raises(SparseInputError, match=r"^v: must have the dtype of k \(torch.float8_e4m3fn\)"):
        fas.flash_attn_with_sparse_block_table(q, k, torch.zeros_like(k, dtype=torch.bfloat16), table(),
                                               k_descale=1.0, v_descale=1.0)


def test_a_valid_fp8_call_is_stopped_only_by_the_cuda_check():
    for dtypes, descales in ((dict(), dict(k_descale=1.0, v_descale=1.0)),
                             (dict(q_dtype=torch.float16), dict(k_descale=torch.ones(1, HK), v_descale=torch.ones(B, 1))),
                             (dict(q_dtype=E4M3), dict(q_descale=0.5, k_descale=torch.tensor(2.0), v_descale=1))):
        with pytest.raises(SparseInputError, match="^q: must be on a CUDA device"):
            fas.flash_attn_with_sparse_block_table(*qkv(**dtypes), table(), **descales)


def test_the_call_records_what_fp8_changes(on_cuda):
    call = sparse_call(*qkv(), k_descale=2.0, v_descale=torch.full((B, HK), 3.0))
    assert call.fp8 and call.quantizes_q and call.out_dtype == torch.bfloat16 and call.q_descale is None
    assert call.k_descale.shape == (B, HK) and bool((call.k_descale == 2).all()) and bool((call.v_descale == 3).all())
    given = sparse_call(*qkv(q_dtype=E4M3), q_descale=1.0, k_descale=1.0, v_descale=1.0)
    assert given.fp8 and not given.quantizes_q and given.q_descale.shape == (B, HK)
    plain = sparse_call(*qkv(kv_dtype=torch.bfloat16))
    assert not plain.fp8 and plain.out_dtype == torch.bfloat16 and plain.k_descale is None
    half = sparse_call(*qkv(q_dtype=torch.float16), k_descale=1.0, v_descale=1.0)
    assert half.out_dtype == torch.bfloat16  # FP8 K/V give bfloat16 out whatever q's dtype
    rebound = call.rebind(k_descale=torch.zeros(B, HK))
    assert bool((rebound.k_descale == 0).all()) and bool((call.k_descale == 2).all())


@pytest.mark.parametrize("out_dtype", [torch.float16, E4M3, torch.float32])
def test_an_fp8_calls_out_must_be_bfloat16(on_cuda, out_dtype):
    q, k, v = qkv(q_dtype=torch.float16)
    with pytest.raises(SparseInputError, match=r"^out: must be like q \(.*torch.bfloat16"):
        fas.flash_attn_with_sparse_block_table(q, k, v, table(), k_descale=1.0, v_descale=1.0, backend="fa3",
                                               out=torch.empty_like(q, dtype=out_dtype))


# --- normalize_descale ----------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(), (1, 1), (B, 1), (1, HK), (B, HK)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_descales_broadcast_to_batch_by_kv_heads(shape, dtype):
    value = (torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32) / 4).reshape(shape).to(dtype)
    result = normalize_descale("k_descale", value, B, HK, "cpu")
    assert result.shape == (B, HK) and result.dtype == torch.float32
    assert torch.equal(result, value.float().expand(B, HK))
    if dtype == torch.float32:  # no copy: a view of the caller's tensor (stride 0 where broadcast)
        assert result.data_ptr() == value.data_ptr()
        if shape == (B, HK):
            assert result is value
        else:
            assert 0 in result.stride()


def test_a_float_descale_is_a_stride_0_float32_tensor():
    result = normalize_descale("v_descale", 0.25, B, HK, "cpu")
    assert result.shape == (B, HK) and result.stride() == (0, 0) and bool((result == 0.25).all())
    assert normalize_descale("v_descale", 3, B, HK, "cpu").dtype == torch.float32


# --- backends and auto ------------------------------------------------------------------------

def test_fa2_and_fa4_refuse_fp8_calls_by_name(on_cuda):
    call = sparse_call(*qkv(), k_descale=1.0, v_descale=1.0)
    assert "FA-2 has no FP8 (float8_e4m3fn) kernels" in fa2.refusal(call) and "'fa3'" in fa2.refusal(call)
    assert "FP8" in fa4.refusal(call) and "'fa3'" in fa4.refusal(call)
    for backend, words in (("fa2", "FA-2 has no FP8"), ("fa4", "flash-attn-4")):
        with pytest.raises(SparseInputError, match=f"^backend: '{backend}' cannot run this call: .*{words}"):
            fas.flash_attn_with_sparse_block_table(*qkv(), table(), k_descale=1.0, v_descale=1.0, backend=backend)


def test_auto_sends_fp8_to_fa3_only_and_names_its_refusal(fp8_build, monkeypatch):
    call = sparse_call(*qkv(), backend="auto", k_descale=1.0, v_descale=1.0)
    backend, why = routing.choose(call)
    assert backend == "fa3" and "FP8" in why
    assert fas.choose_backend(*qkv(), table(), k_descale=1.0, v_descale=1.0)[0] == "fa3"
    monkeypatch.setitem(fa3_ops._DISABLED, "answer", ("FP8",))  # the dev build without FLASH_ATTN_SPARSE_FP8=1
    with pytest.raises(SparseInputError) as raised:
        routing.choose(call)
    message = str(raised.value)
    assert message.startswith("backend: no backend runs this FP8 call: 'fa3'") and "FLASH_ATTN_SPARSE_FP8=1" in message
    assert "FA-2" not in message  # fa3's reason, not fa2's
    monkeypatch.setattr(fa3_ops, "_on_sm90", lambda q: False)
    with pytest.raises(SparseInputError, match="FP8 call: 'fa3' .* sm90"):
        fas.flash_attn_with_sparse_block_table(*qkv(), table(), k_descale=1.0, v_descale=1.0)


def test_a_build_whose_op_predates_the_descales_is_refused_as_without_fp8(fp8_build, monkeypatch):
    monkeypatch.setitem(fa3_ops._DESCALES, "answer", False)
    q, k, _ = qkv()
    assert "FLASH_ATTN_SPARSE_FP8=1" in fa3_ops.refusal(q, k, lists(), varlen=False)


def test_fa3_takes_fp8_where_it_takes_16_bit_calls_but_cp_async_pages(fp8_build, monkeypatch):
    for q_dtype in (E4M3, torch.bfloat16, torch.float16):
        q, k, _ = qkv(q_dtype=q_dtype)
        assert fa3_ops.refusal(q, k, lists(), varlen=False) is None
        assert fa3_ops.refusal(q, k, lists(), varlen=False, page_size=256) is None  # TMA pages
        assert "not supported for FP8" in fa3_ops.refusal(q, k, lists(), varlen=False, page_size=64)
        assert "head dims" in fa3_ops.refusal(q[..., :96], k[..., :96], lists(), varlen=False)
    q, k, _ = qkv(q_dtype=torch.float32)
    assert "float8_e4m3fn" in fa3_ops.refusal(q, k, lists(), varlen=False)
    monkeypatch.setitem(fa3_ops._DISABLED, "answer", ("FP16",))  # a quantized fp16 q runs the e4m3 kernels
    assert fa3_ops.refusal(*qkv(q_dtype=torch.float16)[:2], lists(), varlen=False) is None
    assert "FP16" in fa3_ops.refusal(*qkv(torch.float16, torch.float16)[:2], lists(), varlen=False)


def test_the_speculative_forms_and_the_partials_refuse_fp8():
    q, k, v = qkv()
    with pytest.raises(SparseInputError, match="^k: flash_attn_speculative_sparse_zero_copy is not yet for FP8 K/V"):
        fas.flash_attn_speculative_sparse_zero_copy(q, k, v, table(), table())
    with pytest.raises(SparseInputError, match="^k: flash_attn_speculative_sparse is not yet for FP8 K/V"):
        fas.flash_attn_speculative_sparse(q, k[:, :128], v[:, :128], k, v, table())
    with pytest.raises(SparseInputError, match="^q: flash_attn_sparse_partials is not yet for FP8 K/V"):
        fas.flash_attn_sparse_partials(q.to(E4M3), k, v, [table()])


# --- quantize_q -------------------------------------------------------------------------------

def _magnitudes(q_dtype, shape, heads):
    """Random values of very different magnitudes per query head (a K/V head's group mixes them)."""
    g = torch.Generator().manual_seed(7)
    per_head = torch.tensor([1e-4, 3e-2, 1.0, 40.0, 1e3, 0.5, 2e-6, 7.0][:heads])
    return (torch.randn(*shape, generator=g) * per_head.view(*([1] * (len(shape) - 2)), heads, 1)).to(q_dtype)


def _check_quantized(q, q_e4m3, q_descale, heads_k, cu_seqlens=None):
    assert q_e4m3.dtype == E4M3 and q_e4m3.shape == q.shape and q_e4m3.is_contiguous()
    assert q_descale.dtype == torch.float32
    exact = q.float()
    error = (dequantize(q_e4m3, q_descale, cu_seqlens) - exact).abs()
    per_head = dequantize(torch.ones_like(q_e4m3, dtype=torch.float32), q_descale, cu_seqlens)  # the descale per element
    # Rounding to 3 mantissa bits: 2^-4 of the value in e4m3's normal range, 2^-10 x descale below it.
    assert bool((error <= exact.abs() * 2 ** -4 + per_head * 2 ** -10).all())
    group = q.shape[-2] // heads_k
    reduced = (1, 3, 4) if q.dim() == 4 else (0, 2, 3)
    amax = exact.abs().unflatten(-2, (heads_k, group)).amax(dim=reduced)
    worst = error.unflatten(-2, (heads_k, group)).amax(dim=reduced)
    assert bool((worst <= amax * 2 ** -4).all()), (worst / amax).max()
    scaled = amax / (q_descale[0] if q.dim() == 3 else q_descale)
    assert bool(((scaled > E4M3_MAX / 2) & (scaled <= E4M3_MAX)).all())  # the largest value uses e4m3's top binade
    assert torch.equal(torch.exp2(torch.log2(q_descale).round()), q_descale)  # a power of two


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,heads_k", [(8, 2), (8, 8), (8, 1)])
def test_quantize_q_is_within_e4m3s_rounding_of_the_float_values(q_dtype, heads, heads_k):
    q = _magnitudes(q_dtype, (3, 37, heads, 64), heads)
    q_e4m3, q_descale = quantize_q(q, heads_k)
    assert q_descale.shape == (3, heads_k)
    _check_quantized(q, q_e4m3, q_descale, heads_k)
    buffers = quantized_q_buffers(q, heads_k, 3)
    into, into_descale = quantize_q(q, heads_k, out=buffers)
    assert into is buffers[0] and torch.equal(into.float(), q_e4m3.float()) and torch.equal(into_descale, q_descale)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_a_varlen_q_takes_one_scale_per_kv_head_for_every_sequence(q_dtype):
    q = _magnitudes(q_dtype, (45, 8, 64), 8)
    cu = torch.tensor([0, 5, 5, 45], dtype=torch.int32)
    q_e4m3, q_descale = quantize_q(q, 2, cu_seqlens_q=cu)
    assert q_descale.shape == (3, 2) and q_descale.stride() == (0, 1)
    _check_quantized(q, q_e4m3, q_descale, 2, cu)
    assert torch.equal(quantize_q(q, 2, batch=3)[1], q_descale)


def test_quantize_q_keeps_nan_and_inf_non_finite_where_they_were():
    q = _magnitudes(torch.bfloat16, (2, 9, 8, 64), 8)
    poisoned = q.clone()
    poisoned[0, 3, 5, 7] = float("nan")
    poisoned[1, 0, 2, 1] = float("inf")
    poisoned[1, 8, 2, 2] = float("-inf")
    q_e4m3, q_descale = quantize_q(poisoned, 2)
    assert torch.isfinite(q_descale).all()  # the scale ignores them ...
    bad = ~torch.isfinite(q_e4m3.float())
    assert torch.equal(bad, ~torch.isfinite(poisoned))  # ... and they stay NaN (e4m3fn has no inf) where they were
    clean_e4m3, clean_descale = quantize_q(poisoned.nan_to_num(0.0, 0.0, 0.0), 2)
    assert torch.equal(q_descale, clean_descale) and torch.equal(q_e4m3.float()[~bad], clean_e4m3.float()[~bad])


def test_an_all_zero_or_empty_q_gets_descale_1():
    q_e4m3, q_descale = quantize_q(torch.zeros(2, 4, 8, 64, dtype=torch.bfloat16), 2)
    assert bool((q_descale == 1).all()) and not q_e4m3.float().any()
    tiny = torch.full((1, 2, 2, 64), 2.0 ** -120, dtype=torch.bfloat16)  # below AMAX_FLOOR: finite, quantized to 0
    assert torch.isfinite(quantize_q(tiny, 1)[1]).all()
    empty_e4m3, empty_descale = quantize_q(torch.zeros(0, 8, 64, dtype=torch.float16), 2, batch=2)
    assert empty_e4m3.shape == (0, 8, 64) and empty_descale.shape == (2, 2) and bool((empty_descale == 1).all())


def test_quantize_q_reads_nothing_back_to_the_host():
    """Meta tensors hold no data, so an op that reads values back (a host sync on the GPU) would fail."""
    q_e4m3, q_descale = quantize_q(torch.empty(2, 16, 8, 128, dtype=torch.bfloat16, device="meta"), 2)
    assert q_e4m3.device.type == "meta" and q_e4m3.dtype == E4M3 and q_descale.shape == (2, 2)


def test_dequantize_maps_query_heads_to_their_kv_heads_descale():
    x = torch.ones(2, 3, 4, 8).to(E4M3)
    descale = torch.tensor([[1.0, 2.0], [4.0, 8.0]])
    real = dequantize(x, descale)
    assert real[0, :, :2].eq(1).all() and real[0, :, 2:].eq(2).all() and real[1, :, 2:].eq(8).all()
    packed = dequantize(torch.ones(5, 4, 8).to(E4M3), descale, torch.tensor([0, 2, 5]))
    assert packed[:2, 2:].eq(2).all() and packed[2:, :2].eq(4).all()


# --- what the FA-3 backend launches -------------------------------------------------------------

@pytest.fixture
def fake_fa3(fp8_build, monkeypatch):
    """The extension's SparseForward and the ops, recording what they are given."""
    record = {"made": [], "runs": [], "ops": []}

    class FakeSparseForward:
        def __init__(self, **named):
            record["made"].append(named)

        def run(self, q, k, v, out):
            record["runs"].append(dict(q=q, k=k, v=v, out=out))
            return torch.zeros(q.shape[0], q.shape[2], q.shape[1])

        def release_run_buffers(self):
            pass

        def run_with(self, **named):
            record["runs"].append(named)
            q = named["q"]
            return torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def fwd(**named):
        record["ops"].append(named)
        q = named["q"]
        return torch.empty_like(q, dtype=torch.bfloat16), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(fa3_ops, "planner", lambda: FakeSparseForward)
    monkeypatch.setattr(fa3_ops, "op", lambda: fwd)
    monkeypatch.setattr(fa3_ops, "direct", lambda: None)
    monkeypatch.setattr(fa3_ops, "op_out", lambda: None)
    return record


def test_a_plan_quantizes_q_into_its_planned_buffers_and_keeps_its_own_descales(fake_fa3):
    q, k, v = qkv()
    k_descale = torch.full((B, HK), 2.0)
    plan = fas.SparsePlan(q, k, v, lists(), k_descale=k_descale, v_descale=0.5)
    assert plan.backend == "fa3" and plan.out.dtype == torch.bfloat16 and plan.out.shape == q.shape
    (made,) = fake_fa3["made"]
    assert made["q"].dtype == E4M3 and made["q"].shape == q.shape and made["out"] is plan.out
    assert made["q_descale"].shape == (B, HK) and made["k_descale"] is not k_descale  # the plan's copy
    assert bool((made["k_descale"] == 2).all()) and bool((made["v_descale"] == 0.5).all())
    out, _ = plan.run(q, k, v)
    (run,) = fake_fa3["runs"]
    assert out is plan.out and run["q"] is made["q"] and run["k"] is k  # q quantized into the planned buffer
    assert torch.equal(run["q"].float(), quantize_q(q, HK)[0].float())
    assert torch.equal(made["q_descale"], quantize_q(q, HK)[1])
    plan.run(q * 3, k, v, k_descale=torch.full((1, HK), 4.0), v_descale=1.0)
    assert bool((made["k_descale"] == 4).all()) and bool((made["v_descale"] == 1).all())
    assert torch.equal(made["q_descale"], quantize_q(q * 3, HK)[1])
    plan.run(q, k, v)
    assert bool((made["k_descale"] == 4).all())  # kept until a run gives new ones
    with pytest.raises(SparseInputError, match="^q_descale: this plan takes none: its q is quantized"):
        plan.run(q, k, v, q_descale=1.0)
    with pytest.raises(SparseInputError, match=r"^q: the plan was made for shape .*bfloat16"):
        plan.run(q.half(), k, v)
    with pytest.raises(SparseInputError, match=r"^k_descale: must be \(batch, heads_k\)"):
        plan.run(q, k, v, k_descale=torch.ones(B, H))


def test_a_plan_of_e4m3_q_runs_its_descales_and_a_16_bit_plan_takes_none(fake_fa3, monkeypatch):
    q, k, v = qkv(q_dtype=E4M3)
    plan = fas.SparsePlan(q, k, v, lists(), q_descale=torch.full((B, 1), 0.25), k_descale=1.0, v_descale=1.0)
    (made,) = fake_fa3["made"]
    assert made["q"] is q and bool((made["q_descale"] == 0.25).all())
    plan.run(q, k, v, q_descale=0.125)
    assert fake_fa3["runs"][-1]["q"] is q and bool((made["q_descale"] == 0.125).all())
    monkeypatch.setattr(fa3, "refusal", lambda call: None)
    plain = fas.SparsePlan(*qkv(kv_dtype=torch.bfloat16), lists(), backend="fa3")
    with pytest.raises(SparseInputError, match="^k_descale: this plan takes none: its k and v are not float8_e4m3fn"):
        plain.run(*qkv(kv_dtype=torch.bfloat16), k_descale=1.0)


def test_the_one_shot_cache_keys_on_descale_facts_and_passes_each_calls_descales(fake_fa3):
    q, k, v = qkv()
    first, second = torch.full((B, HK), 2.0), torch.full((B, HK), 3.0)
    out1, _ = fas.flash_attn_with_sparse_block_table(q, k, v, lists(), k_descale=first, v_descale=1.0)
    out2, _ = fas.flash_attn_with_sparse_block_table(q, k, v, lists(), k_descale=second, v_descale=5.0)
    assert len(fake_fa3["made"]) == 1 and len(fake_fa3["runs"]) == 2
    run1, run2 = fake_fa3["runs"]
    assert run1["k_descale"] is first and run2["k_descale"] is second and bool((run2["v_descale"] == 5).all())
    assert run1["q"].dtype == E4M3 and run1["q_descale"].shape == (B, HK)
    assert out1.dtype == torch.bfloat16 and out1 is not out2
    fas.flash_attn_with_sparse_block_table(q, k, v, lists(), k_descale=2.0, v_descale=1.0)  # other facts: a new plan
    assert len(fake_fa3["made"]) == 2 and fake_fa3["runs"][-1]["k_descale"].stride() == (0, 0)
    key = lambda descales: interface.cache_key(q, k, v, None, lists(), CallOptions(), None, None, None, None,  # noqa: E731
                                               (None, None), descales)
    assert key(dict(k_descale=first)) == key(dict(k_descale=second)) != key(dict(k_descale=2.0)) != key(None)


def test_the_traceable_path_quantizes_q_and_passes_its_descale(fake_fa3):
    call = sparse_call(*qkv(), k_descale=1.0, v_descale=1.0)
    out, _ = fa3.run(call, 1)
    (named,) = fake_fa3["ops"]
    assert named["q"].dtype == E4M3 and named["q_descale"].shape == (B, HK) and out.dtype == torch.bfloat16
    assert named["k_descale"] is call.k_descale and named["v_descale"] is call.v_descale


def test_a_varlen_fp8_call_plans_a_shared_q_descale(fake_fa3):
    seqlens_q, seqlens_k = [3, 1], [300, 700]
    q = torch.randn(sum(seqlens_q), H, D, dtype=torch.bfloat16)
    k = v = torch.zeros(sum(seqlens_k), HK, D).to(E4M3)
    cu = lambda lens: torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)  # noqa: E731
    blocks = pack_varlen_lists([[[[0, 2]]] * HK, [[[5]]] * HK], None, 128, 128)
    fas.flash_attn_varlen_with_sparse_blocks(q, k, v, blocks, cu_seqlens_q=cu(seqlens_q), cu_seqlens_k=cu(seqlens_k),
                                             max_seqlen_q=3, max_seqlen_k=700, k_descale=torch.ones(2, HK), v_descale=1.0)
    (made,), (run,) = fake_fa3["made"], fake_fa3["runs"]
    for named in (made, run):
        assert named["q"].dtype == E4M3 and named["q_descale"].shape == (2, HK) and named["q_descale"].stride() == (0, 1)
