/******************************************************************************
 * The host's choice of sparse kernel for a call (flash_api_sparse.cpp): packing, split count and
 * tile rows from the call's shapes alone, and the refusal of what the build compiled out
 * (FLASHATTENTION_DISABLE_*), before any kernel runs. Plain C++ without torch or CUDA, so that a
 * CPU test compiles it under each build flag (tests/backends/test_sparse_kernel_choice.py).
 ******************************************************************************/

#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "sparse_params.h"

struct SparseCallShape {
    int batch_size = 0, num_heads = 0, num_heads_k = 0;
    int table_heads = 0;      // the lists' head extent: 1, num_heads_k or num_heads
    int seqlen_q = 0;         // the longest sequence's under varlen
    int q_block_size = 0;     // query rows per list row
    int head_dim = 0;
    bool fp16 = false;        // else bf16, or e4m3 where fp8
    bool fp8 = false;         // e4m3 q, k and v
    bool varlen = false;
    int max_list_blocks = 0;  // a bound on any tile's list length (from shapes)
    int num_sm = 0;
    int num_splits = 0;       // requested; <= 0: chosen here
    int pack_gqa = -1;        // requested: 1 on, 0 off, -1 chosen here
    bool paged_cpasync = false;  // paged K/V in pages that do not hold whole 128-key blocks
};

struct SparseKernelChoice {
    std::string refusal;  // non-empty: the call is refused, and why
    bool pack = false;
    int num_splits = 1;
    int block_m = kSparseBlockM;
    int tiles_per_row = 1;  // or kOneListRow
};

constexpr int kSparseMaxSplits = 128;

// Splits when the tiles leave SMs idle: at most one split per two list blocks of the longest
// possible list (a bound from shapes, no host sync).
inline int sparse_auto_num_splits(int num_tiles, int num_sm, int max_list_blocks) {
    if (num_tiles >= num_sm) { return 1; }
    int const by_sms = num_sm / std::max(num_tiles, 1);
    return std::max(1, std::min({by_sms, max_list_blocks / 2, kSparseMaxSplits}));
}

// The FLASH_ATTENTION_DISABLE_* flags (their suffixes) this build was compiled with that the
// sparse path reads, for callers that route around what is missing (flash_attn_3._C.sparse_disabled).
inline std::vector<std::string> sparse_build_disabled() {
    std::vector<std::string> disabled;
#ifdef FLASHATTENTION_DISABLE_VARLEN
    disabled.push_back("VARLEN");
#endif
#ifdef FLASHATTENTION_DISABLE_PACKGQA
    disabled.push_back("PACKGQA");
#endif
#ifdef FLASHATTENTION_DISABLE_SPLIT
    disabled.push_back("SPLIT");
#endif
#ifdef FLASHATTENTION_DISABLE_HDIM64
    disabled.push_back("HDIM64");
#endif
#ifdef FLASHATTENTION_DISABLE_HDIM128
    disabled.push_back("HDIM128");
#endif
#ifdef FLASHATTENTION_DISABLE_FP16
    disabled.push_back("FP16");
#endif
#ifdef FLASHATTENTION_DISABLE_FP8
    disabled.push_back("FP8");
#endif
#ifdef FLASHATTENTION_DISABLE_PAGEDKV
    disabled.push_back("PAGEDKV");
#endif
    return disabled;
}

// What this build compiled out that the call needs, or "".
inline std::string sparse_build_refusal(SparseCallShape const &s) {
    std::string const build = "this flash_attn_3 build (FLASH_ATTENTION_DISABLE_";
#ifdef FLASHATTENTION_DISABLE_VARLEN
    if (s.varlen) { return build + "VARLEN) has no varlen kernels"; }
#endif
#ifdef FLASHATTENTION_DISABLE_FP16
    if (s.fp16) { return build + "FP16) has no fp16 kernels"; }
#endif
#ifdef FLASHATTENTION_DISABLE_FP8
    if (s.fp8) { return build + "FP8) has no FP8 kernels: build with FLASH_ATTN_SPARSE_FP8=1"; }
#endif
#ifdef FLASHATTENTION_DISABLE_HDIM64
    if (s.head_dim == 64) { return build + "HDIM64) has no head dim 64 kernels"; }
#endif
#ifdef FLASHATTENTION_DISABLE_HDIM128
    if (s.head_dim == 128) { return build + "HDIM128) has no head dim 128 kernels"; }
#endif
#ifdef FLASHATTENTION_DISABLE_PAGEDKV
    if (s.paged_cpasync) { return build + "PAGEDKV) has no kernels for pages of other than a multiple of 128 keys"; }
#endif
#ifdef FLASHATTENTION_DISABLE_PACKGQA
    if (s.pack_gqa == 1) { return build + "PACKGQA) has no PackGQA kernels: pass pack_gqa=False or None"; }
    if (s.paged_cpasync) { return build + "PACKGQA) has no kernels for pages of other than a multiple of 128 keys (they pack)"; }
#endif
#ifdef FLASHATTENTION_DISABLE_SPLIT
    if (s.num_splits > 1) { return build + "SPLIT) has no split-KV kernels: pass num_splits=1 or 0"; }
#endif
    (void)s;
    return "";
}

