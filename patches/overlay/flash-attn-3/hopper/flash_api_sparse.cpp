/******************************************************************************
 * Host entry points of the sparse SM90 forward: the ops flash_attn_3_sparse::fwd (allocates
 * out) and fwd_out (writes a given out), for torch.compile; and in the module flash_attn_3._C
 * (pybind11) the class SparseForward (planned once, run many times) and fwd_into (fwd_out's
 * call without the dispatcher), for eager callers. Attention of each (batch, table head, query
 * tile) over the K/V blocks its lists name (the project's sparse contract,
 * flash_attn_sparse/metadata.py), split-KV partials merged by flash_fwd_combine.
 *
 * The Python layer validates the lists' contents; here are the cheap checks (dtypes, shapes,
 * strides) and the kernels stay memory safe on bad contents (sparse_block_list.h).
 ******************************************************************************/

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <ATen/ATen.h>
#include <torch/library.h>
#include <torch/python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <cutlass/numeric_types.h>

#include <array>
#include <cmath>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "flash.h"
#include "kernel_launch_sink.h"
#include "planned_kernel_graph.h"
#include "sparse_kernel_choice.h"

// From flash_api.cpp.
void set_params_fprop(Flash_fwd_params &params, const size_t b, const size_t seqlen_q, const size_t seqlen_k,
                      const size_t seqlen_q_rounded, const size_t seqlen_k_rounded, const size_t h, const size_t h_k,
                      const size_t d, const size_t d_rounded, const at::Tensor q, const at::Tensor k, const at::Tensor v,
                      at::Tensor out, void *cu_seqlens_q_d, void *cu_seqlens_k_d, void *seqused_q, void *seqused_k,
                      void *softmax_lse_d, float p_dropout, float softmax_scale, int window_size_left,
                      int window_size_right, int attention_chunk, const float softcap, const int sm_margin);
void run_mha_fwd_combine(Flash_fwd_params &params, cudaStream_t stream, bool enable_pdl);

template <typename T, int kHeadDim, bool Split, bool PackGQA, int kBlockM, bool PagedKVNonTMA>
void run_mha_fwd_sparse_(Flash_fwd_params &params, cudaStream_t stream);

namespace {

// FP8 (e4m3) q, k and v give bf16 out, as upstream's FP8 forward; fp16 and bf16 give their own.
at::ScalarType out_dtype_of(at::Tensor const &q) {
    return q.scalar_type() == at::kFloat8_e4m3fn ? at::kBFloat16 : q.scalar_type();
}

// A list table: int32 on q's device, `dim` dimensions; its last one contiguous where the kernel
// walks it (every idx table, and the varlen layout's cnt[hs, total_m_blocks]).
void check_table(const c10::optional<at::Tensor> &t, const char *name, const at::Tensor &q, int64_t dim,
                 bool contiguous_rows) {
    if (!t.has_value()) { return; }
    TORCH_CHECK(t->scalar_type() == at::kInt, name, " must be int32");
    TORCH_CHECK(t->device() == q.device(), name, " must be on the device of q");
    TORCH_CHECK(t->dim() == dim, name, " must have ", dim, " dimensions");
    TORCH_CHECK(!contiguous_rows || t->numel() == 0 || t->stride(-1) == 1, name, " must have a contiguous last dimension");
}

// A batched table's layout for the kernel (sparse_params.h); cnt (b, hs, m), idx (b, hs, m, capacity).
SparseListLayout batched_layout(at::Tensor const &cnt, at::Tensor const &idx) {
    SparseListLayout l;
    l.cnt_batch_stride = cnt.stride(0);
    l.cnt_head_stride = cnt.stride(1);
    l.cnt_row_stride = cnt.stride(2);
    l.idx_batch_stride = idx.stride(0);
    l.idx_head_stride = idx.stride(1);
    l.idx_row_stride = idx.stride(2);
    l.idx_capacity = idx.size(3);
    return l;
}

// The packed kernels (PackGQA), with cp.async paged K/V loads or not: split ones in the tile rows
// the host chose, unsplit ones in 128-row tiles. Returns false where the build has none.
template <typename T, int kHeadDim, bool PagedKVNonTMA>
bool run_packed(Flash_fwd_params &params, cudaStream_t stream) {
    if (params.num_splits > 1) {
#ifndef FLASHATTENTION_DISABLE_SPLIT
        if (params.sparse.block_m == kSparseBlockMDecode) {
            run_mha_fwd_sparse_<T, kHeadDim, true, true, kSparseBlockMDecode, PagedKVNonTMA>(params, stream);
        } else {
            run_mha_fwd_sparse_<T, kHeadDim, true, true, kSparseBlockM, PagedKVNonTMA>(params, stream);
        }
        return true;
#endif
        return false;
    }
    run_mha_fwd_sparse_<T, kHeadDim, false, true, kSparseBlockM, PagedKVNonTMA>(params, stream);
    return true;
}

// The instantiations of the build (setup.py leaves out those its DISABLE flags remove).
template <typename T, int kHeadDim>
void run_sparse_of_type(Flash_fwd_params &params, cudaStream_t stream) {
    if (params.page_table != nullptr && !params.pagedkv_tma) {  // cp.async pages: packed kernels only (the host packs)
#if !defined(FLASHATTENTION_DISABLE_PAGEDKV) && !defined(FLASHATTENTION_DISABLE_PACKGQA)
        if (run_packed<T, kHeadDim, true>(params, stream)) { return; }
#endif
        TORCH_CHECK(false, "this build has no cp.async paged sparse kernel for num_splits=", params.num_splits);
    }
    if (params.pack_gqa) {
#ifndef FLASHATTENTION_DISABLE_PACKGQA
        if (run_packed<T, kHeadDim, false>(params, stream)) { return; }
#endif
    } else if (params.num_splits > 1) {
#ifndef FLASHATTENTION_DISABLE_SPLIT
        return run_mha_fwd_sparse_<T, kHeadDim, true, false, kSparseBlockM, false>(params, stream);
#endif
    } else {
        return run_mha_fwd_sparse_<T, kHeadDim, false, false, kSparseBlockM, false>(params, stream);
    }
    TORCH_CHECK(false, "this build has no sparse kernel for num_splits=", params.num_splits, ", pack_gqa=", params.pack_gqa);
}

template <typename T>
void run_sparse_of_dim(Flash_fwd_params &params, cudaStream_t stream) {
#ifndef FLASHATTENTION_DISABLE_HDIM64
    if (params.d == 64) { return run_sparse_of_type<T, 64>(params, stream); }
#endif
#ifndef FLASHATTENTION_DISABLE_HDIM128
    if (params.d == 128) { return run_sparse_of_type<T, 128>(params, stream); }
#endif
    TORCH_CHECK(false, "this build has no sparse kernel for head dim ", params.d);
}

void run_sparse(Flash_fwd_params &params, cudaStream_t stream) {
    if (params.is_e4m3) {
#ifndef FLASHATTENTION_DISABLE_FP8
        return run_sparse_of_dim<cutlass::float_e4m3_t>(params, stream);
#endif
        TORCH_CHECK(false, "this build has no FP8 sparse kernels");
    }
    if (params.is_bf16) { return run_sparse_of_dim<cutlass::bfloat16_t>(params, stream); }
#ifndef FLASHATTENTION_DISABLE_FP16
    return run_sparse_of_dim<cutlass::half_t>(params, stream);
#endif
    TORCH_CHECK(false, "this build has no fp16 sparse kernels");
}

}  // namespace

