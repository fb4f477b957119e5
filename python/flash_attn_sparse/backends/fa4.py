"""The Hopper backend: sparse calls run by flash-attn-4's CuTe-DSL SM90 forward (stage 4).

flash-attn-4 (imported as `flash_attn.cute`, the `[hopper]` extra) already walks per-tile
"mask"/"full" block lists on SM90 with TMA and WGMMA. Upstream's contract is narrower than this
project's (the partial tail block last in its list, every id in range, counts within the row);
patch flash-attn-4/0004 widens its SM90 kernel to ours instead (counts clamped to the row, an id
out of range read as the block past the end, the sequence-end mask on every block of a list that
names the tail block or such an id: 0007); cute.py lays the lists out for it, without copies
for batched calls.
Empty lists keep their meaning (O = 0, LSE = -inf) and LSE comes back in the FA-2 path's layout.

Split-KV (stage 4), fixed-length calls only (SPLIT_KV_UNSUPPORTED): each of `num_splits` CTAs
per tile walks an even share of the tile's lists and writes an fp32 partial; flash-attn-4's
combine kernel merges them.

What it cannot run (`refusal` says why): GPUs other than SM90, head dims above 128,
logical block sizes other than 64 and 128 (its SM90 tile_n must equal the block size), varlen
query tiles other than 64 and 128 rows, paged K/V, seqused_k on fixed-length calls, and batched
list rows wider than the K/V's block count.
"""

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..metadata import SparseBlocks, cdiv
from .cute import block_sparse_tensors, import_cute, missing_runtime
from .device import MAX_SPLITS, num_sms
from .protocol import Traits

BLOCK_SIZES = (64, 128)
VARLEN_Q_BLOCK_SIZES = (64, 128)
MAX_HEAD_DIM = 128
TILE_ROWS = 128  # query rows of its SM90 tile at these head dims
SMALL_TILE_ROWS = 64  # ... or of its one-warpgroup tile, which decode calls take (small_tile)
SPLIT_KV_UNSUPPORTED = ("split-KV runs on fixed-length calls only (varlen splits would need the per-sequence "
                        "split counts of flash-attn-4's varlen scheduler, which its SM90 kernel does not read)")


