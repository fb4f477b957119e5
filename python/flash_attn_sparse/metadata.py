"""Block-list metadata of the sparse forward: one type for every backend, and its validation.

A *block* is `block_size` consecutive key positions (the last one of a sequence may be partial).
For each (batch, table head, query tile) there are two lists of block ids: "full" blocks, visible
to every query row of the tile, and "mask" blocks, which get the causal mask (when the call is
causal) and the sequence-end mask. Only the first `cnt` entries of a list row are read.

Layouts (int32, last dim contiguous), the same as the block-sparsity tensors of upstream's
CuTe-DSL kernels:
- batched: cnt (batch, heads, m_blocks), idx (batch, heads, m_blocks, n);
- varlen: cnt (heads, total_m_blocks), idx (heads, total_n_blocks), with cu_total_m_blocks
  (prefix sums of ceil(seqlen_q_b / q_block_size)) and cu_block_idx_offsets (prefix sums of
  m_blocks_b * n_b); the row of (b, m) starts at cu_block_idx_offsets[b] + m * n_b.
`heads` is 1 (shared), the number of K/V heads, or the number of query heads.

Validation has two levels. The cheap one (always) looks only at dtypes, devices, shapes and
strides, so it never synchronises with the GPU. The exhaustive one reads the lists (one host
sync) and is on when FLASH_ATTN_SPARSE_VALIDATE=full is set or validate="full" is passed: counts
within the row, ids within the sequence, no duplicates, "full" blocks fully historical for their
tile when causal, varlen offsets that agree with cu_seqlens. Without it, the kernels stay memory
safe on bad lists (counts are clamped, out-of-range ids are skipped) but the result is then
attention over whatever valid blocks the lists name.
"""

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import Tensor

BLOCK_SIZES = (16, 32, 64, 128, 256)
Q_BLOCK_MULTIPLE = 64  # query tiles are whole 64-row kernel tiles
VALIDATE_ENV = "FLASH_ATTN_SPARSE_VALIDATE"
PAST_EVERY_ID = torch.iinfo(torch.int32).max  # sort key of list entries past the count or out of range


class SparseInputError(ValueError):
    """A bad argument to a sparse attention call; the message starts with the argument's name."""


def fail(argument: str, problem: str):
    raise SparseInputError(f"{argument}: {problem}")


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


_RAMPS = {}  # device -> int32 [0, 1, ..., n): the newest, longest ramp
_RETIRED_RAMPS = []  # outgrown ramps, kept: a captured CUDA graph may still read them


def int_range(start: int, stop: int, device) -> Tensor:
    """int32 [start, stop) on device: a view of a cached ramp, so that the shared lists' counts
    and the speculative blocks' ids cost no kernel per call, also inside a captured CUDA graph
    (where each such kernel was a graph node of its own). The ramp is made (and synchronised)
    once per device and length class outside graph capture, and never freed (a graph may read
    it); while capturing with no ramp long enough, while tracing, or on CPU, a fresh tensor is
    made instead."""
    device = torch.device(device)
    if device.type != "cuda" or torch.compiler.is_compiling():
        return torch.arange(start, stop, dtype=torch.int32, device=device)
    if device.index is None:  # "cuda" and "cuda:0" share one ramp
        device = torch.device("cuda", torch.cuda.current_device())
    ramp = _RAMPS.get(device)
    if ramp is not None and ramp.numel() >= stop:
        return ramp[start:stop]
    if torch.cuda.is_current_stream_capturing():  # growing it would synchronise
        return torch.arange(start, stop, dtype=torch.int32, device=device)
    length = max(stop, 4096)
    if ramp is not None:
        _RETIRED_RAMPS.append(ramp)
        length = max(length, 2 * ramp.numel())
    ramp = torch.arange(length, dtype=torch.int32, device=device)
    torch.cuda.current_stream(device).synchronize()  # other streams may read it next
    _RAMPS[device] = ramp
    return ramp[start:stop]