// One checked sparse forward: its parameters and buffers (the LSE, the split partials, the tile
// counter of the persistent scheduler), made by prepare_sparse and run by launch_sparse.
struct SparseLaunch {
    Flash_fwd_params params;
    at::Tensor softmax_lse, out_accum, lse_accum, tile_count_semaphore;
    bool no_queries = false, no_keys = false;
};

namespace {

// Checks every argument and fills the parameters for `out` (like q, contiguous last dimension).
SparseLaunch prepare_sparse(
        at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out,
        at::Tensor full_cnt, at::Tensor full_idx,
        c10::optional<at::Tensor> mask_cnt, c10::optional<at::Tensor> mask_idx,
        c10::optional<at::Tensor> cu_total_m_blocks, c10::optional<at::Tensor> cu_block_idx_offsets,
        c10::optional<at::Tensor> cu_seqlens_q, c10::optional<at::Tensor> cu_seqlens_k,
        c10::optional<int64_t> max_seqlen_q, c10::optional<int64_t> max_seqlen_k,
        double softmax_scale, int64_t block_size, int64_t q_block_size, bool causal,
        int64_t num_splits, c10::optional<bool> pack_gqa,
        c10::optional<at::Tensor> seqused_k, c10::optional<at::Tensor> page_table,
        c10::optional<at::Tensor> q_descale, c10::optional<at::Tensor> k_descale, c10::optional<at::Tensor> v_descale) {
    auto const q_type = q.scalar_type();
    bool const fp8 = q_type == at::kFloat8_e4m3fn;
    TORCH_CHECK(q_type == at::kHalf || q_type == at::kBFloat16 || fp8, "q must be fp16, bf16 or float8_e4m3fn");
    TORCH_CHECK(k.scalar_type() == q_type && v.scalar_type() == q_type, "q, k and v must have one dtype");
    TORCH_CHECK(fp8 || !(q_descale.has_value() || k_descale.has_value() || v_descale.has_value()),
                "q_descale, k_descale and v_descale go with float8_e4m3fn q, k and v");
    TORCH_CHECK(q.is_cuda() && k.device() == q.device() && v.device() == q.device(), "q, k and v must be on one CUDA device");
    TORCH_CHECK(q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1, "q, k and v must have a contiguous last dimension");
    TORCH_CHECK(block_size == kSparseBlockSize, "block_size must be ", kSparseBlockSize, " on the FA-3 sparse path");
    bool const varlen = cu_seqlens_q.has_value();
    bool const paged = page_table.has_value();
    // Paged K/V: a sequence's key p is row p % page_size of page page_table[b, p / page_size], and
    // its length is seqused_k[b] (or the table's max_pages * page_size), as in upstream's paged
    // forward; so varlen's cu_seqlens_k, which places keys in one packed tensor, is left out.
    TORCH_CHECK(cu_seqlens_k.has_value() == (varlen && !paged),
                paged ? "with a page_table, pass seqused_k for the sequences' key counts, not cu_seqlens_k"
                      : "cu_seqlens_q and cu_seqlens_k go together");
    TORCH_CHECK(!(varlen && paged) || seqused_k.has_value(), "varlen with a page_table needs seqused_k");
    TORCH_CHECK(varlen == cu_total_m_blocks.has_value() && varlen == cu_block_idx_offsets.has_value(),
                "varlen inputs need the varlen list layout (cu_total_m_blocks, cu_block_idx_offsets) and batched ones the batched layout");
    TORCH_CHECK(mask_cnt.has_value() == mask_idx.has_value(), "mask_cnt and mask_idx go together");
    c10::cuda::CUDAGuard device_guard{q.device()};

    int const batch_size = varlen ? cu_seqlens_q->size(0) - 1 : q.size(0);
    TORCH_CHECK(!varlen || (max_seqlen_q.has_value() && max_seqlen_k.has_value()), "varlen needs max_seqlen_q and max_seqlen_k");
    TORCH_CHECK(q.dim() == (varlen ? 3 : 4) && k.dim() == (varlen && !paged ? 3 : 4) && v.dim() == k.dim(),
                "q, k, v: (b, s, h, d), or (total, h, d) with cu_seqlens; paged k, v: (num_pages, page_size, h_k, d)");
    int const page_size = paged ? k.size(1) : 0, num_pages = paged ? k.size(0) : 0;
    int const max_pages = paged ? page_table->size(-1) : 0;
    if (paged) {
        TORCH_CHECK(page_table->scalar_type() == at::kInt && page_table->device() == q.device() && page_table->dim() == 2
                    && page_table->size(0) == batch_size && (page_table->numel() == 0 || page_table->stride(-1) == 1),
                    "page_table must be an int32 (batch_size, max_pages) tensor on the device of q with a contiguous last dimension");
        TORCH_CHECK(page_size > 0, "page_size (k.size(1)) must be positive");
        TORCH_CHECK(int64_t(max_pages) * page_size <= std::numeric_limits<int>::max(), "max_pages * page_size must fit in int32");
        TORCH_CHECK(v.size(0) == num_pages && v.size(1) == page_size, "v must have the pages of k");
    }
    if (seqused_k.has_value()) {
        TORCH_CHECK(seqused_k->scalar_type() == at::kInt && seqused_k->device() == q.device() && seqused_k->dim() == 1
                    && seqused_k->size(0) == batch_size && seqused_k->is_contiguous(),
                    "seqused_k must be a contiguous int32 (batch_size,) tensor on the device of q");
    }
    int const seqlen_q = varlen ? int(max_seqlen_q.value_or(0)) : q.size(1);
    // The keys a sequence may hold: the kernels' seqlen_k, and the list walk's bound (the longest under varlen).
    int const seqlen_k = paged ? max_pages * page_size : varlen ? int(max_seqlen_k.value_or(0)) : k.size(1);
    int const max_seqlen_k_listed = varlen ? int(max_seqlen_k.value_or(0)) : seqlen_k;
    TORCH_CHECK(!(varlen && paged) || max_seqlen_k_listed <= seqlen_k, "max_seqlen_k must be at most max_pages * page_size");
    int const total_q = varlen ? q.size(0) : batch_size * seqlen_q;
    int64_t const total_k = paged ? int64_t(num_pages) * page_size : varlen ? k.size(0) : int64_t(batch_size) * seqlen_k;
    int const num_heads = q.size(-2), num_heads_k = k.size(-2), head_size = q.size(-1);
    TORCH_CHECK(head_size == 64 || head_size == 128, "head dim must be 64 or 128, got ", head_size);
    TORCH_CHECK(k.size(-1) == head_size && v.size(-1) == head_size, "k and v must have the head dim of q");
    TORCH_CHECK(num_heads_k > 0 && num_heads % num_heads_k == 0, "num_heads must be a multiple of num_heads_k");
    // The varlen kernels run varlen calls and those with seqused_k (upstream's rule).
    bool const varlen_kernel = varlen || seqused_k.has_value();
    if (varlen) {
        for (auto const &t : {cu_seqlens_q, cu_seqlens_k, cu_total_m_blocks, cu_block_idx_offsets}) {
            if (!t.has_value()) { continue; }  // cu_seqlens_k of a paged call
            TORCH_CHECK(t->scalar_type() == at::kInt && t->device() == q.device() && t->is_contiguous() && t->dim() == 1 && t->size(0) == batch_size + 1,
                        "cu_seqlens and cu_* list offsets must be contiguous int32 (batch_size + 1,) tensors on the device of q");
        }
    }
    int64_t const cnt_dim = varlen ? 2 : 3, idx_dim = varlen ? 2 : 4;
    check_table(full_cnt, "full_cnt", q, cnt_dim, varlen);
    check_table(full_idx, "full_idx", q, idx_dim, true);
    check_table(mask_cnt, "mask_cnt", q, cnt_dim, varlen);
    check_table(mask_idx, "mask_idx", q, idx_dim, true);
    if (mask_cnt.has_value() && varlen) {  // one set of offsets and strides for both lists
        TORCH_CHECK(mask_cnt->sizes() == full_cnt.sizes() && mask_cnt->strides() == full_cnt.strides(), "mask_cnt must have the shape and strides of full_cnt");
        TORCH_CHECK(mask_idx->sizes() == full_idx.sizes() && mask_idx->strides() == full_idx.strides(), "mask_idx must have the shape and strides of full_idx");
    } else if (mask_cnt.has_value()) {  // batched mask lists may have their own width and strides
        TORCH_CHECK(mask_cnt->sizes() == full_cnt.sizes(), "mask_cnt must have the shape of full_cnt");
        TORCH_CHECK(mask_idx->sizes().slice(0, 3) == full_idx.sizes().slice(0, 3), "mask_idx must have the leading dims of full_idx");
    }
    int const table_heads = varlen ? full_cnt.size(0) : full_cnt.size(1);
    TORCH_CHECK(table_heads == 1 || table_heads == num_heads_k || table_heads == num_heads,
                "list head extent must be 1, num_heads_k or num_heads, got ", table_heads);
    TORCH_CHECK((varlen ? full_idx.size(0) : full_idx.size(1)) == table_heads, "full_idx must have the head extent of full_cnt");

    // Packing, splits and tile rows (sparse_kernel_choice.h), and what the build lacks, refused here.
    int const n_blocks_k = (max_seqlen_k_listed + kSparseBlockSize - 1) / kSparseBlockSize;
    SparseCallShape shape;
    shape.batch_size = batch_size;
    shape.num_heads = num_heads;
    shape.num_heads_k = num_heads_k;
    shape.table_heads = table_heads;
    shape.seqlen_q = seqlen_q;
    shape.q_block_size = int(std::min<int64_t>(q_block_size, std::numeric_limits<int>::max()));
    shape.head_dim = head_size;
    shape.fp16 = q_type == at::kHalf;
    shape.fp8 = fp8;
    shape.varlen = varlen_kernel;
    shape.max_list_blocks = varlen ? n_blocks_k
        : int(std::min<int64_t>(n_blocks_k, full_idx.size(3) + (mask_idx.has_value() ? mask_idx->size(3) : 0)));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&shape.num_sm, cudaDevAttrMultiProcessorCount, q.get_device()));
    shape.num_splits = int(std::clamp<int64_t>(num_splits, -1, kSparseMaxSplits));
    shape.pack_gqa = pack_gqa.has_value() ? int(*pack_gqa) : -1;
    // TMA loads a 128-key block from one page; pages that do not hold whole blocks take cp.async loads.
    shape.paged_cpasync = paged && page_size % kSparseBlockSize != 0;
    SparseKernelChoice const choice = choose_sparse_kernel(shape);
    TORCH_CHECK(choice.refusal.empty(), choice.refusal);
    bool const pack = choice.pack;
    if (!varlen) {
        TORCH_CHECK(full_cnt.size(0) == batch_size, "full_cnt: batch extent must be ", batch_size);
        TORCH_CHECK(full_idx.sizes().slice(0, 3) == full_cnt.sizes(), "full_idx: leading dims must be full_cnt's");
        TORCH_CHECK(full_cnt.size(2) >= (seqlen_q + q_block_size - 1) / q_block_size, "full_cnt needs one row per query tile");
    }

    TORCH_CHECK(out.scalar_type() == out_dtype_of(q) && out.device() == q.device() && out.sizes() == q.sizes()
                && (out.numel() == 0 || out.stride(-1) == 1),
                "out must be like q (device, shape; bf16 for float8_e4m3fn q, else q's dtype) with a contiguous last dimension");
    // Descales: float32 (batch_size, num_heads_k), any strides (a scalar expanded to that shape has zero strides).
    for (auto const &[t, name] : {std::make_pair(&q_descale, "q_descale"), std::make_pair(&k_descale, "k_descale"),
                                  std::make_pair(&v_descale, "v_descale")}) {
        TORCH_CHECK(!t->has_value() || ((*t)->scalar_type() == at::kFloat && (*t)->device() == q.device() && (*t)->dim() == 2
                                        && (*t)->size(0) == batch_size && (*t)->size(1) == num_heads_k),
                    name, " must be a float32 (batch_size, num_heads_k) tensor on the device of q");
    }
    auto opts = q.options();
    SparseLaunch launch;
    launch.softmax_lse = varlen ? at::empty({num_heads, total_q}, opts.dtype(at::kFloat))
                                : at::empty({batch_size, num_heads, seqlen_q}, opts.dtype(at::kFloat));
    launch.no_queries = total_q == 0;
    launch.no_keys = total_k == 0 || seqlen_k == 0;  // the empty-list result everywhere
    if (launch.no_queries || launch.no_keys) { return launch; }
    at::Tensor &softmax_lse = launch.softmax_lse;

    Flash_fwd_params &params = launch.params;
    params = {};
    auto round_up = [](int x, int m) { return (x + m - 1) / m * m; };
    set_params_fprop(params, batch_size, seqlen_q, seqlen_k, round_up(seqlen_q, 128), round_up(seqlen_k, 128),
                     num_heads, num_heads_k, head_size, head_size, q, k, v, out,
                     varlen ? cu_seqlens_q->data_ptr() : nullptr, cu_seqlens_k.has_value() ? cu_seqlens_k->data_ptr() : nullptr,
                     nullptr /*seqused_q*/, seqused_k.has_value() ? seqused_k->data_ptr() : nullptr, softmax_lse.data_ptr(), 0.f, float(softmax_scale),
                     -1 /*window_size_left*/, causal ? 0 : -1 /*window_size_right*/, 0 /*attention_chunk*/, 0.f, 0);
    // is_bf16 names the out type for the combine (else fp16); e4m3 inputs write bf16 out.
    params.is_bf16 = out_dtype_of(q) == at::kBFloat16;
    params.total_q = total_q;
    params.total_k = total_k;
    params.b_k = batch_size;
    params.dv = head_size;
    params.dv_rounded = head_size;
    params.page_size = 1;
    if (paged) {  // TMA paging where a page holds whole kBlockN blocks, as upstream's get_pagedkv_tma
        params.page_table = page_table->data_ptr<int>();
        params.page_table_batch_stride = page_table->stride(0);
        params.page_size = page_size;
        params.num_pages = num_pages;
        params.pagedkv_tma = !shape.paged_cpasync;
        params.sparse.max_keys = seqlen_k;
    }
    params.pack_gqa = pack;
    // Null descales read as 1 in the kernel.
    params.q_descale_ptr = q_descale.has_value() ? q_descale->data_ptr<float>() : nullptr;
    params.k_descale_ptr = k_descale.has_value() ? k_descale->data_ptr<float>() : nullptr;
    params.v_descale_ptr = v_descale.has_value() ? v_descale->data_ptr<float>() : nullptr;
    if (q_descale.has_value()) { params.q_descale_batch_stride = q_descale->stride(0); params.q_descale_head_stride = q_descale->stride(1); }
    if (k_descale.has_value()) { params.k_descale_batch_stride = k_descale->stride(0); params.k_descale_head_stride = k_descale->stride(1); }
    if (v_descale.has_value()) { params.v_descale_batch_stride = v_descale->stride(0); params.v_descale_head_stride = v_descale->stride(1); }

    auto &sp = params.sparse;
    sp.full_cnt = full_cnt.data_ptr<int>();
    sp.full_idx = full_idx.data_ptr<int>();
    sp.mask_cnt = mask_cnt.has_value() ? mask_cnt->data_ptr<int>() : nullptr;
    sp.mask_idx = mask_idx.has_value() ? mask_idx->data_ptr<int>() : nullptr;
    if (varlen) {
        sp.cu_total_m_blocks = cu_total_m_blocks->data_ptr<int>();
        sp.cu_block_idx_offsets = cu_block_idx_offsets->data_ptr<int>();
        sp.full.cnt_head_stride = full_cnt.stride(0);
        sp.full.idx_head_stride = full_idx.stride(0);
        sp.mask = sp.full;
    } else {
        sp.full = batched_layout(full_cnt, full_idx);
        sp.mask = mask_cnt.has_value() ? batched_layout(*mask_cnt, *mask_idx) : sp.full;
    }
    // bidh in the kernel is the query head, or the K/V head under PackGQA.
    sp.head_ratio = (pack ? num_heads_k : num_heads) / table_heads;

    params.num_splits = choice.num_splits;
    sp.block_m = choice.block_m;
    sp.tiles_per_row = choice.tiles_per_row;

    at::Tensor &out_accum = launch.out_accum, &lse_accum = launch.lse_accum;
    if (params.num_splits > 1) {
        out_accum = varlen ? at::empty({params.num_splits, num_heads, total_q, head_size}, opts.dtype(at::kFloat))
                           : at::empty({params.num_splits, batch_size, num_heads, seqlen_q, head_size}, opts.dtype(at::kFloat));
        lse_accum = varlen ? at::empty({params.num_splits, num_heads, total_q}, opts.dtype(at::kFloat))
                           : at::empty({params.num_splits, batch_size, num_heads, seqlen_q}, opts.dtype(at::kFloat));
        if (!varlen) {
            params.oaccum_batch_stride = out_accum.stride(1);
            params.lseaccum_batch_stride = lse_accum.stride(1);
        }
        params.is_fp32 = false;
        params.oaccum_ptr = out_accum.data_ptr();
        params.softmax_lseaccum_ptr = lse_accum.data_ptr();
        params.oaccum_split_stride = out_accum.stride(0);
        params.oaccum_row_stride = out_accum.stride(-2);
        params.oaccum_head_stride = out_accum.stride(-3);
        params.lseaccum_split_stride = lse_accum.stride(0);
        params.lseaccum_head_stride = lse_accum.stride(-2);
    }
    // The sparse path's persistent scheduler takes tiles from a counter zeroed before each launch
    // (launch_sparse); split calls of fixed length run one tile per CTA (UsePersistentScheduler in
    // the launch template) and need none. No dynamic splits.
    bool const scheduler_needs_semaphore = !(params.num_splits > 1 && !varlen_kernel);
    if (scheduler_needs_semaphore) { launch.tile_count_semaphore = at::empty({1}, opts.dtype(at::kInt)); }
    params.tile_count_semaphore = scheduler_needs_semaphore ? launch.tile_count_semaphore.data_ptr<int>() : nullptr;
    params.num_splits_dynamic_ptr = nullptr;
    return launch;
}

