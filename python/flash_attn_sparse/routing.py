"""auto's choice among the backends (backends/): `choose`, what a call runs under graph replay
(and inside a capture), and `eager_choice`, where an eager call goes instead when FA-4's host time
would decide it (`choose_now` picks by the current stream). Shapes only: never syncs."""

import math
from typing import Optional, Tuple

import torch

from . import ops
from .backends import BACKENDS, fa3, fa4
from .backends.device import num_sms
from .calls import SparseCall
from .metadata import cdiv, fail

# auto sends a fixed-length call to the Hopper (FA-4) backend when the query heads of a K/V head
# share its tiles (GQA packing: shared or per-K/V-head lists), or when its 128-row tiles hold at
# least FA4_MIN_TILE_ROWS query rows. Both backends split the lists; since patch flash-attn-4/0004
# the FA-4 API costs what its kernel costs; through this rule (run 68, H200) packed decode on
# FA-4 vs FA-2: B8 Sq1 H32/8 1/16 20.9 vs 24.1 us, 1/4 68.8 vs 70.5, every block 0.245 vs 0.249
# ms; B1 Sq1 128k 15.4 vs 16.1, but 1/4 40.2 vs 39.9 and every block 0.134 vs 0.132 (FA-2 ahead
# by 1%); ahead at B8 Sq16 and every crossover point (run 56). Unpacked calls with fewer rows (per
# query head lists at decode) were not timed on FA-4 and stay on FA-2. A varlen call goes
# to FA-4 when its tiles are full and keep most of the GPU busy without splitting (FA-4 cannot
# split varlen calls): at least FA4_MIN_QUERY_ROWS rows per sequence and tiles for
# FA4_MIN_SM_SHARE of the SMs (crossover measured before split-KV, H200 B1 H32 Sk16k: FA-2
# ahead at 64 tiles, FA-4 at 128; stages/stage4.md).
FA4_MIN_TILE_ROWS = 64
FA4_MIN_QUERY_ROWS = 128
FA4_MIN_SM_SHARE = 0.75
# FA-3 (when its build is present and takes the call), from the crossovers of runs 108-109 and 115
# (H200, graph replay; docs/performance.md): calls of at least one FA-3 tile of query rows per
# sequence go to FA-3 where they would go to FA-2 (FA-3 1.2-2.8x FA-2 from 64 query rows up, and
# under torch.compile, which FA-4 cannot trace); and from FA-4 where FA-4 does not pack GQA query
# heads, when causal (B1 S16k H32: FA-3 ahead by 2-13%) or when the lists' capacity bounds them
# to 1/16 of the key blocks or less (ahead by 4% at 1/16, behind by 5% at 1/4; the counts
# themselves are not known without a sync). Where FA-4 packs GQA heads (B1 H32/8 Sk16k, Sq 64 to
# 2048) it led FA-3 at every point, by 10-32% (run 161, H100, with FA-3's 64-row tile for packed
# split calls: FA-3 ahead by 2-5% at Sq64 and Sq128 1/16 only). Decode-shaped calls that FA-4
# takes stay there: under graph replay FA-4 is fastest at every decode shape measured (level with
# FA-3 at B1 Sq32, run 161). Where FA-2 would run a
# decode-shaped call (eagerly, under torch.compile, or without FA-4), FA-3 takes it when it packs
# at least FA3_MIN_PACKED_ROWS query rows of a K/V head into its tile (GQA, shared or per-K/V-head
# lists): runs 143 / 146 (H100, graph replay, H32/8 Sk32k 1/16, fa3 / fa2 time) B1 Sq1 1.15 / 1.15,
# Sq4 1.11 / 1.19, Sq8 0.94 / 1.01, Sq16 0.91 / 0.90, Sq32 0.74 / 0.73; B8 Sq1 0.99 / 1.01, Sq4
# 1.01 / 1.04, Sq8 0.92 / 0.91, Sq16 0.90 / 0.92, Sq32 0.90 / 0.92 (Sq8 is 32 packed rows; B8 Sq16
# also 0.925 in run 113, H200). With packed split calls on 64-row tiles (run 161, H100, the same
# shapes): B1 Sq1 1.00, Sq4 1.04, Sq8 0.90, Sq16 0.83, Sq32 0.67; B8 Sq1 0.98, Sq4 1.00, Sq8 0.90,
# Sq16 0.89, Sq32 0.97: still level or behind under 32 packed rows, so the threshold stands.
FA3_MIN_QUERY_ROWS = 128
FA3_MIN_PACKED_ROWS = 32
FA3_MAX_DENSITY_INVERSE = 16
# Eagerly, back-to-back calls overlap host and GPU work, so a call costs about the longer of the
# two. FA-4's host time per call is 10-20x FA-2's or FA-3's and varies 2x from host to host
# (medians of 142-430 us in runs 117-125, H200: flash-attn-4's Python dispatch and CuTe-DSL
# argument conversion), while its lead under graph replay is at most 10-30%. So outside a
# CUDA-graph capture auto's FA-4 choice goes to the backend auto takes without FA-4 unless FA-4's
# modelled GPU time (fa4.modelled_time_us: lists at capacity, causal ones to the diagonal) is at
# least FA4_EAGER_MIN_GPU_US, long enough to hide that host time on a slow host. Run 127, eager
# ms (B1 H32/8 unless named): B8 Sq16 decode 1/16 auto (fa2) 0.033, FA-4 0.198; causal S4k 1/4
# auto (fa3) 0.113, FA-4 0.363; Sq4096 Sk16k 1/4 (modelled 488 us) auto (FA-4) 0.444, fa3 0.473.
# Inside a capture only GPU time is replayed, and FA-4 keeps the call.
FA4_EAGER_MIN_GPU_US = 400.0
# Likewise auto's FA-3 choice (or FA-3 in place of an FA-4 choice, above) runs on FA-2 outside a
# capture when FA-4's modelled GPU time (the yardstick; FA-3 takes 1.0-1.2x it at decode) is under
# FA3_EAGER_MIN_GPU_US: such a call is bound by its host time, and FA-2's host path is 1-3 us
# shorter than FA-3's (one-shot 26.7 vs 28.8 us, plan.run 6.7 vs 9.9, run 145). Runs 143 and 146
# (H100, eager ms fa2 / fa3, B1 H32/8 1/16 unless named, FA-4's modelled us in brackets): Sq8
# 0.0214 / 0.0220 (5.6), Sq32 0.0214 / 0.0221 (8.3), Sq64 Sk16k 0.0217 / 0.0229 (8.3), Sq128 Sk16k
# 0.0215 / 0.0229 (10.7); Sq256 Sk16k 0.0280 / 0.0229 (13.7), Sq64 Sk16k 1/4 0.0291 / 0.0227 (14.5),
# B8 Sq8 0.0379 / 0.0357 (16.9), B8 Sq16 0.0406 / 0.0382 (16.9).
FA3_EAGER_MIN_GPU_US = 12.0


