/******************************************************************************
 * Launchers of the sparse block-list forward (stage 3 of the sparse patch set).
 ******************************************************************************/

#pragma once

#include "namespace_config.h"
#include <c10/cuda/CUDAException.h>  // For C10_CUDA_CHECK and C10_CUDA_KERNEL_LAUNCH_CHECK

#include <atomic>
#include <cstdint>

#include "static_switch.h"
#include "flash.h"
#include "flash_sparse.h"
#include "flash_fwd_launch_template.h"  // KERNEL_PARAM_MODIFIER, ARCH_SUPPORTS_FLASH, upstream traits
#include "flash_fwd_sparse_kernel.h"
#include "flash_sparse_combine.h"

namespace FLASH_NAMESPACE {

// cudaFuncSetAttribute(MaxDynamicSharedMemorySize) unless `done` has the current device's bit:
// a planned run is only a launch, and the attribute keeps its value for the kernel.
template<typename Kernel>
void allow_dynamic_smem(Kernel kernel, size_t smem_size, std::atomic<uint64_t> &done) {
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
    if (bit != 0 && (done.load(std::memory_order_relaxed) & bit)) { return; }
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_size));
    done.fetch_or(bit, std::memory_order_relaxed);
}

template<typename Kernel_traits, bool Is_even_K, bool Split, bool Paged, bool ClusterMerge>
__forceinline__ __device__ void run_sparse_tile(const Flash_fwd_params &params) {
    #if defined(ARCH_SUPPORTS_FLASH)
        #if __CUDA_ARCH__ >= 900
        // Lets the combine launched after a split call start now (it waits for this grid to
        // finish before reading the partials; flash_sparse_combine.h).
        asm volatile("griddepcontrol.launch_dependents;");
        #endif
        // With GQA packing a CTA serves the query heads of one K/V head (see the kernel).
        const int tile_heads = params.h / params.sparse_pack_gqa;
        const int m_block = blockIdx.x;
        const int bidb = Split ? blockIdx.z / tile_heads : blockIdx.y;
        const int bidh = Split ? blockIdx.z - bidb * tile_heads : blockIdx.z;
        const int n_split_idx = Split ? blockIdx.y : 0;
        const int num_n_splits = Split ? gridDim.y : 1;
        FLASH_NAMESPACE::compute_attn_1rowblock_sparse<Kernel_traits, Is_even_K, Split, Paged, ClusterMerge>(params, bidb, bidh, m_block, n_split_idx, num_n_splits);
    #else
        FLASH_UNSUPPORTED_ARCH
    #endif
}

template<typename Kernel_traits, bool Is_even_K, bool Split, bool Paged, bool ClusterMerge>
__global__ void flash_fwd_sparse_kernel(KERNEL_PARAM_MODIFIER const Flash_fwd_params params) {
    run_sparse_tile<Kernel_traits, Is_even_K, Split, Paged, ClusterMerge>(params);
}

// The key-split tile's registers bounded for three CTAs per SM, as its 68 KB of shared memory
// allows (165-168 registers, <= 16 B of spills at d128; unbounded it took 211-226, two per SM).
template<typename Kernel_traits, bool Is_even_K, bool Split, bool Paged, bool ClusterMerge>
__global__ void __launch_bounds__(Kernel_traits::kNThreads, 3) flash_fwd_sparse_kernel_keysplit(KERNEL_PARAM_MODIFIER const Flash_fwd_params params) {
    run_sparse_tile<Kernel_traits, Is_even_K, Split, Paged, ClusterMerge>(params);
}

