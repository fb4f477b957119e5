/******************************************************************************
 * The (O, LSE) merge of the sparse forward's split partials and of flash_attn_combine
 * (stage 6 of the sparse patch set).
 *
 * Upstream's combine kernel gives a CTA four rows and walks the splits a few at a time, so a
 * decode call with few query rows (B1 Sq1 H32: 32 rows, 8 CTAs, 32 splits) waits for one load
 * round trip after another (about a quarter of a decode call). Here each row gets its own warps
 * and each warp loads 8 of its splits' partials at once, before and while the LSEs are reduced.
 * Few rows (decode with one query row): four warps per row, 32 splits in flight, merged across
 * warps in shared memory. Many rows (several query rows): one warp per row, no shared memory or
 * CTA barrier; four warps per row there left the GPU's warp slots too few for the rows and made
 * the merge slower than upstream's (B8 Sq16 H32, 4096 rows: 5.8 -> 10.7 us).
 *
 * The sparse contract, which upstream's combine does not keep: varlen rows past a sequence's
 * length are neither read nor written (upstream combines only padded rows), and a row no partial
 * saw gets O = 0 and LSE = -inf, the neutral element of a later merge (upstream writes +inf).
 * Partials whose LSE is -inf are not merged. The accumulation order differs from upstream's (per
 * warp, then across warps), so results match it to rounding; repeated calls are bitwise equal.
 ******************************************************************************/

#pragma once

#include <cmath>

#include "namespace_config.h"
#include "flash.h"

