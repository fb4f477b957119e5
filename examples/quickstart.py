"""Quest-style sparse decode: score K/V blocks per K/V head, keep the top 14 plus a sink and the
local block (1/16 of a 32k context), attend over them, and check against an fp32 reference.

Run on an sm80+ GPU with the patched flash_attn wheel installed: `python examples/quickstart.py`.
"""

import torch

from flash_attn_sparse import blocks_from_scores, choose_backend, flash_attn_with_sparse_block_table

torch.manual_seed(0)
batch, query_rows, heads, heads_k, head_dim, seqlen_k, block_size = 2, 1, 32, 8, 128, 32768, 128
n_blocks = seqlen_k // block_size
q = torch.randn(batch, query_rows, heads, head_dim, device="cuda", dtype=torch.bfloat16)
k = torch.randn(batch, seqlen_k, heads_k, head_dim, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)

# Quest's upper bound of q.k over a block: per channel, the larger of q*min(k) and q*max(k),
# summed over channels and over the query heads sharing the K/V head.
k_blocks = k.float().view(batch, n_blocks, block_size, heads_k, head_dim)
k_min, k_max = k_blocks.amin(2), k_blocks.amax(2)                              # (batch, n_blocks, heads_k, dim)
q_grouped = q.float().view(batch, query_rows, heads_k, heads // heads_k, head_dim).sum(1)
bound = torch.maximum(torch.einsum("bhgd,bnhd->bhgnd", q_grouped, k_min),
                      torch.einsum("bhgd,bnhd->bhgnd", q_grouped, k_max))
scores = bound.sum(-1).sum(2).unsqueeze(2)                                     # (batch, heads_k, 1, n_blocks)

blocks = blocks_from_scores(scores, 14, block_size, sink_blocks=1, local_blocks=1)
out, lse = flash_attn_with_sparse_block_table(q, k, v, blocks, block_size=block_size)
backend, why = choose_backend(q, k, v, blocks, block_size=block_size)

# fp32 reference: attention over exactly the listed blocks of each (batch, K/V head).
count = blocks.full_cnt[:, :, 0].long()
rank = torch.arange(blocks.full_idx.shape[-1], device="cuda")
# Entries past a row's count go to a spare column, so they cannot unmark a listed block.
ids = torch.where(rank < count.unsqueeze(-1), blocks.full_idx[:, :, 0].long(), n_blocks)
listed = torch.zeros(batch, heads_k, n_blocks + 1, dtype=torch.bool, device="cuda").scatter_(2, ids, True)[..., :n_blocks]
visible = listed.repeat_interleave(block_size, dim=2).repeat_interleave(heads // heads_k, dim=1)
logits = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(heads // heads_k, dim=2))
logits = logits / head_dim ** 0.5
logits = logits.masked_fill(~visible[:, :, None, :], float("-inf"))
reference = torch.einsum("bhqk,bkhd->bqhd", logits.softmax(-1), v.float().repeat_interleave(heads // heads_k, dim=2))

error = (out.float() - reference).abs().max().item()
print(f"{int(count[0, 0])} of {n_blocks} blocks per K/V head; backend {backend} ({why})")
print(f"out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)}; max |out - fp32 reference| = {error:.2e}")
assert error < 5e-3, "the sparse result differs from the reference"
