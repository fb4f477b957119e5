/******************************************************************************
 * Sparse K/V block-list forward for FlashAttention-2 (stage 3 of the sparse patch set).
 *
 * One CTA computes one query tile of one (batch, head) over the K/V blocks its list names,
 * optionally only a contiguous share of that list (split-KV). The list is walked in tiles of
 * kBlockN "list rows": list row v is entry e = v / block_size, key position
 * list[e] * block_size + v % block_size. So a kernel tile may hold part of one logical block
 * (block_size >= kBlockN) or several whole ones (block_size < kBlockN), and every key row is
 * addressed from the list with an absolute 64-bit offset, for K and V alike.
 *
 * Rows that are not real keys (past the list end, past seqlen_k in the tail block, or named by an
 * out-of-range entry) are never loaded: their scores are set to -inf and their V rows in shared
 * memory are zeroed, so no list content can make the kernel read out of bounds.
 *
 * Paged K/V (params.block_table != nullptr): the lists still name logical blocks of key
 * positions; position p lives at row p % page_block_size of page block_table[b][p / page_block_size].
 * The page is looked up where the position is (one tile ahead, overlapping the matmul) and turned
 * into a row index of the cache, so K and V offsets are computed exactly as in the contiguous case.
 *
 * With GQA packing (params.sparse_pack_gqa = g > 1) a CTA serves the g query heads of one K/V
 * head: its query row r is position r / g of head h_k * g + r % g, so every listed K/V tile
 * feeds g times more rows. Query rows are addressed one by one for that reason (Q is read and O
 * written once per CTA, so this costs nothing measurable).
 ******************************************************************************/

#pragma once

#include "namespace_config.h"

#include <cooperative_groups.h>
#include <cute/tensor.hpp>

#include <cutlass/cutlass.h>
#include <cutlass/array.h>
#include <cutlass/numeric_types.h>

#include "block_info.h"
#include "kernel_traits.h"
#include "utils.h"
#include "softmax.h"

namespace FLASH_NAMESPACE {

// Kernel traits with kSparseKeySplit = true make the warps split each tile's keys instead of its
// rows (Sparse_keysplit_kernel_traits, flash_fwd_sparse_launch_template.h).
template <typename Traits, typename = void>
struct is_sparse_keysplit : std::false_type {};
template <typename Traits>
struct is_sparse_keysplit<Traits, std::void_t<decltype(Traits::kSparseKeySplit)>> : std::bool_constant<Traits::kSparseKeySplit> {};

using namespace cute;

////////////////////////////////////////////////////////////////////////////////////////////////////

// The lists of one query tile, concatenated: entry e < mask_cnt is mask_idx[e], the rest are
// full_idx[e - mask_cnt]. Mask entries may name blocks of a second K/V source (mask_seqlen_k
// keys long; equal to seqlen_k when there is none).
struct SparseTileList {
    const int *mask_idx;
    const int *full_idx;
    int mask_cnt;
    int total_cnt;
    int block_size;
    int block_size_log2;
    int seqlen_k;
    int mask_seqlen_k;

    __forceinline__ __device__ int block(const int e) const {
        return e < mask_cnt ? __ldg(mask_idx + e) : __ldg(full_idx + (e - mask_cnt));
    }

    // Keys in the source of entry e.
    __forceinline__ __device__ int source_keys(const int e) const { return e < mask_cnt ? mask_seqlen_k : seqlen_k; }

    // Whether blk is a block of entry e's source (checked before any shift, so a huge id cannot
    // wrap into range).
    __forceinline__ __device__ bool valid_block(const int e, const int blk) const {
        return blk >= 0 && blk <= ((source_keys(e) - 1) >> block_size_log2);
    }

    // Key position of list row v (entry e = v / block_size, block id blk), or -1 if that row is
    // not a real key of its source.
    __forceinline__ __device__ int position_in_block(const int v, const int blk) const {
        const int e = v >> block_size_log2;
        if (e >= total_cnt || !valid_block(e, blk)) { return -1; }
        const int pos = (blk << block_size_log2) + (v & (block_size - 1));
        return pos < source_keys(e) ? pos : -1;
    }

    __forceinline__ __device__ int position(const int v) const {
        const int e = v >> block_size_log2;
        return position_in_block(v, e < total_cnt ? block(e) : -1);
    }

    // Whether list rows [v0, v0 + n) need score masking: a mask block (when causal), a list
    // end, the tail block or an invalid entry inside them. Uniform across the CTA.
    __forceinline__ __device__ bool needs_mask(const int v0, const int n, const bool is_causal) const {
        const int e0 = v0 >> block_size_log2;
        const int e1 = (v0 + n - 1) >> block_size_log2;
        if (e1 >= total_cnt || (is_causal && e0 < mask_cnt)) { return true; }
        for (int e = e0; e <= e1; ++e) {
            const int blk = block(e);
            if (!valid_block(e, blk) || ((blk + 1) << block_size_log2) > source_keys(e)) { return true; }
        }
        return false;
    }
};

// Paged K/V of one sequence. resolve(pos) is the row of key position pos in units of the cache's
// row stride (page * rows_per_page + row in page), or -1 for a negative page id: the unit of a
// contiguous position, so offsets stay position * row_stride for K and V alike. The host checks
// that page stride / row stride is the same integer for K and V and that the largest such row
// index fits in int.
struct SparsePagedKV {
    const int *table;  // this sequence's row of the page table
    int page_size;
    int page_shift;    // log2(page_size), or -1 if page_size is not a power of two
    int rows_per_page; // page stride / row stride
    int num_pages;

    __forceinline__ __device__ int resolve(const int pos) const {
        int page_idx, row;
        if (page_shift >= 0) {
            page_idx = pos >> page_shift;
            row = pos & (page_size - 1);
        } else {
            page_idx = pos / page_size;
            row = pos - page_idx * page_size;
        }
        const int page = __ldg(table + page_idx);
        return page < 0 || page >= num_pages ? -1 : page * rows_per_page + row;
    }
};

template<typename Params>
__forceinline__ __device__ SparsePagedKV get_sparse_paged_kv(const Params &params, const int bidb) {
    SparsePagedKV paged;
    paged.table = params.block_table + bidb * params.block_table_batch_stride;
    paged.page_size = params.page_block_size;
    paged.page_shift = (params.page_block_size & (params.page_block_size - 1)) == 0 ? __ffs(params.page_block_size) - 1 : -1;
    paged.rows_per_page = int(params.k_batch_stride / params.k_row_stride);
    paged.num_pages = params.sparse_num_pages;
    return paged;
}

// Where a CTA's query rows live. Row r of the tile is packed row first_row + r: query position
// (first_row + r) / group of head first_head + (first_row + r) % group.
struct SparseTileRows {
    int first_row;
    int num_rows;  // packed rows of this sequence: actual_seqlen_q * group
    int group;
    int first_head;

