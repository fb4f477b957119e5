/******************************************************************************
 * The block list of one sparse work tile (batch, table head, query tile, split), read the same
 * way by the producer warp (TMA loads of K and V) and the MMA warpgroups (masking), so that
 * both walk the same number of entries in the same order: the pipeline depends on it.
 *
 * Entries are numbered 0 .. num_full + num_mask - 1: the full list first, then the mask list.
 * The mainloop walks a split's entry range downwards, like the dense n_block loop; the entry
 * index takes the place of n_block and block(entry) that of the key-block coordinate.
 * Counts are clamped to the row capacity; ids outside [0, n_blocks_k) are loaded clamped into
 * range (memory safe) and masked out entirely, i.e. skipped.
 ******************************************************************************/

#pragma once

#include <cute/tensor.hpp>
#include <cutlass/fast_math.h>

#include "sparse_params.h"

namespace flash {


struct SparseBlockList {
    int const *full_idx = nullptr;
    int const *mask_idx = nullptr;
    int num_full = 0;
    int num_entries = 0;
    int n_blocks_k = 0;
    int tail_keys = 0;  // keys in the sequence's last block (kSparseBlockSize unless partial)

    // Varlen: the kernel's flag. Its lists are in the varlen layout when cu_total_m_blocks is
    // given; a fixed-length call with seqused_k also runs the varlen kernel, over batched lists.
    template <bool Varlen>
    CUTLASS_DEVICE static SparseBlockList
    make(SparseBlockParams const &p, int const bidb, int const bidh, int const m_block, int const seqlen_k_used) {
        SparseBlockList list;
        int const seqlen_k = min(seqlen_k_used, p.max_keys);
        list.n_blocks_k = (seqlen_k + kSparseBlockSize - 1) / kSparseBlockSize;
        list.tail_keys = seqlen_k - max(list.n_blocks_k - 1, 0) * kSparseBlockSize;
        int const head = bidh / p.head_ratio;
        int const row = m_block / p.tiles_per_row;
        auto clamped = [](int const *cnt, int const capacity) { return max(0, min(*cnt, capacity)); };
        if (Varlen && p.cu_total_m_blocks != nullptr) {
            int const m_begin = p.cu_total_m_blocks[bidb];
            int const m_rows = p.cu_total_m_blocks[bidb + 1] - m_begin;
            if (row >= m_rows) { return list; }  // a tile past the lists: nothing listed
            int const idx_begin = p.cu_block_idx_offsets[bidb];
            int const capacity = (p.cu_block_idx_offsets[bidb + 1] - idx_begin) / m_rows;
            int64_t const cnt_offset = head * p.full.cnt_head_stride + m_begin + row;
            int64_t const idx_offset = head * p.full.idx_head_stride + idx_begin + int64_t(row) * capacity;
            list.full_idx = p.full_idx + idx_offset;
            list.num_full = clamped(p.full_cnt + cnt_offset, capacity);
            list.num_entries = list.num_full;
            if (p.mask_idx != nullptr) {
                list.mask_idx = p.mask_idx + idx_offset;
                list.num_entries += clamped(p.mask_cnt + cnt_offset, capacity);
            }
        } else {
            list.full_idx = p.full_idx + batched_idx_offset(p.full, bidb, head, row);
            list.num_full = clamped(p.full_cnt + batched_cnt_offset(p.full, bidb, head, row), p.full.idx_capacity);
            list.num_entries = list.num_full;
            if (p.mask_idx != nullptr) {
                list.mask_idx = p.mask_idx + batched_idx_offset(p.mask, bidb, head, row);
                list.num_entries += clamped(p.mask_cnt + batched_cnt_offset(p.mask, bidb, head, row), p.mask.idx_capacity);
            }
        }
        return list;
    }

    CUTLASS_DEVICE static int64_t
    batched_cnt_offset(SparseListLayout const &l, int const bidb, int const head, int const row) {
        return bidb * l.cnt_batch_stride + head * l.cnt_head_stride + row * l.cnt_row_stride;
    }
    CUTLASS_DEVICE static int64_t
    batched_idx_offset(SparseListLayout const &l, int const bidb, int const head, int const row) {
        return bidb * l.idx_batch_stride + head * l.idx_head_stride + row * l.idx_row_stride;
    }

