"""Shared test helpers: inputs, poisoning, and FlashAttention's tolerance convention."""

import torch

from flash_attn_sparse.reference import attention_ref, block_positions


def random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, device="cuda", generator=None):
    """Fresh random inputs (never zeros)."""
    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)
    return randn(batch, seqlen_q, heads, head_dim), randn(batch, seqlen_k, heads_k, head_dim), randn(batch, seqlen_k, heads_k, head_dim)


def poison_allocator(*shapes_and_dtypes, device="cuda"):
    """Fill soon-to-be-reused cached blocks with NaN, so an output element the kernel does not
    write shows up as NaN (outputs are allocated inside the ops)."""
    held = [torch.full(shape, float("nan"), dtype=dtype, device=device) for shape, dtype in shapes_and_dtypes]
    del held


def batched_rows(cnt, idx):
    """rows[b][h][m] = the first cnt entries of the row, as a Python list (one host sync)."""
    cnt, idx = cnt.tolist(), idx.tolist()
    return [[[row[:c] for c, row in zip(cnt_h, idx_h)] for cnt_h, idx_h in zip(cnt_b, idx_b)]
            for cnt_b, idx_b in zip(cnt, idx)]


def max_err(a, b):
    """Max abs difference, with matching infinities counting as equal."""
    a, b = a.double(), b.double()
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    diff = torch.where(both_inf, torch.zeros_like(a), (a - b).abs())
    return diff.max().item() if diff.numel() else 0.0


LSE_TOLERANCE = 1e-3  # fp32 accumulation and exp2 in the kernel; the reference LSE is exact from the same bf16/fp16 inputs


def assert_close_to_reference(out, lse, q, k, v, visible, softmax_scale=None, lse_layout="bhs"):
    """FlashAttention's convention: error vs an fp32 reference at most 2x the error of the same
    computation in the input dtype, plus a rounding term; LSE compared too.

    lse_layout "bhs": lse is (batch, heads, seqlen_q); "hs": varlen (heads, total_q) with batch 1.
    """
    ref_out, ref_lse = attention_ref(q, k, v, visible, softmax_scale, dtype=torch.float32)
    low_out, _ = attention_ref(q, k, v, visible, softmax_scale, dtype=q.dtype)
    assert not torch.isnan(out).any(), "output has NaN (unwritten or poisoned elements)"
    assert not torch.isnan(lse).any(), "LSE has NaN"
    err, low_err = max_err(out, ref_out), max_err(low_out, ref_out)
    assert err <= 2 * low_err + 1e-5, f"output error {err:.3e} > 2 x low-precision error {low_err:.3e} + 1e-5"
    if lse_layout == "hs":
        ref_lse = ref_lse[0]
    lse_err = max_err(lse, ref_lse)
    assert lse_err <= LSE_TOLERANCE, f"LSE error {lse_err:.3e} > {LSE_TOLERANCE}"
    return err, low_err, lse_err


def sparse_kernel_launches(fn):
    """The names of the sparse forward kernels fn launches, one entry per launch."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "flash_fwd_sparse_kernel" in e.name]


def missed_and_spec(n_blocks, n_spec, rng):
    """The speculative set holds the last n_spec blocks (the diagonal); the missed set is a
    permuted, gapped choice of earlier blocks."""
    spec = list(range(n_blocks - n_spec, n_blocks))
    missed = rng.sample(range(n_blocks - n_spec), (n_blocks - n_spec) // 3)
    return spec, missed


def gather_speculative(q, k, v, spec, missed, block_size):
    """The gathered speculative K/V and the missed table of a two-pass call, and its reference's
    keys, values and visibility: the missed keys (all visible), then the speculative keys (causal
    within them)."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    spec_pos = block_positions(spec, block_size, seqlen_k).to(q.device)
    miss_pos = block_positions(missed, block_size, seqlen_k).to(q.device)
    k_spec, v_spec = k[:, spec_pos].contiguous(), v[:, spec_pos].contiguous()
    table = torch.tensor(missed, dtype=torch.int32, device=q.device)
    keys = torch.cat([k[:, miss_pos], k_spec], dim=1)
    values = torch.cat([v[:, miss_pos], v_spec], dim=1)
    n_spec = spec_pos.numel()
    visible = torch.ones(seqlen_q, keys.shape[1], dtype=torch.bool, device=q.device)
    rows = torch.arange(seqlen_q, device=q.device)[:, None]
    visible[:, miss_pos.numel():] = torch.arange(n_spec, device=q.device)[None, :] <= rows + n_spec - seqlen_q
    return k_spec, v_spec, table, (keys, values, visible)