    __forceinline__ __device__ bool valid(const int r) const { return first_row + r < num_rows; }
    __forceinline__ __device__ int position(const int r) const { return (first_row + r) / group; }
    __forceinline__ __device__ int head(const int r) const { return first_head + (first_row + r) % group; }
};

template<int kBlockM, typename Params>
__forceinline__ __device__ SparseTileList get_sparse_tile_list(const Params &params, const int bidb, const SparseTileRows &rows,
                                                               const int seqlen_k) {
    using index_t = typename Params::index_t;
    // With packing, the host guarantees that the group's heads share a table head and that a
    // tile's positions stay within one table row.
    const int hs = rows.first_head / params.sparse_head_ratio;
    const int m_row = rows.position(0) / params.sparse_q_block_size;
    index_t cnt_offset, idx_offset, mask_cnt_offset, mask_idx_offset;
    int capacity, mask_capacity;
    if (params.sparse_cu_total_m_blocks == nullptr) {
        cnt_offset = bidb * params.sparse_cnt_batch_stride + hs * params.sparse_cnt_head_stride + m_row;
        idx_offset = bidb * params.sparse_idx_batch_stride + hs * params.sparse_idx_head_stride + m_row * params.sparse_idx_row_stride;
        capacity = params.sparse_idx_capacity;
        mask_cnt_offset = bidb * params.sparse_mask_cnt_batch_stride + hs * params.sparse_mask_cnt_head_stride
            + m_row * params.sparse_mask_cnt_row_stride;
        mask_idx_offset = bidb * params.sparse_mask_idx_batch_stride + hs * params.sparse_mask_idx_head_stride
            + m_row * params.sparse_mask_idx_row_stride;
        mask_capacity = params.sparse_mask_idx_capacity;
    } else {
        const int m_first = params.sparse_cu_total_m_blocks[bidb];
        const int m_rows = params.sparse_cu_total_m_blocks[bidb + 1] - m_first;
        const int idx_first = params.sparse_cu_block_idx_offsets[bidb];
        const int n_per_row = m_rows > 0 ? (params.sparse_cu_block_idx_offsets[bidb + 1] - idx_first) / m_rows : 0;
        cnt_offset = hs * params.sparse_cnt_head_stride + m_first + m_row;
        idx_offset = hs * params.sparse_idx_head_stride + idx_first + index_t(m_row) * n_per_row;
        // A tile without a row in the metadata gets an empty list rather than a stray read.
        capacity = m_row < m_rows ? n_per_row : 0;
        mask_cnt_offset = cnt_offset;
        mask_idx_offset = idx_offset;
        mask_capacity = capacity;
    }
    SparseTileList list;
    const int full_cnt = capacity > 0 ? min(max(params.sparse_full_cnt[cnt_offset], 0), capacity) : 0;
    const int mask_cnt = mask_capacity > 0 && params.sparse_mask_cnt != nullptr
        ? min(max(params.sparse_mask_cnt[mask_cnt_offset], 0), mask_capacity) : 0;
    list.full_idx = params.sparse_full_idx + idx_offset;
    list.mask_idx = params.sparse_mask_idx == nullptr ? list.full_idx : params.sparse_mask_idx + mask_idx_offset;
    list.mask_cnt = mask_cnt;
    list.total_cnt = mask_cnt + full_cnt;
    list.block_size = params.sparse_block_size;
    list.block_size_log2 = params.sparse_block_size_log2;
    list.seqlen_k = seqlen_k;
    list.mask_seqlen_k = params.sparse_mask_seqlen_k > 0 ? params.sparse_mask_seqlen_k : seqlen_k;
    return list;
}

////////////////////////////////////////////////////////////////////////////////////////////////////

// Copies the rows of one tile, each from its own place. S0 is the thread's copy partition of a
// row-stride-0 view of the source (so it only carries column offsets); row_offset(m) is the
// element offset of the thread's m-th row, negative for a row that is not copied (then its
// shared-memory row is zeroed if Clear_invalid_rows). D may be shared or global memory.
template <bool Is_even_K, bool Clear_invalid_rows, typename TiledCopy, typename Engine0, typename Layout0,
          typename Engine1, typename Layout1, typename Engine2, typename Layout2, typename RowOffset>
__forceinline__ __device__ void copy_rows(TiledCopy tiled_copy, Tensor<Engine0, Layout0> const &S0,
                                          Tensor<Engine1, Layout1> &D, Tensor<Engine2, Layout2> const &predicate_K,
                                          RowOffset row_offset) {
    #pragma unroll
    for (int m = 0; m < size<1>(S0); ++m) {
        const int64_t offset = row_offset(m);
        if (offset >= 0) {
            #pragma unroll
            for (int k = 0; k < size<2>(S0); ++k) {
                if (Is_even_K || predicate_K(k)) {
                    Tensor src = make_tensor(S0(_, m, k).data() + offset, S0(_, m, k).layout());
                    cute::copy(tiled_copy, src, D(_, m, k));
                } else {
                    // Columns past d are zeroed (upstream's Clear_OOB_K): stale shared memory
                    // must not enter QK^T or PV.
                    cute::clear(D(_, m, k));
                }
            }
        } else if (Clear_invalid_rows) {
            // P is 0 on these rows, but 0 * (stale NaN/Inf) is not 0.
            cute::clear(D(_, m, _));
        }
    }
}

// The same, from registers to places in global memory (the epilogue): S is a register fragment,
// D0 the thread's partition of a row-stride-0 view of the destination.
template <bool Is_even_K, typename TiledCopy, typename Engine0, typename Layout0, typename Engine1, typename Layout1,
          typename Engine2, typename Layout2, typename RowOffset>
__forceinline__ __device__ void store_rows(TiledCopy tiled_copy, Tensor<Engine0, Layout0> const &S,
                                           Tensor<Engine1, Layout1> const &D0, Tensor<Engine2, Layout2> const &predicate_K,
                                           RowOffset row_offset) {
    #pragma unroll
    for (int m = 0; m < size<1>(S); ++m) {
        const int64_t offset = row_offset(m);
        if (offset < 0) { continue; }
        #pragma unroll
        for (int k = 0; k < size<2>(S); ++k) {
            if (Is_even_K || predicate_K(k)) {
                Tensor dst = make_tensor(D0(_, m, k).data() + offset, D0(_, m, k).layout());
                cute::copy(tiled_copy, S(_, m, k), dst);
            }
        }
    }
}

// K or V of one tile into shared memory: from row `start` as one strided tile (S: the thread's
// partition of a view with the row stride, from row 0) when start >= 0, else row by row from
// `positions` (S0: the row-stride-0 partition, see copy_rows).
template <bool Is_even_K, bool Clear_invalid_rows, int kRows, typename TiledCopy, typename Engine0, typename Layout0,
          typename Engine1, typename Layout1, typename Engine2, typename Layout2, typename Engine3, typename Layout3>
__forceinline__ __device__ void copy_keys(TiledCopy tiled_copy, Tensor<Engine0, Layout0> const &S, Tensor<Engine1, Layout1> const &S0,
                                          Tensor<Engine2, Layout2> &D, Tensor<Engine3, Layout3> const &predicate_K,
                                          const int start, const int (&positions)[kRows], const int64_t row_stride,
                                          const int64_t source_shift) {
    if (start >= 0) {
        Tensor src = make_tensor(S.data() + source_shift + int64_t(start) * row_stride, S.layout());
        #pragma unroll
        for (int m = 0; m < size<1>(src); ++m) {
            #pragma unroll
            for (int k = 0; k < size<2>(src); ++k) {
                if (Is_even_K || predicate_K(k)) {
                    cute::copy(tiled_copy, src(_, m, k), D(_, m, k));
                } else {
                    cute::clear(D(_, m, k));
                }
            }
        }
    } else {
        copy_rows<Is_even_K, Clear_invalid_rows>(tiled_copy, make_tensor(S0.data() + source_shift, S0.layout()), D, predicate_K, [&](int m) {
            return positions[m] < 0 ? int64_t(-1) : int64_t(positions[m]) * row_stride;
        });
    }
}

// Sets to -inf the scores of columns that are not keys, and (causal) those of mask-block keys
// after a row's diagonal. acc_s is (MMA=4, MMA_M, MMA_N); list rows [v0, v0 + n). When the tile
// lies in one logical block, one list read serves every column (a read per column made masked
// tiles, e.g. the causal diagonal of a speculative pass, cost several unmasked ones), and each
// row's causal limit is computed once, not per column.
template <typename Engine, typename Layout>
__forceinline__ __device__ void apply_sparse_mask(Tensor<Engine, Layout> &acc_s, const SparseTileList &list,
                                                  const int v0, const int n, const bool is_causal, const SparseTileRows &rows,
                                                  const int row_idx_offset, const int warp_row_stride, const int seqlen_q) {
    Tensor tensor = make_tensor(acc_s.data(), FLASH_NAMESPACE::convert_layout_acc_rowcol(acc_s.layout()));
    constexpr int kRowGroups = decltype(size<0, 1>(tensor))::value;
    constexpr int kRowsPerGroup = decltype(size<0, 0>(tensor))::value;
    int last_visible[kRowGroups][kRowsPerGroup];  // bottom-right aligned causal mask, as in FlashAttention
    #pragma unroll
    for (int mi = 0; mi < kRowGroups; ++mi) {
        #pragma unroll
        for (int i = 0; i < kRowsPerGroup; ++i) {
            last_visible[mi][i] = rows.position(row_idx_offset + mi * warp_row_stride + i * 8) + list.mask_seqlen_k - seqlen_q;
        }
    }
    const int e0 = v0 >> list.block_size_log2;
    const bool one_block = e0 == ((v0 + n - 1) >> list.block_size_log2);
    const int blk0 = one_block && e0 < list.total_cnt ? list.block(e0) : -1;
    const int lane_id = threadIdx.x % 32;
    const int col_offset = v0 + (lane_id % 4) * 2;
    #pragma unroll
    for (int nj = 0; nj < size<1, 1>(tensor); ++nj) {
        #pragma unroll
        for (int j = 0; j < size<1, 0>(tensor); ++j) {
            const int v = col_offset + nj * 8 + j;
            const int pos = one_block ? list.position_in_block(v, blk0) : list.position(v);
            const bool causal_col = is_causal && (v >> list.block_size_log2) < list.mask_cnt;
            #pragma unroll
            for (int mi = 0; mi < kRowGroups; ++mi) {
                #pragma unroll
                for (int i = 0; i < kRowsPerGroup; ++i) {
                    const bool hidden = pos < 0 || (causal_col && pos > last_visible[mi][i]);
                    if (hidden) { tensor(make_coord(i, mi), make_coord(j, nj)) = -INFINITY; }
                }
            }
        }
    }
}

// The causal mask of a whole tile of one valid block, first key position first_key: column c is
// key first_key + c, so a row hides the columns past its last visible key minus first_key. One
// limit per row and a compare-and-select per score, as upstream's causal mask; the general
// apply_sparse_mask, which looks each column up, compiled to branches around every score and
// made such a tile cost several unmasked ones (about 5x at B8 Sq16 decode).
template <typename Engine, typename Layout>
__forceinline__ __device__ void apply_causal_mask_whole_tile(Tensor<Engine, Layout> &acc_s, const int first_key,
                                                             const SparseTileRows &rows, const int row_idx_offset,
                                                             const int warp_row_stride, const int diagonal_offset) {
    Tensor tensor = make_tensor(acc_s.data(), FLASH_NAMESPACE::convert_layout_acc_rowcol(acc_s.layout()));
    const int col_offset = (threadIdx.x % 32 % 4) * 2;
    #pragma unroll
    for (int mi = 0; mi < size<0, 1>(tensor); ++mi) {
        #pragma unroll
        for (int i = 0; i < size<0, 0>(tensor); ++i) {
            const int last_col = rows.position(row_idx_offset + mi * warp_row_stride + i * 8) + diagonal_offset - first_key;
            #pragma unroll
            for (int nj = 0; nj < size<1, 1>(tensor); ++nj) {
                #pragma unroll
                for (int j = 0; j < size<1, 0>(tensor); ++j) {
                    if (col_offset + nj * 8 + j > last_col) { tensor(make_coord(i, mi), make_coord(j, nj)) = -INFINITY; }
                }
            }
        }
    }
}

////////////////////////////////////////////////////////////////////////////////////////////////////

// Where a tile's output goes: O (Split=false) or the fp32 partial slot (Split=true), and LSE.
template<typename Kernel_traits, bool Split, typename Params>
struct SparseOutput {
    using index_t = typename Kernel_traits::index_t;
    using ElementAccum = typename Kernel_traits::ElementAccum;
    using ElementO = std::conditional_t<!Split, typename Kernel_traits::Element, ElementAccum>;

