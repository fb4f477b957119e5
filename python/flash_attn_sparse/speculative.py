"""The speculative + repair forms: attention over a speculative set of K/V blocks (gathered, or a
list over the same K/V) merged exactly with attention over the missed blocks."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from .backends.device import MAX_SPLITS
from .backends.fa2_ops import combine, head_dim_rounded, partial_buffers
from .calls import BlockTable, SparseCall, as_blocks, check_out
from .fp8 import refuse_fp8
from .interface import partials_backend, run
from .metadata import SparseBlocks, cdiv, exhaustive_validation_requested, fail, int_range, validate_block_contents
from .options import CallOptions
from .routing import choose, runs_somewhere

# Query rows from which the missed pass on FA-4 runs the prefill form (both passes, merged).
FA4_PREFILL_QUERY_ROWS = 128


def _one_launch_refusal(q: Tensor, k_spec, v_spec, k: Tensor, v: Tensor, missed: SparseBlocks,
                        paged: bool = False) -> Optional[str]:
    """Why the speculative call's layout rules out one launch over both sources (None if it does
    not; the backends' refusals then say whether one takes it). The two-pass form runs otherwise
    (and reports bad input)."""
    if paged:
        return "paged k and v (the kernel pages every tile alike)"
    if not all(isinstance(t, Tensor) and t.dim() == 4 for t in (q, k_spec, v_spec, k, v)):
        return "not batched 4-D tensors"
    if missed.is_varlen or missed.mask_cnt is not None:
        return "the missed set has mask lists or the varlen layout"
    for t in (k_spec, v_spec):
        if t.dtype != q.dtype or t.device != q.device or t.shape[0] != q.shape[0] or t.shape[2:] != k.shape[2:] or t.shape[1] == 0:
            return "k_spec / v_spec differ from k / v in dtype, device, batch, heads or head dim, or are empty"
    if (k_spec.stride()[1:] != k.stride()[1:] or v_spec.stride()[1:] != v.stride()[1:] or k.stride(-1) != 1
            or v.stride(-1) != 1):
        return "k_spec / v_spec have other row or head strides than k / v"
    return None


def flash_attn_speculative_sparse(q: Tensor, k_spec: Tensor, v_spec: Tensor, k: Tensor, v: Tensor,
                                  sparse_block_table: BlockTable, *, block_size: int = 128,
                                  softmax_scale: Optional[float] = None, causal_spec: bool = True,
                                  num_splits: int = 0, backend: str = "auto", validate: Optional[str] = None,
                                  seqused_k: Optional[Tensor] = None,
                                  page_table: Optional[Tensor] = None,
                                  out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Speculative + repair: attention over the caller-gathered speculative K/V (k_spec, v_spec;
    it holds the diagonal, causal when causal_spec) merged exactly with attention over the
    missed blocks of the full K/V (sparse_block_table, all "full": every key visible to every
    query row). Returns (out, lse) like flash_attn_with_sparse_block_table. seqused_k and
    page_table describe k and v (paged caches) as in flash_attn_with_sparse_block_table; k_spec
    and v_spec stay contiguous (batch, seqlen_spec, heads_k, head_dim).

    With backend="fa4" at prefill (seqlen_q >= 128), the missed pass runs there over every
    row, and the speculative pass only over the rows that see a speculative key (with
    causal_spec, the last seqlen_spec rows), merged into those rows. Otherwise, where the layout
    allows (see _one_launch_refusal: k_spec/v_spec strided like k/v, no mask lists in the missed
    set) and a backend takes it (FA-2: a block size of at least one kernel tile), one launch: the
    missed blocks are the call's "full" blocks and the speculative ones its "mask" blocks, read
    from k_spec / v_spec. Otherwise two passes write fp32 partials into one buffer (FA-2's
    kernels) and the sparse combine kernel merges them. The same attention every way.
    out: as in flash_attn_with_sparse_block_table (written in place by the one-launch form on
    FA-2, filled by a copy otherwise). Not yet for FP8 inputs (refused)."""
    refuse_fp8("flash_attn_speculative_sparse", q=q, k=k, v=v, k_spec=k_spec, v_spec=v_spec)
    batch = q.shape[0] if isinstance(q, Tensor) and q.dim() == 4 else 1
    missed = as_blocks(sparse_block_table, block_size, batch, "sparse_block_table")
    if not isinstance(k_spec, Tensor) or k_spec.dim() != 4:
        fail("k_spec", "must be a (batch, seqlen_spec, heads_k, head_dim) tensor")
    if not isinstance(causal_spec, bool):
        fail("causal_spec", f"must be a bool, got {causal_spec!r}")
    # Missed blocks are all visible, so the missed pass is not causal (and is validated so).
    missed_call = SparseCall(q, k, v, missed, CallOptions(causal=False, softmax_scale=softmax_scale, num_splits=num_splits,
                                                          backend=backend, validate=validate),
                             seqused_k=seqused_k, page_table=page_table)
    check_out(out, missed_call.q)
    # At prefill on FA-4 the speculative pass runs over the rows that see k_spec only (faster than
    # one pass over the union there); elsewhere one launch, on the backend the missed pass takes
    # (FA-4 reads k_spec through a second pair of TMA descriptors, patch flash-attn-4/0006; FA-2
    # through its second source pointers).
    one_launch = _one_launch_refusal(q, k_spec, v_spec, k, v, missed, paged=page_table is not None) is None
    on_fa4 = choose(missed_call)[0] == "fa4"
    if on_fa4 and (missed_call.max_seqlen_q >= FA4_PREFILL_QUERY_ROWS or not one_launch):
        return _into(out, _speculative_over_missed_on_fa4(missed_call, k_spec, v_spec, causal_spec, validate, backend))
    if one_launch:
        # "mask" blocks whatever causal_spec: they name the second source; the flag masks them.
        spec = _every_block_of(k_spec, batch, "mask", missed.block_size)
        one_launch_call = missed_call.rebind()
        one_launch_call.use_mask_lists(spec, source=(k_spec, v_spec), causal=causal_spec)
        if runs_somewhere(one_launch_call):
            return run(one_launch_call, out)
    spec_blocks = _every_block_of(k_spec, batch, "mask" if causal_spec else "full")
    spec_call = SparseCall(q, k_spec, v_spec, spec_blocks, CallOptions(causal=causal_spec, softmax_scale=softmax_scale,
                                                                       num_splits=num_splits, validate=validate),
                           table_name="k_spec")
    partials = partials_backend()
    spec_splits = partials.num_splits(spec_call)
    missed_splits = partials.num_splits(missed_call)
    if spec_splits + missed_splits > MAX_SPLITS:
        spec_splits, missed_splits = min(spec_splits, MAX_SPLITS // 2), min(missed_splits, MAX_SPLITS // 2)
    out_partial, lse_partial = partial_buffers(spec_splits + missed_splits, spec_call.batch, q.shape[2],
                                               q.shape[1], q.shape[3], q.device)
    partials.run_partial(spec_call, out_partial, lse_partial, 0, spec_splits)
    partials.run_partial(missed_call, out_partial, lse_partial, spec_splits, missed_splits)
    return _into(out, combine(out_partial, lse_partial, q.dtype, q.shape[3], None, 0))


def _into(out: Optional[Tensor], result: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
    """result, with its output copied into `out` when given (a form that cannot write there)."""
    if out is None:
        return result
    out.copy_(result[0])
    return out, result[1]


def _every_block_of(k_spec: Tensor, batch: int, kind: str, block_size: int = 128) -> SparseBlocks:
    """Every block of k_spec as `kind` ("mask" or "full") blocks, one list shared by every row."""
    table = int_range(0, cdiv(k_spec.shape[1], block_size), k_spec.device)
    return SparseBlocks.from_block_table(table, block_size, batch, kind=kind)


def _speculative_over_missed_on_fa4(missed_call: SparseCall, k_spec: Tensor, v_spec: Tensor, causal_spec: bool,
                                    validate: Optional[str], backend: str) -> Tuple[Tensor, Tensor]:
    """The speculative call with its missed pass on FA-4 (prefill): that pass over every row, the
    speculative pass over the rows that see a speculative key, and the two merged there. With
    causal_spec, row r sees speculative key j iff j <= r + seqlen_spec - seqlen_q, so rows before
    the last seqlen_spec see none and keep the missed pass's answer: at prefill the merge touches a
    few rows, not every row of a second full-size output."""
    q, batch = missed_call.q, missed_call.batch
    out, lse = run(missed_call)
    seqlen_q, seqlen_spec = q.shape[1], k_spec.shape[1]
    rows = min(seqlen_q, seqlen_spec) if causal_spec else seqlen_q
    if rows == 0:
        return out, lse
    spec_blocks = _every_block_of(k_spec, batch, "mask" if causal_spec else "full")
    spec_call = SparseCall(q[:, seqlen_q - rows:], k_spec, v_spec, spec_blocks,
                           CallOptions(causal=causal_spec, softmax_scale=missed_call.scale, backend=backend, validate=validate),
                           table_name="k_spec")
    out_spec, lse_spec = run(spec_call)
    # Both partials of those rows as the combine's fp32 (2, b, h, rows, d_rounded) and (2, b, h, rows).
    head_dim = q.shape[-1]
    parts = torch.stack((out[:, seqlen_q - rows:], out_spec)).transpose(2, 3).float()
    pad = head_dim_rounded(head_dim) - head_dim
    parts = torch.nn.functional.pad(parts, (0, pad)) if pad else parts
    lses = torch.stack((lse[:, :, seqlen_q - rows:], lse_spec))
    merged, merged_lse = combine(parts.contiguous(), lses.contiguous(), q.dtype, head_dim, None, 0)
    out[:, seqlen_q - rows:] = merged
    lse[:, :, seqlen_q - rows:] = merged_lse
    return out, lse


def flash_attn_speculative_sparse_zero_copy(q: Tensor, k: Tensor, v: Tensor, spec_block_table: BlockTable,
                                            missed_block_table: BlockTable, *, block_size: int = 128,
                                            softmax_scale: Optional[float] = None, causal_spec: bool = True,
                                            num_splits: int = 0, backend: str = "auto",
                                            validate: Optional[str] = None,
                                            out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Speculative + repair without gathering: the speculative set is a block list over the same
    K/V (as "mask" blocks, so the diagonal gets the causal mask when causal_spec) and the missed
    set another ("full" blocks). One pass over both lists gives attention over their union.
    Both tables are 1-D int32 block-id tensors shared by every batch, head and query row.
    backend and out as in flash_attn_with_sparse_block_table: backend="fa4" runs it
    there as the union pass does. Not yet for FP8 inputs (refused)."""
    refuse_fp8("flash_attn_speculative_sparse_zero_copy", q=q, k=k, v=v)
    batch = q.shape[0] if isinstance(q, Tensor) and q.dim() == 4 else 1
    for name, t in (("spec_block_table", spec_block_table), ("missed_block_table", missed_block_table)):
        if not isinstance(t, Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            fail(name, "must be a 1-D int32 tensor of block ids")
        if isinstance(q, Tensor) and t.device != q.device:
            fail(name, f"must be on the device of q ({q.device}), got {t.device}")
    spec = SparseBlocks.from_block_table(spec_block_table, block_size, batch, kind="mask")
    missed = SparseBlocks.from_block_table(missed_block_table, block_size, batch)
    call = SparseCall(q, k, v, missed, CallOptions(causal=causal_spec, softmax_scale=softmax_scale, num_splits=num_splits,
                                                   backend=backend, validate=validate))
    if exhaustive_validation_requested(validate):  # the two lists together: ids in range, no block twice
        n = max(spec_block_table.shape[0], missed_block_table.shape[0])
        pad = lambda t: torch.nn.functional.pad(t, (0, n - t.shape[0])).view(1, 1, 1, n).expand(batch, 1, 1, n)
        union = SparseBlocks(missed.full_cnt, pad(missed_block_table), spec.mask_cnt, pad(spec_block_table), block_size)
        validate_block_contents(union, causal=causal_spec, seqlens_q=[call.max_seqlen_q] * batch,
                                seqlens_k=[call.max_seqlen_k] * batch)
    check_out(out, call.q)
    call.use_mask_lists(spec)  # views of the two tables, not a padded union (two copies and a fill)
    return run(call, out)