def unsupported_reason(q: Tensor, blocks: SparseBlocks, *, max_seqlen_q: int, varlen: bool,
                       paged: bool = False) -> Optional[str]:
    """Why this call cannot run on the Hopper backend, or None. Shapes only: never syncs."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "the Hopper backend runs on SM90 GPUs (H100/H200) only"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} > {MAX_HEAD_DIM}"
    if blocks.block_size not in BLOCK_SIZES:
        return f"block_size {blocks.block_size} not in {BLOCK_SIZES} (SM90 tile_n must equal the block size)"
    if varlen and blocks.resolved_q_block_size(max_seqlen_q) not in VARLEN_Q_BLOCK_SIZES:
        return f"varlen q_block_size must be one of {VARLEN_Q_BLOCK_SIZES}"
    if paged:
        return "paged K/V with block lists is not handled by flash-attn-4's sparse producer"
    return missing_runtime()


def _packed(q: Tensor, k: Tensor, blocks: SparseBlocks) -> Tuple[int, int]:
    """(tile heads, query heads per tile): the query heads of a K/V head share a tile when the
    lists are shared or per K/V head (the interface's PackGQA rule)."""
    heads, heads_k = q.shape[-2], k.shape[-2]
    if heads > heads_k and blocks.num_heads in (1, heads_k):
        return heads_k, heads // heads_k
    return heads, 1


def tiles(q: Tensor, k: Tensor, blocks: SparseBlocks, *, batch: int, max_seqlen_q: int) -> int:
    """CTAs of one split: 128-row tiles of each sequence's (packed) query rows (a call that takes
    64-row tiles, small_tile, fits one either way)."""
    tile_heads, group = _packed(q, k, blocks)
    return batch * tile_heads * cdiv(max_seqlen_q * group, TILE_ROWS)


def rows_per_tile(q: Tensor, k: Tensor, blocks: SparseBlocks, *, max_seqlen_q: int) -> int:
    """Query rows of real work in one of its 128-row tiles (packed rows, up to 128)."""
    return min(TILE_ROWS, max_seqlen_q * _packed(q, k, blocks)[1])


# FA-4's split-KV cost model, fitted to a split sweep (H200, graph time against blocks per list
# for 1-8 splits at B8 and B1 decode, benchmarks/profile_decode.py --backend fa4;
# benchmarks/fit_split_model.py picks each table's split count from the model and reports how far
# that is from the measured best: 0% on the sweep's 27 points): one CTA walks its
# list at ~62 GB/s (one 128-key K/V block pair of d128 per ~1.06 us, whatever the CTA count up to
# ~64), all CTAs together at ~4.4 TB/s, and splitting costs the combine launch plus the fp32
# partials written and read. A CTA's block also takes its tile's matmuls at about the per-SM
# share of flash-attn-4's dense prefill rate (652 TFLOP/s / 132 SMs, DESIGN 7): 1.7 us for a
# 128-row tile, more than its bytes, so query tiles of a few hundred rows still split.
# Upstream's wave heuristic split B8 Sq16 1/16 in two, 27.5 us where one split takes 23.6: 64
# CTAs already stream at full bandwidth there, so the merge was pure cost.
CTA_READ_BYTES_PER_US = 62e3
CTA_FLOP_PER_US = 4.9e6
HBM_READ_BYTES_PER_US = 4.4e6
SPLIT_MERGE_US = 3.0


def split_time_us(splits: int, *, tiles: int, list_blocks: int, block_bytes: int, block_flops: int,
                  partial_bytes: int, num_sms: int) -> float:
    """Modelled time of `splits` splits: the longer of one CTA's chain of blocks (each its bytes
    or its tile's matmuls, in waves of one CTA per SM) and all listed bytes at full bandwidth,
    plus the merge when split."""
    waves = cdiv(tiles * splits, num_sms)
    per_block = max(block_bytes / CTA_READ_BYTES_PER_US, block_flops / CTA_FLOP_PER_US)
    chain = waves * cdiv(list_blocks, splits) * per_block
    stream = tiles * list_blocks * block_bytes / HBM_READ_BYTES_PER_US
    merge = 0.0 if splits == 1 else SPLIT_MERGE_US + 2 * splits * partial_bytes / HBM_READ_BYTES_PER_US
    return max(chain, stream) + merge


def split_work(*, tiles: int, list_blocks: int, batch: int, seqlen_q: int, heads: int, head_dim: int,
               block_size: int, element_size: int, small_tile: bool, num_sms: int) -> dict:
    """split_time_us's work for one call: its tiles, longest list, one K/V block's bytes and one
    tile's matmuls per block, and one split's fp32 partials (O and LSE of every query row)."""
    return dict(tiles=tiles, list_blocks=max(list_blocks, 1), block_bytes=2 * block_size * head_dim * element_size,
                block_flops=4 * (SMALL_TILE_ROWS if small_tile else TILE_ROWS) * block_size * head_dim,
                partial_bytes=batch * seqlen_q * heads * (head_dim + 1) * 4, num_sms=num_sms)


@functools.lru_cache(maxsize=1024)  # every argument is an int from shapes; ~135 us to evaluate at 256 blocks
def choose_num_splits(*, max_splits: int, list_blocks: int, **work) -> int:
    """The split count of least modelled time (split_time_us over `work`), the fewest on a tie;
    at most one split per listed block."""
    candidates = range(1, max(1, min(max_splits, list_blocks)) + 1)
    return min(candidates, key=lambda s: (split_time_us(s, list_blocks=list_blocks, **work), s))


def small_tile(q: Tensor, k: Tensor, blocks: SparseBlocks, *, max_seqlen_q: int) -> bool:
    """Whether a fixed-length call takes 64-row tiles (one consumer warpgroup): its packed query
    rows fit 64, so a 128-row tile would compute at least half of its WGMMA rows for nothing."""
    return not blocks.is_varlen and max_seqlen_q <= SMALL_TILE_ROWS and \
        rows_per_tile(q, k, blocks, max_seqlen_q=max_seqlen_q) <= SMALL_TILE_ROWS


def launch(q: Tensor, k: Tensor, v: Tensor, blocks: SparseBlocks, *, softmax_scale: float, causal: bool,
        batch: int, max_seqlen_q: int, max_seqlen_k: int, cu_seqlens_q: Optional[Tensor] = None,
        cu_seqlens_k: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
        num_splits: int = 1, mask_source: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Tensor]:
    """The sparse forward on flash-attn-4's SM90 kernel. Returns (out, lse) as the FA-2 path does.
    mask_source (K, V): the tensors the mask lists name blocks of, in the same launch (patch
    flash-attn-4/0006: the speculative call's gathered blocks); fixed-length calls only."""
    entry = entry_and_arguments(q, k, blocks, softmax_scale=softmax_scale, causal=causal, batch=batch,
                                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, cu_seqlens_q=cu_seqlens_q,
                                cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, num_splits=num_splits,
                                mask_source=mask_source)
    return launch_entry(entry, q, k, v)


def entry_and_arguments(q: Tensor, k: Tensor, blocks: SparseBlocks, *, softmax_scale: float, causal: bool,
                        batch: int, max_seqlen_q: int, max_seqlen_k: int, cu_seqlens_q: Optional[Tensor] = None,
                        cu_seqlens_k: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
                        num_splits: int = 1, mask_source: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple:
    """(flash-attn-4's entry point, its arguments but q, k, v): launch's conversion, which a plan
    of a batched call makes once (its block-sparse tensors are views of the lists; q and k give
    shapes only). Varlen lists are converted into new tensors, so a varlen plan converts per run."""
    interface = import_cute("interface")
    small = small_tile(q, k, blocks, max_seqlen_q=max_seqlen_q)
    tensors = block_sparse_tensors(blocks, batch=batch, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                   cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                                   q_block_size=SMALL_TILE_ROWS if small else None)
    common = dict(softmax_scale=softmax_scale, causal=causal, block_sparse_tensors=tensors, return_lse=True,
                  num_splits=num_splits)
    if blocks.is_varlen:
        return interface.flash_attn_varlen_func, dict(common, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                                      seqused_k=seqused_k)
    if mask_source is not None:  # forward only, as this package is: its autograd wrapper does not take it
        return interface._flash_attn_fwd, dict(common, mask_block_kv=mask_source)
    return interface.flash_attn_func, common


def launch_entry(entry: Tuple, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
    """(out, lse) of entry_and_arguments' entry over q, k, v."""
    function, arguments = entry
    out, lse, *_ = function(q, k, v, **arguments)
    return out, lse


def call_entry(call, splits: int) -> Tuple:
    """entry_and_arguments for a validated calls.SparseCall."""
    return entry_and_arguments(call.q, call.k, call.effective_blocks(), softmax_scale=call.scale, causal=call.causal,
                               batch=call.batch, max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k,
                               cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_k=call.cu_seqlens_k,
                               seqused_k=call.seqused_k, num_splits=splits, mask_source=call.mask_source)


# --- the backend protocol (backends/__init__.py) ----------------------------------------------

# Fixed-length calls go to flash_attn.cute's flash_attn_func, which takes no seqused_k: its kernel
# would attend to every key up to k's length (fuzzer seed 3, configs 26, 33, 718: wrong answers).
SEQUSED_K_UNSUPPORTED = "seqused_k on a fixed-length call (flash-attn-4's flash_attn_func takes none)"


def wider_than_the_keys(call) -> Optional[str]:
    """Why a batched call's list rows cannot go to flash-attn-4, or None: it takes rows of at most
    one entry per K/V block, and cutting a row there could drop listed blocks that follow
    skipped (out-of-range) ids (fuzzer seed 3, configs 307, 1248, 1519)."""
    if call.varlen:
        return None
    blocks = call.effective_blocks()
    n_blocks = cdiv(call.max_seqlen_k, blocks.block_size)
    # Mask lists read from a second K/V source (the speculative one-launch form) count its blocks.
    mask_keys = call.mask_source[0].shape[1] if call.mask_source is not None else call.max_seqlen_k
    for idx, limit in ((blocks.full_idx, n_blocks), (blocks.mask_idx, cdiv(mask_keys, blocks.block_size))):
        if idx is not None and idx.shape[-1] > limit:
            return f"list rows of {idx.shape[-1]} entries for {limit} K/V blocks (flash-attn-4 takes at most one per block)"
    return None


def refusal(call) -> Optional[str]:
    """Why this backend cannot run `call` (a calls.SparseCall), or None. Shapes only: never syncs."""
    if call.fp8:
        return "flash-attn-4's sparse forward here takes no FP8 (float8_e4m3fn) inputs; FP8 K/V runs on backend='fa3' (sm90)"
    if torch.compiler.is_compiling():
        return "flash-attn-4's CuTe-DSL call cannot be traced by torch.compile; use 'fa2', 'fa3' or 'auto' there"
    if call.varlen and call.requested_splits > 1:
        return SPLIT_KV_UNSUPPORTED
    if not call.varlen and call.seqused_k is not None:
        return SEQUSED_K_UNSUPPORTED
    return unsupported_reason(call.q, call.blocks, max_seqlen_q=call.max_seqlen_q, varlen=call.varlen,
                              paged=call.page_table is not None) or wider_than_the_keys(call)


def traits(call) -> Traits:
    """packed_group: the GQA group where the lists are shared or per K/V head, else 1."""
    return Traits(packed_group=_packed(call.q, call.k, call.blocks)[1])


def num_splits(call) -> int:
    """The requested split count, or for 0 the least modelled time (choose_num_splits) over this
    backend's tiles, the longest list and the fp32 partials of one split."""
    if call.varlen:
        return 1  # see SPLIT_KV_UNSUPPORTED
    if call.requested_splits:
        return call.requested_splits
    return choose_num_splits(max_splits=MAX_SPLITS, **_call_work(call))


def _call_work(call) -> dict:
    q, k, blocks = call.q, call.k, call.blocks
    return split_work(
        tiles=tiles(q, k, blocks, batch=call.batch, max_seqlen_q=call.max_seqlen_q),
        list_blocks=call.max_list_length(), batch=call.batch, seqlen_q=call.max_seqlen_q, heads=q.shape[-2],
        head_dim=q.shape[-1], block_size=blocks.block_size, element_size=q.element_size(),
        small_tile=small_tile(q, k, blocks, max_seqlen_q=call.max_seqlen_q), num_sms=num_sms(q.device.index or 0))


def run(call, splits: int, out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out, lse) of `call` over `splits` splits. flash-attn-4's forward allocates its output, so
    a given `out` is filled by a copy (one extra pass over the output)."""
    result, lse = launch(call.q, call.k, call.v, call.effective_blocks(), softmax_scale=call.scale, causal=call.causal,
                         batch=call.batch, max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k,
                         cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_k=call.cu_seqlens_k, seqused_k=call.seqused_k,
                         num_splits=splits, mask_source=call.mask_source)
    if out is None:
        return result, lse
    out.copy_(result)
    return out, lse


def plan(call, splits: int, out: Optional[Tensor], keep_buffers: bool = True) -> "Planned":
    """This call's forward bound once (backends/protocol.py)."""
    return Planned(call, splits, keep_buffers)


# A call's tensors (calls.TENSOR_FIELDS): what a one-shot plan drops, so that its cache keeps none alive.
_CALL_TENSORS = ("q", "k", "v", "blocks", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table", "q_descale",
                 "k_descale", "v_descale")


class Planned:
    """A batched plan's flash-attn-4 entry point and block-sparse tensors (views of the lists)
    made once; a varlen plan's lists are converted on each run (new tensors), as are run_with's.
    flash-attn-4 allocates its output, so an out given is filled by a copy; flash-attn-4's own
    Python dispatch and compile-cache lookup remain on every run."""

    checks_facts = False

    def __init__(self, call, splits: int, keep_buffers: bool):
        self._splits = splits
        self._entry = call_entry(call, splits) if keep_buffers and not call.varlen else None
        self._call = call.rebind(**dict.fromkeys(("q", "k", "v") if keep_buffers else _CALL_TENSORS))

    def run(self, q: Tensor, k: Tensor, v: Tensor, out: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        if self._entry is None:
            return run(self._call.rebind(q=q, k=k, v=v), self._splits, out)
        result, lse = launch_entry(self._entry, q, k, v)
        if out is None:
            return result, lse
        out.copy_(result)
        return out, lse

    run_any_out = run

    def run_with(self, q: Tensor, k: Tensor, v: Tensor, out: Optional[Tensor], blocks, tensors: dict) -> Tuple[Tensor, Tensor]:
        return run(self._call.rebind(q=q, k=k, v=v, blocks=blocks, **tensors), self._splits, out)
