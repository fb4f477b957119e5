"""The backends a sparse forward can run on, each one module behind one protocol (protocol.py):

    refusal(call) -> Optional[str]      why it cannot run this call (shapes only, never syncs), or None
    traits(call) -> Traits              the facts routing weighs (e.g. its GQA packing)
    num_splits(call) -> int             its split-KV count for the call (the requested one, if any)
    run(call, splits, out=None) -> (out, lse)  the forward, out like q (into `out` if given),
                                        lse (batch, heads, seqlen_q) or (heads, total_q)

where `call` is a validated calls.SparseCall. A backend may also have
    launcher(call, splits, out=None) -> launch(q, k, v, blocks, out, **tensors) -> (out, lse)
the forward over new tensors of the call's facts, bound once (the one-shot cache's hit path;
`out`: the layout of the outs to come, None for new ones), and run_partial (fp32 partials into a
caller's buffer). A new backend is one module here plus its line in BACKENDS; routing.choose
says when auto takes it.
"""

from . import fa2, fa3, fa4
from .protocol import Backend, Traits

BACKENDS: "dict[str, Backend]" = {"fa2": fa2, "fa3": fa3, "fa4": fa4}

__all__ = ["BACKENDS", "Backend", "Traits"]
