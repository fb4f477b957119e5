"""Instantiations of the sparse SM90 forward (flash_fwd_sparse_launch_template.h): head dims 64
and 128, fp16, bf16 and e4m3 (FP8 Q/K/V, bf16 out), with and without PackGQA (shared and per-K/V-head lists) and split-KV, in
128-row tiles, and packed split calls also in 64-row tiles (`_m64`, decode: sparse_params.h); the
packed ones also with cp.async paged K/V (`_paged`: pages that do not hold whole 128-key blocks).

They are not carried as files: setup.py calls write_sparse_kernels() for the units its DISABLE
flags keep, and generate_kernels.py writes all of them beside the dense ones."""

import itertools
from collections import namedtuple
from pathlib import Path

SparseKernel = namedtuple("SparseKernel", ["template", "filename"])

SPARSE_DTYPES = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t", "e4m3": "cutlass::float_e4m3_t"}
SPARSE_HEAD_DIMENSIONS = [64, 128]

PRELUDE = """// Copyright (c) 2024, Jay Shah, Ganesh Bikshandi, Ying Zhang, Vijay Thakkar, Pradeep Ramani, Tri Dao.
// Splitting the different template instantiations to different files to speed up compilation.
// This file is auto-generated. See "generate_kernels_sparse.py"

"""

SPARSE_TEMPLATE = """#include "flash_fwd_sparse_launch_template.h"

{GUARDS}
template void run_mha_fwd_sparse_<{DTYPE}, {HEAD_DIM}, {SPLIT}, {PACKGQA}, {BLOCK_M}, {PAGED}>(Flash_fwd_params &, cudaStream_t);
{ENDIFS}
"""


def sparse_kernels():
    for dtype, head_dim, packgqa, split in itertools.product(SPARSE_DTYPES, SPARSE_HEAD_DIMENSIONS, [False, True], [False, True]):
        for block_m, paged in itertools.product([128, 64] if packgqa and split else [128], [False, True] if packgqa else [False]):
            filename = (f"flash_fwd_hdim{head_dim}_{dtype}{'_paged' if paged else ''}{'_packgqa' if packgqa else ''}"
                        f"{'_split' if split else ''}{'_m64' if block_m == 64 else ''}_sparse_sm90.cu")
            # PAGEDKV: upstream's flag for its cp.async paged kernels covers these too.
            flags = ["SPARSE"] + (["FP8"] if dtype == "e4m3" else []) + (["PAGEDKV"] if paged else []) + [f"HDIM{head_dim}"]
            template = SPARSE_TEMPLATE.format(
                GUARDS="\n".join(f"#ifndef FLASHATTENTION_DISABLE_{flag}" for flag in flags), ENDIFS="#endif\n" * len(flags),
                DTYPE=SPARSE_DTYPES[dtype], HEAD_DIM=head_dim, SPLIT=str(split).lower(), PACKGQA=str(packgqa).lower(),
                BLOCK_M=block_m, PAGED=str(paged).lower())
            yield SparseKernel(template.rstrip("\n") + "\n", filename)


def write_sparse_kernels(output_dir, keep=lambda filename: True):
    """Write the kept units into output_dir and return their file names. A file already holding
    the same text is left alone, so ninja does not recompile it."""
    written = []
    for kernel in sparse_kernels():
        if not keep(kernel.filename):
            continue
        path = Path(output_dir) / kernel.filename
        text = PRELUDE + kernel.template
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
        written.append(kernel.filename)
    return written