@dataclass(frozen=True)
class SparseBlocks:
    """Which K/V blocks each (batch, head, query tile) attends to. See the module docstring.

    q_block_size=None means one list row per (batch, head) for all query rows (m_blocks == 1).
    """

    full_cnt: Tensor
    full_idx: Tensor
    mask_cnt: Optional[Tensor] = None
    mask_idx: Optional[Tensor] = None
    block_size: int = 128
    q_block_size: Optional[int] = None
    cu_total_m_blocks: Optional[Tensor] = None
    cu_block_idx_offsets: Optional[Tensor] = None

    @property
    def is_varlen(self) -> bool:
        return self.cu_total_m_blocks is not None

    @property
    def num_heads(self) -> int:
        return self.full_cnt.shape[0 if self.is_varlen else 1]

    def max_list_length(self, max_seqlen_k: int) -> int:
        """An upper bound of a row's total count, from shapes only (no host sync)."""
        n_blocks = cdiv(max_seqlen_k, self.block_size)
        if self.is_varlen:
            return n_blocks
        per_list = min(self.full_idx.shape[-1], n_blocks)
        return min(per_list * (2 if self.mask_idx is not None else 1), n_blocks)

    def tensors(self) -> List[Optional[Tensor]]:
        return [self.full_cnt, self.full_idx, self.mask_cnt, self.mask_idx, self.cu_total_m_blocks, self.cu_block_idx_offsets]

    def resolved_q_block_size(self, max_seqlen_q: int) -> int:
        """The q_block_size the kernel uses: None becomes one tile covering every query row."""
        if self.q_block_size is not None:
            return self.q_block_size
        return cdiv(max(max_seqlen_q, 1), 128) * 128

    @staticmethod
    def from_block_table(table: Tensor, block_size: int = 128, batch_size: int = 1, kind: str = "full") -> "SparseBlocks":
        """One list shared by every batch, head and query row (the seed's 1-D sparse_block_table).

        The counts come from the table's length, so nothing is read back from the GPU; the
        batch axis is a stride-0 view.
        """
        if not isinstance(table, Tensor):
            fail("sparse_block_table", f"must be a tensor or SparseBlocks, got {type(table).__name__}")
        if table.dim() != 1:
            fail("sparse_block_table", f"must be 1-D (n,), got shape {tuple(table.shape)}; use SparseBlocks for per-batch/head/tile lists")
        if kind not in ("full", "mask"):
            fail("kind", f"must be 'full' or 'mask', got {kind!r}")
        n = table.shape[0]

        def shared_count(value: int) -> Tensor:
            return int_range(value, value + 1, table.device).view(1, 1, 1).expand(batch_size, 1, 1)

        idx = table.view(1, 1, 1, n).expand(batch_size, 1, 1, n)
        if kind == "full":
            return SparseBlocks(shared_count(n), idx, block_size=block_size)
        return SparseBlocks(shared_count(0), idx, mask_cnt=shared_count(n), mask_idx=idx, block_size=block_size)

    @staticmethod
    def from_lists(full: Sequence, mask: Optional[Sequence] = None, block_size: int = 128,
                   q_block_size: Optional[int] = None, device=None) -> "SparseBlocks":
        """Batched metadata from nested Python lists full[b][hs][m] = [block ids] (host-side helper)."""
        def pack(lists):
            batch, heads, m_blocks = len(lists), len(lists[0]), len(lists[0][0])
            n = max([len(row) for per_b in lists for per_h in per_b for row in per_h] + [1])
            cnt = torch.zeros(batch, heads, m_blocks, dtype=torch.int32)
            idx = torch.zeros(batch, heads, m_blocks, n, dtype=torch.int32)
            for b, per_b in enumerate(lists):
                for h, per_h in enumerate(per_b):
                    for m, row in enumerate(per_h):
                        cnt[b, h, m] = len(row)
                        idx[b, h, m, :len(row)] = torch.tensor(row, dtype=torch.int32)
            return cnt, idx

        full_cnt, full_idx = pack(full)
        mask_cnt = mask_idx = None
        if mask is not None:
            mask_cnt, mask_idx = pack(mask)
            n = max(full_idx.shape[-1], mask_idx.shape[-1])
            full_idx = torch.nn.functional.pad(full_idx, (0, n - full_idx.shape[-1]))
            mask_idx = torch.nn.functional.pad(mask_idx, (0, n - mask_idx.shape[-1]))
            mask_cnt, mask_idx = mask_cnt.to(device), mask_idx.to(device)
        return SparseBlocks(full_cnt.to(device), full_idx.to(device), mask_cnt, mask_idx, block_size, q_block_size)


