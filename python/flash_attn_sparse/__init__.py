"""Speculative sparse attention over FlashAttention: attention over caller-given lists of K/V
blocks, the speculative + repair two-pass merged exactly through the (O, LSE) combine, and
varlen block sparsity. Ships inside the patched flash_attn wheel; `reference` needs no GPU."""

from .backends.cute import blocks_from_cute_block_sparse_tensors, to_cute_block_sparse_tensors
from .builders import (
    blocks_from_flex_block_mask,
    blocks_from_mask,
    blocks_from_scores,
    flex_block_mask_from_blocks,
    pack_varlen,
)
from .csr import blocks_from_csr
from .interface import (
    choose_backend,
    choose_num_splits_for,
    flash_attn_combine,
    flash_attn_sparse_partials,
    flash_attn_varlen_with_sparse_blocks,
    flash_attn_with_sparse_block_table,
)
from .metadata import SparseBlocks, SparseInputError
from .plan import SparsePlan, plan
from .speculative import flash_attn_speculative_sparse, flash_attn_speculative_sparse_zero_copy

__all__ = [
    "SparseBlocks",
    "SparseInputError",
    "SparsePlan",
    "blocks_from_csr",
    "blocks_from_cute_block_sparse_tensors",
    "blocks_from_flex_block_mask",
    "blocks_from_mask",
    "blocks_from_scores",
    "choose_backend",
    "choose_num_splits_for",
    "flash_attn_combine",
    "flash_attn_sparse_partials",
    "flash_attn_speculative_sparse",
    "flash_attn_speculative_sparse_zero_copy",
    "flash_attn_varlen_with_sparse_blocks",
    "flash_attn_with_sparse_block_table",
    "flex_block_mask_from_blocks",
    "pack_varlen",
    "plan",
    "to_cute_block_sparse_tensors",
]