    const Params &params;
    const SparseTileRows &rows;
    index_t o_base;    // start of this sequence in O (Split=false)
    index_t lse_base;  // start of this sequence's first head in LSE
    index_t lse_head_stride;
    index_t slot_base; // start of (slot, batch) in the partials, in rows of d_rounded (Split=true)

    __forceinline__ __device__ SparseOutput(const Params &params, const SparseTileRows &rows, const BlockInfo</*Varlen=*/true> &binfo,
                                            const int bidb, const int slot) : params(params), rows(rows) {
        o_base = binfo.q_offset(params.o_batch_stride, params.o_row_stride, bidb);
        slot_base = (index_t(slot) * params.b + bidb) * params.h * params.seqlen_q;
        if (Split || !params.unpadded_lse) {  // (slot, b, h, seqlen_q)
            lse_base = slot_base;
            lse_head_stride = params.seqlen_q;
        } else {                              // varlen: (h, total_q)
            lse_base = binfo.q_offset(params.seqlen_q, 1, bidb);
            lse_head_stride = params.total_q;
        }
    }

    __forceinline__ __device__ ElementO *o_ptr() const { return reinterpret_cast<ElementO *>(Split ? params.oaccum_ptr : params.o_ptr); }

    // Element offset of tile row r in O / the partials; -1 past the sequence.
    __forceinline__ __device__ int64_t o_offset(const int r) const {
        if (!rows.valid(r)) { return -1; }
        if (Split) { return (slot_base + index_t(rows.head(r)) * params.seqlen_q + rows.position(r)) * params.d_rounded; }
        return o_base + index_t(rows.position(r)) * params.o_row_stride + index_t(rows.head(r)) * params.o_head_stride;
    }