inline SparseKernelChoice choose_sparse_kernel(SparseCallShape const &s) {
    SparseKernelChoice c;
    c.refusal = sparse_build_refusal(s);
    if (!c.refusal.empty()) { return c; }
#ifdef FLASHATTENTION_DISABLE_PACKGQA
    bool const packgqa_built = false;
#else
    bool const packgqa_built = true;
#endif
#ifdef FLASHATTENTION_DISABLE_SPLIT
    bool const split_built = false;
#else
    bool const split_built = true;
#endif
    // Under PackGQA, packed row r of a sequence is query r / group of head r % group (upstream's
    // layout, any group). A tile must not straddle two list rows, since it reads one list: so
    // either one list row covers every query, or a list row's packed rows fill whole 128-row tiles
    // (and so whole 64-row ones).
    static_assert(kSparseBlockM % kSparseBlockMDecode == 0, "list rows that fill 128-row tiles must fill 64-row ones");
    int const group = s.num_heads / s.num_heads_k;
    bool const one_list_row = s.q_block_size >= s.seqlen_q;
    bool const lists_shared_by_group = s.table_heads != s.num_heads || group == 1;
    bool const packed_rows_fill_tiles = one_list_row || (int64_t(s.q_block_size) * group) % kSparseBlockM == 0;
    bool const packable = packgqa_built && lists_shared_by_group && packed_rows_fill_tiles && s.pack_gqa != 0;
    if (s.pack_gqa == 1 && group > 1 && !packable) {
        c.refusal = "pack_gqa needs shared or per-K/V-head lists, and one list row for all queries or q_block_size * group a multiple of "
                    + std::to_string(kSparseBlockM);
        return c;
    }
    // cp.async paged kernels are instantiated packed only (as upstream's): a group of 1 packs too.
    if (s.paged_cpasync && !packable) {
        c.refusal = "pages of other than a multiple of " + std::to_string(kSparseBlockSize)
                    + " keys need packed tiles: shared or per-K/V-head lists, one list row for all queries or q_block_size * group "
                      "a multiple of " + std::to_string(kSparseBlockM) + ", and pack_gqa not False";
        return c;
    }
    c.pack = packable && (group > 1 || s.paged_cpasync);
    if (!(s.q_block_size > 0 && (one_list_row || c.pack || s.q_block_size % kSparseBlockM == 0))) {
        c.refusal = "q_block_size must be a positive multiple of " + std::to_string(kSparseBlockM)
                    + " here (or cover every query row)";
        return c;
    }
    int const tile_heads = c.pack ? s.num_heads_k : s.num_heads;
    int64_t const packed_rows = int64_t(s.seqlen_q) * (c.pack ? group : 1);
    int64_t const tiles = int64_t(s.batch_size) * tile_heads * ((packed_rows + kSparseBlockM - 1) / kSparseBlockM);
    int const tiles_capped = int(std::min<int64_t>(tiles, s.num_sm));
    c.num_splits = s.num_splits > 0 ? std::min(s.num_splits, kSparseMaxSplits)
                 : split_built ? sparse_auto_num_splits(tiles_capped, s.num_sm, s.max_list_blocks) : 1;
    // A split call of one query head per K/V head packs too (packing a group of 1 moves no row),
    // for the packed split kernel's 64-row tile when its rows fit; upstream packs every split
    // call likewise.
    if (c.num_splits > 1 && packable && group == 1 && s.seqlen_q <= kSparseBlockMDecode) { c.pack = true; }
    c.block_m = c.pack && c.num_splits > 1 && packed_rows <= kSparseBlockMDecode ? kSparseBlockMDecode : kSparseBlockM;
    c.tiles_per_row = one_list_row ? kOneListRow : int(int64_t(s.q_block_size) * (c.pack ? group : 1) / c.block_m);
    return c;
}