def choose(call: SparseCall) -> Tuple[str, str]:
    """(backend, why): the requested one, or auto's choice, never a backend that refuses the call
    (a requested one that does is a SparseInputError naming its reason)."""
    if call.requested_backend == "fa2":
        return "fa2", "requested"
    if call.requested_backend == "fa3":
        if reason := fa3.refusal(call):
            fail("backend", f"'fa3' cannot run this call: {reason}")
        return "fa3", "requested"
    if torch.compiler.is_compiling():  # the FA-2 and FA-3 paths are custom ops; the FA-4 one is not traceable
        if call.requested_backend == "fa4":
            fail("backend", "'fa4' cannot be traced by torch.compile; use 'fa2', 'fa3' or 'auto' there")
        if fa3_why := _fa3_reason(call):
            return "fa3", f"traced by torch.compile; {fa3_why}"
        return "fa2", "traced by torch.compile"
    unsupported = fa4.refusal(call)
    if call.requested_backend == "fa4":
        if unsupported:
            fail("num_splits" if unsupported == fa4.SPLIT_KV_UNSUPPORTED else "backend",
                 f"'fa4' cannot run this call: {unsupported}")
        return "fa4", "requested"
    backend, why = _fa2_or_fa4(call, unsupported)
    if backend == "fa2":
        fa3_why = _fa3_reason(call)
        return ("fa3", f"{fa3_why} ({why})") if fa3_why else (backend, why)
    # From FA-4 only prefill-shaped calls whose GQA heads it does not pack: FA-4 packing them led
    # FA-3 at every crossover point (runs 115, 141), and at decode FA-4 leads under graph replay.
    if (not fa4.packs_query_heads(call.q, call.k, call.blocks) and _query_rows(call) >= FA3_MIN_QUERY_ROWS
            and _fa3_reason(call)):
        if call.causal:
            return "fa3", "causal prefill: FA-3 ahead of FA-4 at 1/4 and 1/16 of the blocks, level with all"
        n_blocks = cdiv(call.max_seqlen_k, call.blocks.block_size)
        bound = call.max_list_length()
        if bound * FA3_MAX_DENSITY_INVERSE <= n_blocks:
            return "fa3", f"lists of at most {bound} of {n_blocks} blocks: FA-3 ahead of FA-4 at 1/16"
    return backend, why


