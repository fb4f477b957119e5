"""Block-CSR (FlashInfer's BSR layout) to SparseBlocks, on the device.

FlashInfer describes a block-sparse mask by rows of R query rows: indptr (M + 1,) and indices
(nnz,), where row r lists the key blocks (of C keys each) indices[indptr[r]:indptr[r + 1]]. Here
the rows run over (batch, head, query tile) in that order, so M = batch * num_heads * m_blocks;
FlashInfer's own single-sequence, head-shared layout is batch=1, num_heads=1."""

from typing import Optional

import torch
from torch import Tensor

from .metadata import SparseBlocks, fail


def blocks_from_csr(indptr: Tensor, indices: Tensor, *, block_size: int, q_block_size: int, num_heads: int = 1,
                    batch: int = 1, kind: str = "full", max_row_length: Optional[int] = None) -> SparseBlocks:
    """SparseBlocks (batched layout, cnt (batch, num_heads, m_blocks)) whose row (b, h, m) holds
    row (b * num_heads + h) * m_blocks + m of the CSR layout, as `kind` ("full" or "mask")
    blocks. block_size is C (keys per block), q_block_size R (query rows per row).

    No host sync: the rows are max_row_length entries wide, by default nnz = indices.numel()
    (which bounds every row); pass a smaller bound (e.g. the number of key blocks, when rows hold
    no duplicates) to keep the tables small. A row longer than max_row_length keeps its count,
    which validate="full" on the attention call reports."""
    for name, t in (("indptr", indptr), ("indices", indices)):
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            fail(name, "must be a 1-D int32 or int64 tensor")
    if indices.device != indptr.device:
        fail("indices", f"must be on the device of indptr ({indptr.device}), got {indices.device}")
    if kind not in ("full", "mask"):
        fail("kind", f"must be 'full' or 'mask', got {kind!r}")
    for name, value in (("num_heads", num_heads), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            fail(name, f"must be a positive int, got {value!r}")
    rows = indptr.numel() - 1
    if rows < 1 or rows % (batch * num_heads):
        fail("indptr", f"must hold batch * num_heads * m_blocks + 1 entries (batch={batch}, num_heads={num_heads}), "
                       f"got {indptr.numel()}")
    width = indices.numel() if max_row_length is None else max_row_length
    if not isinstance(width, int) or width < 0:
        fail("max_row_length", f"must be a non-negative int, got {max_row_length!r}")
    width = max(width, 1)  # a table row of one (unused) entry when every row is empty
    starts, counts = indptr[:-1].long(), (indptr[1:] - indptr[:-1]).to(torch.int32)
    slots = torch.arange(width, device=indptr.device)
    used = slots < counts.unsqueeze(1)
    source = (starts.unsqueeze(1) + slots).clamp(0, max(indices.numel() - 1, 0))
    gathered = indices[source] if indices.numel() else torch.zeros_like(source)
    idx = torch.where(used, gathered, torch.zeros_like(gathered)).to(torch.int32)
    shape = (batch, num_heads, rows // (batch * num_heads))
    cnt, idx = counts.view(shape), idx.view(*shape, width)
    if kind == "full":
        return SparseBlocks(cnt, idx, block_size=block_size, q_block_size=q_block_size)
    return SparseBlocks(torch.zeros_like(cnt), torch.zeros_like(idx), cnt, idx, block_size=block_size,
                        q_block_size=q_block_size)
