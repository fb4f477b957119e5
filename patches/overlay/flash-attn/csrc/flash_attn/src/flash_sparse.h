/******************************************************************************
 * Entry points of the sparse block-list forward, shared by the host code and the generated
 * kernel translation units (stage 3 of the sparse patch set).
 ******************************************************************************/

#pragma once

#include "namespace_config.h"
#include "flash.h"

namespace FLASH_NAMESPACE {

// Query rows per CTA of the two sparse kernel shapes; a table's query tile must be a multiple of
// the shape's rows.
constexpr int kSparseWideBlockM = 128;
constexpr int kSparseNarrowBlockM = 64;
// Decode: calls whose packed query rows (seqlen_q x packed heads) fit one 16-row, one-warp tile.
constexpr int kSparseDecodeBlockM = 16;

template<typename T, int Headdim> void run_mha_fwd_sparse_(Flash_fwd_params &params, cudaStream_t stream);
template<typename T, int Headdim> void run_mha_fwd_sparse_narrow_(Flash_fwd_params &params, cudaStream_t stream, bool split);
template<typename T, int Headdim> void run_mha_combine_(Flash_fwd_params &params, cudaStream_t stream);

}  // namespace FLASH_NAMESPACE
