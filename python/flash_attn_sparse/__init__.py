"""Speculative sparse attention over FlashAttention: attention over caller-given lists of K/V
blocks, the speculative + repair two-pass merged exactly through the (O, LSE) combine, and
varlen block sparsity. Ships inside the patched flash_attn wheel; `reference` needs no GPU."""

from .metadata import SparseBlocks, SparseInputError
from .interface import (
    flash_attn_combine,
    flash_attn_sparse_partials,
    flash_attn_speculative_sparse,
    flash_attn_speculative_sparse_zero_copy,
    flash_attn_varlen_with_sparse_blocks,
    flash_attn_with_sparse_block_table,
)

__all__ = [
    "SparseBlocks",
    "SparseInputError",
    "flash_attn_combine",
    "flash_attn_sparse_partials",
    "flash_attn_speculative_sparse",
    "flash_attn_speculative_sparse_zero_copy",
    "flash_attn_varlen_with_sparse_blocks",
    "flash_attn_with_sparse_block_table",
]