// The forward and, for a split call, the combine.
void launch_kernels(Flash_fwd_params &params, cudaStream_t stream) {
    run_sparse(params, stream);
    if (params.num_splits > 1) {
        run_mha_fwd_combine(params, stream, false /*enable_pdl*/);
    }
}

// Runs a prepared forward into `out`, whose pointer and strides its parameters hold.
void launch_sparse(SparseLaunch &launch, at::Tensor &out) {
    if (launch.no_queries) { return; }
    if (launch.no_keys) {
        out.zero_();
        launch.softmax_lse.fill_(-std::numeric_limits<float>::infinity());
        return;
    }
    auto stream = c10::cuda::getCurrentCUDAStream().stream();
    if (launch.params.tile_count_semaphore != nullptr) {
        C10_CUDA_CHECK(cudaMemsetAsync(launch.params.tile_count_semaphore, 0, sizeof(int), stream));
    }
    launch_kernels(launch.params, stream);
}

// SparseForward's graph_launch: the planned kernels (the forward and, for a split call, the
// combine) captured once (planned_kernel_graph.h). Each later run builds their arguments as a direct
// run does (the launch templates: parameters, TMA descriptors), takes them as the launch sink
// (kernel_launch_sink.h) onto the kernel nodes of the same function, and launches the graph once,
// where a direct run pays the runtime's launch per kernel. Calls with the persistent scheduler's
// tile counter launch directly (its memset would need each run_with's counter): those are the
// unsplit prefill calls, whose kernels outlast their launches.
class KernelGraph final : public flash::KernelLaunchSink {
public:
    explicit KernelGraph(Flash_fwd_params &params)
        : graph_([&](cudaStream_t capture) { launch_kernels(params, capture); }) {}