def pack_varlen_lists(full: Sequence, mask: Optional[Sequence] = None, block_size: int = 128,
                      q_block_size: int = 128, device=None) -> SparseBlocks:
    """Varlen metadata from nested Python lists full[b][hs][m] = [block ids] (host-side helper).

    Sequence b has len(full[b][0]) query tiles; its rows hold n_b = the longest of its lists
    (at least 1) entries, so cu_block_idx_offsets advances by m_blocks_b * n_b.
    """
    batch, heads = len(full), len(full[0])
    lists_of = [full] + ([mask] if mask is not None else [])
    m_blocks = [len(full[b][0]) for b in range(batch)]
    n_per_row = [max([len(row) for kind in lists_of for per_h in kind[b] for row in per_h] + [1]) for b in range(batch)]
    cu_m = [0]
    cu_off = [0]
    for b in range(batch):
        cu_m.append(cu_m[-1] + m_blocks[b])
        cu_off.append(cu_off[-1] + m_blocks[b] * n_per_row[b])

    def pack(lists):
        cnt = torch.zeros(heads, cu_m[-1], dtype=torch.int32)
        idx = torch.zeros(heads, max(cu_off[-1], 1), dtype=torch.int32)
        for b in range(batch):
            for h in range(heads):
                for m, row in enumerate(lists[b][h]):
                    cnt[h, cu_m[b] + m] = len(row)
                    start = cu_off[b] + m * n_per_row[b]
                    idx[h, start:start + len(row)] = torch.tensor(row, dtype=torch.int32)
        return cnt.to(device), idx.to(device)

    full_cnt, full_idx = pack(full)
    mask_cnt, mask_idx = pack(mask) if mask is not None else (None, None)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=device)
    return SparseBlocks(full_cnt, full_idx, mask_cnt, mask_idx, block_size, q_block_size,
                        cu_total_m_blocks=as_tensor(cu_m), cu_block_idx_offsets=as_tensor(cu_off))


def zeros_with_layout(t: Tensor) -> Tensor:
    """Zeros of t's shape *and strides* (stride-0 broadcast dims included): SparseBlocks needs
    its mask and full tables to share a layout."""
    if t.numel() == 0:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    storage = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return torch.zeros(storage, dtype=t.dtype, device=t.device).as_strided(t.shape, t.stride())


