/******************************************************************************
 * Host entry points of the sparse block-list forward and of the (O, LSE) combine
 * (stage 5 of the sparse patch set), bound in flash_api.cpp's module.
 ******************************************************************************/

#pragma once

#include <array>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

#include "namespace_config.h"
#include "flash.h"

class PlannedKernelGraph;  // planned_kernel_graph.h: graph_launch's CUDA graph

namespace FLASH_NAMESPACE {

// (head dims with compiled kernels, whether other multiples of 8 run on the next larger one):
// a build narrowed by the FLASHATTENTION_DISABLE_* macros (the dev profile) runs only some.
std::tuple<std::vector<int64_t>, bool> sparse_head_dims();

// Attention of q over the K/V blocks named by the lists, batched (q: b x seqlen_q x h x d) or
// varlen (q: total_q x h x d with cu_seqlens_q). Returns {out, softmax_lse}, or, when out_partial
// is given, writes fp32 partials to its slots [partial_offset, partial_offset + num_splits) and
// returns {out_partial, lse_partial}. pack_gqa puts the query heads of a K/V head in one tile
// (the lists must then be shared or per K/V head). With page_table (b x max_pages int32, batched
// only), k and v are paged caches (num_pages x page_size x h_k x d): key position p of batch b is
// row p % page_size of page page_table[b][p / page_size].
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
    std::optional<at::Tensor> k_mask_source_, std::optional<at::Tensor> v_mask_source_);

// A prepared sparse forward: its parameters, flags and buffers (flash_api_sparse.cpp).
struct SparseLaunch {
    Flash_fwd_params params;
    at::Tensor out, softmax_lse, out_accum, lse_accum;
    bool partial = false, split = false, wide = false, empty = false;
};

// A sparse forward planned once and run many times (flash_attn_sparse.SparsePlan on FA-2):
// the constructor takes mha_fwd_sparse's arguments (with an example q, k, v and out; no partials
// and no second K/V source), checks them, fills the parameters and allocates the LSE and split
// buffers; run(q, k, v, out) swaps in tensors of the planned shapes, strides and dtype and
// launches, returning the plan's LSE buffer (the next run overwrites it). The lists, offsets and
// page table are the caller's tensors, read at every run. run_with also swaps in the lists,
// offsets, seqused_k and page table (laid out as planned), returns a new LSE and takes its split
// partials from the allocator per call (stream-ordered, so any stream): the one-shot cache's
// launch, whose entry drops run's buffers (release_run_buffers) to hold none. With graph_launch,
// the runs after the first launch the planned kernels as one CUDA graph (planned_kernel_graph.h) given each
// run's parameters, one cudaGraphLaunch instead of a runtime launch per kernel; a run on a stream
// being captured launches them directly (a graph cannot be launched into a capture).

class SparseForward {
  public:
    SparseForward(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, at::Tensor out,
                  const at::Tensor &full_cnt, const at::Tensor &full_idx,
                  std::optional<at::Tensor> mask_cnt, std::optional<at::Tensor> mask_idx,
                  std::optional<at::Tensor> cu_seqlens_q, std::optional<at::Tensor> cu_seqlens_k,
                  std::optional<at::Tensor> seqused_k, std::optional<at::Tensor> page_table,
                  std::optional<at::Tensor> cu_total_m_blocks, std::optional<at::Tensor> cu_block_idx_offsets,
                  int max_seqlen_q, int max_seqlen_k, int block_size, int q_block_size,
                  double softmax_scale, bool is_causal, int num_splits, bool pack_gqa, bool graph_launch = false);
    ~SparseForward();
    at::Tensor run(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, at::Tensor out);
    at::Tensor run_with(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, at::Tensor out,
                        const at::Tensor &full_cnt, const at::Tensor &full_idx,
                        std::optional<at::Tensor> mask_cnt, std::optional<at::Tensor> mask_idx,
                        std::optional<at::Tensor> cu_seqlens_q, std::optional<at::Tensor> cu_seqlens_k,
                        std::optional<at::Tensor> seqused_k, std::optional<at::Tensor> page_table,
                        std::optional<at::Tensor> cu_total_m_blocks, std::optional<at::Tensor> cu_block_idx_offsets);
    // Frees what only run uses (its LSE, split partials and lists); run is refused after.
    void release_run_buffers();

  private:
    // The constructor's and run_with's list arguments, in their order.
    using ListTensors = std::array<std::optional<at::Tensor>, 10>;
    struct Layout {
        bool given = false;
        std::vector<int64_t> sizes, strides;
    };
    void check_planned(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &out,
                       const char *what) const;
    bool has_layout(const std::optional<at::Tensor> &t, const Layout &planned) const;
    void keep_alive(const ListTensors &lists);
    void launch_planned(SparseLaunch &launch);  // directly, or through graph_

    SparseLaunch launch_;
    at::Device device_;
    std::vector<int64_t> q_sizes_, q_strides_, k_sizes_, k_strides_, v_strides_, out_strides_, lse_sizes_;
    int64_t out_accum_numel_ = 0, lse_accum_numel_ = 0;
    at::ScalarType dtype_;
    std::array<Layout, 10> list_layouts_;
    bool released_ = false;
    std::vector<at::Tensor> lists_;  // kept alive: the parameters point into them
    bool graph_launch_ = false;
    std::unique_ptr<PlannedKernelGraph> graph_;  // made by the first eager run with graph_launch
};

// Merges partials (S x b x h x seqlen_q x d_rounded fp32, S x b x h x seqlen_q fp32) into out and
// softmax_lse, laid out as mha_fwd_sparse returns them, with the sparse combine kernel (flash_sparse_combine.h).
void mha_combine(const at::Tensor &out_partial, const at::Tensor &lse_partial,
                 at::Tensor out, at::Tensor softmax_lse, std::optional<at::Tensor> cu_seqlens_q_);

}  // namespace FLASH_NAMESPACE