    void launch(Flash_fwd_params &params, cudaStream_t stream) {
        taken_ = 0;
        {
            SinkInstalled installed{this};
            launch_kernels(params, stream);
        }
        TORCH_CHECK(taken_ == graph_.num_kernels(), "SparseForward: its graph holds ", graph_.num_kernels(),
                    " kernels, the run built ", taken_);
        graph_.launch(stream);
    }

    void take(void const *kernel, void *argument) override {
        size_t const set = graph_.set_argument(kernel, argument);
        TORCH_CHECK(set > 0, "SparseForward: a kernel its graph launch did not capture");
        taken_ += set;
    }

private:
    struct SinkInstalled {
        explicit SinkInstalled(flash::KernelLaunchSink *sink) { flash::kernel_launch_sink = sink; }
        ~SinkInstalled() { flash::kernel_launch_sink = nullptr; }
    };

    PlannedKernelGraph graph_;
    size_t taken_ = 0;
};

}  // namespace

// The forward into `out` (like q, contiguous last dimension); returns the LSE.
at::Tensor mha_fwd_sparse_into(
        at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out,
        at::Tensor full_cnt, at::Tensor full_idx,
        c10::optional<at::Tensor> mask_cnt, c10::optional<at::Tensor> mask_idx,
        c10::optional<at::Tensor> cu_total_m_blocks, c10::optional<at::Tensor> cu_block_idx_offsets,
        c10::optional<at::Tensor> cu_seqlens_q, c10::optional<at::Tensor> cu_seqlens_k,
        c10::optional<int64_t> max_seqlen_q, c10::optional<int64_t> max_seqlen_k,
        double softmax_scale, int64_t block_size, int64_t q_block_size, bool causal,
        int64_t num_splits, c10::optional<bool> pack_gqa,
        c10::optional<at::Tensor> seqused_k, c10::optional<at::Tensor> page_table,
        c10::optional<at::Tensor> q_descale, c10::optional<at::Tensor> k_descale, c10::optional<at::Tensor> v_descale) {
    c10::cuda::CUDAGuard device_guard{q.device()};
    SparseLaunch launch = prepare_sparse(q, k, v, out, full_cnt, full_idx, mask_cnt, mask_idx, cu_total_m_blocks,
                                         cu_block_idx_offsets, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         softmax_scale, block_size, q_block_size, causal, num_splits, pack_gqa, seqused_k, page_table,
                                         q_descale, k_descale, v_descale);
    launch_sparse(launch, out);
    return launch.softmax_lse;
}