    __forceinline__ __device__ void write_lse(const int r, const float lse) const {
        if (rows.valid(r)) {
            ElementAccum *lse_ptr = reinterpret_cast<ElementAccum *>(Split ? params.softmax_lseaccum_ptr : params.softmax_lse_ptr);
            lse_ptr[lse_base + index_t(rows.head(r)) * lse_head_stride + rows.position(r)] = lse;
        }
    }
};

// Writes O = 0 and LSE = -inf for a tile with nothing to attend to (an empty list or split).
template<typename Kernel_traits, bool Is_even_K, bool Split, typename Output>
__forceinline__ __device__ void write_empty_sparse_tile(const Output &output) {
    using GmemTiledCopyO = std::conditional_t<!Split, typename Kernel_traits::GmemTiledCopyO, typename Kernel_traits::GmemTiledCopyOaccum>;
    using ElementO = typename Output::ElementO;
    constexpr int kBlockM = Kernel_traits::kBlockM;
    constexpr int kHeadDim = Kernel_traits::kHeadDim;
    const int tidx = threadIdx.x;

    Tensor gO0 = make_tensor(make_gmem_ptr(output.o_ptr()), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_stride(_0{}, _1{}));
    GmemTiledCopyO gmem_tiled_copy_O;
    auto gmem_thr_copy_O = gmem_tiled_copy_O.get_thread_slice(tidx);
    Tensor tOgO0 = gmem_thr_copy_O.partition_D(gO0);
    Tensor tOrO = make_tensor<ElementO>(shape(tOgO0));
    clear(tOrO);
    Tensor tOcO = gmem_thr_copy_O.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tOpO = make_tensor<bool>(make_shape(size<2>(tOgO0)));
    if (!Is_even_K) {
        #pragma unroll
        for (int k = 0; k < size(tOpO); ++k) { tOpO(k) = get<1>(tOcO(0, 0, k)) < output.params.d; }
    }
    store_rows<Is_even_K>(gmem_tiled_copy_O, tOrO, tOgO0, tOpO, [&](int m) { return output.o_offset(get<0>(tOcO(0, m, 0))); });
    #pragma unroll
    for (int m = 0; m < size<1>(tOgO0); ++m) {
        if (get<1>(tOcO(0, m, 0)) == 0) { output.write_lse(get<0>(tOcO(0, m, 0)), -INFINITY); }
    }
}

////////////////////////////////////////////////////////////////////////////////////////////////////

// The merge of a tile's splits inside their thread-block cluster (sm_90+): CTA `rank` of
// `num_ranks` holds its normalised O in fp32 (s_o, laid out as SmemLayoutO) and its LSE per row
// (s_lse, -inf where it saw no key) in its shared memory. Rank r merges rows r, r + num_ranks, ...
// one warp per row, reading every rank's O and LSE through distributed shared memory, and writes
// O and LSE, as the combine kernel would from global partials (the same merge, splits in order,
// a row no split saw: O = 0, LSE = -inf). Two cluster barriers: the first makes every rank's
// O and LSE visible, the second keeps each rank's shared memory alive until all have read it.
template<typename Kernel_traits, bool Is_even_K, typename Output>
__forceinline__ __device__ void merge_splits_in_cluster(const Output &output, const float *s_o, const float *s_lse,
                                                        const int rank, const int num_ranks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using Element = typename Output::ElementO;
    constexpr int kBlockM = Kernel_traits::kBlockM;
    constexpr int kHeadDim = Kernel_traits::kHeadDim;
    constexpr int kWarps = Kernel_traits::kNWarps;
    constexpr int kColsPerLane = kHeadDim / 32;
    static_assert(kHeadDim % 32 == 0);
    const typename Kernel_traits::SmemLayoutO layout_o;
    cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    cluster.sync();
    for (int row = rank + warp * num_ranks; row < kBlockM; row += kWarps * num_ranks) {
        // Lane s reads split s's LSE (num_ranks <= 32).
        const float lse_split = lane < num_ranks ? *cluster.map_shared_rank(s_lse + row, lane) : -INFINITY;
        float lse_max = lse_split;
        #pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) { lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffff, lse_max, offset)); }
        const float max_shift = lse_max == -INFINITY ? 0.f : lse_max;
        float sum = lse_split == -INFINITY ? 0.f : expf(lse_split - max_shift);
        #pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) { sum += __shfl_xor_sync(0xffffffff, sum, offset); }
        // sum == 0: no rank saw a key; a NaN sum (a rank's LSE is NaN) stays NaN, as O does.
        const float lse = sum == 0.f ? -INFINITY : logf(sum) + max_shift;
        const float scale = lse == -INFINITY || lse_split == -INFINITY ? 0.f : expf(lse_split - lse);
        float acc[kColsPerLane];
        #pragma unroll
        for (int j = 0; j < kColsPerLane; ++j) { acc[j] = 0.f; }
        for (int split = 0; split < num_ranks; ++split) {
            const float split_scale = __shfl_sync(0xffffffff, scale, split);
            if (split_scale == 0.f) { continue; }  // a split that saw nothing (its O holds no keys)
            const float *o_split = cluster.map_shared_rank(s_o, split);
            #pragma unroll
            for (int j = 0; j < kColsPerLane; ++j) { acc[j] = fmaf(split_scale, o_split[layout_o(row, lane + 32 * j)], acc[j]); }
        }
        const int64_t o_offset = output.o_offset(row);  // -1 past the sequence
        if (o_offset >= 0) {
            Element *o = output.o_ptr() + o_offset;
            #pragma unroll
            for (int j = 0; j < kColsPerLane; ++j) {
                const int col = lane + 32 * j;
                if (Is_even_K || col < output.params.d) { o[col] = Element(acc[j]); }
            }
        }
        if (lane == 0) { output.write_lse(row, lse); }
    }
    cluster.sync();
#endif
}

// Paged: K/V are paged caches (params.block_table); a template flag so that the contiguous
// kernels keep their registers. ClusterMerge (with Split): the CTAs of a tile's splits are one
// thread-block cluster and merge their (O, LSE) in shared memory at the end
// (merge_splits_in_cluster), so no fp32 partials reach global memory and no combine runs.
template<typename Kernel_traits, bool Is_even_K, bool Split, bool Paged, bool ClusterMerge, typename Params>
inline __device__ void compute_attn_1rowblock_sparse(const Params &params, const int bidb, const int bidh, const int m_block,
                                                     const int n_split_idx, const int num_n_splits) {
    using Element = typename Kernel_traits::Element;
    using ElementAccum = typename Kernel_traits::ElementAccum;
    using index_t = typename Kernel_traits::index_t;
    static_assert(!Kernel_traits::Is_Q_in_regs && !Kernel_traits::Share_Q_K_smem);

    extern __shared__ char smem_[];
    const int tidx = threadIdx.x;

    constexpr int kBlockM = Kernel_traits::kBlockM;
    constexpr int kBlockN = Kernel_traits::kBlockN;
    constexpr int kHeadDim = Kernel_traits::kHeadDim;
    constexpr int kNWarps = Kernel_traits::kNWarps;
    // The key-split tile (Sparse_keysplit_kernel_traits): the warps load each tile together, then
    // each computes the tile's 16 rows over its own kMmaKeys keys with its own row max, sum and O,
    // and the warps' results are merged in shared memory at the end. Otherwise the warps split
    // the rows, as upstream's.
    constexpr bool kKeySplit = is_sparse_keysplit<Kernel_traits>::value;
    constexpr int kMmaKeys = kKeySplit ? kBlockN / kNWarps : kBlockN;
    const int warp = tidx / 32;
    const int mma_tidx = kKeySplit ? tidx % 32 : tidx;
    const int warp_first_col = kKeySplit ? warp * kMmaKeys : 0;

    static_assert(!ClusterMerge || Split);
    // What leaves the CTA: fp32 partials (Split), or O and LSE (no split, or a cluster's merge).
    // Both split forms stage the CTA's O in fp32 shared memory.
    constexpr bool kPartialsOut = Split && !ClusterMerge;
    using GmemTiledCopyO = std::conditional_t<!Split, typename Kernel_traits::GmemTiledCopyO, typename Kernel_traits::GmemTiledCopyOaccum>;
    using ElementO = std::conditional_t<!Split, Element, ElementAccum>;

    const BlockInfo</*Varlen=*/true> binfo(params, bidb);
    // bidh is the tile's head: the K/V head when packing, else the query head.
    const int group = params.sparse_pack_gqa;
    const SparseTileRows rows{m_block * kBlockM, binfo.actual_seqlen_q * group, group, bidh * group};
    if (rows.first_row >= rows.num_rows) return;
    // A cluster writes O and LSE once, at their places (slot 0), whichever rank merges a row.
    const SparseOutput<Kernel_traits, kPartialsOut, Params> output(params, rows, binfo, bidb,
                                                                   kPartialsOut ? params.sparse_split_offset + n_split_idx : 0);

    // seqused_k beyond the rows K/V hold (batch, varlen or paged extent) is clamped, so it cannot
    // lead the kernel past them; paged, also to the page table's capacity (params.seqlen_k), which
    // a varlen call's cu_seqlens_k could name more keys than.
    int seqlen_k = std::min(binfo.actual_seqlen_k, binfo.seqlen_k_cache);
    if constexpr (Paged) { seqlen_k = std::min(seqlen_k, params.seqlen_k); }
    const SparseTileList list = get_sparse_tile_list<kBlockM>(params, bidb, rows, seqlen_k);
    // This split's share of the list, in kernel tiles of kBlockN list rows.
    const int n_tiles = cute::ceil_div(list.total_cnt << list.block_size_log2, kBlockN);
    const int tiles_per_split = cute::ceil_div(n_tiles, num_n_splits);
    const int tile_min = n_split_idx * tiles_per_split;
    const int tile_max = std::min(n_tiles, tile_min + tiles_per_split);
    // A split with no tiles writes an empty partial; in a cluster it still takes part in the
    // merge (its LSE is -inf), since its siblings wait for it there.
    const bool has_tiles = tile_min < tile_max;
    if (!has_tiles) {
        if constexpr (!ClusterMerge) {
            write_empty_sparse_tile<Kernel_traits, Is_even_K, Split>(output);
            return;
        }
    }

    const int bidh_k = rows.first_head / params.h_h_k_ratio;
    const SparsePagedKV paged = Paged ? get_sparse_paged_kv(params, bidb) : SparsePagedKV{};
    // Row-stride-0 views of Q, K and V: rows are placed one by one (copy_rows). Paged K/V has no
    // batch offset: the page id places each row.
    Tensor gQ0 = make_tensor(make_gmem_ptr(reinterpret_cast<Element *>(params.q_ptr) + binfo.q_offset(params.q_batch_stride, params.q_row_stride, bidb)),
                             Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_stride(_0{}, _1{}));
    Tensor gK0 = make_tensor(make_gmem_ptr(reinterpret_cast<Element *>(params.k_ptr)
                                           + (Paged ? index_t(0) : binfo.k_offset(params.k_batch_stride, params.k_row_stride, bidb))
                                           + bidh_k * params.k_head_stride),
                             Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(_0{}, _1{}));
    Tensor gV0 = make_tensor(make_gmem_ptr(reinterpret_cast<Element *>(params.v_ptr)
                                           + (Paged ? index_t(0) : binfo.k_offset(params.v_batch_stride, params.v_row_stride, bidb))
                                           + bidh_k * params.v_head_stride),
                             Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(_0{}, _1{}));

    Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element *>(smem_)), typename Kernel_traits::SmemLayoutQ{});
    Tensor sK = make_tensor(sQ.data() + size(sQ), typename Kernel_traits::SmemLayoutKV{});
    Tensor sV = make_tensor(sK.data() + size(sK), typename Kernel_traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(sV.data(), typename Kernel_traits::SmemLayoutVtransposed{});
    Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Kernel_traits::SmemLayoutVtransposedNoSwizzle{});

    typename Kernel_traits::GmemTiledCopyQKV gmem_tiled_copy_QKV;
    auto gmem_thr_copy_QKV = gmem_tiled_copy_QKV.get_thread_slice(tidx);

    Tensor tQgQ0 = gmem_thr_copy_QKV.partition_S(gQ0);
    Tensor tQsQ = gmem_thr_copy_QKV.partition_D(sQ);
    Tensor tKgK0 = gmem_thr_copy_QKV.partition_S(gK0);  // (KCPY, KCPY_N, KCPY_K)
    Tensor tKsK = gmem_thr_copy_QKV.partition_D(sK);
    Tensor tVgV0 = gmem_thr_copy_QKV.partition_S(gV0);  // (VCPY, VCPY_N, VCPY_K)
    Tensor tVsV = gmem_thr_copy_QKV.partition_D(sV);

    // The keys this warp multiplies: all of sK / sVt, or its kMmaKeys of them (key split).
    auto warp_keys = [&](auto const &s) {
        if constexpr (kKeySplit) { return local_tile(s, Shape<Int<kMmaKeys>, Int<kHeadDim>>{}, make_coord(warp, 0)); } else { return s; }
    };
    auto warp_keys_t = [&](auto const &s) {  // transposed: keys are the second mode
        if constexpr (kKeySplit) { return local_tile(s, Shape<Int<kHeadDim>, Int<kMmaKeys>>{}, make_coord(0, warp)); } else { return s; }
    };
    Tensor sK_mma = warp_keys(sK);
    Tensor sVt_mma = warp_keys_t(sVt);
    Tensor sVtNoSwizzle_mma = warp_keys_t(sVtNoSwizzle);

    typename Kernel_traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(mma_tidx);
    Tensor tSrQ  = thr_mma.partition_fragment_A(sQ);                           // (MMA,MMA_M,MMA_K)
    Tensor tSrK  = thr_mma.partition_fragment_B(sK_mma);                       // (MMA,MMA_N,MMA_K)
    Tensor tOrVt  = thr_mma.partition_fragment_B(sVtNoSwizzle_mma);            // (MMA, MMA_K,MMA_N)
    Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // MMA, MMA_M, MMA_K

    auto smem_tiled_copy_Q = make_tiled_copy_A(typename Kernel_traits::SmemCopyAtom{}, tiled_mma);
    auto smem_thr_copy_Q = smem_tiled_copy_Q.get_thread_slice(mma_tidx);
    Tensor tSsQ = smem_thr_copy_Q.partition_S(sQ);
    auto smem_tiled_copy_K = make_tiled_copy_B(typename Kernel_traits::SmemCopyAtom{}, tiled_mma);
    auto smem_thr_copy_K = smem_tiled_copy_K.get_thread_slice(mma_tidx);
    Tensor tSsK = smem_thr_copy_K.partition_S(sK_mma);
    auto smem_tiled_copy_V = make_tiled_copy_B(typename Kernel_traits::SmemCopyAtomTransposed{}, tiled_mma);
    auto smem_thr_copy_V = smem_tiled_copy_V.get_thread_slice(mma_tidx);
    Tensor tOsVt = smem_thr_copy_V.partition_S(sVt_mma);

    // Predicates
    Tensor cQ = make_identity_tensor(make_shape(size<0>(sQ), size<1>(sQ)));    // (BLK_M,BLK_K) -> (blk_m,blk_k)
    Tensor cKV = make_identity_tensor(make_shape(size<0>(sK), size<1>(sK)));    // (BLK_N,BLK_K) -> (blk_n,blk_k)
    Tensor tQcQ = gmem_thr_copy_QKV.partition_S(cQ);
    Tensor tKVcKV = gmem_thr_copy_QKV.partition_S(cKV);
    Tensor tQpQ = make_tensor<bool>(make_shape(size<2>(tQsQ)));
    Tensor tKVpKV = make_tensor<bool>(make_shape(size<2>(tKsK)));
    if (!Is_even_K) {
        #pragma unroll
        for (int k = 0; k < size(tQpQ); ++k) { tQpQ(k) = get<1>(tQcQ(0, 0, k)) < params.d; }
        #pragma unroll
        for (int k = 0; k < size(tKVpKV); ++k) { tKVpKV(k) = get<1>(tKVcKV(0, 0, k)) < params.d; }
    }

    // Key positions of this thread's copy rows for one tile (rows of the cache when paged); K and
    // V of a tile share them.
    constexpr int kRowsPerThread = decltype(size<1>(tKgK0))::value;
    auto tile_positions = [&](const int tile, int (&positions)[kRowsPerThread]) {
        if (list.block_size >= kBlockN) {
            // The whole tile lies in one logical block: one list read for all rows.
            const int e = (tile * kBlockN) >> list.block_size_log2;
            const int blk = e < list.total_cnt ? list.block(e) : -1;
            #pragma unroll
            for (int m = 0; m < kRowsPerThread; ++m) {
                positions[m] = list.position_in_block(tile * kBlockN + get<0>(tKVcKV(0, m, 0)), blk);
            }
        } else {
            #pragma unroll
            for (int m = 0; m < kRowsPerThread; ++m) {
                positions[m] = list.position(tile * kBlockN + get<0>(tKVcKV(0, m, 0)));
            }
        }
        if constexpr (Paged) {
            #pragma unroll
            for (int m = 0; m < kRowsPerThread; ++m) {
                if (positions[m] >= 0) { positions[m] = paged.resolve(positions[m]); }
            }
        }
    };

    // The common tile is kBlockN consecutive keys of one valid block (block_size >= kBlockN, not
    // past seqlen_k; when paged, inside one page). Its first row (a position, or a row of the
    // cache when paged) is enough: it is copied as one strided tile, each thread's row offsets
    // fixed, as in upstream's dense kernel, instead of an address per row. Under ncu (every block
    // listed, B1 Sq1 Sk128k) the per-row path ran 46% more instructions than upstream's kernel,
    // 22% longer on the same grid; this path: 20% fewer instructions, 5% less time. When tiles can be whole, a tile's block id is read before the matmul
    // (tile_block) and used after it (tile_keys: the first row, or -1 after filling
    // `positions`), so the load is in flight during the matmul; a branch on it right after the
    // load would wait for it.
    const bool whole_tiles = list.block_size >= kBlockN && (!Paged || (paged.page_shift >= 0 && paged.page_size >= kBlockN));
    auto tile_block = [&](const int tile) {
        const int e = (tile * kBlockN) >> list.block_size_log2;
        return e < list.total_cnt ? list.block(e) : -1;
    };
    auto tile_keys = [&](const int tile, const int blk, int (&positions)[kRowsPerThread]) {
        const int e = (tile * kBlockN) >> list.block_size_log2;
        const int start = (blk << list.block_size_log2) + ((tile * kBlockN) & (list.block_size - 1));
        if (list.valid_block(e, blk) && start + kBlockN <= list.source_keys(e)) {
            if constexpr (!Paged) { return start; }
            const int row = paged.resolve(start);
            if (row >= 0) { return row; }
        }
        tile_positions(tile, positions);
        return -1;
    };
    // Where a tile's keys come from: K/V, or (its entry a mask entry) the mask blocks' own source,
    // whose rows lie a fixed distance away (the host keeps a tile within one entry then).
    auto in_mask_source = [&](const int tile) {
        return params.sparse_mask_seqlen_k > 0 && ((tile * kBlockN) >> list.block_size_log2) < list.mask_cnt;
    };
    auto k_shift = [&](const int tile) {
        return in_mask_source(tile) ? params.sparse_mask_k_shift + bidb * params.sparse_mask_k_batch_shift : int64_t(0);
    };
    auto v_shift = [&](const int tile) {
        return in_mask_source(tile) ? params.sparse_mask_v_shift + bidb * params.sparse_mask_v_batch_shift : int64_t(0);
    };
    // Strided views of K and V from row 0, partitioned once; a tile's copy moves the base.
    Tensor tKgK = gmem_thr_copy_QKV.partition_S(make_tensor(gK0.data(), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(params.k_row_stride, _1{})));
    Tensor tVgV = gmem_thr_copy_QKV.partition_S(make_tensor(gV0.data(), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_stride(params.v_row_stride, _1{})));

    // Prologue: Q, and K of the last tile of this split (tiles are visited in reverse). Nothing
    // without tiles (only a cluster's empty split gets here): no copy may land in shared memory
    // that the merge then uses.
    if (has_tiles) {
        copy_rows<Is_even_K, /*Clear_invalid_rows=*/false>(gmem_tiled_copy_QKV, tQgQ0, tQsQ, tQpQ, [&](int m) {
            const int r = get<0>(tQcQ(0, m, 0));
            return rows.valid(r) ? int64_t(rows.position(r)) * params.q_row_stride + int64_t(rows.head(r)) * params.q_head_stride : int64_t(-1);
        });
    }
    // A whole tile of a mask block needs the causal mask only if one of its keys lies after the
    // diagonal of the tile's first (lowest-position) row; the other mask-block tiles are fully
    // visible and take the unmasked path, as upstream masks only its diagonal tiles. (The
    // speculative forms list several mask blocks of which one holds the diagonal.) A tile that
    // does cross it is masked from its first key alone (apply_causal_mask_whole_tile).
    const int diagonal_offset = list.mask_seqlen_k - binfo.actual_seqlen_q;  // bottom-right aligned
    const int first_row_last_visible = rows.position(0) + diagonal_offset;
    // The first key of a whole tile that crosses the diagonal, else -1.
    auto diagonal_tile_first_key = [&](const int tile, const int blk) {
        const int e = (tile * kBlockN) >> list.block_size_log2;
        const int first_key = (blk << list.block_size_log2) + ((tile * kBlockN) & (list.block_size - 1));
        return params.is_causal && e < list.mask_cnt && first_key + kBlockN - 1 > first_row_last_visible ? first_key : -1;
    };
    int tile = tile_max - 1;
    int positions[kRowsPerThread];
    int start = -1;
    int diagonal_first_key = -1;  // of the current tile, when whole (start >= 0)
    if (has_tiles) {
        if (whole_tiles) {
            const int blk = tile_block(tile);
            start = tile_keys(tile, blk, positions);
            diagonal_first_key = diagonal_tile_first_key(tile, blk);
        } else {
            tile_positions(tile, positions);
        }
        // Invalid K rows need no clearing: their scores are masked to -inf.
        copy_keys<Is_even_K, /*Clear_invalid_rows=*/false>(gmem_tiled_copy_QKV, tKgK, tKgK0, tKsK, tKVpKV, start, positions, params.k_row_stride, k_shift(tile));
        cute::cp_async_fence();
    }
    // The 4-warp kernels issue V of a tile as soon as sV is free (here, and after the previous
    // tile's PV), so it loads beside that tile's K: groups in flight at the top of an iteration
    // are [K(t)] [V(t)]: one split walking many tiles ran 5-10% faster, default split counts
    // unchanged. The one-warp decode tile keeps upstream's order (V(t) after K(t) is in):
    // issuing early made it 2-4% slower. Invalid V rows are cleared: P is 0 there, but 0 *
    // garbage need not be.
    constexpr bool kIssueVEarly = kNWarps > 1;
    if (kIssueVEarly && has_tiles) {
        copy_keys<Is_even_K, /*Clear_invalid_rows=*/true>(gmem_tiled_copy_QKV, tVgV, tVgV0, tVsV, tKVpKV, start, positions, params.v_row_stride, v_shift(tile));
        cute::cp_async_fence();
    }

    clear(acc_o);
    FLASH_NAMESPACE::Softmax<2 * size<1>(acc_o)> softmax;
    if (!has_tiles) {  // no tile sets the running max and sum: the normalisation below gives O = 0, LSE = -inf
        fill(softmax.row_max, -INFINITY);
        fill(softmax.row_sum, 0.f);
    }
    const int row_idx_offset = kKeySplit ? (tidx % 32) / 4 : (tidx / 32) * 16 + (tidx % 32) / 4;
    constexpr int kWarpRowStride = kKeySplit ? 16 : kNWarps * 16;

    for (bool is_first = true; tile >= tile_min; --tile, is_first = false) {
        Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kMmaKeys>>{});  // (MMA=4, MMA_M, MMA_N)
        clear(acc_s);
        FLASH_NAMESPACE::cp_async_wait<kIssueVEarly ? 1 : 0>();  // K(t) is in
        __syncthreads();
        if constexpr (!kIssueVEarly) {
            copy_keys<Is_even_K, /*Clear_invalid_rows=*/true>(gmem_tiled_copy_QKV, tVgV, tVgV0, tVsV, tKVpKV, start, positions, params.v_row_stride, v_shift(tile));
            cute::cp_async_fence();
        }
        // Look up the next tile's keys now so the list reads overlap the matmul.
        int next_positions[kRowsPerThread];
        int next_blk = -1;
        if (tile > tile_min) {
            if (whole_tiles) { next_blk = tile_block(tile - 1); } else { tile_positions(tile - 1, next_positions); }
        }

        FLASH_NAMESPACE::gemm(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_tiled_copy_Q, smem_tiled_copy_K,
                              smem_thr_copy_Q, smem_thr_copy_K);
        // A whole valid tile needs a mask only where it crosses the causal diagonal; only row-path
        // tiles need the list scan.
        const bool masked = start >= 0 ? diagonal_first_key >= 0 : list.needs_mask(tile * kBlockN, kBlockN, params.is_causal);
        const int next_start = tile > tile_min && whole_tiles ? tile_keys(tile - 1, next_blk, next_positions) : -1;
        if (masked) {
            if (start >= 0) {
                apply_causal_mask_whole_tile(acc_s, diagonal_first_key + warp_first_col, rows, row_idx_offset, kWarpRowStride, diagonal_offset);
            } else {
                apply_sparse_mask(acc_s, list, tile * kBlockN + warp_first_col, kMmaKeys, params.is_causal, rows, row_idx_offset, kWarpRowStride, binfo.actual_seqlen_q);
            }
        }

        FLASH_NAMESPACE::cp_async_wait<0>();
        __syncthreads();
        if (tile > tile_min) {
            copy_keys<Is_even_K, /*Clear_invalid_rows=*/false>(gmem_tiled_copy_QKV, tKgK, tKgK0, tKsK, tKVpKV, next_start, next_positions, params.k_row_stride, k_shift(tile - 1));
            // The fence stays inside the branch, as upstream's: the wait<0> above counts on it.
            cute::cp_async_fence();
            start = next_start;
            diagonal_first_key = next_start >= 0 ? diagonal_tile_first_key(tile - 1, next_blk) : -1;
            if (next_start < 0) {
                #pragma unroll
                for (int m = 0; m < kRowsPerThread; ++m) { positions[m] = next_positions[m]; }
            }
        }

        // A masked tile can hide whole rows, so the running max may still be -inf.
        if (is_first) {
            softmax.template softmax_rescale_o</*Is_first=*/true, /*Check_inf=*/true>(acc_s, acc_o, params.scale_softmax_log2);
        } else if (masked) {
            softmax.template softmax_rescale_o</*Is_first=*/false, /*Check_inf=*/true>(acc_s, acc_o, params.scale_softmax_log2);
        } else {
            softmax.template softmax_rescale_o</*Is_first=*/false, /*Check_inf=*/false>(acc_s, acc_o, params.scale_softmax_log2);
        }
        Tensor rP = FLASH_NAMESPACE::convert_type<Element>(acc_s);
        Tensor tOrP = make_tensor(rP.data(), FLASH_NAMESPACE::convert_layout_acc_Aregs<typename Kernel_traits::TiledMma>(rP.layout()));
        FLASH_NAMESPACE::gemm_rs(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, smem_tiled_copy_V, smem_thr_copy_V);
        if (kIssueVEarly && tile > tile_min) {
            __syncthreads();  // every warp's PV(t) is done with sV
            copy_keys<Is_even_K, /*Clear_invalid_rows=*/true>(gmem_tiled_copy_QKV, tVgV, tVgV0, tVsV, tKVpKV, start, positions, params.v_row_stride, v_shift(tile - 1));
            cute::cp_async_fence();
        }
    }

    // Epilogue. A row that saw no key (everything masked) gets LSE = -inf and O = 0.
    Tensor lse = softmax.template normalize_softmax_lse</*Is_dropout=*/false, /*Split (LSE of empty rows = -inf)=*/true>(acc_o, params.scale_softmax);
    // Upstream gives a NaN row (NaN/Inf in q, k or v: row_sum is NaN) the empty row's LSE too;
    // every merge below (key-split warps, cluster, combine) would then weigh its NaN O by 0 and
    // write zeros. Its LSE is NaN instead, so NaN in means NaN out, as in the dense kernels.
    // Once per row in the epilogue: the key loop is unchanged.
    #pragma unroll
    for (int mi = 0; mi < size(lse); ++mi) {
        if (softmax.row_sum(mi) != softmax.row_sum(mi)) { lse(mi) = NAN; }
    }

    Tensor caccO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});    // (BLK_M,BLK_K) -> (blk_m,blk_k)
    Tensor taccOcO = thr_mma.partition_C(caccO);                           // (MMA,MMA_M,MMA_K)
    static_assert(decltype(size<0>(taccOcO))::value == 4);
    // Convert to ((2, 2), MMA_M, MMA_K) then take only the row indices.
    Tensor taccOcO_row = logical_divide(taccOcO, Shape<_2>{})(make_coord(0, _), _, 0);
    CUTE_STATIC_ASSERT_V(size(lse) == size(taccOcO_row));                     // MMA_M
    if constexpr (kKeySplit) {
        // Each warp holds O and LSE of the rows over its keys. In sV (every warp is past its last
        // PV): the warps' LSEs, then warps 1.. put their O, rescaled to the merged LSE, where
        // warp 0 adds them to its own, thread by thread in fragment order.
        float *merge_lse = reinterpret_cast<float *>(smem_ + (size(sQ) + size(sK)) * sizeof(Element));  // [warp][row]
        float *merge_o = merge_lse + kNWarps * kBlockM;                                                  // [warp - 1][i][lane]
        static_assert((kNWarps * kBlockM + (kNWarps - 1) * kBlockM * kHeadDim) * sizeof(float) <= size(sV) * sizeof(Element));
        const int lane = tidx % 32;
        __syncthreads();
        if (get<1>(taccOcO_row(0)) == 0) {
            #pragma unroll
            for (int mi = 0; mi < size(lse); ++mi) { merge_lse[warp * kBlockM + get<0>(taccOcO_row(mi))] = lse(mi); }
        }
        __syncthreads();
        Tensor acc_o_rowcol = make_tensor(acc_o.data(), FLASH_NAMESPACE::convert_layout_acc_rowcol(acc_o.layout()));
        #pragma unroll
        for (int mi = 0; mi < size(lse); ++mi) {
            const int row = get<0>(taccOcO_row(mi));
            float max_lse = -INFINITY;
            #pragma unroll
            for (int w = 0; w < kNWarps; ++w) { max_lse = fmaxf(max_lse, merge_lse[w * kBlockM + row]); }
            // fmaxf skips a NaN LSE; the sum does not, so a NaN warp makes the merged LSE NaN.
            const float max_shift = max_lse == -INFINITY ? 0.f : max_lse;
            float sum = 0.f;
            #pragma unroll
            for (int w = 0; w < kNWarps; ++w) {
                const float lse_w = merge_lse[w * kBlockM + row];
                sum += lse_w == -INFINITY ? 0.f : expf(lse_w - max_shift);
            }
            const float merged = sum == 0.f ? -INFINITY : max_shift + logf(sum);
            const float scale = lse(mi) == -INFINITY ? 0.f : expf(lse(mi) - merged);
            #pragma unroll
            for (int ni = 0; ni < size<1>(acc_o_rowcol); ++ni) { acc_o_rowcol(mi, ni) *= scale; }
            lse(mi) = merged;
        }
        if (warp > 0) {
            #pragma unroll
            for (int i = 0; i < size(acc_o); ++i) { merge_o[((warp - 1) * size(acc_o) + i) * 32 + lane] = acc_o(i); }
        }
        __syncthreads();
        if (warp == 0) {
            #pragma unroll
            for (int i = 0; i < size(acc_o); ++i) {
                #pragma unroll
                for (int w = 1; w < kNWarps; ++w) { acc_o(i) += merge_o[((w - 1) * size(acc_o) + i) * 32 + lane]; }
            }
        }
    }

    Tensor sOaccum = make_tensor(make_smem_ptr(reinterpret_cast<ElementO *>(smem_)), typename Kernel_traits::SmemLayoutO{}); // (SMEM_M,SMEM_N)
    using SmemTiledCopyO = std::conditional_t<!Split, typename Kernel_traits::SmemCopyAtomO, typename Kernel_traits::SmemCopyAtomOaccum>;
    auto smem_tiled_copy_Oaccum = make_tiled_copy_C(SmemTiledCopyO{}, tiled_mma);
    auto smem_thr_copy_Oaccum = smem_tiled_copy_Oaccum.get_thread_slice(mma_tidx);
    Tensor rO = FLASH_NAMESPACE::convert_type<ElementO>(acc_o);
    Tensor taccOrOaccum = smem_thr_copy_Oaccum.retile_S(rO);        // ((Atom,AtomNum), MMA_M, MMA_N)
    Tensor taccOsOaccum = smem_thr_copy_Oaccum.partition_D(sOaccum);     // ((Atom,AtomNum),PIPE_M,PIPE_N)
    // sOaccum overlaps sQ and, in fp32, sK and sV: wait until every warp is done with them.
    __syncthreads();
    if (!kKeySplit || warp == 0) { cute::copy(smem_tiled_copy_Oaccum, taccOrOaccum, taccOsOaccum); }

    // The cluster's CTAs keep their LSE beside their O in shared memory.
    float *cluster_lse = reinterpret_cast<float *>(smem_) + cosize(typename Kernel_traits::SmemLayoutO{});
    if ((!kKeySplit || warp == 0) && get<1>(taccOcO_row(0)) == 0) {
        #pragma unroll
        for (int mi = 0; mi < size(lse); ++mi) {
            if constexpr (ClusterMerge) {
                cluster_lse[get<0>(taccOcO_row(mi))] = lse(mi);
            } else {
                output.write_lse(get<0>(taccOcO_row(mi)), lse(mi));
            }
        }
    }
    if constexpr (ClusterMerge) {
        static_assert((cosize(typename Kernel_traits::SmemLayoutO{}) + kBlockM) * sizeof(float) <= Kernel_traits::kSmemSize);
        merge_splits_in_cluster<Kernel_traits, Is_even_K>(output, reinterpret_cast<const float *>(smem_), cluster_lse, n_split_idx, num_n_splits);
        return;
    }

    Tensor gO0 = make_tensor(make_gmem_ptr(output.o_ptr()), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_stride(_0{}, _1{}));
    GmemTiledCopyO gmem_tiled_copy_Oaccum;
    auto gmem_thr_copy_Oaccum = gmem_tiled_copy_Oaccum.get_thread_slice(tidx);
    Tensor tOsOaccum = gmem_thr_copy_Oaccum.partition_S(sOaccum);        // ((Atom,AtomNum),ATOM_M,ATOM_N)
    Tensor tOgO0 = gmem_thr_copy_Oaccum.partition_D(gO0);
    __syncthreads();
    Tensor tOrOaccum = make_tensor<ElementO>(shape(tOgO0));
    cute::copy(gmem_tiled_copy_Oaccum, tOsOaccum, tOrOaccum);

    Tensor tOcO = gmem_thr_copy_Oaccum.partition_D(make_identity_tensor(make_shape(size<0>(sOaccum), size<1>(sOaccum))));
    Tensor tOpO = make_tensor<bool>(make_shape(size<2>(tOgO0)));
    if (!Is_even_K) {
        #pragma unroll
        for (int k = 0; k < size(tOpO); ++k) { tOpO(k) = get<1>(tOcO(0, 0, k)) < params.d; }
    }
    store_rows<Is_even_K>(gmem_tiled_copy_Oaccum, tOrOaccum, tOgO0, tOpO, [&](int m) { return output.o_offset(get<0>(tOcO(0, m, 0))); });
}

} // namespace FLASH_NAMESPACE