def one_shot_calls_on_two_streams(run, first, second, third):
    """run(blocks) -> (out, lse) over three lists of one shape: the first two calls on the current
    stream, the third on a side stream. Asserts that the later calls left the first call's out
    and LSE as they were (a new LSE per call); returns [(blocks, out, lse)] for each call."""
    out1, lse1 = run(first)
    kept = out1.clone(), lse1.clone()
    out2, lse2 = run(second)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out3, lse3 = run(third)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(out1, kept[0]) and torch.equal(lse1, kept[1]) and lse1.data_ptr() != lse2.data_ptr()
    return [(first, out1, lse1), (second, out2, lse2), (third, out3, lse3)]


def assert_captured_run_equals_direct(graphed, direct, q, k, v):
    """A graph-launching SparseForward's run recorded into the caller's CUDA graph (it launches
    directly while the stream is capturing) and replayed equals a direct one's run bitwise."""
    captured_out = torch.empty_like(q)
    torch.cuda.synchronize()
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        captured_lse = graphed.run(q, k, v, captured_out)
    captured_out.zero_()
    cuda_graph.replay()
    reference_out = torch.empty_like(q)
    reference_lse = direct.run(q, k, v, reference_out)
    assert torch.equal(captured_out, reference_out) and torch.equal(captured_lse, reference_lse)


def causal_lists(seqlen_q, seqlen_k, heads, block_size, q_block_size, density, rng):
    """Per-(head, query tile) lists of a causal sparse pattern: the blocks a tile's rows can see
    partly (around the diagonal) are "mask" blocks, a random share of the fully visible ones
    are "full" blocks. Lists are shuffled: the FA-2 path does not rely on order."""
    full, mask = [], []
    offset = seqlen_k - seqlen_q
    n_blocks = -(-seqlen_k // block_size)
    for _ in range(heads):
        full_h, mask_h = [], []
        for m in range(-(-seqlen_q // q_block_size)):
            first_row, last_row = m * q_block_size, min((m + 1) * q_block_size, seqlen_q) - 1
            # Key blocks entirely visible to the tile's first row, and those some row can see.
            historical = [b for b in range(n_blocks) if (b + 1) * block_size - 1 <= first_row + offset]
            partial = [b for b in range(n_blocks) if b not in historical and b * block_size <= last_row + offset]
            chosen = [b for b in historical if rng.random() < density]
            rng.shuffle(chosen)
            rng.shuffle(partial)
            full_h.append(chosen)
            mask_h.append(partial)
        full.append(full_h)
        mask.append(mask_h)
    return full, mask


SKEWED_LIST_LENGTHS = (0, 1, 2, 3, 33, 70)  # empty, a few, and long lists side by side in one call


def skewed_rows(rng, table_heads, seqlen_q, seqlen_k, causal, block_size=128, q_block_size=128, lengths=SKEWED_LIST_LENGTHS):
    """(full, mask)[hs][m] of one sequence: each (table head, query tile) list's length drawn from
    `lengths` in random order across tiles (every length about equally often), its ids a random,
    unsorted sample. Causal: the full blocks are fully historical for the tile's first row and the
    mask blocks (most tiles) those on its diagonal, each cut to what the tile has; else mask lists
    are empty."""
    n_blocks = -(-seqlen_k // block_size)
    m_tiles = -(-seqlen_q // q_block_size)
    drawn = [lengths[i % len(lengths)] for i in range(table_heads * m_tiles)]
    rng.shuffle(drawn)
    full = [[[] for _ in range(m_tiles)] for _ in range(table_heads)]
    mask = [[[] for _ in range(m_tiles)] for _ in range(table_heads)]
    shift = seqlen_k - seqlen_q
    for hs in range(table_heads):
        for m in range(m_tiles):
            length = drawn[hs * m_tiles + m]
            if not causal:
                full[hs][m] = rng.sample(range(n_blocks), min(length, n_blocks))
                continue
            first_row, last_row = m * q_block_size, min((m + 1) * q_block_size, seqlen_q) - 1
            historical = [b for b in range(n_blocks)
                          if (b + 1) * block_size - 1 <= first_row + shift and (b + 1) * block_size <= seqlen_k]
            diagonal = [b for b in range(len(historical), n_blocks) if b * block_size <= last_row + shift]
            if length and rng.random() < 0.75:
                mask[hs][m] = rng.sample(diagonal, min(length, len(diagonal)))
            full[hs][m] = rng.sample(historical, min(length - len(mask[hs][m]), len(historical)))
    return full, mask
