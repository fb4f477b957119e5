"""Tensors, calls and reference of one fuzzer Config (space.py), through the public API only.

`Case.call(backend)` runs the configuration's entry point with everything after the tensors and
lists passed by keyword; `Case.route()` asks choose_backend what "auto" takes; `Case.reference`
computes the same attention densely (reference.attention_ref) over the visibility the lists
define, with the kernels' skip / clamp semantics for bad entries, in the layout of the output.
"""


import torch
from torch import Tensor

import flash_attn_sparse as fas
from flash_attn_sparse import SparseBlocks
from flash_attn_sparse.metadata import pack_varlen_lists
from flash_attn_sparse.reference import attention_ref

from .space import Config, cdiv

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _row_view(c: Config, kind: str, b: int, h: int, m: int, ids: list, capacity: int) -> list:
    """The ids the kernels read of one list row: the first clamp(count, 0, capacity) entries of
    the padded row, those outside [0, blocks of the sequence) skipped."""
    count = c.counts.get((kind, b, h, m), len(ids))
    padded = ids + [_padding(c, b, j) for j in range(capacity - len(ids))]
    n_valid = cdiv(c.effective_seqlens_k()[b], c.block_size)
    return [i for i in padded[:max(0, min(count, capacity))] if 0 <= i < n_valid]


def _padding(c: Config, b: int, j: int) -> int:
    """Unused row entries: ids past the sequence, so a clamped count reads nothing valid."""
    return cdiv(c.seqlens_k[b], c.block_size) + 7 + j


