"""The backends a sparse forward can run on, behind one small protocol the router
(routing.choose) calls. A backend is a module with

    refusal(call) -> Optional[str]      why it cannot run this call (shapes only, never syncs), or None
    num_splits(call) -> int             its split-KV count for the call (the requested one, if any)
    run(call, splits, out=None) -> (out, lse)  the forward, out like q (into `out` if given),
                                        lse (batch, heads, seqlen_q) or (heads, total_q)

where `call` is a validated calls.SparseCall. A backend may also have
    launcher(call, splits, out=None) -> launch(q, k, v, blocks, out, **tensors) -> (out, lse)
the forward over new tensors of the call's facts, bound once (the one-shot cache's hit path;
`out`: the layout of the outs to come, None for new ones). FA-2 also has run_partial (fp32 partials into a
caller's buffer, for flash_attn_sparse_partials and the speculative two-pass form). A new
backend is one module here plus its name in BACKENDS (the router's order of preference is
routing.choose's).
"""

from typing import Optional, Protocol, Tuple

from torch import Tensor

from . import fa2, fa3, fa4


class Backend(Protocol):
    def refusal(self, call) -> Optional[str]: ...

    def num_splits(self, call) -> int: ...

    def run(self, call, splits: int, out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]: ...


BACKENDS = {"fa2": fa2, "fa3": fa3, "fa4": fa4}
