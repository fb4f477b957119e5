/******************************************************************************
 * Host code of the sparse block-list forward and of the (O, LSE) combine
 * (stage 5 of the sparse patch set).
 *
 * The Python layer (flash_attn_sparse) validates the block lists and picks num_splits; this file
 * checks what the kernels rely on for memory safety and fills Flash_fwd_params.
 ******************************************************************************/

#include <algorithm>
#include <limits>
#include <utility>

#include <torch/python.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cutlass/numeric_types.h>

#include "namespace_config.h"
#include "hardware_info.h"
#include "flash.h"
#include "flash_sparse.h"
#include "flash_api_sparse.h"
#include "planned_kernel_graph.h"
#include "static_switch.h"

#define CHECK_DEVICE(x) TORCH_CHECK(x.is_cuda(), #x " must be on CUDA")
#define CHECK_SHAPE(x, ...) TORCH_CHECK(x.sizes() == torch::IntArrayRef({__VA_ARGS__}), #x " must have shape (" #__VA_ARGS__ ")")
#define CHECK_CONTIGUOUS(x) TORCH_CHECK(x.is_contiguous(), #x " must be contiguous")

namespace FLASH_NAMESPACE {

// Defined in flash_api.cpp.
void set_params_fprop(Flash_fwd_params &params,
                      const size_t b, const size_t seqlen_q, const size_t seqlen_k,
                      const size_t seqlen_q_rounded, const size_t seqlen_k_rounded,
                      const size_t h, const size_t h_k, const size_t d, const size_t d_rounded,
                      const at::Tensor q, const at::Tensor k, const at::Tensor v, at::Tensor out,
                      void *cu_seqlens_q_d, void *cu_seqlens_k_d, void *seqused_k, void *p_d,
                      void *softmax_lse_d, float p_dropout, float softmax_scale,
                      int window_size_left, int window_size_right, const float softcap,
                      bool seqlenq_ngroups_swapped, const bool unpadded_lse);

// HEADDIM_SWITCH's head dims that this build compiled (see static_switch.h, patch 0001).
std::tuple<std::vector<int64_t>, bool> sparse_head_dims() {
    std::vector<int64_t> head_dims;
#ifndef FLASHATTENTION_DISABLE_HDIM32
    head_dims.push_back(32);
#endif
#ifndef FLASHATTENTION_DISABLE_HDIM64
    head_dims.push_back(64);
#endif
#ifndef FLASHATTENTION_DISABLE_HDIM96
    head_dims.push_back(96);
#endif
#ifndef FLASHATTENTION_DISABLE_HDIM128
    head_dims.push_back(128);
#endif
#ifndef FLASHATTENTION_DISABLE_HDIM192
    head_dims.push_back(192);
#endif
#ifndef FLASHATTENTION_DISABLE_HDIM256
    head_dims.push_back(256);
#endif
#ifdef FLASHATTENTION_DISABLE_UNEVEN_K
    return {head_dims, false};
#else
    return {head_dims, true};
#endif
}

namespace {

int round_multiple(int x, int m) { return (x + m - 1) / m * m; }

int head_size_rounded(int head_size) { return round_multiple(head_size, head_size <= 128 ? 32 : 64); }

void check_int32_table(const at::Tensor &t, const char *name, const at::Tensor &q) {
    TORCH_CHECK(t.dtype() == torch::kInt32, name, " must have dtype int32");
    TORCH_CHECK(t.device() == q.device(), name, " must be on the same device as q");
    TORCH_CHECK(t.stride(-1) == 1, name, " must have a contiguous last dimension");
}

// A build with FLASHATTENTION_DISABLE_UNEVEN_K (the dev profile) has only the kernels that read
// and write whole rows of their head dimension: any other head dim would run past each row.
// Python checks sparse_head_dims() first (a clear SparseInputError); this is the backstop.
void check_head_dim_has_kernel(const int head_size) {
    const auto [head_dims, uneven] = sparse_head_dims();
    const bool compiled = std::find(head_dims.begin(), head_dims.end(), head_size) != head_dims.end();
    TORCH_CHECK(compiled || uneven,
                "this build has no kernels for uneven head dimensions (FLASHATTENTION_DISABLE_UNEVEN_K): "
                "the head dimension must be one this build compiled, got ", head_size);
}

void run_sparse(Flash_fwd_params &params, cudaStream_t stream, bool wide, bool split) {
    FP16_SWITCH(!params.is_bf16, [&] {
        HEADDIM_SWITCH(params.d, [&] {
            if (wide) {
                run_mha_fwd_sparse_<elem_type, kHeadDim>(params, stream);
            } else {
                run_mha_fwd_sparse_narrow_<elem_type, kHeadDim>(params, stream, split);
            }
        });
    });
}

void run_combine(Flash_fwd_params &params, cudaStream_t stream) {
    FP16_SWITCH(!params.is_bf16, [&] {
        HEADDIM_SWITCH(params.d, [&] {
            run_mha_combine_<elem_type, kHeadDim>(params, stream);
        });
    });
}

}  // namespace

// Checks every argument, fills the parameters and allocates out (when not given), LSE and the
// split buffers; launch_sparse runs it. Shared by mha_fwd_sparse (one call) and SparseForward
// (made once, run many times).
static SparseLaunch prepare_sparse(
    const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
    std::optional<at::Tensor> out_,
    const at::Tensor &full_cnt, const at::Tensor &full_idx,
    std::optional<at::Tensor> mask_cnt_, std::optional<at::Tensor> mask_idx_,
    std::optional<at::Tensor> cu_seqlens_q_, std::optional<at::Tensor> cu_seqlens_k_,
    std::optional<at::Tensor> seqused_k_, std::optional<at::Tensor> page_table_,
    std::optional<at::Tensor> cu_total_m_blocks_, std::optional<at::Tensor> cu_block_idx_offsets_,
    int max_seqlen_q, int max_seqlen_k,
    int block_size, int q_block_size,
    double softmax_scale, bool is_causal, int num_splits, bool pack_gqa,
    std::optional<at::Tensor> out_partial_, std::optional<at::Tensor> lse_partial_, int partial_offset,
    std::optional<at::Tensor> k_mask_source_, std::optional<at::Tensor> v_mask_source_) {

    at::cuda::CUDAGuard device_guard{q.device()};
    auto [cc_major, cc_minor] = get_compute_capability(get_current_device());
    TORCH_CHECK(cc_major >= 8, "FlashAttention only supports Ampere GPUs or newer.");

    const auto q_dtype = q.dtype();
    TORCH_CHECK(q_dtype == torch::kFloat16 || q_dtype == torch::kBFloat16, "FlashAttention only support fp16 and bf16 data type");
    TORCH_CHECK(k.dtype() == q_dtype && v.dtype() == q_dtype, "q, k and v must have the same dtype");
    CHECK_DEVICE(q); CHECK_DEVICE(k); CHECK_DEVICE(v);
    TORCH_CHECK(q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1, "q, k and v must have a contiguous last dimension");

    const bool varlen = cu_seqlens_q_.has_value();
    TORCH_CHECK(varlen == cu_seqlens_k_.has_value(), "cu_seqlens_q and cu_seqlens_k go together");
    TORCH_CHECK(varlen == cu_total_m_blocks_.has_value() && varlen == cu_block_idx_offsets_.has_value(),
                "varlen inputs need the varlen list layout (cu_total_m_blocks, cu_block_idx_offsets) and vice versa");
    const bool paged = page_table_.has_value();
    const int batch_size = varlen ? cu_seqlens_q_->numel() - 1 : q.size(0);
    const int seqlen_q = varlen ? max_seqlen_q : q.size(1);
    const int page_size = paged ? k.size(1) : 0;
    const int64_t paged_seqlen_k = paged ? page_table_->size(-1) * int64_t(page_size) : 0;
    TORCH_CHECK(paged_seqlen_k <= std::numeric_limits<int>::max(), "page_table: max_pages * page_size must fit in int32");
    TORCH_CHECK(!(varlen && paged) || max_seqlen_k <= paged_seqlen_k, "max_seqlen_k must be at most max_pages * page_size with a page_table");
    // Varlen + paged: params.seqlen_k is the page table's capacity, which the kernel clamps every
    // sequence's key count to (cu_seqlens_k is not read on the host, so it is not trusted).
    const int seqlen_k = paged ? int(paged_seqlen_k) : (varlen ? max_seqlen_k : k.size(1));
    const int num_heads = q.size(-2);
    const int head_size = q.size(-1);
    const int num_heads_k = k.size(-2);
    const int total_q = varlen ? q.size(0) : batch_size * seqlen_q;
    TORCH_CHECK(batch_size > 0, "batch size must be positive");
    TORCH_CHECK(head_size <= 256 && head_size % 8 == 0, "head dimension must be a multiple of 8, at most 256");
    check_head_dim_has_kernel(head_size);
    TORCH_CHECK(num_heads % num_heads_k == 0, "Number of heads in key/value must divide number of heads in query");
    if (varlen) {
        CHECK_SHAPE(q, total_q, num_heads, head_size);
        TORCH_CHECK(paged || (k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == num_heads_k && k.size(2) == head_size),
                    "k and v must be total_k x num_heads_k x head_size");
        for (const auto &t : {*cu_seqlens_q_, *cu_seqlens_k_, *cu_total_m_blocks_, *cu_block_idx_offsets_}) {
            check_int32_table(t, "cu_seqlens / varlen list offsets", q);
            TORCH_CHECK(t.numel() == batch_size + 1, "cu_seqlens and varlen list offsets must have batch_size + 1 entries");
        }
    } else {
        TORCH_CHECK(q.dim() == 4, "q must be batch x seqlen_q x num_heads x head_size");
    }
    if (paged) {
        const at::Tensor &page_table = *page_table_;
        TORCH_CHECK(page_table.dtype() == torch::kInt32, "page_table must have dtype int32");
        TORCH_CHECK(page_table.device() == q.device(), "page_table must be on the same device as q");
        TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == batch_size, "page_table must be batch_size x max_pages_per_seq");
        TORCH_CHECK(page_table.size(1) == 0 || page_table.stride(1) == 1, "page_table must have a contiguous last dimension");
        TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.size(2) == num_heads_k && k.size(3) == head_size,
                    "paged k and v must be num_pages x page_size x num_heads_k x head_size");
        TORCH_CHECK(page_size > 0 && page_size % 16 == 0 && block_size > 0 && (page_size % block_size == 0 || block_size % page_size == 0),
                    "page size must be a multiple of 16 that divides block_size or is a multiple of it");
        // The kernel places a key at (page * rows_per_page + row) * row_stride, for K and V alike.
        const int64_t rows_per_page = k.stride(1) > 0 ? k.stride(0) / k.stride(1) : 0;
        TORCH_CHECK(rows_per_page >= page_size && k.stride(0) == rows_per_page * k.stride(1)
                    && v.stride(0) == rows_per_page * v.stride(1),
                    "paged k and v: the page stride must be the same multiple of the row stride for both");
        TORCH_CHECK((k.size(0) - 1) * rows_per_page + page_size <= std::numeric_limits<int>::max(),
                    "paged k and v: the cache must span fewer than 2^31 rows");
    } else if (!varlen) {
        CHECK_SHAPE(k, batch_size, seqlen_k, num_heads_k, head_size);
        CHECK_SHAPE(v, batch_size, seqlen_k, num_heads_k, head_size);
    }
    if (seqused_k_.has_value()) {
        check_int32_table(*seqused_k_, "seqused_k", q);
        CHECK_SHAPE((*seqused_k_), batch_size);
    }

    // Lists. The kernel clamps counts to the row capacity and skips out-of-range entries, so
    // nothing here needs to read them.
    check_int32_table(full_cnt, "full_cnt", q);
    check_int32_table(full_idx, "full_idx", q);
    TORCH_CHECK(mask_cnt_.has_value() == mask_idx_.has_value(), "mask_cnt and mask_idx go together");
    if (mask_cnt_.has_value()) {
        check_int32_table(*mask_cnt_, "mask_cnt", q);
        check_int32_table(*mask_idx_, "mask_idx", q);
        if (varlen) {
            TORCH_CHECK(mask_cnt_->sizes() == full_cnt.sizes() && mask_cnt_->strides() == full_cnt.strides(), "varlen lists: mask_cnt must have the shape and strides of full_cnt");
            TORCH_CHECK(mask_idx_->sizes() == full_idx.sizes() && mask_idx_->strides() == full_idx.strides(), "varlen lists: mask_idx must have the shape and strides of full_idx");
        } else {
            // Batched: the mask lists keep their own strides and capacity (a shared list is a view).
            TORCH_CHECK(mask_cnt_->sizes() == full_cnt.sizes(), "mask_cnt must have the shape of full_cnt");
            TORCH_CHECK(mask_idx_->dim() == 4 && mask_idx_->sizes().slice(0, 3) == full_idx.sizes().slice(0, 3),
                        "mask_idx must have full_idx's batch, head and m_blocks extents");
        }
    }
    const bool mask_source = k_mask_source_.has_value();
    TORCH_CHECK(mask_source == v_mask_source_.has_value(), "k_mask_source and v_mask_source go together");
    if (mask_source) {
        const at::Tensor &k2 = *k_mask_source_, &v2 = *v_mask_source_;
        TORCH_CHECK(!varlen && !paged, "a mask-block K/V source needs batched, unpaged k and v");
        TORCH_CHECK(mask_cnt_.has_value(), "a mask-block K/V source needs mask lists");
        TORCH_CHECK(k2.dtype() == q_dtype && v2.dtype() == q_dtype, "k_mask_source and v_mask_source must have the dtype of q");
        CHECK_DEVICE(k2); CHECK_DEVICE(v2);
        TORCH_CHECK(k2.dim() == 4 && v2.sizes() == k2.sizes() && k2.size(0) == batch_size && k2.size(2) == num_heads_k && k2.size(3) == head_size,
                    "k_mask_source and v_mask_source must be batch x seqlen x num_heads_k x head_size");
        TORCH_CHECK(k2.size(1) > 0, "k_mask_source must hold keys");
        // The kernel reaches the source from k's and v's row offsets, and copies a tile from one source.
        TORCH_CHECK(k2.stride(1) == k.stride(1) && k2.stride(2) == k.stride(2) && k2.stride(3) == 1
                    && v2.stride(1) == v.stride(1) && v2.stride(2) == v.stride(2) && v2.stride(3) == 1,
                    "k_mask_source and v_mask_source must have the row and head strides of k and v");
        TORCH_CHECK(block_size >= sparse_max_tile_keys(head_size), "a mask-block K/V source needs block_size >= ",
                    sparse_max_tile_keys(head_size), " (the kernel tile) at head dim ", head_size);
    }
    TORCH_CHECK(block_size >= 16 && block_size <= 256 && (block_size & (block_size - 1)) == 0, "block_size must be 16, 32, 64, 128 or 256");
    TORCH_CHECK(q_block_size > 0 && q_block_size % kSparseNarrowBlockM == 0, "q_block_size must be a positive multiple of 64");
    const int num_table_heads = varlen ? full_cnt.size(0) : full_cnt.size(1);
    TORCH_CHECK(num_table_heads == 1 || num_table_heads == num_heads_k || num_table_heads == num_heads,
                "the lists' head extent must be 1, num_heads_k or num_heads");
    if (varlen) {
        TORCH_CHECK(full_cnt.dim() == 2 && full_idx.dim() == 2 && full_idx.size(0) == num_table_heads, "varlen lists: cnt is (heads, total_m_blocks), idx is (heads, total_n_blocks)");
    } else {
        TORCH_CHECK(full_cnt.dim() == 3 && full_idx.dim() == 4, "batched lists: cnt is (batch, heads, m_blocks), idx is (batch, heads, m_blocks, n)");
        TORCH_CHECK(full_cnt.size(0) == batch_size && full_idx.size(0) == batch_size && full_idx.size(1) == num_table_heads
                    && full_idx.size(2) == full_cnt.size(2), "the lists' batch, head and m_blocks extents must agree with each other and with q");
        TORCH_CHECK(full_cnt.size(2) >= (seqlen_q + q_block_size - 1) / q_block_size, "the lists need one row per query tile: m_blocks >= ceil(seqlen_q / q_block_size)");
    }

    at::Tensor out = out_.has_value() ? *out_ : torch::empty_like(q);
    TORCH_CHECK(out.sizes() == q.sizes() && out.dtype() == q_dtype && out.stride(-1) == 1 && out.device() == q.device(),
                "out must be like q with a contiguous last dimension");
    auto opts = q.options();
    at::Tensor softmax_lse = varlen ? torch::empty({num_heads, total_q}, opts.dtype(at::kFloat))
                                    : torch::empty({batch_size, num_heads, seqlen_q}, opts.dtype(at::kFloat));

    const int d_rounded = head_size_rounded(head_size);
    Flash_fwd_params params;
    set_params_fprop(params, batch_size, seqlen_q, seqlen_k, round_multiple(seqlen_q, 128), round_multiple(seqlen_k, 128),
                     num_heads, num_heads_k, head_size, d_rounded, q, k, v, out,
                     varlen ? cu_seqlens_q_->data_ptr() : nullptr, varlen ? cu_seqlens_k_->data_ptr() : nullptr,
                     seqused_k_.has_value() ? seqused_k_->data_ptr() : nullptr,
                     /*p_d=*/nullptr, softmax_lse.data_ptr(), /*p_dropout=*/0.f, float(softmax_scale),
                     /*window_size_left=*/-1, /*window_size_right=*/-1, /*softcap=*/0.f,
                     /*seqlenq_ngroups_swapped=*/false, /*unpadded_lse=*/varlen);
    if (paged) {
        // The page stride (set_params_fprop leaves the batch strides unset for varlen calls).
        params.k_batch_stride = k.stride(0);
        params.v_batch_stride = v.stride(0);
        params.block_table = page_table_->data_ptr<int>();
        params.block_table_batch_stride = page_table_->stride(0);
        params.page_block_size = page_size;
        params.sparse_num_pages = k.size(0);
    }
    // Causality applies to "mask" blocks only; the window fields stay those of a non-causal call.
    params.is_causal = is_causal;
    params.total_q = total_q;

    params.sparse_full_cnt = full_cnt.data_ptr<int>();
    params.sparse_full_idx = full_idx.data_ptr<int>();
    params.sparse_mask_cnt = mask_cnt_.has_value() ? mask_cnt_->data_ptr<int>() : nullptr;
    params.sparse_mask_idx = mask_idx_.has_value() ? mask_idx_->data_ptr<int>() : nullptr;
    if (mask_source) {
        // Address differences in elements: the kernel adds them to k's and v's row offsets.
        const auto element_shift = [](const at::Tensor &to, const at::Tensor &from) {
            const int64_t bytes = reinterpret_cast<int64_t>(to.data_ptr()) - reinterpret_cast<int64_t>(from.data_ptr());
            TORCH_CHECK(bytes % int64_t(from.element_size()) == 0, "k/v and their mask-block source must be element-aligned to each other");
            return bytes / int64_t(from.element_size());
        };
        params.sparse_mask_k_shift = element_shift(*k_mask_source_, k);
        params.sparse_mask_v_shift = element_shift(*v_mask_source_, v);
        params.sparse_mask_k_batch_shift = k_mask_source_->stride(0) - k.stride(0);
        params.sparse_mask_v_batch_shift = v_mask_source_->stride(0) - v.stride(0);
        params.sparse_mask_seqlen_k = k_mask_source_->size(1);
    }
    if (varlen) {
        params.sparse_cnt_head_stride = full_cnt.stride(0);
        params.sparse_idx_head_stride = full_idx.stride(0);
        params.sparse_cu_total_m_blocks = cu_total_m_blocks_->data_ptr<int>();
        params.sparse_cu_block_idx_offsets = cu_block_idx_offsets_->data_ptr<int>();
    } else {
        params.sparse_cnt_batch_stride = full_cnt.stride(0);
        params.sparse_cnt_head_stride = full_cnt.stride(1);
        TORCH_CHECK(full_cnt.stride(2) == 1, "full_cnt must have a contiguous last dimension");
        params.sparse_idx_batch_stride = full_idx.stride(0);
        params.sparse_idx_head_stride = full_idx.stride(1);
        params.sparse_idx_row_stride = full_idx.stride(2);
        params.sparse_idx_capacity = full_idx.size(3);
        if (mask_cnt_.has_value()) {
            params.sparse_mask_cnt_batch_stride = mask_cnt_->stride(0);
            params.sparse_mask_cnt_head_stride = mask_cnt_->stride(1);
            params.sparse_mask_cnt_row_stride = mask_cnt_->stride(2);
            params.sparse_mask_idx_batch_stride = mask_idx_->stride(0);
            params.sparse_mask_idx_head_stride = mask_idx_->stride(1);
            params.sparse_mask_idx_row_stride = mask_idx_->stride(2);
            params.sparse_mask_idx_capacity = mask_idx_->size(3);
        }
    }
    params.sparse_head_ratio = num_heads / num_table_heads;
    params.sparse_block_size = block_size;
    params.sparse_block_size_log2 = __builtin_ctz(block_size);
    params.sparse_q_block_size = q_block_size;
    // Packing puts h / h_k query heads in a tile (packed row r: query r / group, head r % group,
    // any group); they must share their lists, and a tile reads one list row, so either one row
    // covers every query or a row's packed rows fill whole 64-row tiles (and so 16-row ones).
    const int group = pack_gqa ? num_heads / num_heads_k : 1;
    TORCH_CHECK(!pack_gqa || num_table_heads != num_heads || num_heads == num_heads_k,
                "pack_gqa needs lists shared by all heads or per K/V head");
    TORCH_CHECK(q_block_size >= seqlen_q || (int64_t(q_block_size) * group) % kSparseNarrowBlockM == 0,
                "pack_gqa needs one list row for all queries or q_block_size * (h / h_k) a multiple of ", kSparseNarrowBlockM);
    params.sparse_pack_gqa = group;

    TORCH_CHECK(num_splits >= 1 && num_splits <= 128, "num_splits must be in [1, 128]");
    params.num_splits = num_splits;
    const bool partial = out_partial_.has_value();
    TORCH_CHECK(partial == lse_partial_.has_value(), "out_partial and lse_partial go together");
    at::Tensor out_accum, lse_accum;
    if (partial) {
        out_accum = *out_partial_;
        lse_accum = *lse_partial_;
        const int num_slots = out_accum.size(0);
        TORCH_CHECK(out_accum.dtype() == at::kFloat && lse_accum.dtype() == at::kFloat, "partials must be float32");
        TORCH_CHECK(out_accum.device() == q.device() && lse_accum.device() == q.device(), "partials must be on the device of q");
        CHECK_CONTIGUOUS(out_accum); CHECK_CONTIGUOUS(lse_accum);
        CHECK_SHAPE(out_accum, num_slots, batch_size, num_heads, seqlen_q, d_rounded);
        CHECK_SHAPE(lse_accum, num_slots, batch_size, num_heads, seqlen_q);
        TORCH_CHECK(partial_offset >= 0 && partial_offset + num_splits <= num_slots, "partial slots [offset, offset + num_splits) must fit in out_partial");
        params.sparse_split_offset = partial_offset;
        params.sparse_num_slots = num_slots;
    }
    // Few splits on sm_90+ merge inside a thread-block cluster: no partials, no combine.
    const bool cluster_merge = !partial && sparse_cluster_merge(params);
    if (!partial && num_splits > 1 && !cluster_merge) {
        out_accum = torch::empty({num_splits, batch_size, num_heads, seqlen_q, d_rounded}, opts.dtype(at::kFloat));
        lse_accum = torch::empty({num_splits, batch_size, num_heads, seqlen_q}, opts.dtype(at::kFloat));
        params.sparse_num_slots = num_splits;
    }
    if (out_accum.defined()) {
        params.oaccum_ptr = out_accum.data_ptr();
        params.softmax_lseaccum_ptr = lse_accum.data_ptr();
    }

    SparseLaunch launch;
    launch.split = out_accum.defined() || cluster_merge;
    // 128-row tiles suit long queries; 64-row tiles waste less on short ones, and split.
    launch.wide = !launch.split && !pack_gqa && seqlen_q > kSparseNarrowBlockM && q_block_size % kSparseWideBlockM == 0;
    launch.partial = partial;
    launch.empty = q.numel() == 0;
    launch.params = params;
    launch.out = out;
    launch.softmax_lse = softmax_lse;
    launch.out_accum = out_accum;
    launch.lse_accum = lse_accum;
    return launch;
}