def _check_table(t: Optional[Tensor], name: str, device: torch.device, dim: int):
    if t is None:
        return
    if not isinstance(t, Tensor):
        fail(name, f"must be a tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        fail(name, f"must have dtype torch.int32, got {t.dtype}")
    if t.device != device:
        fail(name, f"must be on the device of q ({device}), got {t.device}")
    if t.dim() != dim:
        fail(name, f"must have {dim} dimensions, got shape {tuple(t.shape)}")
    if t.numel() > 0 and t.stride(-1) != 1:
        fail(name, f"must have a contiguous last dimension, got strides {t.stride()}")


def validate_blocks(blocks: SparseBlocks, *, batch_size: int, num_heads: int, num_heads_k: int, max_seqlen_q: int,
                    device: torch.device, varlen: bool) -> None:
    """The cheap, always-on checks: dtypes, devices, shapes, strides. Never syncs."""
    if not isinstance(blocks, SparseBlocks):
        fail("blocks", f"must be SparseBlocks, got {type(blocks).__name__}")
    if blocks.block_size not in BLOCK_SIZES:
        fail("block_size", f"must be one of {BLOCK_SIZES}, got {blocks.block_size}")
    if blocks.q_block_size is not None and (blocks.q_block_size <= 0 or blocks.q_block_size % Q_BLOCK_MULTIPLE):
        fail("q_block_size", f"must be a positive multiple of {Q_BLOCK_MULTIPLE}, got {blocks.q_block_size}")
    if (blocks.mask_cnt is None) != (blocks.mask_idx is None):
        fail("mask_cnt", "mask_cnt and mask_idx go together")
    if varlen != blocks.is_varlen:
        fail("blocks", "varlen inputs (cu_seqlens) need the varlen list layout (cu_total_m_blocks, cu_block_idx_offsets), "
                       "and batched inputs the batched one")
    if (blocks.cu_total_m_blocks is None) != (blocks.cu_block_idx_offsets is None):
        fail("cu_block_idx_offsets", "cu_total_m_blocks and cu_block_idx_offsets go together")
    cnt_dim, idx_dim = (2, 2) if varlen else (3, 4)
    for name in ("full_cnt", "mask_cnt"):
        _check_table(getattr(blocks, name), name, device, cnt_dim)
    for name in ("full_idx", "mask_idx"):
        _check_table(getattr(blocks, name), name, device, idx_dim)
    if blocks.mask_cnt is not None:
        if blocks.mask_cnt.shape != blocks.full_cnt.shape or blocks.mask_cnt.stride() != blocks.full_cnt.stride():
            fail("mask_cnt", f"must have the shape and strides of full_cnt {tuple(blocks.full_cnt.shape)}, got {tuple(blocks.mask_cnt.shape)}")
        if blocks.mask_idx.shape != blocks.full_idx.shape or blocks.mask_idx.stride() != blocks.full_idx.stride():
            fail("mask_idx", f"must have the shape and strides of full_idx {tuple(blocks.full_idx.shape)}, got {tuple(blocks.mask_idx.shape)}")
    heads = blocks.num_heads
    if heads not in (1, num_heads_k, num_heads):
        fail("full_cnt", f"head extent must be 1, num_heads_k={num_heads_k} or num_heads={num_heads}, got {heads}")
    q_block = blocks.resolved_q_block_size(max_seqlen_q)
    if varlen:
        for name in ("cu_total_m_blocks", "cu_block_idx_offsets"):
            t = getattr(blocks, name)
            _check_table(t, name, device, 1)
            if t.shape[0] != batch_size + 1:
                fail(name, f"must have batch_size + 1 = {batch_size + 1} entries, got {t.shape[0]}")
        if blocks.full_idx.shape[0] != heads:
            fail("full_idx", f"head extent {blocks.full_idx.shape[0]} must match full_cnt's {heads}")
    else:
        b, _, m_blocks = blocks.full_cnt.shape
        if b != batch_size:
            fail("full_cnt", f"batch extent must be {batch_size}, got {b}")
        if blocks.full_cnt.stride(-1) != 1:
            fail("full_cnt", "must have a contiguous last dimension")
        if tuple(blocks.full_idx.shape[:3]) != tuple(blocks.full_cnt.shape):
            fail("full_idx", f"leading dims must be full_cnt's {tuple(blocks.full_cnt.shape)}, got {tuple(blocks.full_idx.shape[:3])}")
        if m_blocks < cdiv(max_seqlen_q, q_block):
            fail("full_cnt", f"needs one row per query tile: m_blocks >= ceil({max_seqlen_q} / q_block_size={q_block}), got {m_blocks}")


@torch.compiler.assume_constant_result
def _validation_mode_from_env() -> str:
    return os.environ.get(VALIDATE_ENV, "cheap")


def exhaustive_validation_requested(validate: Optional[str]) -> bool:
    mode = validate if validate is not None else _validation_mode_from_env()
    if mode not in ("cheap", "full"):
        fail("validate", f"must be 'cheap' or 'full', got {mode!r}")
    if mode != "full":
        return False
    # Reading the lists back cannot happen while a graph is captured or traced.
    return not (torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()))


