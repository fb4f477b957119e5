"""auto's choice of backend: one rule over the call's shapes, the same eagerly, inside a CUDA-graph
capture and under torch.compile, so a call validated eagerly runs the same kernel when captured
(bitwise-equal results). It never syncs.

| GPU | call | backend |
|---|---|---|
| sm90 + flash_attn_3 built with FP8 | float8_e4m3fn K/V that FA-3 takes (else refused: no other backend has FP8 kernels) | fa3 |
| sm90 + flash_attn_3 | FA-3 takes it (contiguous or paged K/V); >= 128 query rows, or lists shared or per K/V head | fa3 |
| any | every other (16-bit) call | fa2 |

FA-3 takes pages of fewer than 128 keys where its build has the cp.async paged units (the full
build, or FLASH_ATTN_SPARSE_PAGED=1); elsewhere its refusal leaves them to FA-2.

fa4 runs on request only (backend="fa4"): under graph replay it can lead at decode, but its host
time per eager call (flash-attn-4's Python dispatch) is many times a decode kernel's, so no one
choice of it holds in both modes. The crossover behind the two thresholds: docs/routing.md.
"""

from typing import Optional, Tuple

from .backends import BACKENDS
from .calls import SparseCall
from .metadata import SparseInputError, fail

FA3_MIN_QUERY_ROWS = 128  # one FA-3 tile of query rows per sequence: prefill-shaped


def choose(call: SparseCall) -> Tuple[str, str]:
    """(backend, why): the requested backend, or auto's choice; never a backend that refuses the
    call (a requested one that does is a SparseInputError naming its reason)."""
    if call.requested_backend != "auto":
        name = call.requested_backend
        if reason := BACKENDS[name].refusal(call):
            fail("backend", f"'{name}' cannot run this call: {reason}")
        return name, "requested"
    if call.fp8:
        if refusal := BACKENDS["fa3"].refusal(call):
            fail("backend", f"no backend runs this FP8 call: 'fa3' is the only one with FP8 (float8_e4m3fn) kernels "
                            f"and cannot: {refusal}")
        return "fa3", "FP8 K/V: FA-3 is the only backend with FP8 kernels (auto's rule)"
    reason = fa3_reason(call)
    if reason:
        return "fa3", reason
    if refusal := BACKENDS["fa2"].refusal(call):
        fail("backend", f"no backend runs this call: 'fa2' cannot: {refusal}")
    return "fa2", "every call FA-3 does not take (auto's rule)"


def runs_somewhere(call: SparseCall) -> bool:
    """Whether choose(call) finds a backend (the requested one, or auto's)."""
    try:
        choose(call)
    except SparseInputError:
        return False
    return True


def fa3_reason(call: SparseCall) -> Optional[str]:
    """Why auto sends this call to fa3, or None: prefill-shaped, or decode whose list rows each serve
    a whole K/V head (packed GQA, or no GQA), and FA-3 takes it. Decode with per-query-head lists
    under GQA runs unpacked and stays on fa2 (docs/routing.md has the measurements)."""
    rows = query_rows(call)
    if rows >= FA3_MIN_QUERY_ROWS:
        why = f"{rows:g} query rows per sequence"
    elif (group := BACKENDS["fa3"].traits(call).packed_group) > 1:
        why = f"{rows:g} query rows x {group} query heads of a K/V head packed in a tile"
    elif call.q.shape[-2] == call.k.shape[-2]:
        why = f"{rows:g} query rows, one query head per K/V head"
    else:  # per-query-head lists under GQA: unpacked, where fa2 leads with few (batch, head) tiles
        return None
    return None if BACKENDS["fa3"].refusal(call) else f"{why} (auto's rule)"


def query_rows(call: SparseCall) -> float:
    """Query rows per sequence (a varlen call's on average)."""
    return call.q.shape[0] / max(call.batch, 1) if call.varlen else call.max_seqlen_q