static void launch_kernels(SparseLaunch &launch, cudaStream_t stream) {
    run_sparse(launch.params, stream, launch.wide, launch.split);
    if (!launch.partial && launch.out_accum.defined()) { run_combine(launch.params, stream); }
}

static void launch_sparse(SparseLaunch &launch) {
    if (launch.empty) { return; }
    launch_kernels(launch, at::cuda::getCurrentCUDAStream().stream());
}

std::vector<at::Tensor> mha_fwd_sparse(
    const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
    std::optional<at::Tensor> out_,
    const at::Tensor &full_cnt, const at::Tensor &full_idx,
    std::optional<at::Tensor> mask_cnt_, std::optional<at::Tensor> mask_idx_,
    std::optional<at::Tensor> cu_seqlens_q_, std::optional<at::Tensor> cu_seqlens_k_,
    std::optional<at::Tensor> seqused_k_, std::optional<at::Tensor> page_table_,
    std::optional<at::Tensor> cu_total_m_blocks_, std::optional<at::Tensor> cu_block_idx_offsets_,
    int max_seqlen_q, int max_seqlen_k,
    int block_size, int q_block_size,
    double softmax_scale, bool is_causal, int num_splits, bool pack_gqa,
    std::optional<at::Tensor> out_partial_, std::optional<at::Tensor> lse_partial_, int partial_offset,
    std::optional<at::Tensor> k_mask_source_, std::optional<at::Tensor> v_mask_source_) {
    at::cuda::CUDAGuard device_guard{q.device()};
    SparseLaunch launch = prepare_sparse(q, k, v, out_, full_cnt, full_idx, mask_cnt_, mask_idx_, cu_seqlens_q_, cu_seqlens_k_,
                                         seqused_k_, page_table_, cu_total_m_blocks_, cu_block_idx_offsets_, max_seqlen_q,
                                         max_seqlen_k, block_size, q_block_size, softmax_scale, is_causal, num_splits, pack_gqa,
                                         out_partial_, lse_partial_, partial_offset, k_mask_source_, v_mask_source_);
    launch_sparse(launch);
    if (launch.partial) { return {launch.out_accum, launch.lse_accum}; }
    return {launch.out, launch.softmax_lse};
}