def validate_block_contents(blocks: SparseBlocks, *, causal: bool, seqlens_q: List[int], seqlens_k: List[int]) -> None:
    """The exhaustive checks: reads the lists (one host sync)."""
    bs = blocks.block_size
    q_block = blocks.resolved_q_block_size(max(seqlens_q + [1]))
    tensors = {name: (t.cpu() if t is not None else None) for name, t in zip(
        ["full_cnt", "full_idx", "mask_cnt", "mask_idx", "cu_total_m_blocks", "cu_block_idx_offsets"], blocks.tensors())}
    batch = len(seqlens_q)
    heads = blocks.num_heads
    if blocks.is_varlen:
        cu_m, cu_off = tensors["cu_total_m_blocks"].tolist(), tensors["cu_block_idx_offsets"].tolist()
        for b in range(batch):
            expected = cdiv(seqlens_q[b], q_block)
            if cu_m[b + 1] - cu_m[b] != expected:
                fail("cu_total_m_blocks", f"batch {b}: {cu_m[b + 1] - cu_m[b]} query tiles, but ceil(seqlen_q={seqlens_q[b]} / {q_block}) = {expected}")
            if expected and (cu_off[b + 1] - cu_off[b]) % expected:
                fail("cu_block_idx_offsets", f"batch {b}: {cu_off[b + 1] - cu_off[b]} entries is not a multiple of its {expected} query tiles")
        if cu_m[0] != 0 or cu_off[0] != 0:
            fail("cu_total_m_blocks", "prefix sums must start at 0")
        if cu_m[-1] > tensors["full_cnt"].shape[1]:
            fail("cu_total_m_blocks", f"total {cu_m[-1]} exceeds full_cnt's {tensors['full_cnt'].shape[1]} rows")
        if cu_off[-1] > tensors["full_idx"].shape[1]:
            fail("cu_block_idx_offsets", f"total {cu_off[-1]} exceeds full_idx's {tensors['full_idx'].shape[1]} entries")

    def rows():
        """Yields (batch, head, tile, [(list name, ids)])."""
        for b in range(batch):
            m_tiles = cdiv(seqlens_q[b], q_block)
            for h in range(heads):
                for m in range(m_tiles):
                    lists = []
                    for kind in ("full", "mask"):
                        cnt_t, idx_t = tensors[f"{kind}_cnt"], tensors[f"{kind}_idx"]
                        if cnt_t is None:
                            continue
                        if blocks.is_varlen:
                            n_b = (cu_off[b + 1] - cu_off[b]) // max(cu_m[b + 1] - cu_m[b], 1)
                            count = int(cnt_t[h, cu_m[b] + m])
                            start = cu_off[b] + m * n_b
                            capacity = n_b
                            ids = idx_t[h, start:start + max(min(count, capacity), 0)].tolist()
                        else:
                            count = int(cnt_t[b, h, m])
                            capacity = idx_t.shape[-1]
                            ids = idx_t[b, h, m, :max(min(count, capacity), 0)].tolist()
                        if count < 0 or count > capacity:
                            fail(f"{kind}_cnt", f"batch {b}, head {h}, tile {m}: count {count} outside [0, {capacity}]")
                        lists.append((kind, ids))
                    yield b, h, m, lists

    for b, h, m, lists in rows():
        n_blocks = cdiv(seqlens_k[b], bs)
        seen = set()
        for kind, ids in lists:
            for block in ids:
                if block < 0 or block >= n_blocks:
                    fail(f"{kind}_idx", f"batch {b}, head {h}, tile {m}: block {block} outside [0, {n_blocks}) (seqlen_k={seqlens_k[b]}, block_size={bs})")
                if block in seen:
                    fail(f"{kind}_idx", f"batch {b}, head {h}, tile {m}: block {block} listed twice")
                seen.add(block)
                if causal and kind == "full":
                    # Every row of the tile must see every key of a "full" block.
                    first_row = m * q_block
                    if (block + 1) * bs - 1 > first_row + seqlens_k[b] - seqlens_q[b]:
                        fail("full_idx", f"batch {b}, head {h}, tile {m}: block {block} is not fully historical for the tile "
                                         f"(causal); list it as a mask block")