    // Warm, from the thread that claimed it, the lists of a batched tile that runs next: its
    // counts and, of each row, the first line and the line of its last entry within the first
    // kPrefetchBytes (the walk starts at the last listed entry, in a full row the row's last;
    // rows of up to 32 entries are then whole), as L1 prefetches.
    static constexpr int kPrefetchBytes = 1024;
    CUTLASS_DEVICE static void
    prefetch(SparseBlockParams const &p, int const bidb, int const bidh, int const m_block) {
        int const head = bidh / p.head_ratio;
        int const row = m_block / p.tiles_per_row;
        auto warm = [](void const *address) { asm volatile("prefetch.global.L1 [%0];" :: "l"(address)); };
        auto warm_list = [&](int const *cnt, int const *idx, SparseListLayout const &l) {
            if (cnt == nullptr || idx == nullptr) { return; }
            warm(cnt + batched_cnt_offset(l, bidb, head, row));
            int const last_byte = min(l.idx_capacity * int(sizeof(int)), kPrefetchBytes) - 1;
            if (last_byte < 0) { return; }
            char const *row_start = reinterpret_cast<char const *>(idx + batched_idx_offset(l, bidb, head, row));
            warm(row_start);
            warm(row_start + last_byte);
        };
        warm_list(p.full_cnt, p.full_idx, p.full);
        warm_list(p.mask_cnt, p.mask_idx, p.mask);
    }

    // The listed id, possibly out of range.
    CUTLASS_DEVICE int raw_block(int const entry) const {
        return entry < num_full ? full_idx[entry] : mask_idx[entry - num_full];
    }
    CUTLASS_DEVICE bool is_mask(int const entry) const { return entry >= num_full; }
    CUTLASS_DEVICE bool is_valid(int const block) const { return block >= 0 && block < n_blocks_k; }
    // Whether a listed id needs the sequence-end mask: out of range (masked out, i.e. skipped) or
    // the partial last block.
    CUTLASS_DEVICE bool reaches_end(int const block) const {
        return !is_valid(block) || (tail_keys < kSparseBlockSize && block == n_blocks_k - 1);
    }
    // Keys of the listed block inside the sequence: the rows of its loaded V that P·V may read
    // (none for an out-of-range id).
    CUTLASS_DEVICE int keys_in(int const block) const {
        return !is_valid(block) ? 0 : block == n_blocks_k - 1 ? tail_keys : kSparseBlockSize;
    }
    // One vote of the calling warp: whether any entry in [first, last] names a block that reaches
    // the sequence end. Lane i reads entries first + i, first + i + 32, ...
    CUTLASS_DEVICE bool any_reaches_end(int const first, int const last) const {
        bool reaches = false;
        for (int entry = first + int(threadIdx.x % 32); entry <= last; entry += 32) {
            reaches |= reaches_end(raw_block(entry));
        }
        return __any_sync(0xffffffff, reaches);
    }
    // Key-block coordinate for the TMA loads: always inside the sequence (or block 0 of an
    // empty one, which TMA bounds-checks and the mask hides).
    CUTLASS_DEVICE int load_block(int const entry) const {
        return max(0, min(raw_block(entry), n_blocks_k - 1));
    }

    // The split's entry range [begin, end), an even share of the entries by count; split_idx
    // carries the dynamic split count in its top 16 bits as in BlockMN::get_n_block_min_max.
    template <bool Split>
    CUTLASS_DEVICE cute::tuple<int, int> entry_range(int const split_idx, int const num_splits) const {
        if constexpr (!Split) {
            return {0, num_entries};
        } else {
            int const num_splits_dynamic = int(uint32_t(split_idx) >> 16);
            int const splits = num_splits_dynamic > 0 ? num_splits_dynamic : num_splits;
            int const per_split = cute::ceil_div(num_entries, splits);
            int const begin = (split_idx & 0xFFFF) * per_split;
            return {begin, min(begin + per_split, num_entries)};
        }
    }
};

}  // namespace flash
