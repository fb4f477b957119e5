"""Plan once, run many (as FlashInfer's plan() / run()): SparsePlan does a call's validation,
routing, split choice, argument conversion and output allocation once; run(q, k, v) compares the
tensors' identity facts with the planned ones and launches, CUDA-graph capturable. The plan keeps
the caller's list tensors (not copies), so lists updated in place between runs take effect."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import ops
from .backends import BACKENDS, fa2, fa3, fa4
from .calls import BlockTable, SparseCall, as_blocks, check_out
from .interface import Decision, facts
from .metadata import fail


class SparsePlan:
    """A planned sparse forward over tensors like the examples q, k, v (their shapes, strides,
    dtypes and devices; the data need not be final) and the lists `blocks` (a 1-D int32 table
    with block_size, or SparseBlocks), with the options of flash_attn_with_sparse_block_table, or
    with cu_seqlens_q / cu_seqlens_k / max_seqlen_q / max_seqlen_k those of
    flash_attn_varlen_with_sparse_blocks. Every check runs here, and raises SparseInputError.

    run(q, k, v, out=None) -> (out, lse): q, k, v must match the examples' facts (else
    SparseInputError; on FA-2 the extension compares them, in C++); out defaults to the plan's
    own output buffer, which the next run overwrites. The lists, seqused_k, page_table and cu_seqlens are the plan's (the caller's
    tensors): update them in place between runs, within the shapes planned (list capacity,
    pages), and the next run sees them. On the FA-2 backend the extension's SparseForward holds
    the checked parameters and the LSE and split buffers, and run only swaps in q, k, v and out
    and launches (no argument parsing, no allocation, no host sync; capturable in a CUDA graph);
    its lse is the plan's buffer, overwritten by the next run, like the default out. On FA-3 the
    same with flash_attn_3._C's SparseForward (backends/fa3.planned; a build without it, or an
    out of other strides, goes through backends/fa3.launcher, the extension's fwd_into). On the FA-4
    backend a batched plan converts the lists to flash-attn-4's block-sparse tensors (views)
    once and run calls flash-attn-4's forward (its own Python dispatch and compile-cache lookup
    remain, and it allocates its output, copied into out); a varlen FA-4 plan converts its lists
    on each run.

    backend, why: where run goes, eagerly and inside a CUDA-graph capture alike (routing.choose).
    """

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, blocks: BlockTable, *, block_size: int = 128,
                 causal: bool = False, softmax_scale: Optional[float] = None, num_splits: int = 0,
                 backend: str = "auto", validate: Optional[str] = None, seqused_k: Optional[Tensor] = None,
                 page_table: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                 cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                 max_seqlen_k: Optional[int] = None):
        varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        batch = q.shape[0] if isinstance(q, Tensor) and q.dim() == 4 and not varlen else 1
        self.blocks = as_blocks(blocks, block_size, batch, "blocks")
        shapes = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k) if varlen else {}
        call = SparseCall(q, k, v, self.blocks, causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
                          validate=validate, backend=backend, seqused_k=seqused_k, page_table=page_table,
                          table_name="blocks", **shapes)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.stride(-1) != 1:
                fail(name, f"a plan runs tensors with a contiguous last dimension, got strides {t.stride()}")
        self.blocks = call.blocks  # batch-broadcast views of the caller's lists, where they had batch 1
        self._decision = Decision(call)
        self.backend, self.why, self.num_splits = self._decision.backend, self._decision.why, self._decision.num_splits
        self.out = torch.empty_like(q)
        self._facts = (facts(q), facts(k), facts(v))
        self._out_facts = facts(self.out)
        # The extension's arguments, the lists included, bound once: run adds q, k, v.
        self._extension_args = self._fa4_entry = self._launch = self._planned = None
        if self.backend == "fa2":
            self._extension_args = dict(ops.extension_args(fa2.op_args(call, self.num_splits)), q=None, k=None, v=None)
            self._planned = ops.planned_forward(self._extension_args, call.q, call.k, call.v, self.out)
        elif self.backend == "fa4":
            if not call.varlen:  # flash-attn-4's block-sparse tensors: views of the lists, converted once
                self._fa4_entry = fa4.call_entry(call, self.num_splits)
        else:  # fa3: the extension's planned forward, and the op's launcher for an out of other strides
            self._planned = fa3.planned(call, self.num_splits, self.out)
            self._launch = BACKENDS[self.backend].launcher(call, self.num_splits, reuse_plan=False)
            self._launch_tensors = dict(cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_k=call.cu_seqlens_k,
                                        seqused_k=call.seqused_k, page_table=call.page_table)

    def run(self, q: Tensor, k: Tensor, v: Tensor, out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """(out, lse) of the planned forward over q, k, v (see the class)."""
        failure = None
        if self._planned is not None:
            # The extension's run compares dtype, device, shapes and strides itself (C++), so the
            # planned case pays no Python checks; anything it refuses falls through to the checks
            # below, which name what differs.
            target = self.out if out is None else out
            try:
                return target, self._planned.run(q, k, v, target)
            except (RuntimeError, TypeError) as error:
                failure = error
        if (facts(q), facts(k), facts(v)) != self._facts:
            self._refuse(q, k, v)
        if out is None:
            out = self.out
        elif facts(out) != self._out_facts:
            check_out(out, q)  # names what differs; an out of other strides but a contiguous last dim runs
            if self._extension_args is not None:  # the planned forward holds the planned out's strides
                return out, ops.launch_direct(dict(self._extension_args, q=q, k=k, v=v), out)
            if self._launch is not None:
                return self._launch(q, k, v, self.blocks, out, **self._launch_tensors)
        if failure is not None:  # tensors laid out as planned: the planned forward's own error
            raise failure
        if self._launch is not None:
            return self._launch(q, k, v, self.blocks, out, **self._launch_tensors)
        if self._fa4_entry is not None:
            result, lse = fa4.launch_entry(self._fa4_entry, q, k, v)
            out.copy_(result)
            return out, lse
        if self._extension_args is None:
            return BACKENDS[self.backend].run(self._decision.call.rebind(q=q, k=k, v=v), self.num_splits, out)
        return out, ops.launch_direct(dict(self._extension_args, q=q, k=k, v=v), out)

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
