"""fp8.quantize_q on the GPU: its Triton kernels (fp8_triton) write the same bytes as its torch
form, in the one-launch and the two-pass layouts, batched and varlen, with NaN, inf, zero and
tiny groups, into given buffers, and under CUDA-graph capture."""

import pytest
import torch

from flash_attn_sparse import fp8
from flash_attn_sparse.fp8 import FP8_DTYPE, quantize_q, quantized_q_buffers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not fp8._triton_available(), reason="needs triton")]


def assert_same_e4m3(got, want):
    """Bitwise equal, NaN anywhere counted equal to NaN (e4m3fn has two NaN encodings)."""
    got_nan, want_nan = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(got_nan, want_nan)
    assert torch.equal(got.view(torch.uint8)[~got_nan], want.view(torch.uint8)[~want_nan])


def groups_of_many_magnitudes(shape, dtype, seed):
    """Values whose magnitude differs by query head over 1e-6 .. 1e4, so that groups take different scales."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    heads = shape[-2]
    magnitude = torch.logspace(-6, 4, heads, device="cuda").view(*([1] * (len(shape) - 2)), heads, 1)
    return (torch.randn(*shape, device="cuda", generator=g) * magnitude).to(dtype)


def poisoned(q):
    q = q.clone()
    flat = q.view(-1, q.shape[-1])
    flat[0, 3], flat[-1, 0], flat[len(flat) // 2, 5] = float("nan"), float("inf"), float("-inf")
    return q


# (shape, heads_k): decode and short rows take the one-launch kernel; 4k rows the two passes.
BATCHED = [((8, 16, 32, 128), 8), ((2, 1, 32, 64), 4), ((1, 4096, 32, 128), 8), ((3, 37, 8, 64), 1), ((2, 300, 64, 128), 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,heads_k", BATCHED, ids=[f"{s}-hk{h}" for s, h in BATCHED])
@pytest.mark.parametrize("poison", [False, True], ids=["finite", "nan-inf"])
def test_the_triton_kernels_write_the_torch_forms_bytes(shape, heads_k, dtype, poison):
    q = groups_of_many_magnitudes(shape, dtype, seed=sum(shape) + heads_k)
    if poison:
        q = poisoned(q)
    got, got_descale = quantize_q(q, heads_k)
    want, want_descale = fp8._quantize_q_torch(q, heads_k, q.shape[0], None)
    assert got.dtype == FP8_DTYPE and got.shape == q.shape and got_descale.shape == (shape[0], heads_k)
    assert torch.equal(got_descale, want_descale)
    assert_same_e4m3(got, want)


@pytest.mark.parametrize("total", [45, 5000])
def test_a_varlen_q_and_given_buffers_match_the_torch_form(total):
    q = poisoned(groups_of_many_magnitudes((total, 8, 128), torch.bfloat16, seed=total))
    buffers = quantized_q_buffers(q, 2, 3)
    got, got_descale = quantize_q(q, 2, batch=3, out=buffers)
    want, want_descale = fp8._quantize_q_torch(q, 2, 3, None)
    assert got is buffers[0] and got_descale.shape == (3, 2) and got_descale.stride() == (0, 1)
    assert torch.equal(got_descale, want_descale)
    assert_same_e4m3(got, want)


def test_zero_tiny_and_empty_groups_take_descale_1_as_in_torch():
    q = torch.zeros(2, 4, 8, 64, dtype=torch.bfloat16, device="cuda")
    q[1, :, 4:] = 2.0 ** -120  # below the amax floor
    got, got_descale = quantize_q(q, 2)
    assert bool((got_descale == 1).all()) and not got.float().any()
    assert torch.equal(got_descale, fp8._quantize_q_torch(q, 2, 2, None)[1])
    empty, empty_descale = quantize_q(torch.zeros(0, 8, 64, dtype=torch.float16, device="cuda"), 2, batch=2)
    assert empty.shape == (0, 8, 64) and bool((empty_descale == 1).all())


def test_a_non_contiguous_q_quantizes_as_its_contiguous_copy():
    q = groups_of_many_magnitudes((2, 16, 32, 128), torch.bfloat16, seed=3).transpose(1, 2).contiguous().transpose(1, 2)
    got, got_descale = quantize_q(q, 8)
    want, want_descale = quantize_q(q.contiguous(), 8)
    assert torch.equal(got_descale, want_descale)
    assert_same_e4m3(got, want)


def test_quantize_q_replays_in_a_cuda_graph_over_new_values():
    q = groups_of_many_magnitudes((8, 16, 32, 128), torch.bfloat16, seed=5)
    buffers = quantized_q_buffers(q, 8, 8)
    quantize_q(q, 8, out=buffers)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantize_q(q, 8, out=buffers)
    q.copy_(groups_of_many_magnitudes(q.shape, q.dtype, seed=6))
    graph.replay()
    want, want_descale = fp8._quantize_q_torch(q, 8, 8, None)
    assert torch.equal(buffers[1], want_descale)
    assert_same_e4m3(buffers[0], want)