namespace FLASH_NAMESPACE {

namespace sparse_combine {

// Programmatic dependent launch (sm_90+): the combine is launched to start while the split
// kernel that writes its partials still runs, and waits here for that kernel to finish and flush
// its writes, so in a stream or CUDA graph the gap between the two kernels is not paid.
__forceinline__ __device__ void wait_for_partials() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

constexpr int kWarpsPerCta = 4;
constexpr int kMaxSplits = 128;
constexpr int kSplitsPerWarpInFlight = 8;

__forceinline__ __device__ float4 fma4(const float scale, const float4 v, const float4 acc) {
    return make_float4(fmaf(scale, v.x, acc.x), fmaf(scale, v.y, acc.y), fmaf(scale, v.z, acc.z), fmaf(scale, v.w, acc.w));
}

__forceinline__ __device__ float4 add4(const float4 a, const float4 b) {
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

template <typename Element>
__forceinline__ __device__ void store4(Element *dst, const float4 v) {
    dst[0] = Element(v.x); dst[1] = Element(v.y); dst[2] = Element(v.z); dst[3] = Element(v.w);
}

// Reduces v over the kWarpsPerRow warps of a row: shuffles within a warp, then shared memory.
template <int kWarpsPerRow, typename Op>
__forceinline__ __device__ float row_reduce(float v, float *scratch, const int warp_in_row, const int lane, Op op) {
    #pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) { v = op(v, __shfl_xor_sync(0xffffffff, v, offset)); }
    if constexpr (kWarpsPerRow > 1) {
        __syncthreads();  // scratch may still be read by the previous reduction
        if (lane == 0) { scratch[warp_in_row] = v; }
        __syncthreads();
        v = scratch[0];
        #pragma unroll
        for (int w = 1; w < kWarpsPerRow; ++w) { v = op(v, scratch[w]); }
    }
    return v;
}

}  // namespace sparse_combine

// Row r = (b, h, i) of the partials (S, b, h, seqlen_q, d_rounded) is merged by kWarpsPerRow
// warps; a CTA of four warps takes 4 / kWarpsPerRow rows. kFloat4PerLane * 128 >= d_rounded;
// params.num_splits <= kMaxSplits.
template <typename Element, int kFloat4PerLane, int kWarpsPerRow>
__global__ void __launch_bounds__(sparse_combine::kWarpsPerCta * 32)
flash_sparse_combine_kernel(const __grid_constant__ Flash_fwd_params params) {
    using namespace sparse_combine;
    constexpr int kRowsPerCta = kWarpsPerCta / kWarpsPerRow;
    constexpr int kThreadsPerRow = kWarpsPerRow * 32;
    constexpr int kSplitsPerThread = kMaxSplits / kThreadsPerRow;  // for the LSE reduction
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row_in_cta = warp / kWarpsPerRow, warp_in_row = warp % kWarpsPerRow;
    const int thread_in_row = warp_in_row * 32 + lane;
    const int rows = params.b * params.h * params.seqlen_q;
    const int row = blockIdx.x * kRowsPerCta + row_in_cta;
    // Warps leave only where no CTA barrier follows: with one warp per row there is none, and
    // with four the CTA is the row.
    if (row >= rows) { return; }
    const int batch = row / (params.h * params.seqlen_q);
    const int head = (row / params.seqlen_q) % params.h;
    const int i = row % params.seqlen_q;
    int q_row = i;  // the output row within the batch (padded) or of the packed varlen batch
    if (params.cu_seqlens_q != nullptr) {
        const int start = params.cu_seqlens_q[batch];
        if (i >= params.cu_seqlens_q[batch + 1] - start) { return; }  // padding: never written
        q_row = start + i;
    }
    wait_for_partials();  // nothing before this reads what the split kernel writes
    const int num_splits = params.num_splits;
    const int n4 = params.d_rounded / 4;
    const float *lse_accum = reinterpret_cast<const float *>(params.softmax_lseaccum_ptr);
    const float4 *o_accum = reinterpret_cast<const float4 *>(params.oaccum_ptr);

    __shared__ float s_scale[kRowsPerCta][kMaxSplits];
    __shared__ float s_reduce[kWarpsPerRow];
    __shared__ float4 s_acc[kWarpsPerRow > 1 ? kWarpsPerRow : 1][kFloat4PerLane * 32];

    // This warp's splits are warp_in_row, + kWarpsPerRow, ...; the first 8 are loaded before the
    // LSE reduction, which they do not depend on.
    float4 loaded[kSplitsPerWarpInFlight][kFloat4PerLane];
    auto load_splits = [&](const int first) {
        #pragma unroll
        for (int u = 0; u < kSplitsPerWarpInFlight; ++u) {
            const int split = first + u * kWarpsPerRow;
            #pragma unroll
            for (int f = 0; f < kFloat4PerLane; ++f) {
                const int idx = lane + f * 32;
                loaded[u][f] = split < num_splits && idx < n4
                    ? __ldg(o_accum + (size_t(split) * rows + row) * n4 + idx) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
    };
    load_splits(warp_in_row);

    // LSE of the row: max, then the sum of exp(lse - max), over the splits.
    float lse[kSplitsPerThread];
    float lse_max = -INFINITY;
    #pragma unroll
    for (int s = 0; s < kSplitsPerThread; ++s) {
        const int split = thread_in_row + s * kThreadsPerRow;
        lse[s] = split < num_splits ? lse_accum[size_t(split) * rows + row] : -INFINITY;
        lse_max = fmaxf(lse_max, lse[s]);
    }
    lse_max = row_reduce<kWarpsPerRow>(lse_max, s_reduce, warp_in_row, lane, [](float a, float b) { return fmaxf(a, b); });
    const float max_shift = lse_max == -INFINITY ? 0.f : lse_max;
    float sum = 0.f;
    #pragma unroll
    for (int s = 0; s < kSplitsPerThread; ++s) { sum += lse[s] == -INFINITY ? 0.f : expf(lse[s] - max_shift); }
    sum = row_reduce<kWarpsPerRow>(sum, s_reduce, warp_in_row, lane, [](float a, float b) { return a + b; });
    // A row that no split saw: +inf here makes every scale 0; its LSE is written as -inf. A split
    // with a NaN LSE (NaN in its inputs) makes the sum, every scale and so O and LSE NaN.
    const float lse_final = sum == 0.f ? INFINITY : logf(sum) + max_shift;
    #pragma unroll
    for (int s = 0; s < kSplitsPerThread; ++s) {
        const int split = thread_in_row + s * kThreadsPerRow;
        s_scale[row_in_cta][split] = split < num_splits ? expf(lse[s] - lse_final) : 0.f;
    }
    if (thread_in_row == 0) {
        const float written = lse_final == INFINITY ? -INFINITY : lse_final;
        float *lse_out = reinterpret_cast<float *>(params.softmax_lse_ptr);
        if (params.cu_seqlens_q != nullptr) {  // varlen: LSE is (h, total_q), as the sparse calls set unpadded_lse
            lse_out[size_t(head) * params.total_q + q_row] = written;
        } else {
            lse_out[row] = written;  // (b, h, seqlen_q)
        }
    }
    if constexpr (kWarpsPerRow > 1) { __syncthreads(); } else { __syncwarp(); }

    // Merge: this warp's splits in order, then (several warps per row) the warps' sums in order,
    // so the result is deterministic.
    float4 acc[kFloat4PerLane];
    #pragma unroll
    for (int f = 0; f < kFloat4PerLane; ++f) { acc[f] = make_float4(0.f, 0.f, 0.f, 0.f); }
    for (int first = warp_in_row; first < num_splits; first += kWarpsPerRow * kSplitsPerWarpInFlight) {
        if (first != warp_in_row) { load_splits(first); }
        #pragma unroll
        for (int u = 0; u < kSplitsPerWarpInFlight; ++u) {
            const int split = first + u * kWarpsPerRow;
            const float scale = split < num_splits ? s_scale[row_in_cta][split] : 0.f;
            if (scale != 0.f) {  // skips splits that saw nothing (their partials hold no keys)
                #pragma unroll
                for (int f = 0; f < kFloat4PerLane; ++f) { acc[f] = fma4(scale, loaded[u][f], acc[f]); }
            }
        }
    }

    const int64_t o_offset = (params.cu_seqlens_q != nullptr ? int64_t(0) : int64_t(batch) * params.o_batch_stride)
        + int64_t(q_row) * params.o_row_stride + int64_t(head) * params.o_head_stride;
    Element *o = reinterpret_cast<Element *>(params.o_ptr) + o_offset;
    // Head dims are multiples of 8, so a float4 of the output is all in or all out.
    if constexpr (kWarpsPerRow == 1) {
        #pragma unroll
        for (int f = 0; f < kFloat4PerLane; ++f) {
            const int idx = lane + f * 32;
            if (idx < n4 && idx * 4 < params.d) { store4(o + idx * 4, acc[f]); }
        }
    } else {
        #pragma unroll
        for (int f = 0; f < kFloat4PerLane; ++f) { s_acc[warp_in_row][lane + f * 32] = acc[f]; }
        __syncthreads();
        for (int idx = thread_in_row; idx < n4 && idx * 4 < params.d; idx += kThreadsPerRow) {
            float4 total = s_acc[0][idx];
            #pragma unroll
            for (int w = 1; w < kWarpsPerRow; ++w) { total = add4(total, s_acc[w][idx]); }
            store4(o + idx * 4, total);
        }
    }
}

// Four warps per row while the rows' warps fill at most a quarter of the GPU's warp slots (B8
// Sq1 H32: 256 rows), one warp per row past that (B8 Sq16 H32: 4096 rows).
template <typename Element, int Headdim>
void run_sparse_combine(const Flash_fwd_params &params, cudaStream_t stream) {
    constexpr int kFloat4PerLane = Headdim <= 128 ? 1 : 2;
    const int rows = params.b * params.h * params.seqlen_q;
    int device = 0, num_sms = 0, warps_per_sm = 0, major = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
    cudaDeviceGetAttribute(&warps_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    warps_per_sm /= 32;
    const bool four_warps_per_row = int64_t(rows) * 4 * 4 <= int64_t(num_sms) * warps_per_sm;
    auto kernel = four_warps_per_row ? flash_sparse_combine_kernel<Element, kFloat4PerLane, 4>
                                     : flash_sparse_combine_kernel<Element, kFloat4PerLane, 1>;
    constexpr int kRowsPerCtaOneWarp = sparse_combine::kWarpsPerCta;
    cudaLaunchAttribute early_start[1];
    early_start[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    early_start[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(four_warps_per_row ? rows : (rows + kRowsPerCtaOneWarp - 1) / kRowsPerCtaOneWarp);
    config.blockDim = dim3(sparse_combine::kWarpsPerCta * 32);
    config.stream = stream;
    config.attrs = early_start;
    config.numAttrs = major >= 9 ? 1 : 0;  // programmatic dependent launch needs sm_90
    cudaLaunchKernelEx(&config, kernel, params);
}

}  // namespace FLASH_NAMESPACE