// A sparse forward planned once (a plan's, and a one-shot cache entry's): every check, the
// parameters and the buffers at construction. run swaps in q, k, v and out, laid out as planned,
// and launches; the lists, offsets and cu_seqlens are the caller's planned tensors, read at every
// run, and the LSE is the plan's buffer, overwritten by the next run. run_with also swaps in the
// lists, offsets and cu_seqlens (laid out as planned), returns a new LSE (or writes a given one)
// and takes its split partials (one allocation) and tile counter from the allocator per call
// (stream-ordered, so any stream): the one-shot cache's launch, whose entry drops run's buffers
// (release_run_buffers) to hold none.
// With graph_launch, the runs after the first launch the kernels as one CUDA graph given each
// run's arguments (KernelGraph), where the call's kernels allow it.
class SparseForward {
public:
    SparseForward(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out, at::Tensor full_cnt, at::Tensor full_idx,
                  c10::optional<at::Tensor> mask_cnt, c10::optional<at::Tensor> mask_idx,
                  c10::optional<at::Tensor> cu_total_m_blocks, c10::optional<at::Tensor> cu_block_idx_offsets,
                  c10::optional<at::Tensor> cu_seqlens_q, c10::optional<at::Tensor> cu_seqlens_k,
                  c10::optional<int64_t> max_seqlen_q, c10::optional<int64_t> max_seqlen_k, double softmax_scale,
                  int64_t block_size, int64_t q_block_size, bool causal, int64_t num_splits,
                  c10::optional<bool> pack_gqa, c10::optional<at::Tensor> seqused_k,
                  c10::optional<at::Tensor> page_table, c10::optional<at::Tensor> q_descale,
                  c10::optional<at::Tensor> k_descale, c10::optional<at::Tensor> v_descale, bool graph_launch)
        : device_(q.device()), dtype_(q.scalar_type()), out_dtype_(out_dtype_of(q)), q_sizes_(q.sizes().vec()), q_strides_(q.strides().vec()),
          k_sizes_(k.sizes().vec()), k_strides_(k.strides().vec()), v_strides_(v.strides().vec()),
          out_strides_(out.strides().vec()), planned_max_seqlen_q_(max_seqlen_q.value_or(0)),
          planned_max_seqlen_k_(max_seqlen_k.value_or(0)), graph_launch_(graph_launch) {
        c10::cuda::CUDAGuard device_guard{q.device()};
        launch_ = prepare_sparse(q, k, v, out, full_cnt, full_idx, mask_cnt, mask_idx, cu_total_m_blocks,
                                 cu_block_idx_offsets, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 softmax_scale, block_size, q_block_size, causal, num_splits, pack_gqa, seqused_k, page_table,
                                 q_descale, k_descale, v_descale);
        lse_sizes_ = launch_.softmax_lse.sizes().vec();
        if (launch_.out_accum.defined()) {
            out_accum_numel_ = launch_.out_accum.numel();
            lse_accum_numel_ = launch_.lse_accum.numel();
        }
        ListTensors const lists{full_cnt, full_idx, mask_cnt, mask_idx, cu_total_m_blocks, cu_block_idx_offsets,
                                cu_seqlens_q, cu_seqlens_k, seqused_k, page_table};
        for (size_t i = 0; i < lists.size(); ++i) { list_layouts_[i] = layout_of(lists[i]); }
        DescaleTensors const descales{q_descale, k_descale, v_descale};
        for (size_t i = 0; i < descales.size(); ++i) { descale_layouts_[i] = layout_of(descales[i]); }
        keep_alive(lists, descales);  // the parameters point into them
    }

    at::Tensor run(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out) {
        TORCH_CHECK(!released_, "SparseForward.run: its buffers were released (release_run_buffers); use run_with");
        check_planned(q, k, v, out, "SparseForward.run");
        c10::cuda::CUDAGuard device_guard{device_};
        swap_qkv_out(launch_.params, q, k, v, out);
        launch_planned(launch_, out);
        return launch_.softmax_lse;
    }

