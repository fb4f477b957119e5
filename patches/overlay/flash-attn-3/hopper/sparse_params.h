/******************************************************************************
 * Block lists of the sparse forward (the project's sparse contract,
 * flash_attn_sparse/metadata.py): plain data shared by the host entry point and the kernels.
 * A null full_idx means dense; the dense kernels never read these fields.
 ******************************************************************************/

#pragma once

#include <cstdint>
#include <tuple>

// Where one kind of list (full or mask) lies: batched cnt[b, hs, m] and idx[b, hs, m, capacity]
// by these strides; varlen cnt[hs, total_m_blocks] and idx[hs, total_n_blocks] by the head strides.
struct SparseListLayout {
    int64_t cnt_batch_stride = 0, cnt_head_stride = 0, cnt_row_stride = 0;
    int64_t idx_batch_stride = 0, idx_head_stride = 0, idx_row_stride = 0;
    int idx_capacity = 0;  // entries per batched row
};

struct SparseBlockParams {
    // Lists, with cu_total_m_blocks / cu_block_idx_offsets (both [b + 1]) under varlen. Batched
    // mask lists have their own layout (the zero-copy speculative form's are stride-0 views of
    // another width); varlen ones share the full lists' (the host checks it).
    int const *full_cnt = nullptr;
    int const *full_idx = nullptr;
    int const *mask_cnt = nullptr;  // may be null: no mask blocks
    int const *mask_idx = nullptr;
    int const *cu_total_m_blocks = nullptr;  // non-null: varlen layout
    int const *cu_block_idx_offsets = nullptr;
    SparseListLayout full, mask;
    // Table head of a kernel tile: bidh / head_ratio, where bidh is the query head, or the K/V
    // head under PackGQA.
    int head_ratio = 1;
    // Kernel query tiles per list row (packed rows of a list row / rows of one kernel tile), or
    // kOneListRow when one list row covers every query.
    int tiles_per_row = 1;
    // kBlockM of the kernel the host chose (kSparseBlockM or kSparseBlockMDecode); the launch
    // dispatches on it.
    int block_m = 0;
    // Keys a sequence can hold: a paged cache's max_pages * page_size (a longer seqused_k is cut
    // to it, so that page-table reads stay in the table), else unbounded.
    int max_keys = 1 << 30;
};

// Keys per list block; the kernels' kBlockN equals it.
constexpr int kSparseBlockSize = 128;
// tiles_per_row when every tile of a sequence reads its one list row.
constexpr int kOneListRow = 1 << 30;

// Query rows of a sparse tile: 128, or 64 (one MMA warpgroup, half the matmul work of each
// memory-bound step) for PackGQA split calls whose packed rows fit in 64 (decode). Packed split
// calls of more rows take 128 so that one tile, not two, reads each listed K/V block.
constexpr int kSparseBlockM = 128;
constexpr int kSparseBlockMDecode = 64;

namespace flash {

// Tile of the sparse kernels, {kBlockM, kBlockN, MmaPV_is_RS, IntraWGOverlap}, for kBlockM query
// rows: head dim 128's dense causal configuration; head dim 64 takes 128 rows instead of the dense
// 192, so that query tiles of 128 rows map onto whole kernel tiles.
constexpr std::tuple<int, int, bool, bool> tile_size_fwd_sm90_sparse(int block_m) {
    return {block_m, kSparseBlockSize, true, true};
}

}  // namespace flash
