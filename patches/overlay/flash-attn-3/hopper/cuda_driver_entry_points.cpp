/******************************************************************************
 * The two driver functions CUTLASS's TMA descriptors call, resolved once per process.
 *
 * Built without CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL, CUTLASS's wrapper
 * (cutlass/cuda_host_adapter.hpp) looks cuTensorMapEncodeTiled up with
 * cudaGetDriverEntryPointByVersion on every call, and every FA-3 launch builds five or six TMA
 * descriptors (Q, K, V, K_new, V_new, O). setup.py (patch flash-attn-3/0011) defines the macro for
 * every unit, so CUTLASS calls the functions below by name; they are hidden inside the extension
 * (no driver symbol is exported or interposed) and look the driver's entry point up on first use,
 * as the wrapper did, so the extension still imports where there is no driver and links no libcuda.
 ******************************************************************************/

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

namespace {

template <typename Function>
Function driver_entry_point(const char *name) {
    void *function = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion(name, &function, 12000, cudaEnableDefault, &found) != cudaSuccess
            || found != cudaDriverEntryPointSuccess) {
        return nullptr;
    }
    return reinterpret_cast<Function>(function);
}

}  // namespace

extern "C" __attribute__((visibility("hidden"))) CUresult CUDAAPI cuTensorMapEncodeTiled(
        CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType, cuuint32_t tensorRank, void *globalAddress,
        const cuuint64_t *globalDim, const cuuint64_t *globalStrides, const cuuint32_t *boxDim,
        const cuuint32_t *elementStrides, CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
        CUtensorMapL2promotion l2Promotion, CUtensorMapFloatOOBfill oobFill) {
    static auto const encode = driver_entry_point<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled");
    if (encode == nullptr) { return CUDA_ERROR_NOT_FOUND; }
    return encode(tensorMap, tensorDataType, tensorRank, globalAddress, globalDim, globalStrides, boxDim,
                  elementStrides, interleave, swizzle, l2Promotion, oobFill);
}

extern "C" __attribute__((visibility("hidden"))) CUresult CUDAAPI cuTensorMapEncodeIm2col(
        CUtensorMap *tensorMap, CUtensorMapDataType tensorDataType, cuuint32_t tensorRank, void *globalAddress,
        const cuuint64_t *globalDim, const cuuint64_t *globalStrides, const int *pixelBoxLowerCorner,
        const int *pixelBoxUpperCorner, cuuint32_t channelsPerPixel, cuuint32_t pixelsPerColumn,
        const cuuint32_t *elementStrides, CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
        CUtensorMapL2promotion l2Promotion, CUtensorMapFloatOOBfill oobFill) {
    static auto const encode = driver_entry_point<PFN_cuTensorMapEncodeIm2col_v12000>("cuTensorMapEncodeIm2col");
    if (encode == nullptr) { return CUDA_ERROR_NOT_FOUND; }
    return encode(tensorMap, tensorDataType, tensorRank, globalAddress, globalDim, globalStrides, pixelBoxLowerCorner,
                  pixelBoxUpperCorner, channelsPerPixel, pixelsPerColumn, elementStrides, interleave, swizzle,
                  l2Promotion, oobFill);
}