    at::Tensor run_with(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out,
                        at::Tensor full_cnt, at::Tensor full_idx, c10::optional<at::Tensor> mask_cnt,
                        c10::optional<at::Tensor> mask_idx, c10::optional<at::Tensor> cu_total_m_blocks,
                        c10::optional<at::Tensor> cu_block_idx_offsets, c10::optional<at::Tensor> cu_seqlens_q,
                        c10::optional<at::Tensor> cu_seqlens_k, c10::optional<int64_t> max_seqlen_q,
                        c10::optional<int64_t> max_seqlen_k, c10::optional<at::Tensor> softmax_lse,
                        c10::optional<at::Tensor> seqused_k, c10::optional<at::Tensor> page_table,
                        c10::optional<at::Tensor> q_descale, c10::optional<at::Tensor> k_descale,
                        c10::optional<at::Tensor> v_descale) {
        check_planned(q, k, v, out, "SparseForward.run_with");
        if (cu_seqlens_q.has_value()) {
            // The tile choice, split count and combine grid were sized for the planned longest
            // sequences; new cu_seqlens must come with the caller's bound on theirs (read here
            // without a host sync), no longer than planned.
            TORCH_CHECK(max_seqlen_q.has_value() && max_seqlen_k.has_value()
                        && *max_seqlen_q <= planned_max_seqlen_q_ && *max_seqlen_k <= planned_max_seqlen_k_,
                        "SparseForward.run_with: new cu_seqlens need max_seqlen_q and max_seqlen_k of at most the "
                        "planned ", planned_max_seqlen_q_, " and ", planned_max_seqlen_k_, "; plan again for longer sequences");
        }
        ListTensors const lists{full_cnt, full_idx, mask_cnt, mask_idx, cu_total_m_blocks, cu_block_idx_offsets,
                                cu_seqlens_q, cu_seqlens_k, seqused_k, page_table};
        for (size_t i = 0; i < lists.size(); ++i) {
            TORCH_CHECK(has_layout(lists[i], list_layouts_[i]), "SparseForward.run_with: ", kListNames[i],
                        " must be given or left out as planned, an int32 tensor of the planned shape and strides on the planned device");
        }
        DescaleTensors const descales{q_descale, k_descale, v_descale};
        for (size_t i = 0; i < descales.size(); ++i) {
            TORCH_CHECK(has_layout(descales[i], descale_layouts_[i], at::kFloat), "SparseForward.run_with: ", kDescaleNames[i],
                        " must be given or left out as planned, a float32 tensor of the planned shape and strides on the planned device");
        }
        if (softmax_lse.has_value()) {
            TORCH_CHECK(softmax_lse->scalar_type() == at::kFloat && softmax_lse->device() == device_
                        && softmax_lse->sizes() == at::IntArrayRef(lse_sizes_) && softmax_lse->is_contiguous(),
                        "SparseForward.run_with: softmax_lse must be a contiguous float32 tensor of shape ",
                        at::IntArrayRef(lse_sizes_), " on the planned device");
        }
        c10::cuda::CUDAGuard device_guard{device_};
        SparseLaunch launch = launch_;  // the planned parameters; this call's pointers below
        Flash_fwd_params &params = launch.params;
        swap_qkv_out(params, q, k, v, out);
        // A new LSE per call unless one is given (allocated here, not in Python: a few us less).
        launch.softmax_lse = softmax_lse.has_value() ? *softmax_lse : at::empty(lse_sizes_, q.options().dtype(at::kFloat));
        params.softmax_lse_ptr = launch.softmax_lse.data_ptr();
        auto &sp = params.sparse;
        sp.full_cnt = full_cnt.data_ptr<int>();
        sp.full_idx = full_idx.data_ptr<int>();
        sp.mask_cnt = mask_cnt.has_value() ? mask_cnt->data_ptr<int>() : nullptr;
        sp.mask_idx = mask_idx.has_value() ? mask_idx->data_ptr<int>() : nullptr;
        if (cu_total_m_blocks.has_value()) {  // varlen (has_layout checked all four against the plan)
            sp.cu_total_m_blocks = cu_total_m_blocks->data_ptr<int>();
            sp.cu_block_idx_offsets = cu_block_idx_offsets->data_ptr<int>();
            params.cu_seqlens_q = cu_seqlens_q->data_ptr<int>();
            params.cu_seqlens_k = cu_seqlens_k.has_value() ? cu_seqlens_k->data_ptr<int>() : nullptr;
        }
        params.seqused_k = seqused_k.has_value() ? seqused_k->data_ptr<int>() : nullptr;
        if (page_table.has_value()) { params.page_table = page_table->data_ptr<int>(); }
        if (q_descale.has_value()) { params.q_descale_ptr = q_descale->data_ptr<float>(); }
        if (k_descale.has_value()) { params.k_descale_ptr = k_descale->data_ptr<float>(); }
        if (v_descale.has_value()) { params.v_descale_ptr = v_descale->data_ptr<float>(); }
        if (params.num_splits > 1) {
            // Both split partials in one allocation, laid out as planned (contiguous): out_accum's
            // floats, then lse_accum's (out_accum's count is a multiple of the head dim: aligned).
            launch.out_accum = at::empty({out_accum_numel_ + lse_accum_numel_}, q.options().dtype(at::kFloat));
            launch.lse_accum = at::Tensor();
            float *partials = launch.out_accum.data_ptr<float>();
            params.oaccum_ptr = partials;
            params.softmax_lseaccum_ptr = partials + out_accum_numel_;
        }
        if (params.tile_count_semaphore != nullptr) {
            launch.tile_count_semaphore = at::empty({1}, q.options().dtype(at::kInt));
            params.tile_count_semaphore = launch.tile_count_semaphore.data_ptr<int>();
        }
        launch_planned(launch, out);
        keep_alive(lists, descales);  // until the next run, as a plan keeps its own
        return launch.softmax_lse;
    }

    // Frees what only run uses (its LSE, split partials and tile counter); run_with allocates
    // its own per call. A one-shot cache entry holds no buffers this way.
    void release_run_buffers() {
        launch_.softmax_lse = at::Tensor();
        launch_.out_accum = at::Tensor();
        launch_.lse_accum = at::Tensor();
        launch_.tile_count_semaphore = at::Tensor();
        released_ = true;
    }

private:
    using ListTensors = std::array<c10::optional<at::Tensor>, 10>;
    using DescaleTensors = std::array<c10::optional<at::Tensor>, 3>;