def eager_choice(call: SparseCall, backend: str, splits: int) -> Optional[Tuple[str, str]]:
    """Where auto's choice `backend` (in `splits` splits) should run outside a CUDA-graph capture
    when that differs (FA4_EAGER_MIN_GPU_US, FA3_EAGER_MIN_GPU_US), else None."""
    if backend not in ("fa3", "fa4") or call.requested_backend != "auto":
        return None
    if backend == "fa4":
        modelled = fa4.modelled_time_us(call, splits)
        if modelled >= FA4_EAGER_MIN_GPU_US:
            return None
        why = (f"eager: FA-4's modelled {modelled:.0f} us of GPU time would not hide its 140-430 us of host time per "
               f"call (FA4_EAGER_MIN_GPU_US {FA4_EAGER_MIN_GPU_US:.0f})")
        if modelled >= FA3_EAGER_MIN_GPU_US and _fa3_reason(call):
            return "fa3", why
    else:
        modelled = fa4.modelled_time_us(call, fa4.num_splits(call))
        if modelled >= FA3_EAGER_MIN_GPU_US:
            return None
        why = (f"eager: {modelled:.0f} us of modelled GPU time, shorter than the host time of a call, where FA-2's "
               f"host path is the shorter (FA3_EAGER_MIN_GPU_US {FA3_EAGER_MIN_GPU_US:.0f})")
    if _fa2_build_runs(call.q.shape[-1]):
        return "fa2", why
    return None


def _fa2_build_runs(head_dim: int) -> bool:
    """Whether the FA-2 build has kernels for head_dim (a dev build compiles 64 and 128 only)."""
    try:
        return ops.head_dim_refusal(head_dim) is None
    except ImportError:  # no flash_attn_2_cuda here: nothing to send the call to
        return False


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph. is_initialized, not
    is_available: no capture without torch's CUDA state, and is_available reads the environment
    and counts devices per call (capturing() took 2-6 us that way, run 129)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _query_rows(call: SparseCall) -> float:
    """Query rows per sequence (a varlen call's on average)."""
    return call.q.shape[0] / max(call.batch, 1) if call.varlen else call.max_seqlen_q


def _fa3_reason(call: SparseCall) -> Optional[str]:
    """Why FA-3 should run a call rather than FA-2, or None: prefill-shaped (at least one FA-3
    tile of query rows per sequence), or at least FA3_MIN_PACKED_ROWS packed rows; and run by the
    FA-3 build present."""
    rows = _query_rows(call)
    if rows >= FA3_MIN_QUERY_ROWS:
        why = f"{rows:g} query rows: FA-3's tiles run about 1.8x FA-2's"
    elif (packed := rows * fa3.packed_group(call)) >= FA3_MIN_PACKED_ROWS:
        why = f"{packed:g} query rows of a K/V head packed in FA-3's tile: level with FA-2 at 32, ahead by 8-27% from 64"
    else:
        return None
    return why if fa3.refusal(call) is None else None


def _fa2_or_fa4(call: SparseCall, unsupported: Optional[str]) -> Tuple[str, str]:
    """Between FA-2 and FA-4 (the rule at the top of this file)."""
    if unsupported:
        return "fa2", unsupported
    if not call.varlen:  # both backends split the lists: FA-4 where it packs heads or fills half a tile
        rows = fa4.rows_per_tile(call.q, call.k, call.blocks, max_seqlen_q=call.max_seqlen_q)
        if fa4.packs_query_heads(call.q, call.k, call.blocks):
            return "fa4", f"query heads packed per K/V head, {rows} rows per FA-4 tile"
        if rows < FA4_MIN_TILE_ROWS:
            return "fa2", f"{rows} query rows per FA-4 tile of {fa4.TILE_ROWS}: FA-2's smaller tiles"
        return "fa4", f"{rows} query rows per FA-4 tile of {fa4.TILE_ROWS}"
    if call.max_seqlen_q < FA4_MIN_QUERY_ROWS:
        return "fa2", f"max_seqlen_q {call.max_seqlen_q} < {FA4_MIN_QUERY_ROWS}: decode-shaped, FA-2 splits the list"
    # Varlen: the tiles of an average sequence (total_q / batch) stand for each sequence's.
    rows = call.q.shape[0] / max(call.batch, 1)
    ctas = call.batch * call.q.shape[-2] * math.ceil(rows / fa4.TILE_ROWS)
    sms = num_sms(call.q.device.index or 0)
    if ctas < FA4_MIN_SM_SHARE * sms:
        return "fa2", f"{ctas} FA-4 tiles for {sms} SMs: FA-2 splits the list to fill the GPU"
    return "fa4", f"{ctas} FA-4 tiles of {fa4.TILE_ROWS} rows for {sms} SMs"


def choose_now(call: SparseCall, graph: Optional[bool] = None) -> Tuple[str, str]:
    """choose, or outside a CUDA-graph capture (graph False, or None and the current stream not
    capturing) eager_choice where it differs."""
    chosen = choose(call)
    if graph is None:
        graph = torch.compiler.is_compiling() or capturing()
    if graph:
        return chosen
    return eager_choice(call, chosen[0], BACKENDS[chosen[0]].num_splits(call)) or chosen