SparseForward::SparseForward(
    const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, at::Tensor out,
    const at::Tensor &full_cnt, const at::Tensor &full_idx,
    std::optional<at::Tensor> mask_cnt, std::optional<at::Tensor> mask_idx,
    std::optional<at::Tensor> cu_seqlens_q, std::optional<at::Tensor> cu_seqlens_k,
    std::optional<at::Tensor> seqused_k, std::optional<at::Tensor> page_table,
    std::optional<at::Tensor> cu_total_m_blocks, std::optional<at::Tensor> cu_block_idx_offsets,
    int max_seqlen_q, int max_seqlen_k, int block_size, int q_block_size,
    double softmax_scale, bool is_causal, int num_splits, bool pack_gqa, bool graph_launch)
    : device_(q.device()), q_sizes_(q.sizes().vec()), q_strides_(q.strides().vec()), k_sizes_(k.sizes().vec()),
      k_strides_(k.strides().vec()), v_strides_(v.strides().vec()), out_strides_(out.strides().vec()), dtype_(q.scalar_type()) {
    at::cuda::CUDAGuard device_guard{q.device()};
    // The lists, offsets and page table are the caller's tensors, read at every run; no second
    // K/V source (its element shift depends on k's address) and no partials.
    launch_ = prepare_sparse(q, k, v, out, full_cnt, full_idx, mask_cnt, mask_idx, cu_seqlens_q, cu_seqlens_k, seqused_k,
                             page_table, cu_total_m_blocks, cu_block_idx_offsets, max_seqlen_q, max_seqlen_k, block_size,
                             q_block_size, softmax_scale, is_causal, num_splits, pack_gqa, std::nullopt, std::nullopt, 0,
                             std::nullopt, std::nullopt);
    lse_sizes_ = launch_.softmax_lse.sizes().vec();
    if (launch_.out_accum.defined()) {
        out_accum_numel_ = launch_.out_accum.numel();
        lse_accum_numel_ = launch_.lse_accum.numel();
    }
    const ListTensors lists{full_cnt, full_idx, mask_cnt, mask_idx, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
                            cu_total_m_blocks, cu_block_idx_offsets};
    for (size_t i = 0; i < lists.size(); ++i) {
        if (lists[i].has_value()) { list_layouts_[i] = {true, lists[i]->sizes().vec(), lists[i]->strides().vec()}; }
    }
    keep_alive(lists);
    graph_launch_ = graph_launch;
}