    // launch_sparse, or with graph_launch through the plan's KernelGraph: the first eager run
    // launches directly (setting the kernels' attributes outside any capture) and then captures;
    // a run on a stream being captured launches directly into the caller's graph.
    void launch_planned(SparseLaunch &launch, at::Tensor &out) {
        bool const graphable = graph_launch_ && !launch.no_queries && !launch.no_keys
                               && launch.params.tile_count_semaphore == nullptr;
        cudaStream_t const stream = c10::cuda::getCurrentCUDAStream().stream();
        cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
        if (graphable) { C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing)); }
        if (!graphable || capturing != cudaStreamCaptureStatusNone) {
            launch_sparse(launch, out);
        } else if (graph_ == nullptr) {
            launch_sparse(launch, out);
            graph_ = std::make_unique<KernelGraph>(launch.params);
        } else {
            graph_->launch(launch.params, stream);
        }
    }
    static constexpr std::array<char const *, 10> kListNames{"full_cnt", "full_idx", "mask_cnt", "mask_idx",
                                                            "cu_total_m_blocks", "cu_block_idx_offsets",
                                                            "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table"};
    static constexpr std::array<char const *, 3> kDescaleNames{"q_descale", "k_descale", "v_descale"};
    struct Layout {
        bool given = false;
        std::vector<int64_t> sizes, strides;
    };

    static Layout layout_of(c10::optional<at::Tensor> const &t) {
        return t.has_value() ? Layout{true, t->sizes().vec(), t->strides().vec()} : Layout{};
    }
    bool has_layout(c10::optional<at::Tensor> const &t, Layout const &planned, at::ScalarType dtype = at::kInt) const {
        if (!t.has_value()) { return !planned.given; }
        return planned.given && t->scalar_type() == dtype && t->device() == device_
               && t->sizes() == at::IntArrayRef(planned.sizes) && t->strides() == at::IntArrayRef(planned.strides);
    }

    // The parameters hold the planned strides: the tensors must be laid out as planned.
    void check_planned(at::Tensor const &q, at::Tensor const &k, at::Tensor const &v, at::Tensor const &out,
                       char const *what) const {
        TORCH_CHECK(q.scalar_type() == dtype_ && k.scalar_type() == dtype_ && v.scalar_type() == dtype_
                    && out.scalar_type() == out_dtype_, what, ": q, k, v and out must have the planned dtypes");
        TORCH_CHECK(q.device() == device_ && k.device() == device_ && v.device() == device_ && out.device() == device_,
                    what, ": q, k, v and out must be on the planned device");
        TORCH_CHECK(q.sizes() == at::IntArrayRef(q_sizes_) && q.strides() == at::IntArrayRef(q_strides_)
                    && k.sizes() == at::IntArrayRef(k_sizes_) && v.sizes() == at::IntArrayRef(k_sizes_)
                    && k.strides() == at::IntArrayRef(k_strides_) && v.strides() == at::IntArrayRef(v_strides_)
                    && out.sizes() == at::IntArrayRef(q_sizes_) && out.strides() == at::IntArrayRef(out_strides_),
                    what, ": q, k, v and out must have the planned shapes and strides");
    }

    static void swap_qkv_out(Flash_fwd_params &params, at::Tensor const &q, at::Tensor const &k,
                             at::Tensor const &v, at::Tensor const &out) {
        params.q_ptr = q.data_ptr();
        params.k_ptr = k.data_ptr();
        params.v_ptr = v.data_ptr();
        params.o_ptr = out.data_ptr();
    }

    void keep_alive(ListTensors const &lists, DescaleTensors const &descales) {
        lists_.clear();
        for (auto const &t : lists) {
            if (t.has_value()) { lists_.push_back(*t); }
        }
        for (auto const &t : descales) {
            if (t.has_value()) { lists_.push_back(*t); }
        }
    }

    c10::Device device_;
    at::ScalarType dtype_, out_dtype_;
    std::vector<int64_t> q_sizes_, q_strides_, k_sizes_, k_strides_, v_strides_, out_strides_;
    SparseLaunch launch_;
    std::vector<int64_t> lse_sizes_;
    int64_t out_accum_numel_ = 0, lse_accum_numel_ = 0;
    int64_t planned_max_seqlen_q_, planned_max_seqlen_k_;  // varlen: the bounds run_with's cu_seqlens must keep
    bool released_ = false;
    bool graph_launch_;
    std::unique_ptr<KernelGraph> graph_;  // made by the first eager run with graph_launch
    std::array<Layout, 10> list_layouts_;
    std::array<Layout, 3> descale_layouts_;
    std::vector<at::Tensor> lists_;
};

std::tuple<at::Tensor, at::Tensor> mha_fwd_sparse(
        at::Tensor q, at::Tensor k, at::Tensor v,
        at::Tensor full_cnt, at::Tensor full_idx,
        c10::optional<at::Tensor> mask_cnt, c10::optional<at::Tensor> mask_idx,
        c10::optional<at::Tensor> cu_total_m_blocks, c10::optional<at::Tensor> cu_block_idx_offsets,
        c10::optional<at::Tensor> cu_seqlens_q, c10::optional<at::Tensor> cu_seqlens_k,
        c10::optional<int64_t> max_seqlen_q, c10::optional<int64_t> max_seqlen_k,
        double softmax_scale, int64_t block_size, int64_t q_block_size, bool causal,
        int64_t num_splits, c10::optional<bool> pack_gqa,
        c10::optional<at::Tensor> seqused_k, c10::optional<at::Tensor> page_table,
        c10::optional<at::Tensor> q_descale, c10::optional<at::Tensor> k_descale, c10::optional<at::Tensor> v_descale) {
    at::Tensor out = at::empty_like(q, q.options().dtype(out_dtype_of(q)));
    at::Tensor lse = mha_fwd_sparse_into(q, k, v, out, full_cnt, full_idx, mask_cnt, mask_idx, cu_total_m_blocks,
                                         cu_block_idx_offsets, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         softmax_scale, block_size, q_block_size, causal, num_splits, pack_gqa, seqused_k, page_table,
                                         q_descale, k_descale, v_descale);
    return {out, lse};
}

namespace {

// Shapes only, for torch.compile and FakeTensor.
std::tuple<at::Tensor, at::Tensor> mha_fwd_sparse_meta(
        at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor full_cnt, at::Tensor full_idx,
        c10::optional<at::Tensor> mask_cnt, c10::optional<at::Tensor> mask_idx,
        c10::optional<at::Tensor> cu_total_m_blocks, c10::optional<at::Tensor> cu_block_idx_offsets,
        c10::optional<at::Tensor> cu_seqlens_q, c10::optional<at::Tensor> cu_seqlens_k,
        c10::optional<int64_t> max_seqlen_q, c10::optional<int64_t> max_seqlen_k,
        double softmax_scale, int64_t block_size, int64_t q_block_size, bool causal,
        int64_t num_splits, c10::optional<bool> pack_gqa,
        c10::optional<at::Tensor> seqused_k, c10::optional<at::Tensor> page_table,
        c10::optional<at::Tensor> q_descale, c10::optional<at::Tensor> k_descale, c10::optional<at::Tensor> v_descale) {
    auto lse_opts = q.options().dtype(at::kFloat);
    at::Tensor out = at::empty_like(q, q.options().dtype(out_dtype_of(q)));
    at::Tensor lse = q.dim() == 3 ? at::empty({q.size(1), q.size(0)}, lse_opts)  // varlen (total_q, h, d)
                                              : at::empty({q.size(0), q.size(2), q.size(1)}, lse_opts);
    return {out, lse};
}

at::Tensor mha_fwd_sparse_into_meta(
        at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out, at::Tensor full_cnt, at::Tensor full_idx,
        c10::optional<at::Tensor> mask_cnt, c10::optional<at::Tensor> mask_idx,
        c10::optional<at::Tensor> cu_total_m_blocks, c10::optional<at::Tensor> cu_block_idx_offsets,
        c10::optional<at::Tensor> cu_seqlens_q, c10::optional<at::Tensor> cu_seqlens_k,
        c10::optional<int64_t> max_seqlen_q, c10::optional<int64_t> max_seqlen_k,
        double softmax_scale, int64_t block_size, int64_t q_block_size, bool causal,
        int64_t num_splits, c10::optional<bool> pack_gqa,
        c10::optional<at::Tensor> seqused_k, c10::optional<at::Tensor> page_table,
        c10::optional<at::Tensor> q_descale, c10::optional<at::Tensor> k_descale, c10::optional<at::Tensor> v_descale) {
    return std::get<1>(mha_fwd_sparse_meta(q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, cu_total_m_blocks,
                                           cu_block_idx_offsets, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           softmax_scale, block_size, q_block_size, causal, num_splits, pack_gqa, seqused_k, page_table,
                                         q_descale, k_descale, v_descale));
}

}  // namespace