class Case:
    def __init__(self, c: Config, seed: int, device="cuda"):
        self.c, self.device = c, device
        self.dtype = DTYPES[c.dtype]
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + c.index)
        randn = lambda *shape: torch.randn(*shape, generator=g, device=device).to(self.dtype)
        self._tables = {}
        H, Hk, D, B = c.heads, c.heads_k, c.head_dim, c.batch
        self.varlen = c.form == "varlen"
        if self.varlen:
            self.q, self.k, self.v = randn(sum(c.seqlens_q), H, D), randn(sum(c.seqlens_k), Hk, D), randn(sum(c.seqlens_k), Hk, D)
        else:
            self.q, self.k, self.v = randn(B, c.seqlens_q[0], H, D), randn(B, c.seqlens_k[0], Hk, D), randn(B, c.seqlens_k[0], Hk, D)
        if c.poison and getattr(self, c.poison[0]).numel():
            t = getattr(self, c.poison[0]).view(-1)
            t[int(torch.randint(t.numel(), (1,), generator=g, device=device))] = float(c.poison[1])
        self.k_spec = self.v_spec = None
        if c.form == "spec_gather":
            self.k_spec, self.v_spec = randn(B, c.spec_len, Hk, D), randn(B, c.spec_len, Hk, D)
        self.seqused_k = self.int32(c.seqused_k) if c.seqused_k is not None else None
        self.page_table = self.k_cache = self.v_cache = None
        if c.form == "paged":
            self._page()
        self.blocks = self._blocks()

    def int32(self, values: list) -> Tensor:
        """values as a device int32 tensor, made once per Case: a call under graph capture
        cannot copy from the host, so its tables are made by the warm-up run before it."""
        key = tuple(values)
        if key not in self._tables:
            self._tables[key] = torch.tensor(values, dtype=torch.int32, device=self.device)
        return self._tables[key]

    def _page(self):
        c = self.c
        max_pages = c.seqlens_k[0] // c.page_size
        order = list(c.page_order)
        if c.seqused_k is not None:  # entries past the used keys name no page
            for b, used in enumerate(c.seqused_k):
                for p in range(cdiv(used, c.page_size), max_pages):
                    order[b * max_pages + p] = -1
        self.page_table = self.int32(order).view(c.batch, max_pages)
        shape = (c.num_pages, c.page_size, c.heads_k, c.head_dim)
        # Pages no sequence uses hold NaN: a read of one shows in the answer.
        self.k_cache = torch.full(shape, float("nan"), dtype=self.dtype, device=self.device)
        self.v_cache = torch.full(shape, float("nan"), dtype=self.dtype, device=self.device)
        for b in range(c.batch):
            for p in range(max_pages):
                page = c.page_order[b * max_pages + p]
                if 0 <= page < c.num_pages:
                    rows = slice(p * c.page_size, (p + 1) * c.page_size)
                    self.k_cache[page], self.v_cache[page] = self.k[b, rows], self.v[b, rows]

    def _blocks(self):
        c = self.c
        if c.form not in ("blocks", "varlen", "paged"):
            return None
        full, mask = c.full, c.mask
        if c.bad == "head_extent":  # two table heads: neither 1, heads_k nor heads
            full = [[per_b[0], per_b[0]] for per_b in full]
            mask = [[per_b[0], per_b[0]] for per_b in mask] if mask is not None else None
        if self.varlen:
            blocks = pack_varlen_lists(full, mask, c.block_size, c.q_block_size, device=self.device)
        else:
            blocks = SparseBlocks.from_lists(full, mask, block_size=c.block_size, q_block_size=c.q_block_size,
                                             device=self.device)
        return self._with_counts_and_padding(blocks)

    def _with_counts_and_padding(self, blocks: SparseBlocks) -> SparseBlocks:
        """Planted counts, and padding past the sequence (from_lists pads with block 0)."""
        c = self.c
        if c.bad == "head_extent":  # refused on its shape; nothing reads the entries
            return blocks
        tables = {}
        for kind in ("full", "mask"):
            cnt, idx = getattr(blocks, f"{kind}_cnt"), getattr(blocks, f"{kind}_idx")
            if cnt is None:
                continue
            cnt, idx = cnt.cpu().clone(), idx.cpu().clone()
            lists = c.full if kind == "full" else c.mask
            for b, per_b in enumerate(lists):
                for h, per_h in enumerate(per_b):
                    for m, ids in enumerate(per_h):
                        row, tile = self._row_slice(blocks, b, m)
                        entries = idx[h, row] if self.varlen else idx[b, h, m]
                        entries[len(ids):] = torch.tensor([_padding(c, b, j) for j in range(entries.numel() - len(ids))],
                                                          dtype=torch.int32)
                        count = c.counts.get((kind, b, h, m))
                        if count is not None:
                            if self.varlen:
                                cnt[h, tile] = count
                            else:
                                cnt[b, h, m] = count
            tables[kind] = (cnt.to(self.device), idx.to(self.device))
        mask_cnt, mask_idx = tables.get("mask", (None, None))
        return SparseBlocks(*tables["full"], mask_cnt, mask_idx, blocks.block_size, blocks.q_block_size,
                            blocks.cu_total_m_blocks, blocks.cu_block_idx_offsets)

    def _row_slice(self, blocks: SparseBlocks, b: int, m: int):
        """(entries of list row (b, m), its tile index) in the varlen layout; (None, None) batched."""
        if not self.varlen:
            return None, None
        if not hasattr(self, "_prefix_sums"):  # one host read, not one per row
            self._prefix_sums = blocks.cu_total_m_blocks.tolist(), blocks.cu_block_idx_offsets.tolist()
        cu_m, cu_off = self._prefix_sums
        width = (cu_off[b + 1] - cu_off[b]) // max(cu_m[b + 1] - cu_m[b], 1)
        start = cu_off[b] + m * width
        return slice(start, start + width), cu_m[b] + m

    # ---- calls -------------------------------------------------------------------------------
    def options(self, backend: str) -> dict:
        c = self.c
        return dict(causal=c.causal, num_splits=c.num_splits, validate=c.validate, backend=backend)

    def call(self, backend: str) -> tuple[Tensor, Tensor]:
        c = self.c
        table = lambda ids: self.int32(ids)
        opts = self.options(backend)
        if c.form == "table":
            return fas.flash_attn_with_sparse_block_table(self.q, self.k, self.v, table(c.full[0][0][0]),
                                                          block_size=c.block_size, **opts)
        if c.form == "blocks":
            return fas.flash_attn_with_sparse_block_table(self.q, self.k, self.v, self.blocks, seqused_k=self.seqused_k, **opts)
        if c.form == "paged":
            return fas.flash_attn_with_sparse_block_table(self.q, self.k_cache, self.v_cache, self.blocks,
                                                          seqused_k=self.seqused_k, page_table=self.page_table, **opts)
        if c.form == "varlen":
            cu_q, cu_k = self.cu_seqlens()
            return fas.flash_attn_varlen_with_sparse_blocks(
                self.q, self.k, self.v, self.blocks, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(c.seqlens_q),
                max_seqlen_k=max(c.seqlens_k),
                seqused_k=self.seqused_k, **opts)
        if c.form == "spec_gather":
            return fas.flash_attn_speculative_sparse(self.q, self.k_spec, self.v_spec, self.k, self.v, table(c.full[0][0][0]),
                                                     block_size=c.block_size, causal_spec=c.causal, num_splits=c.num_splits,
                                                     validate=c.validate, backend=backend)
        if c.form == "spec_zero_copy":
            return fas.flash_attn_speculative_sparse_zero_copy(
                self.q, self.k, self.v, table(c.mask[0][0][0]), table(c.full[0][0][0]), block_size=c.block_size,
                causal_spec=c.causal, num_splits=c.num_splits, validate=c.validate, backend=backend)
        parts = fas.flash_attn_sparse_partials(self.q, self.k, self.v, [table(g) for g in c.groups],
                                               block_size=c.block_size, causal=c.causal, validate=c.validate)
        return fas.flash_attn_combine(*parts, out_dtype=self.dtype, head_dim=c.head_dim)

    def cu_seqlens(self):
        prefix = lambda lengths: [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        return self.int32(prefix(self.c.seqlens_q)), self.int32(prefix(self.c.seqlens_k))

    def route(self) -> tuple[str, str] | None:
        """choose_backend's (backend, why) for "auto"; None for the forms it does not describe."""
        c = self.c
        if c.form in ("spec_gather", "spec_zero_copy", "partials"):
            return None
        opts = dict(causal=c.causal, num_splits=c.num_splits, backend="auto", seqused_k=self.seqused_k)
        if c.form == "table":
            return fas.choose_backend(self.q, self.k, self.v, self.int32(c.full[0][0][0]), block_size=c.block_size,
                                      causal=c.causal, num_splits=c.num_splits, backend="auto")
        if c.form == "paged":
            return fas.choose_backend(self.q, self.k_cache, self.v_cache, self.blocks, page_table=self.page_table, **opts)
        if c.form == "varlen":
            cu_q, cu_k = self.cu_seqlens()
            return fas.choose_backend(self.q, self.k, self.v, self.blocks, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=max(c.seqlens_q), max_seqlen_k=max(c.seqlens_k), **opts)
        return fas.choose_backend(self.q, self.k, self.v, self.blocks, **opts)

    # ---- reference ---------------------------------------------------------------------------
    def reference(self, dtype: torch.dtype, on_cpu: bool = False) -> tuple[Tensor, Tensor]:
        """(out, lse) in the layout of call()'s, computed in `dtype` over padded batched tensors;
        on_cpu: computed on the CPU and copied back (under initcheck: cuBLAS's half GEMMs on the
        H200 write memory the tool does not see written, so every read of them is reported)."""
        problem = self.dense_problem()
        if on_cpu:
            out, lse = attention_ref(*(t.cpu() for t in problem[:4]), dtype=dtype)
            return self._packed(out.to(self.device), lse.to(self.device))
        return self._packed(*attention_ref(*problem[:4], dtype=dtype))

    def non_finite_reach(self) -> tuple[Tensor, Tensor]:
        """(output elements, LSE rows) that a non-finite K or V value may reach in a kernel, in
        the layout of call()'s: every row whose lists name the value's block, masked for that row
        (causal, a tile's other rows) or not, since a kernel multiplies P = 0 by what it loads.
        The reference's non-finite elements are a subset; a kernel's must lie within this."""
        q, k, v, _, read = self.dense_problem()
        group = q.shape[2] // k.shape[2]
        bad = ((~torch.isfinite(k)).any(-1, keepdim=True) | ~torch.isfinite(v)).repeat_interleave(group, dim=2)
        read = read.expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1])  # spec_gather's is (Sq, Sk)
        out = torch.einsum("bhqk,bkhd->bqhd", read.float(), bad.float()) > 0
        return self._packed(out, out.any(-1).transpose(1, 2))

    def _packed(self, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
        """Padded batched (out, lse) in the layout of call()'s (varlen: packed rows)."""
        if not self.varlen:
            return out, lse
        rows = [(b, i) for b, sq in enumerate(self.c.seqlens_q) for i in range(sq)]
        bi = torch.tensor([r[0] for r in rows], dtype=torch.long, device=self.device)
        qi = torch.tensor([r[1] for r in rows], dtype=torch.long, device=self.device)
        return out[bi, qi], lse[bi, :, qi].transpose(0, 1)

    def dense_problem(self):
        """q (B, Sq, H, D), k and v (B, Sk, Hk, D), visibility and the keys the kernels read
        (listed, before the causal mask) (B, H, Sq, Sk); built once."""
        if not hasattr(self, "_dense"):
            self._dense = self._dense_problem()
        return self._dense

    def _dense_problem(self):
        c = self.c
        if c.form == "spec_gather":
            return self._gathered_problem()
        B, H = c.batch, c.heads
        sq_max, sk_max = max(c.seqlens_q + [1]), max(c.seqlens_k + [1])
        q, k, v = self._padded(sq_max, sk_max)
        keys = torch.arange(sk_max, device=self.device)
        rows = torch.arange(sq_max, device=self.device)
        sk_eff = c.effective_seqlens_k()
        n_blocks, q_block, group = cdiv(sk_max, c.block_size), c.resolved_q_block(), H // self.table_heads()
        visible = torch.zeros(B, H, sq_max, sk_max, dtype=torch.bool, device=self.device)
        read = torch.zeros_like(visible)
        for b in range(B):
            sq, sk = c.seqlens_q[b], sk_eff[b]
            in_seq = (keys < sk)[None, :] & (rows < sq)[:, None]
            causal_ok = keys[None, :] <= rows[:, None] + sk - sq
            for kind, per_head in self._lists(b):
                tiles = max(len(per_head[0]), 1)
                listed = torch.zeros(len(per_head), tiles, n_blocks, dtype=torch.bool)
                for hs, per_tile in enumerate(per_head):
                    for m, ids in enumerate(per_tile):
                        listed[hs, m, ids] = True
                listed = listed.to(self.device)
                tile_of_row = (rows // q_block).clamp(max=tiles - 1)
                seen = listed[:, tile_of_row][:, :, keys // c.block_size] & in_seq
                read[b] |= seen.repeat_interleave(group, dim=0)
                if kind == "mask" and c.causal:
                    seen &= causal_ok
                visible[b] |= seen.repeat_interleave(group, dim=0)
        return q, k, v, visible, read

    def table_heads(self) -> int:
        return self.c.table_heads if self.c.form in ("blocks", "varlen", "paged") else 1

    def _lists(self, b: int):
        """(kind, [table head][query tile] -> ids the kernels read) of sequence b."""
        c = self.c
        if c.form in ("table", "spec_zero_copy", "partials"):
            n_valid = cdiv(c.seqlens_k[b], c.block_size)
            ids = c.full[0][0][0] if c.form != "partials" else sum(c.groups, [])
            yield "full", [[[i for i in ids if 0 <= i < n_valid]]]
            if c.form == "spec_zero_copy":
                yield "mask", [[c.mask[0][0][0]]]
            return
        for kind, lists in (("full", c.full), ("mask", c.mask)):
            if lists is not None:
                capacity = self._capacity(b)
                yield kind, [[_row_view(c, kind, b, hs, m, ids, capacity) for m, ids in enumerate(per_tile)]
                             for hs, per_tile in enumerate(lists[b])]

    def _capacity(self, b: int) -> int:
        if not self.varlen:
            return self.blocks.full_idx.shape[-1]
        row, _ = self._row_slice(self.blocks, b, 0)
        return row.stop - row.start

    def _padded(self, sq_max: int, sk_max: int):
        c = self.c
        if not self.varlen:
            return self.q, self.k, self.v
        pad = lambda t, lengths, n: torch.stack([torch.nn.functional.pad(seq, (0, 0, 0, 0, 0, n - seq.shape[0]))
                                                 for seq in t.split(lengths)])
        return pad(self.q, c.seqlens_q, sq_max), pad(self.k, c.seqlens_k, sk_max), pad(self.v, c.seqlens_k, sk_max)

    def _gathered_problem(self):
        """The missed keys of k (all visible), then k_spec's (causal among themselves)."""
        c = self.c
        n_valid = cdiv(c.seqlens_k[0], c.block_size)
        positions = [p for i in c.full[0][0][0] if 0 <= i < n_valid
                     for p in range(i * c.block_size, min((i + 1) * c.block_size, c.seqlens_k[0]))]
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        k = torch.cat([self.k[:, index], self.k_spec], dim=1)
        v = torch.cat([self.v[:, index], self.v_spec], dim=1)
        sq, n_missed = c.seqlens_q[0], len(positions)
        rows = torch.arange(sq, device=self.device)[:, None]
        spec_keys = torch.arange(c.spec_len, device=self.device)[None, :]
        visible = torch.ones(sq, k.shape[1], dtype=torch.bool, device=self.device)
        read = visible.clone()
        if c.causal:
            visible[:, n_missed:] = spec_keys <= rows + c.spec_len - sq
        return self.q, k, v, visible, read