SparseForward::~SparseForward() = default;  // PlannedKernelGraph is complete here

void SparseForward::launch_planned(SparseLaunch &launch) {
    if (launch.empty) { return; }
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (graph_launch_) { C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing)); }
    if (!graph_launch_ || capturing != cudaStreamCaptureStatusNone) {
        launch_kernels(launch, stream);
        return;
    }
    if (graph_ == nullptr) {
        // The first eager run launches directly (setting the kernels' attributes outside any
        // capture), then captures the kernels for the runs after it.
        launch_kernels(launch, stream);
        graph_ = std::make_unique<PlannedKernelGraph>([&](cudaStream_t capture) { launch_kernels(launch, capture); });
        return;
    }
    // Every kernel (the forward and the combine) takes one argument, the parameters.
    graph_->set_argument(nullptr, &launch.params);
    graph_->launch(stream);
}

void SparseForward::check_planned(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &out,
                                  const char *what) const {
    // The parameters hold the planned strides: the tensors must be laid out as planned.
    TORCH_CHECK(q.scalar_type() == dtype_ && k.scalar_type() == dtype_ && v.scalar_type() == dtype_ && out.scalar_type() == dtype_,
                what, ": q, k, v and out must have the planned dtype");
    TORCH_CHECK(q.device() == device_ && k.device() == device_ && v.device() == device_ && out.device() == device_,
                what, ": q, k, v and out must be on the planned device");
    TORCH_CHECK(q.sizes() == at::IntArrayRef(q_sizes_) && q.strides() == at::IntArrayRef(q_strides_)
                && k.sizes() == at::IntArrayRef(k_sizes_) && v.sizes() == at::IntArrayRef(k_sizes_)
                && k.strides() == at::IntArrayRef(k_strides_) && v.strides() == at::IntArrayRef(v_strides_)
                && out.sizes() == at::IntArrayRef(q_sizes_) && out.strides() == at::IntArrayRef(out_strides_),
                what, ": q, k, v and out must have the planned shapes and strides");
}

