"""FA-4 prefill with every block listed: what this project's patches and API cost over upstream.

One shape (B1, S16k, H32, head dim 128, non-causal, bf16), medians of CUDA-graph replays:
cuDNN's dense SDPA (the control between runs), flash-attn-4's dense forward, flash-attn-4's
block-sparse forward on upstream-form lists (every block "full", ids in order, empty mask
lists), and this package's API with backend="fa4". Run it once on the patched flash-attn-4 and
once on the pristine release (--pristine skips the API row, which needs the patches): the same
upstream-form row on both is what the patches cost that kernel.

    python benchmarks/fa4_prefill_check.py [--pristine] [--seqlen 16384] [--label NAME]
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sparse import Shape, random_inputs, timed  # noqa: E402
from flash_attn_sparse.backends.cute import import_cute  # noqa: E402  (flash-attn-4 beside the FA-2 wheel)

BLOCK = 128


def upstream_form_lists(batch: int, heads: int, seqlen: int):
    """flash-attn-4's BlockSparseTensorsTorch with every block of every 128-row tile full."""
    BlockSparseTensorsTorch = import_cute("block_sparsity").BlockSparseTensorsTorch
    blocks = seqlen // BLOCK
    shape = (batch, heads, blocks)
    ids = torch.arange(blocks, dtype=torch.int32, device="cuda").expand(*shape, blocks).contiguous()
    return BlockSparseTensorsTorch(
        mask_block_cnt=torch.zeros(shape, dtype=torch.int32, device="cuda"),
        mask_block_idx=torch.zeros_like(ids),
        full_block_cnt=torch.full(shape, blocks, dtype=torch.int32, device="cuda"),
        full_block_idx=ids,
        block_size=(BLOCK, BLOCK),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pristine", action="store_true", help="flash-attn-4 is the unpatched release")
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    interface = import_cute("interface")

    batch, heads, dim, seqlen = 1, 32, 128, args.seqlen
    q, k, v = random_inputs(Shape("prefill", batch, seqlen, seqlen, heads, heads, 1.0, head_dim=dim))
    flops = 4 * batch * heads * seqlen * seqlen * dim
    lists = upstream_form_lists(batch, heads, seqlen)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

    rows = {
        "cudnn dense": cudnn,
        "fa4 dense": lambda: interface.flash_attn_func(q, k, v, return_lse=True),
        "fa4 block-sparse, upstream-form lists": lambda: interface.flash_attn_func(
            q, k, v, block_sparse_tensors=lists, return_lse=True),
    }
    if not args.pristine:
        import flash_attn_sparse as fas

        every = fas.SparseBlocks.from_block_table(torch.arange(seqlen // BLOCK, dtype=torch.int32, device="cuda"),
                                                  block_size=BLOCK, batch_size=batch)
        rows["this API, backend=fa4"] = lambda: fas.flash_attn_with_sparse_block_table(q, k, v, every, backend="fa4")
    label = args.label or ("pristine" if args.pristine else "patched")
    for name, fn in rows.items():
        ms, note = timed(fn)
        print(f"{label:>9} | {name:<40} | {ms:8.4f} ms | {flops / (ms * 1e-3) / 1e12:6.1f} TFLOP/s {note}", flush=True)


if __name__ == "__main__":
    main()
