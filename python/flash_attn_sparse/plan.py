"""Plan once, run many (as FlashInfer's plan() / run()): SparsePlan does a call's validation,
routing, split choice, argument conversion and output allocation once; run(q, k, v) launches
the backend's Planned forward, CUDA-graph capturable. The plan keeps the caller's list tensors
(not copies), so lists updated in place between runs take effect."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from .backends import BACKENDS
from .calls import BlockTable, SparseCall, as_blocks, check_out, facts
from .fp8 import DESCALE_NAMES, Descale, normalize_descale
from .interface import Decision
from .metadata import fail
from .options import CallOptions


class SparsePlan:
    """A planned sparse forward over tensors like the examples q, k, v (their shapes, strides,
    dtypes and devices; the data need not be final) and the lists `blocks` (a 1-D int32 table
    with block_size, or SparseBlocks), with the options of flash_attn_with_sparse_block_table, or
    with cu_seqlens_q / cu_seqlens_k / max_seqlen_q / max_seqlen_k those of
    flash_attn_varlen_with_sparse_blocks. Every check runs here, and raises SparseInputError.

    run(q, k, v, out=None) -> (out, lse): q, k, v must match the examples' facts (else
    SparseInputError); out defaults to the plan's own output buffer, which the next run
    overwrites. The lists, seqused_k, page_table and cu_seqlens are the plan's (the caller's
    tensors): update them in place between runs, within the shapes planned (list capacity,
    pages), and the next run sees them. On FA-2 and FA-3 the extension's SparseForward holds the
    checked parameters and the LSE and split buffers, and run only swaps in q, k, v and out and
    launches (no argument parsing, no allocation, no host sync; capturable in a CUDA graph); its
    lse is the plan's buffer, overwritten by the next run, like the default out. On FA-4 a
    batched plan converts the lists to flash-attn-4's block-sparse tensors (views) once; its own
    Python dispatch remains per run, and its output is copied into out.

    backend, why: where run goes, eagerly and inside a CUDA-graph capture alike (routing.choose).

    FP8 (float8_e4m3fn k and v; fa3 only): the descales as in flash_attn_with_sparse_block_table.
    The plan reads its own float32 (batch, heads_k) copies of them: run(..., k_descale=...,
    v_descale=..., q_descale=...) copies the descales it is given into them (a device copy, no
    sync, captured by a CUDA graph with its source), and a descale that a run does not pass stays
    as last given. A float16 / bfloat16 q is quantized on each run (no q_descale). Its out is
    bfloat16.
    """

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, blocks: BlockTable, *, block_size: int = 128,
                 causal: bool = False, softmax_scale: Optional[float] = None, num_splits: int = 0,
                 backend: str = "auto", validate: Optional[str] = None, seqused_k: Optional[Tensor] = None,
                 page_table: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                 cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                 max_seqlen_k: Optional[int] = None, q_descale: Optional[Descale] = None,
                 k_descale: Optional[Descale] = None, v_descale: Optional[Descale] = None):
        varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        batch = q.shape[0] if isinstance(q, Tensor) and q.dim() == 4 and not varlen else 1
        shapes = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k) if varlen else {}
        options = CallOptions(causal=causal, softmax_scale=softmax_scale, num_splits=num_splits, backend=backend,
                              validate=validate)
        call = SparseCall(q, k, v, as_blocks(blocks, block_size, batch, "blocks"), options, seqused_k=seqused_k,
                          page_table=page_table, table_name="blocks", q_descale=q_descale, k_descale=k_descale,
                          v_descale=v_descale, **shapes)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.stride(-1) != 1:
                fail(name, f"a plan runs tensors with a contiguous last dimension, got strides {t.stride()}")
        self.blocks = call.blocks  # batch-broadcast views of the caller's lists, where they had batch 1
        decision = Decision(call)
        self.backend, self.why, self.num_splits = decision.backend, decision.why, decision.num_splits
        # The plan's own descales, which the planned forward reads and a run may overwrite.
        self._descale_shape = (call.batch, call.k.shape[-2])
        self._descales = {name: torch.empty(self._descale_shape, dtype=torch.float32, device=q.device).copy_(value)
                          for name in DESCALE_NAMES if (value := getattr(call, name)) is not None}
        call = call.rebind(**self._descales)
        self._out_dtype = call.out_dtype
        self.out = torch.empty_like(q, dtype=call.out_dtype)
        self._facts = (facts(q), facts(k), facts(v))
        self._out_facts = facts(self.out)
        self._planned = BACKENDS[self.backend].plan(call, self.num_splits, self.out)

    def run(self, q: Tensor, k: Tensor, v: Tensor, out: Optional[Tensor] = None, *, q_descale: Optional[Descale] = None,
            k_descale: Optional[Descale] = None, v_descale: Optional[Descale] = None) -> Tuple[Tensor, Tensor]:
        """(out, lse) of the planned forward over q, k, v (see the class), with new FP8 descales where given."""
        if q_descale is not None or k_descale is not None or v_descale is not None:
            self._take_descales(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        target = self.out if out is None else out
        if self._planned.checks_facts:
            # The extension compares dtype, device, shapes and strides itself (C++), so the planned
            # case pays no Python checks; what it refuses falls through to the checks below, which
            # name what differs.
            try:
                return self._planned.run(q, k, v, target)
            except (RuntimeError, TypeError) as error:
                failure = error
        else:
            failure = None
        if (facts(q), facts(k), facts(v)) != self._facts:
            self._refuse(q, k, v)
        if out is not None and facts(out) != self._out_facts:
            check_out(out, q, self._out_dtype)  # names what differs; an out of other strides but a contiguous last dim runs
            return self._planned.run_any_out(q, k, v, out)
        if failure is not None:  # tensors laid out as planned: the planned forward's own error
            raise failure
        return self._planned.run(q, k, v, target)

    def _take_descales(self, **given) -> None:
        """Copies the descales given into the plan's own, after checking them all."""
        normalized = {}
        for name, value in given.items():
            if value is None:
                continue
            if name not in self._descales:
                why = ("its k and v are not float8_e4m3fn" if not self._descales
                       else "its q is quantized by the package, which computes q_descale")
                fail(name, f"this plan takes none: {why}")
            normalized[name] = normalize_descale(name, value, *self._descale_shape, self._descales[name].device)
        for name, value in normalized.items():
            self._descales[name].copy_(value)

    def _refuse(self, q, k, v) -> None:
        for name, t, planned in zip("qkv", (q, k, v), self._facts):
            if not isinstance(t, Tensor):
                fail(name, f"must be a tensor, got {type(t).__name__}")
            if facts(t) != planned:
                shape, strides, dtype, device = planned
                fail(name, f"the plan was made for shape {shape}, strides {strides}, {dtype} on {device}; got "
                           f"shape {tuple(t.shape)}, strides {t.stride()}, {t.dtype} on {t.device}")


def plan(q: Tensor, k: Tensor, v: Tensor, blocks: BlockTable, **options) -> SparsePlan:
    """SparsePlan(q, k, v, blocks, **options)."""
    return SparsePlan(q, k, v, blocks, **options)