bool SparseForward::has_layout(const std::optional<at::Tensor> &t, const Layout &planned) const {
    if (!t.has_value()) { return !planned.given; }
    return planned.given && t->scalar_type() == at::kInt && t->device() == device_
           && t->sizes() == at::IntArrayRef(planned.sizes) && t->strides() == at::IntArrayRef(planned.strides);
}

void SparseForward::keep_alive(const ListTensors &lists) {
    lists_.clear();
    for (const auto &t : lists) {
        if (t.has_value()) { lists_.push_back(*t); }
    }
}

at::Tensor SparseForward::run(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, at::Tensor out) {
    TORCH_CHECK(!released_, "SparseForward.run: its buffers were released (release_run_buffers); use run_with");
    check_planned(q, k, v, out, "SparseForward.run");
    at::cuda::CUDAGuard device_guard{device_};
    launch_.params.q_ptr = q.data_ptr();
    launch_.params.k_ptr = k.data_ptr();
    launch_.params.v_ptr = v.data_ptr();
    launch_.params.o_ptr = out.data_ptr();
    launch_.out = out;
    launch_planned(launch_);
    return launch_.softmax_lse;
}

at::Tensor SparseForward::run_with(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, at::Tensor out,
                                   const at::Tensor &full_cnt, const at::Tensor &full_idx,
                                   std::optional<at::Tensor> mask_cnt, std::optional<at::Tensor> mask_idx,
                                   std::optional<at::Tensor> cu_seqlens_q, std::optional<at::Tensor> cu_seqlens_k,
                                   std::optional<at::Tensor> seqused_k, std::optional<at::Tensor> page_table,
                                   std::optional<at::Tensor> cu_total_m_blocks, std::optional<at::Tensor> cu_block_idx_offsets) {
    static constexpr std::array<const char *, 10> kListNames{
        "full_cnt", "full_idx", "mask_cnt", "mask_idx", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table",
        "cu_total_m_blocks", "cu_block_idx_offsets"};
    check_planned(q, k, v, out, "SparseForward.run_with");
    const ListTensors lists{full_cnt, full_idx, mask_cnt, mask_idx, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
                            cu_total_m_blocks, cu_block_idx_offsets};
    for (size_t i = 0; i < lists.size(); ++i) {
        TORCH_CHECK(has_layout(lists[i], list_layouts_[i]), "SparseForward.run_with: ", kListNames[i],
                    " must be given or left out as planned, an int32 tensor of the planned shape and strides on the planned device");
    }
    at::cuda::CUDAGuard device_guard{device_};
    SparseLaunch launch = launch_;  // the planned parameters; this call's pointers below
    Flash_fwd_params &params = launch.params;
    params.q_ptr = q.data_ptr();
    params.k_ptr = k.data_ptr();
    params.v_ptr = v.data_ptr();
    params.o_ptr = out.data_ptr();
    launch.out = out;
    launch.softmax_lse = torch::empty(lse_sizes_, q.options().dtype(at::kFloat));  // the caller's to keep
    params.softmax_lse_ptr = launch.softmax_lse.data_ptr();
    params.sparse_full_cnt = full_cnt.data_ptr<int>();
    params.sparse_full_idx = full_idx.data_ptr<int>();
    params.sparse_mask_cnt = mask_cnt.has_value() ? mask_cnt->data_ptr<int>() : nullptr;
    params.sparse_mask_idx = mask_idx.has_value() ? mask_idx->data_ptr<int>() : nullptr;
    params.cu_seqlens_q = cu_seqlens_q.has_value() ? cu_seqlens_q->data_ptr<int>() : nullptr;
    params.cu_seqlens_k = cu_seqlens_k.has_value() ? cu_seqlens_k->data_ptr<int>() : nullptr;
    params.seqused_k = seqused_k.has_value() ? seqused_k->data_ptr<int>() : nullptr;
    if (page_table.has_value()) { params.block_table = page_table->data_ptr<int>(); }
    if (cu_total_m_blocks.has_value()) {  // varlen (has_layout checked both offsets against the plan)
        params.sparse_cu_total_m_blocks = cu_total_m_blocks->data_ptr<int>();
        params.sparse_cu_block_idx_offsets = cu_block_idx_offsets->data_ptr<int>();
    }
    if (out_accum_numel_ > 0) {
        // Both split partials in one allocation, laid out as planned (contiguous): out_accum's
        // floats, then lse_accum's (out_accum's count is a multiple of the rounded head dim).
        launch.out_accum = torch::empty({out_accum_numel_ + lse_accum_numel_}, q.options().dtype(at::kFloat));
        launch.lse_accum = at::Tensor();
        float *partials = launch.out_accum.data_ptr<float>();
        params.oaccum_ptr = partials;
        params.softmax_lseaccum_ptr = partials + out_accum_numel_;
    }
    launch_planned(launch);
    keep_alive(lists);  // until the next call, as a plan keeps its own
    return launch.softmax_lse;
}