TORCH_LIBRARY(flash_attn_3_sparse, m) {
    m.def("fwd(Tensor q, Tensor k, Tensor v, Tensor full_cnt, Tensor full_idx, Tensor? mask_cnt, Tensor? mask_idx, "
          "Tensor? cu_total_m_blocks, Tensor? cu_block_idx_offsets, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
          "int? max_seqlen_q, int? max_seqlen_k, *, float softmax_scale, int block_size=128, int q_block_size=128, "
          "bool causal=False, int num_splits=1, bool? pack_gqa=None, Tensor? seqused_k=None, Tensor? page_table=None, "
          "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None) -> (Tensor out, Tensor softmax_lse)");
    // The same forward writing into a given out (no allocation, no copy): a plan's run.
    m.def("fwd_out(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor full_cnt, Tensor full_idx, Tensor? mask_cnt, "
          "Tensor? mask_idx, Tensor? cu_total_m_blocks, Tensor? cu_block_idx_offsets, Tensor? cu_seqlens_q, "
          "Tensor? cu_seqlens_k, int? max_seqlen_q, int? max_seqlen_k, *, float softmax_scale, int block_size=128, "
          "int q_block_size=128, bool causal=False, int num_splits=1, bool? pack_gqa=None, Tensor? seqused_k=None, "
          "Tensor? page_table=None, Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None) -> Tensor softmax_lse");
}

TORCH_LIBRARY_IMPL(flash_attn_3_sparse, CUDA, m) {
    m.impl("fwd", &mha_fwd_sparse);
    m.impl("fwd_out", &mha_fwd_sparse_into);
}

TORCH_LIBRARY_IMPL(flash_attn_3_sparse, Meta, m) {
    m.impl("fwd", &mha_fwd_sparse_meta);
    m.impl("fwd_out", &mha_fwd_sparse_into_meta);
}

// The eager entry points, bound with pybind11 into flash_attn_3._C by its PyInit__C (patch
// flash-attn-3/0010): a call costs a few us less than through torch.classes or torch.ops, whose
// argument parsing against a schema is most of the planned forward's host time. Named arguments,
// as the ops'.
int flash_sparse_add_python_api(PyObject *module) {
    namespace py = pybind11;
    try {
        auto m = py::reinterpret_borrow<py::module_>(module);
        py::class_<SparseForward>(m, "SparseForward",
                                  "A sparse forward planned once (fwd_out's arguments, by name); run(q, k, v, out) launches it; "
                                  "graph_launch: later runs launch its kernels as one CUDA graph")
            .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                          c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                          c10::optional<int64_t>, c10::optional<int64_t>, double, int64_t, int64_t, bool, int64_t,
                          c10::optional<bool>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                          c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>, bool>(),
                 py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("full_cnt"), py::arg("full_idx"),
                 py::arg("mask_cnt"), py::arg("mask_idx"), py::arg("cu_total_m_blocks"), py::arg("cu_block_idx_offsets"),
                 py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"),
                 py::kw_only(), py::arg("softmax_scale"), py::arg("block_size"), py::arg("q_block_size"),
                 py::arg("causal"), py::arg("num_splits"), py::arg("pack_gqa"), py::arg("seqused_k") = py::none(),
                 py::arg("page_table") = py::none(), py::arg("q_descale") = py::none(), py::arg("k_descale") = py::none(),
                 py::arg("v_descale") = py::none(), py::arg("graph_launch") = false)
            .def("run", &SparseForward::run, "Launch over q, k, v into out; returns the plan's LSE",
                 py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"))
            .def("run_with", &SparseForward::run_with,
                 "Launch over q, k, v and the given lists (laid out as planned) into out; returns the LSE, "
                 "a new one unless softmax_lse is given",
                 py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("full_cnt"), py::arg("full_idx"),
                 py::arg("mask_cnt"), py::arg("mask_idx"), py::arg("cu_total_m_blocks"), py::arg("cu_block_idx_offsets"),
                 py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q") = py::none(),
                 py::arg("max_seqlen_k") = py::none(), py::arg("softmax_lse") = py::none(),
                 py::arg("seqused_k") = py::none(), py::arg("page_table") = py::none(), py::arg("q_descale") = py::none(),
                 py::arg("k_descale") = py::none(), py::arg("v_descale") = py::none())
            .def("release_run_buffers", &SparseForward::release_run_buffers,
                 "Free run's LSE, split partials and tile counter (run_with allocates its own); run is refused after");
        m.def("fwd_into", &mha_fwd_sparse_into, "fwd_out without the dispatcher: the forward into out; returns the LSE",
              py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("full_cnt"), py::arg("full_idx"),
              py::arg("mask_cnt"), py::arg("mask_idx"), py::arg("cu_total_m_blocks"), py::arg("cu_block_idx_offsets"),
              py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"),
              py::kw_only(), py::arg("softmax_scale"), py::arg("block_size"), py::arg("q_block_size"),
              py::arg("causal"), py::arg("num_splits"), py::arg("pack_gqa"), py::arg("seqused_k") = py::none(),
              py::arg("page_table") = py::none(), py::arg("q_descale") = py::none(), py::arg("k_descale") = py::none(),
              py::arg("v_descale") = py::none());
        m.def("sparse_disabled", &sparse_build_disabled,
              "The FLASH_ATTENTION_DISABLE_* flags (suffixes) of this build that the sparse path reads");
    } catch (py::error_already_set &error) {
        error.restore();
        return -1;
    } catch (std::exception const &error) {
        PyErr_SetString(PyExc_ImportError, error.what());
        return -1;
    }
    return 0;
}