// Split=false writes O and LSE; Split=true writes fp32 partials to slots
// [sparse_split_offset, sparse_split_offset + num_splits) of oaccum / lseaccum, or, with
// ClusterMerge, launches each tile's splits as one thread-block cluster that merges them and
// writes O and LSE (sparse_cluster_merge decides; then there are no partials).
template<typename Kernel_traits, bool Split, bool ClusterMerge = false>
void run_flash_sparse_fwd(Flash_fwd_params &params, cudaStream_t stream) {
    constexpr size_t smem_size = Kernel_traits::kSmemSize;
    const int tile_heads = params.h / params.sparse_pack_gqa;
    const int num_m_block = (params.seqlen_q * params.sparse_pack_gqa + Kernel_traits::kBlockM - 1) / Kernel_traits::kBlockM;
    const int num_splits = Split ? params.num_splits : 1;
    dim3 grid(num_m_block, Split ? num_splits : params.b, Split ? params.b * tile_heads : tile_heads);
    const bool is_even_K = params.d == Kernel_traits::kHeadDim;
    EVENK_SWITCH(is_even_K, IsEvenKConst, [&] {
        BOOL_SWITCH(params.block_table != nullptr, PagedConst, [&] {
            auto kernel = [] {
                if constexpr (is_sparse_keysplit<Kernel_traits>::value) {
                    return &flash_fwd_sparse_kernel_keysplit<Kernel_traits, IsEvenKConst, Split, PagedConst, ClusterMerge>;
                } else {
                    return &flash_fwd_sparse_kernel<Kernel_traits, IsEvenKConst, Split, PagedConst, ClusterMerge>;
                }
            }();
            if (smem_size >= 48 * 1024) {
                // Once per kernel and device (this lambda's static is per instantiation): the
                // attribute sticks, and setting it takes a driver call on every launch otherwise.
                static std::atomic<uint64_t> smem_allowed_on_devices{0};
                allow_dynamic_smem(kernel, smem_size, smem_allowed_on_devices);
            }
            if constexpr (ClusterMerge) {
                cudaLaunchAttribute cluster[1];
                cluster[0].id = cudaLaunchAttributeClusterDimension;
                cluster[0].val.clusterDim.x = 1;
                cluster[0].val.clusterDim.y = num_splits;  // the splits of one tile
                cluster[0].val.clusterDim.z = 1;
                cudaLaunchConfig_t config = {};
                config.gridDim = grid;
                config.blockDim = dim3(Kernel_traits::kNThreads);
                config.dynamicSmemBytes = smem_size;
                config.stream = stream;
                config.attrs = cluster;
                config.numAttrs = 1;
                C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, params));
            } else {
                kernel<<<grid, Kernel_traits::kNThreads, smem_size, stream>>>(params);
            }
            C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
    });
}

// Query tiles of 128 rows: the tile shape of the dense non-split kernel.
template<typename T, int Headdim>
void run_mha_fwd_sparse_(Flash_fwd_params &params, cudaStream_t stream) {
    run_flash_sparse_fwd<Flash_fwd_kernel_traits<Headdim, kSparseWideBlockM, Headdim <= 64 ? 128 : 64, 4, false, false, T>, /*Split=*/false>(params, stream);
}

// Query tiles of 16 rows, one warp: decode, where a 64-row tile would compute 4-16x the real
// rows (e.g. 1 query position x 4 query heads of a K/V head). 128 keys per tile up to head dim
// 128 (the 64-row kernel takes 256 at head dim 64; one warp would then hold 64 key rows'
// addresses per thread in local memory), 64 above; three CTAs fit per SM instead of two.
template<int kHeadDim, typename T>
struct Sparse_decode_kernel_traits
    : public Flash_fwd_kernel_traits<kHeadDim, kSparseDecodeBlockM, kHeadDim <= 128 ? 128 : 64, 1, false, false, T> {
    using ElementAccum = float;
    // Upstream's fp32 partial copy is laid out for 128 threads; this one for the warp: 4 floats
    // per thread, up to 32 threads per row.
    static constexpr int kOaccumThreadsPerRow = kHeadDim / 4 < 32 ? kHeadDim / 4 : 32;
    using GmemLayoutAtomOaccum = Layout<Shape<Int<32 / kOaccumThreadsPerRow>, Int<kOaccumThreadsPerRow>>,
                                        Stride<Int<kOaccumThreadsPerRow>, _1>>;
    using GmemTiledCopyOaccum = decltype(make_tiled_copy(Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, ElementAccum>{},
                                                         GmemLayoutAtomOaccum{}, Layout<Shape<_1, _4>>{}));
};

