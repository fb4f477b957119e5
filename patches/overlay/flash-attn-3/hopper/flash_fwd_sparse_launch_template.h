/******************************************************************************
 * Launch of the sparse SM90 forward: the dense kernel with the mainloop's Sparse flag on
 * (key blocks from the block lists of params.sparse, sparse_block_list.h).
 * One K/V block list per (batch, table head, query tile), so no K/V multicast (ClusterM = 1);
 * no local window, softcap, append-KV or Qv on this path.
 ******************************************************************************/

#pragma once

#include "flash_fwd_launch_template.h"

// PagedKVNonTMA: paged K/V in pages that do not hold whole 128-key blocks, loaded with cp.async
// (instantiated under PackGQA only, as upstream's; pages of whole blocks take TMA in the others).
// e4m3 (FP8) Q/K/V write bf16 out, as upstream's FP8 forward; V is transposed in shared memory.
template <typename T, int kHeadDim, bool Split, bool PackGQA, int kBlockM, bool PagedKVNonTMA = false>
void run_mha_fwd_sparse_(Flash_fwd_params &params, cudaStream_t stream) {
    static constexpr bool Is_FP8 = cute::is_same_v<T, cutlass::float_e4m3_t>;
    using ElementOut = std::conditional_t<Is_FP8, cutlass::bfloat16_t, T>;
    static_assert((sizeof(T) == 2 || Is_FP8) && kHeadDim <= 128, "sparse kernels: fp16, bf16 or e4m3, head dim 64 or 128");
    static_assert(kBlockM == kSparseBlockM || (kBlockM == kSparseBlockMDecode && Split && PackGQA),
                  "64-row sparse tiles are instantiated for packed split calls only");
    static_assert(!PagedKVNonTMA || PackGQA, "cp.async paged sparse kernels are instantiated under PackGQA only");
    BOOL_SWITCH(params.is_causal, Is_causal, [&] {
        VARLEN_SWITCH(params.cu_seqlens_q || params.cu_seqlens_k || params.seqused_q || params.seqused_k, Varlen, [&] {
            run_flash_fwd<90, kHeadDim, kHeadDim, 1 /*ClusterM*/, T, ElementOut, Is_causal, false /*Is_local*/, false /*Has_softcap*/,
                          Varlen, PagedKVNonTMA, false /*AppendKV*/, false /*HasQv*/, PackGQA, Split,
                          false /*V_colmajor*/, kBlockM /*SparseBlockM*/>(params, stream);
        });
    });
}