void SparseForward::release_run_buffers() {
    launch_.softmax_lse = at::Tensor();
    launch_.out_accum = at::Tensor();
    launch_.lse_accum = at::Tensor();
    launch_.out = at::Tensor();
    lists_.clear();
    released_ = true;
}

void mha_combine(const at::Tensor &out_partial, const at::Tensor &lse_partial,
                 at::Tensor out, at::Tensor softmax_lse, std::optional<at::Tensor> cu_seqlens_q_) {
    at::cuda::CUDAGuard device_guard{out.device()};
    TORCH_CHECK(out_partial.dtype() == at::kFloat && lse_partial.dtype() == at::kFloat, "partials must be float32");
    TORCH_CHECK(out.dtype() == torch::kFloat16 || out.dtype() == torch::kBFloat16, "out must be fp16 or bf16");
    TORCH_CHECK(softmax_lse.dtype() == at::kFloat, "softmax_lse must be float32");
    CHECK_DEVICE(out); CHECK_DEVICE(out_partial); CHECK_DEVICE(lse_partial); CHECK_DEVICE(softmax_lse);
    CHECK_CONTIGUOUS(out_partial); CHECK_CONTIGUOUS(lse_partial); CHECK_CONTIGUOUS(softmax_lse);
    TORCH_CHECK(out.stride(-1) == 1, "out must have a contiguous last dimension");
    TORCH_CHECK(out_partial.dim() == 5 && lse_partial.dim() == 4, "partials must be (S, b, h, seqlen_q, d) and (S, b, h, seqlen_q)");
    const int num_slots = out_partial.size(0), batch_size = out_partial.size(1), num_heads = out_partial.size(2);
    const int seqlen_q = out_partial.size(3);
    const int head_size = out.size(-1);
    check_head_dim_has_kernel(head_size);
    TORCH_CHECK(num_slots >= 1 && num_slots <= 128, "at most 128 partials can be combined");
    CHECK_SHAPE(out_partial, num_slots, batch_size, num_heads, seqlen_q, head_size_rounded(head_size));
    CHECK_SHAPE(lse_partial, num_slots, batch_size, num_heads, seqlen_q);
    const bool varlen = cu_seqlens_q_.has_value();
    const int total_q = varlen ? out.size(0) : batch_size * seqlen_q;
    if (varlen) {
        check_int32_table(*cu_seqlens_q_, "cu_seqlens_q", out);
        CHECK_SHAPE((*cu_seqlens_q_), batch_size + 1);
        CHECK_SHAPE(out, total_q, num_heads, head_size);
        CHECK_SHAPE(softmax_lse, num_heads, total_q);
    } else {
        CHECK_SHAPE(out, batch_size, seqlen_q, num_heads, head_size);
        CHECK_SHAPE(softmax_lse, batch_size, num_heads, seqlen_q);
    }

    Flash_fwd_params params = {};
    params.is_bf16 = out.dtype() == torch::kBFloat16;
    params.b = batch_size;
    params.h = num_heads;
    params.seqlen_q = seqlen_q;
    params.total_q = total_q;
    params.d = head_size;
    params.d_rounded = head_size_rounded(head_size);
    params.num_splits = num_slots;
    params.oaccum_ptr = out_partial.data_ptr();
    params.softmax_lseaccum_ptr = lse_partial.data_ptr();
    params.o_ptr = out.data_ptr();
    params.o_row_stride = out.stride(-3);
    params.o_head_stride = out.stride(-2);
    params.o_batch_stride = varlen ? 0 : out.stride(0);
    params.softmax_lse_ptr = softmax_lse.data_ptr();
    params.unpadded_lse = varlen;
    params.cu_seqlens_q = varlen ? cu_seqlens_q_->data_ptr<int>() : nullptr;
    if (out.numel() == 0) { return; }
    run_combine(params, at::cuda::getCurrentCUDAStream().stream());
}

}  // namespace FLASH_NAMESPACE