// Query tiles of 16 rows, four warps splitting each tile's keys (kBlockN / 4 each), merged at the
// end: decode over short lists, where the 64-row tile computes 4-16x the real rows and the
// one-warp 16-row tile walks each tile's 256 HMMA per warp serially. Same loads and tile keys
// as the 64-row kernel (kBlockN), a quarter of each warp's matmul work per tile.
template<int kHeadDim, typename T>
struct Sparse_keysplit_kernel_traits
    : public Flash_fwd_kernel_traits<kHeadDim, kSparseDecodeBlockM, sparse_max_tile_keys(kHeadDim), 4, false, false, T> {
    using FwdTraits = Flash_fwd_kernel_traits<kHeadDim, kSparseDecodeBlockM, sparse_max_tile_keys(kHeadDim), 4, false, false, T>;
    static constexpr bool kSparseKeySplit = true;
    using TiledMma = TiledMMA<typename FwdTraits::MMA_Atom_Arch, Layout<Shape<_1, _1, _1>>, Tile<_16, _16, _16>>;
};

// The 64-row, 4-warp tile: the tile shape of the dense split-KV kernel.
template<int Headdim, typename T>
using Sparse_narrow_kernel_traits = Flash_fwd_kernel_traits<Headdim, kSparseNarrowBlockM, sparse_max_tile_keys(Headdim), 4, false, false, T>;

// Splits without partial buffers (params.oaccum_ptr unset) are merged in a cluster: the host
// leaves them unset exactly where sparse_cluster_merge holds, which only the key-split tile takes.
template<typename Traits>
void run_flash_sparse_fwd_split_or_not(Flash_fwd_params &params, cudaStream_t stream, bool split) {
    if (split && params.oaccum_ptr == nullptr) {
        if constexpr (is_sparse_keysplit<Traits>::value) {
            run_flash_sparse_fwd<Traits, /*Split=*/true, /*ClusterMerge=*/true>(params, stream);
        } else {
            TORCH_CHECK(false, "internal: split calls of this tile need partial buffers");
        }
    } else if (split) {
        run_flash_sparse_fwd<Traits, /*Split=*/true>(params, stream);
    } else {
        run_flash_sparse_fwd<Traits, /*Split=*/false>(params, stream);
    }
}

// Query tiles of 64 rows: the tile shape of the dense split-KV kernel. Used for splits and
// partials, and for short queries or 64-row table tiles; 16-row tiles where the packed query rows
// fit 16: the one-warp decode tile over long lists (sparse_decode_tile), else (head dim <= 128)
// the key-split tile.
template<typename T, int Headdim>
void run_mha_fwd_sparse_narrow_(Flash_fwd_params &params, cudaStream_t stream, bool split) {
    if (sparse_decode_tile(params)) {
        run_flash_sparse_fwd_split_or_not<Sparse_decode_kernel_traits<Headdim, T>>(params, stream, split);
        return;
    }
    if constexpr (Headdim <= 128) {  // above, a warp's 16 x Headdim fp32 O would not fit its registers
        if (params.seqlen_q * params.sparse_pack_gqa <= kSparseDecodeBlockM) {
            run_flash_sparse_fwd_split_or_not<Sparse_keysplit_kernel_traits<Headdim, T>>(params, stream, split);
            return;
        }
    }
    run_flash_sparse_fwd_split_or_not<Sparse_narrow_kernel_traits<Headdim, T>>(params, stream, split);
}

// The merge of params.num_splits slots of oaccum / lseaccum (flash_sparse_combine.h).
template<typename T, int Headdim>
void run_mha_combine_(Flash_fwd_params &params, cudaStream_t stream) {
    run_sparse_combine<T, Headdim>(params, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace FLASH_NAMESPACE
