/******************************************************************************
 * Entry points of the sparse block-list forward, shared by the host code and the generated
 * kernel translation units (stage 3 of the sparse patch set).
 ******************************************************************************/

#pragma once

#include "namespace_config.h"
#include "flash.h"

namespace FLASH_NAMESPACE {

// Query rows per CTA of the two sparse kernel shapes; a table's query tile must be a multiple of
// the shape's rows.
constexpr int kSparseWideBlockM = 128;
constexpr int kSparseNarrowBlockM = 64;
// Decode: calls whose packed query rows (seqlen_q x packed heads) fit one 16-row, one-warp tile
// take it when their longest list holds at least kSparseDecodeMinListKeys keys and all lists
// together (one per CTA of a split) at least kSparseDecodeMinTotalKeys. The one-warp CTA streams
// a tile more slowly than the 4-warp one; it wins only when the work keeps its three CTAs per SM
// busy. Measured (H200, d128, 4 packed rows, auto splits): 8-9% faster with every block of B8
// Sk32k and B1 Sk128k listed (2M and 1M keys), even at B8 with 128-block lists (1M), 7-17%
// slower at B1 with 128-256 (0.26M keys), 0-27% slower with lists of 2k-8k keys.
constexpr int kSparseDecodeBlockM = 16;
constexpr long kSparseDecodeMinListKeys = 16384;
constexpr long kSparseDecodeMinTotalKeys = 1L << 20;

// Keys per tile (kBlockN) of the 64-row kernel (run_mha_fwd_sparse_narrow_), the largest tile a
// call of this head dim can take: the 128-row and 16-row kernels' are no larger.
constexpr int sparse_max_tile_keys(const int head_size) { return head_size <= 64 ? 256 : (head_size <= 128 ? 128 : 64); }

// Keys of the longest list, bounded from shapes, as flash_attn_sparse.metadata.max_list_length does.
inline long sparse_max_list_keys(const Flash_fwd_params &params) {
    const auto blocks_of = [&](const long keys) { return (keys + params.sparse_block_size - 1) / params.sparse_block_size; };
    const long n_blocks = blocks_of(params.seqlen_k);
    const long mask_capacity = params.sparse_mask_idx != nullptr ? params.sparse_mask_idx_capacity : 0;
    long listed = n_blocks;
    if (params.sparse_cu_total_m_blocks == nullptr) {
        if (params.sparse_mask_seqlen_k > 0) {  // mask blocks from their own source: the lists add up
            const long mask_blocks = blocks_of(params.sparse_mask_seqlen_k);
            listed = std::min<long>(params.sparse_idx_capacity, n_blocks) + std::min(mask_capacity, mask_blocks);
        } else {
            listed = std::min<long>(params.sparse_idx_capacity + mask_capacity, n_blocks);
        }
    }
    return listed * params.sparse_block_size;
}

// flash_attn_sparse.backends.fa2.decode_tile makes the same choice when it picks the split count
// (tests/test_seam_parity.py holds the two to one rule).
inline bool sparse_decode_tile(const Flash_fwd_params &params) {
    if (params.seqlen_q * params.sparse_pack_gqa > kSparseDecodeBlockM) { return false; }
    const long list_keys = sparse_max_list_keys(params);
    const long ctas = long(params.b) * (params.h / params.sparse_pack_gqa);
    return list_keys >= kSparseDecodeMinListKeys && ctas * list_keys >= kSparseDecodeMinTotalKeys;
}

// Splits of one tile merged in a thread-block cluster through distributed shared memory (sm_90+)
// instead of fp32 partials in global memory and the combine kernel: the key-split tile (packed
// rows <= 16, head dim <= 128, not the one-warp decode tile) at 2-4 splits of at most 8 tiles each.
// Measured (H200, d128, 4 packed rows, graph us): 0.6-1.5 us faster there (B8 Sq1 Sk32k 1/16, 4
// splits: 25.9 -> 24.4); 4-split clusters walking 16-32 tiles each were 1.3-2.8 us slower at B8 (64
// tiles), the 64-row tile 1.5x slower in clusters, and 8 splits 3-6 us slower.
// The host asks this and then allocates no partials; the launcher takes a split call without
// partial buffers as a cluster call.
constexpr int kSparseClusterMergeMaxSplits = 4;
constexpr int kSparseClusterMergeMaxTilesPerSplit = 8;
inline bool sparse_cluster_merge(const Flash_fwd_params &params) {
    const bool keysplit_tile = params.seqlen_q * params.sparse_pack_gqa <= kSparseDecodeBlockM && params.d <= 128
        && !sparse_decode_tile(params);
    if (!keysplit_tile || params.num_splits < 2 || params.num_splits > kSparseClusterMergeMaxSplits) { return false; }
    const long max_split_keys = long(kSparseClusterMergeMaxTilesPerSplit) * sparse_max_tile_keys(params.d) * params.num_splits;
    if (sparse_max_list_keys(params) > max_split_keys) { return false; }
    int device = 0, major = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    return major >= 9;
}

template<typename T, int Headdim> void run_mha_fwd_sparse_(Flash_fwd_params &params, cudaStream_t stream);
template<typename T, int Headdim> void run_mha_fwd_sparse_narrow_(Flash_fwd_params &params, cudaStream_t stream, bool split);
template<typename T, int Headdim> void run_mha_combine_(Flash_fwd_params &params, cudaStream_t stream);

}  // namespace FLASH_NAMESPACE
