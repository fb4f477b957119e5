/******************************************************************************
 * The (O, LSE) merge of the sparse forward's split partials and of flash_attn_combine
 * (stage 6 of the sparse patch set).
 *
 * Upstream's combine kernel gives a CTA four rows and walks the splits a few at a time, so a
 * decode call with few query rows (B1 Sq1 H32: 32 rows, 8 CTAs, 32 splits) waits for one load
 * round trip after another (4.9 us of a ~20 us call, run 25). Here a CTA takes one row: its four
 * warps load up to 32 splits' partials at once, before and while the LSEs are reduced, then merge
 * them across warps in shared memory. Same contract as upstream's combine with the stage-6 patch:
 * varlen rows past a sequence's length are neither read nor written, a row no partial saw gets
 * O = 0 and LSE = -inf (combine_empty_lse_is_neg_inf) or +inf, and partials whose LSE is -inf
 * are not merged. The accumulation order differs from upstream's (per warp, then across warps),
 * so results match it to rounding, not bitwise; repeated calls are bitwise equal.
 ******************************************************************************/

#pragma once

#include <cmath>

#include "namespace_config.h"
#include "flash.h"

namespace FLASH_NAMESPACE {

namespace sparse_combine {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kSplitsPerWarpInFlight = 8;  // 4 warps x 8 = 32 splits' loads in flight per row

__forceinline__ __device__ float4 operator_fma(const float scale, const float4 v, const float4 acc) {
    return make_float4(fmaf(scale, v.x, acc.x), fmaf(scale, v.y, acc.y), fmaf(scale, v.z, acc.z), fmaf(scale, v.w, acc.w));
}

template <typename Element>
__forceinline__ __device__ void store4(Element *dst, const float4 v) {
    dst[0] = Element(v.x); dst[1] = Element(v.y); dst[2] = Element(v.z); dst[3] = Element(v.w);
}

}  // namespace sparse_combine

// One CTA per row (b, h, i) of the partials (S, b, h, seqlen_q, d_rounded); kFloat4PerLane * 128
// >= d_rounded. Launched with params.num_splits <= 128.
template <typename Element, int kFloat4PerLane>
__global__ void __launch_bounds__(sparse_combine::kThreads)
flash_sparse_combine_kernel(const __grid_constant__ Flash_fwd_params params) {
    using namespace sparse_combine;
    const int row = blockIdx.x;
    const int rows = params.b * params.h * params.seqlen_q;
    const int batch = row / (params.h * params.seqlen_q);
    const int head = (row / params.seqlen_q) % params.h;
    const int i = row % params.seqlen_q;
    int q_row = i;  // the output row within the batch (padded) or of the packed varlen batch
    if (params.cu_seqlens_q != nullptr) {
        const int start = params.cu_seqlens_q[batch];
        if (i >= params.cu_seqlens_q[batch + 1] - start) { return; }  // padding: never written
        q_row = start + i;
    }
    const int num_splits = params.num_splits;
    const int n4 = params.d_rounded / 4;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float *lse_accum = reinterpret_cast<const float *>(params.softmax_lseaccum_ptr);
    const float4 *o_accum = reinterpret_cast<const float4 *>(params.oaccum_ptr);

    __shared__ float s_scale[kThreads];
    __shared__ float s_reduce[kWarps];
    __shared__ float4 s_acc[kWarps][kFloat4PerLane * 32];

    // This warp's first splits (warp, warp + 4, ...): loads issued before the LSE reduction,
    // which they do not depend on. A split whose LSE is -inf is skipped when merging.
    float4 loaded[kSplitsPerWarpInFlight][kFloat4PerLane];
    auto load_splits = [&](const int first) {
        #pragma unroll
        for (int u = 0; u < kSplitsPerWarpInFlight; ++u) {
            const int split = first + u * kWarps;
            #pragma unroll
            for (int f = 0; f < kFloat4PerLane; ++f) {
                const int idx = lane + f * 32;
                loaded[u][f] = split < num_splits && idx < n4
                    ? __ldg(o_accum + (size_t(split) * rows + row) * n4 + idx) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
    };
    load_splits(warp);

    // LSE of the row: max, then the sum of exp(lse - max), over the splits (one per thread).
    const float lse = threadIdx.x < num_splits ? lse_accum[size_t(threadIdx.x) * rows + row] : -INFINITY;
    float lse_max = lse;
    #pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) { lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffff, lse_max, offset)); }
    if (lane == 0) { s_reduce[warp] = lse_max; }
    __syncthreads();
    lse_max = fmaxf(fmaxf(s_reduce[0], s_reduce[1]), fmaxf(s_reduce[2], s_reduce[3]));
    const float max_shift = lse_max == -INFINITY ? 0.f : lse_max;
    float sum = lse == -INFINITY ? 0.f : expf(lse - max_shift);
    #pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) { sum += __shfl_xor_sync(0xffffffff, sum, offset); }
    __syncthreads();  // s_reduce is reused
    if (lane == 0) { s_reduce[warp] = sum; }
    __syncthreads();
    sum = (s_reduce[0] + s_reduce[1]) + (s_reduce[2] + s_reduce[3]);
    // A row that no split saw: +inf here makes every scale 0, as in upstream's combine.
    const float lse_final = (sum == 0.f || sum != sum) ? INFINITY : logf(sum) + max_shift;
    s_scale[threadIdx.x] = threadIdx.x < num_splits ? expf(lse - lse_final) : 0.f;
    if (threadIdx.x == 0) {
        const float written = lse_final == INFINITY && params.combine_empty_lse_is_neg_inf ? -INFINITY : lse_final;
        float *lse_out = reinterpret_cast<float *>(params.softmax_lse_ptr);
        if (params.cu_seqlens_q != nullptr) {  // varlen: LSE is (h, total_q), as the sparse calls set unpadded_lse
            lse_out[size_t(head) * params.total_q + q_row] = written;
        } else {
            lse_out[row] = written;  // (b, h, seqlen_q)
        }
    }
    __syncthreads();

    // Merge: this warp's splits in order, then the four warps' sums in order (deterministic).
    float4 acc[kFloat4PerLane];
    #pragma unroll
    for (int f = 0; f < kFloat4PerLane; ++f) { acc[f] = make_float4(0.f, 0.f, 0.f, 0.f); }
    for (int first = warp; first < num_splits; first += kWarps * kSplitsPerWarpInFlight) {
        if (first != warp) { load_splits(first); }
        #pragma unroll
        for (int u = 0; u < kSplitsPerWarpInFlight; ++u) {
            const int split = first + u * kWarps;
            const float scale = split < num_splits ? s_scale[split] : 0.f;
            if (scale != 0.f) {  // skips splits that saw nothing (their partials hold no keys)
                #pragma unroll
                for (int f = 0; f < kFloat4PerLane; ++f) { acc[f] = operator_fma(scale, loaded[u][f], acc[f]); }
            }
        }
    }
    #pragma unroll
    for (int f = 0; f < kFloat4PerLane; ++f) { s_acc[warp][lane + f * 32] = acc[f]; }
    __syncthreads();

    const int64_t o_offset = (params.cu_seqlens_q != nullptr ? int64_t(0) : int64_t(batch) * params.o_batch_stride)
        + int64_t(q_row) * params.o_row_stride + int64_t(head) * params.o_head_stride;
    Element *o = reinterpret_cast<Element *>(params.o_ptr) + o_offset;
    for (int idx = threadIdx.x; idx < n4 && idx * 4 < params.d; idx += kThreads) {
        float4 total = s_acc[0][idx];
        #pragma unroll
        for (int w = 1; w < kWarps; ++w) {
            total = make_float4(total.x + s_acc[w][idx].x, total.y + s_acc[w][idx].y, total.z + s_acc[w][idx].z, total.w + s_acc[w][idx].w);
        }
        store4(o + idx * 4, total);  // head dims are multiples of 8, so a float4 is all in or all out
    }
}

template <typename Element, int Headdim>
void run_sparse_combine(const Flash_fwd_params &params, cudaStream_t stream) {
    constexpr int kFloat4PerLane = Headdim <= 128 ? 1 : 2;
    const int rows = params.b * params.h * params.seqlen_q;
    flash_sparse_combine_kernel<Element, kFloat4PerLane><<<rows, sparse_combine::kThreads, 0, stream>>>(params);
}

}  // namespace FLASH_NAMESPACE
