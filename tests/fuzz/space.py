"""The configuration space of the differential fuzzer: one `Config` per index, drawn from a
numpy Generator seeded by (seed, index), so any configuration is reproducible on its own.

A Config is plain data (shapes, lists as Python ints, flags); build.py turns it into tensors.
It covers the contract of flash_attn_sparse: GQA with odd head counts, the compiled head dims,
fp16/bf16, every block size, query tiles, table heads 1 / H_k / H, full and mask lists in any
order with gaps and the partial tail block anywhere, empty rows, causal, fixed and varlen
(ragged, empty sequences, Sq != Sk), paged K/V (pages below / equal / above the block size,
permuted), seqused_k, forced and automatic splits, both speculative forms, partials + combine,
CUDA graph capture and NaN / Inf inputs, and (a few, drawn apart: MANY_TILES_SHARE) calls of
more kernel tiles than the GPU has SMs with list lengths skewed across tiles. `bad` names a
contract violation planted in the lists: refused with validate="full"; without it, out-of-range
ids and counts are skipped / clamped like the FA-2 kernels do (metadata.py) and the answer is
checked against that.
"""

import functools
from dataclasses import dataclass, field

import numpy as np

BLOCK_SIZES = (16, 32, 64, 128, 256)
FORMS = ("table", "blocks", "varlen", "paged", "spec_gather", "spec_zero_copy", "partials")
FORM_WEIGHTS = (0.12, 0.30, 0.20, 0.13, 0.09, 0.08, 0.08)
# Violations of the list contract that only the exhaustive validation sees (the kernels skip or
# clamp the first four and the result is defined; the others are undefined without validation).
SKIPPED_BAD = ("oob_id", "neg_id", "count_over", "count_neg")
UNDEFINED_BAD = ("dup", "causal_full", "seqused_over")
# Violations the cheap validation refuses whatever `validate` says.
SHAPE_BAD = ("m_blocks_short", "head_extent", "q_block_odd")
PAGE_BAD = "bad_page"  # memory safe without validation, result unchecked
PALETTE_SIZE, PALETTE_SHARE = 8, 0.9  # see kernel_palette
SEQLENS_Q = (1, 1, 2, 3, 7, 16, 33, 64, 100, 130, 200)
SEQLENS_K = (1, 15, 16, 100, 128, 200, 257, 300, 513, 700, 1000)
SMS = 132  # an H100's or H200's: past this many tiles each CTA of FA-3's persistent kernel runs several
# Configurations of many tiles: decided by a stream of their own, so that every other
# configuration of a seed is drawn as before.
MANY_TILES_SHARE, MANY_TILES_STREAM = 0.04, 1
MANY_TILES_TARGETS = (1.2, 1.6, 2.2)  # times SMS
# Full-list lengths, dealt to a call's list rows in turn (then shuffled): empty, short and long
# side by side, a call of two rows getting an empty and a long one.
SKEWED_LENGTHS = (0, 70, 1, 33, 2, 3)
LONG_LIST_SEQLENS_K = (8960, 9000, 9300, 10000)  # room for 70 blocks of 128 keys


@dataclass
class Config:
    index: int
    form: str
    dtype: str  # "bf16" / "fp16"
    head_dim: int
    batch: int
    heads_k: int
    group: int  # query heads per K/V head
    block_size: int
    q_block_size: int | None
    table_heads: int  # 1, heads_k or heads
    seqlens_q: list[int]  # one per sequence (all equal unless varlen)
    seqlens_k: list[int]  # K/V length per sequence (paged: max_pages * page_size)
    causal: bool
    num_splits: int
    validate: str  # "cheap" / "full"
    seqused_k: list[int] | None = None
    page_size: int | None = None
    page_order: list[int] | None = None  # page_table rows, flattened (batch * max_pages)
    num_pages: int = 0
    full: list = field(default_factory=list)  # full[b][hs][m] = [ids]; 1-D forms: full[0][0][0]
    mask: list | None = None
    counts: dict = field(default_factory=dict)  # (kind, b, hs, m) -> count replacing len(list)
    extra_tiles: int = 0  # list rows past the query tiles (allowed, never read)
    spec_len: int = 0  # spec_gather: keys of k_spec; spec_zero_copy: blocks of the speculative set
    groups: list | None = None  # partials: disjoint 1-D tables
    bad: str | None = None
    graph: bool = False
    poison: tuple[str, str] | None = None  # ("q" | "k" | "v", "nan" | "inf")
    many_tiles: bool = False  # drawn by _draw_many_tiles: more kernel tiles than SMS, list lengths skewed across tiles

    @property
    def heads(self) -> int:
        return self.heads_k * self.group

    @property
    def expect_refusal(self) -> bool:
        """Whether every backend must raise SparseInputError (before any kernel)."""
        return self.bad in SHAPE_BAD or (self.bad is not None and self.validate == "full")

    @property
    def result_defined(self) -> bool:
        """Whether the answer is checked against the reference (else only memory safety)."""
        return not self.expect_refusal and self.bad != PAGE_BAD

    def effective_seqlens_k(self) -> list[int]:
        return list(self.seqused_k) if self.seqused_k is not None else list(self.seqlens_k)

    def resolved_q_block(self) -> int:
        if self.q_block_size is not None:
            return self.q_block_size
        return -(-max(max(self.seqlens_q), 1) // 128) * 128


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kernel_tiles(c: Config) -> int:
    """Tiles of 128 query rows of the call, the fewer of FA-3's two tilings: query heads packed
    per K/V head (group rows per query position) or one tile row per query head."""
    return sum(c.heads_k * cdiv(sq * c.group, 128) for sq in c.seqlens_q)


def kernel_class(rng, head_dims=(64, 128)) -> tuple:
    """(dtype, head dim, block size, K/V heads, GQA group, causal): what selects a compiled kernel."""
    pick = lambda seq: seq[int(rng.integers(len(seq)))]
    return (pick(("bf16", "fp16")), pick(tuple(head_dims)), pick(BLOCK_SIZES), pick((1, 1, 2, 3)),
            pick((1, 1, 2, 3, 4, 5, 6, 7, 8, 16)), bool(rng.random() < 0.5))


@functools.lru_cache(maxsize=None)
def kernel_palette(seed: int, head_dims: tuple) -> list:
    """The few kernel classes most configurations of run `seed` share, so that the JIT-compiled
    backend (FA-4) compiles a few kernels and reuses them; other seeds draw other palettes."""
    rng = np.random.default_rng([seed, 2 ** 32 - 1])
    return [kernel_class(rng, head_dims) for _ in range(PALETTE_SIZE)]


def draw(seed: int, index: int, head_dims=(64, 128), adversarial: bool = False) -> Config:
    """Configuration `index` of run `seed`. adversarial: the sanitizer subset (bad ids, counts and
    page tables, varlen sequences at the edges), small shapes only."""
    rng = np.random.default_rng([seed, index])
    pick = lambda seq: seq[int(rng.integers(len(seq)))]
    chance = lambda p: bool(rng.random() < p)
    many_tiles = not adversarial and np.random.default_rng([seed, index, MANY_TILES_STREAM]).random() < MANY_TILES_SHARE
    if adversarial:
        form = pick(("blocks", "varlen", "paged", "table"))
    elif many_tiles:
        form = pick(("blocks", "varlen"))
    else:
        form = FORMS[int(rng.choice(len(FORMS), p=FORM_WEIGHTS))]
    kernel = kernel_class(rng, tuple(head_dims))
    if not adversarial and chance(PALETTE_SHARE):
        palette = kernel_palette(seed, tuple(head_dims))
        kernel = palette[int(rng.integers(len(palette)))]
    dtype, head_dim, block_size, heads_k, group, causal = kernel
    if many_tiles:  # FA-3's one block size, and at least 8 query heads so that tiles come from heads as well as rows
        block_size, heads_k = 128, max(heads_k, cdiv(8, group))
    c = Config(index=index, form=form, dtype=dtype, head_dim=head_dim, batch=pick((1, 1, 2, 3)), heads_k=heads_k,
               group=group, block_size=block_size, q_block_size=None, table_heads=1, seqlens_q=[], seqlens_k=[],
               causal=causal, num_splits=pick((0, 0, 0, 1, 2, 3, 5)), validate="full" if chance(0.3) else "cheap")
    if many_tiles:
        _draw_many_tiles(c, rng)
    else:
        _draw_shapes_and_lists(c, rng)
    _plant_bad(c, rng, adversarial)
    if form == "partials":
        ids = c.full[0][0][0]
        cuts = sorted(int(x) for x in rng.integers(0, len(ids) + 1, size=int(rng.integers(0, 4))))
        c.groups = [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]
        c.num_splits = 0
    c.graph = form in ("table", "blocks") and c.bad is None and chance(0.1)
    if not adversarial and c.bad is None and chance(0.08):
        # Inf only in v: an infinite score makes the dense reference's 0 * inf differ from the
        # kernels' online softmax without either being wrong.
        c.poison = pick((("q", "nan"), ("k", "nan"), ("v", "nan"), ("v", "inf")))
    if c.graph or form == "partials":
        c.validate = "cheap" if c.graph else c.validate
    return c


def _draw_shapes_and_lists(c: Config, rng) -> None:
    """Sequence lengths, pages, seqused_k, query tiles and lists of a configuration of `c.form`."""
    pick = lambda seq: seq[int(rng.integers(len(seq)))]
    chance = lambda p: bool(rng.random() < p)
    form = c.form
    if form == "varlen":
        c.batch = pick((1, 2, 3, 4))
        c.seqlens_q = [pick(SEQLENS_Q + (0,)) for _ in range(c.batch)]
        c.seqlens_k = [pick(SEQLENS_K + (0,)) for _ in range(c.batch)]
        c.q_block_size = pick((64, 128, 128, 192, 256))
    else:
        sq = pick(SEQLENS_Q)
        c.seqlens_q = [sq] * c.batch
        c.seqlens_k = [pick(SEQLENS_K)] * c.batch
    if form == "paged":
        c.page_size = pick(tuple(p for p in BLOCK_SIZES if p % c.block_size == 0 or c.block_size % p == 0))
        max_pages = cdiv(c.seqlens_k[0], c.page_size)
        c.seqlens_k = [max_pages * c.page_size] * c.batch
        c.num_pages = c.batch * max_pages + int(rng.integers(0, 4))
        c.page_order = [int(p) for p in rng.permutation(c.num_pages)[:c.batch * max_pages]]
    if form in ("blocks", "varlen", "paged") and chance(0.4):
        c.seqused_k = [int(rng.integers(0, sk + 1)) if chance(0.7) else sk for sk in c.seqlens_k]
    if form in ("blocks", "paged"):
        c.q_block_size = pick((None, None, 64, 128, 192, 256))
        c.extra_tiles = int(chance(0.15))
    if form in ("blocks", "varlen", "paged"):
        c.table_heads = pick((1, c.heads_k, c.heads))
        _draw_lists(c, rng, with_mask=chance(0.6))
    elif form in ("table", "spec_gather", "partials"):
        _draw_shared_table(c, rng, historical=c.causal and form != "spec_gather")
    else:
        _draw_zero_copy(c, rng)
    if form == "spec_gather":
        c.spec_len = int(rng.integers(1, 300))


def _draw_many_tiles(c: Config, rng) -> None:
    """More kernel tiles than SMS (FA-3's persistent CTAs each run several: the early claim of
    the next tile, the K/V pipeline phase and barriers carried across tiles), query tiles of 128
    rows, and per-tile lists of lengths SKEWED_LENGTHS (_draw_skewed_lists). Batched or varlen
    (ragged, sometimes an empty or a one-row sequence), never seqused_k (FA-3 refuses it)."""
    pick = lambda seq: seq[int(rng.integers(len(seq)))]
    target = int(pick(MANY_TILES_TARGETS) * SMS)
    c.many_tiles, c.q_block_size = True, 128
    if c.form == "varlen":
        c.batch = pick((3, 4, 5))
        # Each sequence a share of one length, so that padding the dense reference costs little.
        shares = [pick((0.7, 1.0, 1.0, 1.2)) for _ in range(c.batch)]
        for edge in (0.0, None):  # an empty sequence, a one-row sequence
            if rng.random() < 0.4:
                shares[int(rng.integers(1, c.batch))] = edge
        length = 128
        c.seqlens_q = [1 if s is None else int(s * length) for s in shares]
        while kernel_tiles(c) <= target:
            length += 128
            c.seqlens_q = [1 if s is None else int(s * length) for s in shares]
    else:
        c.batch = max(c.batch, cdiv(16, c.heads))  # 16+ (batch, head) pairs: the tiles are not one long sequence
        c.seqlens_q = [128 - pick((0, 0, 37, 100))] * c.batch
        while kernel_tiles(c) <= target:
            c.seqlens_q = [c.seqlens_q[0] + 128] * c.batch
    # Causal: room before the diagonal for long lists of fully historical blocks in early tiles, or none.
    extra = pick((0, 1000, 9216, 9300)) if c.causal else 0
    keys = [sq + extra if c.causal else pick(LONG_LIST_SEQLENS_K) for sq in c.seqlens_q]
    c.seqlens_k = keys if c.form == "varlen" else [keys[0]] * c.batch
    c.table_heads = pick((1, c.heads_k, c.heads))
    _draw_skewed_lists(c, rng, with_mask=bool(rng.random() < 0.6))


def _draw_skewed_lists(c: Config, rng, with_mask: bool) -> None:
    """Per-(batch, table head, query tile) full lists, permuted and gapped, their lengths
    SKEWED_LENGTHS over and over in random order across the rows (cut to the eligible blocks:
    fully historical ones when causal); mask lists of 0-2 blocks disjoint from them (causal: on the
    tile's diagonal), none where the full list is empty."""
    q_block = c.resolved_q_block()
    rows = sum(c.table_heads * cdiv(sq, q_block) for sq in c.seqlens_q)
    lengths = iter([SKEWED_LENGTHS[int(i) % len(SKEWED_LENGTHS)] for i in rng.permutation(rows)])
    c.full, c.mask = [], [] if with_mask else None
    for b in range(c.batch):
        sq, sk = c.seqlens_q[b], c.seqlens_k[b]
        n_valid = cdiv(sk, c.block_size)
        full_b, mask_b = [], []
        for _ in range(c.table_heads):
            full_h, mask_h = [], []
            for m in range(cdiv(sq, q_block)):
                eligible = [j for j in range(n_valid) if not c.causal or _historical(j, c, m * q_block, sq, sk)]
                length = min(next(lengths), len(eligible))
                full_row = [int(x) for x in rng.choice(eligible, size=length, replace=False)] if length else []
                full_h.append(full_row)
                if with_mask:
                    last_row = min((m + 1) * q_block, sq) - 1
                    others = [j for j in range(n_valid) if j not in full_row
                              and (not c.causal or (j not in eligible and j * c.block_size <= last_row + sk - sq))]
                    count = min(int(rng.integers(0, 3)), len(others)) if full_row else 0
                    mask_h.append([int(x) for x in rng.choice(others, size=count, replace=False)] if count else [])
            full_b.append(full_h)
            mask_b.append(mask_h)
        c.full.append(full_b)
        if with_mask:
            c.mask.append(mask_b)


def _row(rng, n_valid: int, eligible: list[int]) -> list[int]:
    """A permuted, gapped list of distinct blocks from `eligible`: sometimes empty, sometimes
    every one, often with the last (tail) block somewhere."""
    if not eligible or rng.random() < 0.1:
        return []
    count = len(eligible) if rng.random() < 0.15 else int(rng.integers(1, len(eligible) + 1))
    ids = [int(x) for x in rng.choice(eligible, size=count, replace=False)]
    tail = n_valid - 1
    if tail in eligible and tail not in ids and rng.random() < 0.3:
        ids[int(rng.integers(len(ids)))] = tail
    return ids


def _historical(block: int, c: Config, first_row: int, sq: int, sk: int) -> bool:
    return (block + 1) * c.block_size - 1 <= first_row + sk - sq


def _draw_lists(c: Config, rng, with_mask: bool) -> None:
    """Per-(batch, table head, query tile) lists: full blocks (fully historical when causal)
    and, disjoint from them, mask blocks (any)."""
    q_block = c.resolved_q_block()
    sk_eff = c.effective_seqlens_k()
    c.full, c.mask = [], [] if with_mask else None
    for b in range(c.batch):
        sq = c.seqlens_q[b]
        tiles = cdiv(sq, q_block) + (c.extra_tiles if c.form != "varlen" else 0)
        n_valid = cdiv(sk_eff[b], c.block_size)
        full_b, mask_b = [], []
        for _ in range(c.table_heads):
            full_h, mask_h = [], []
            for m in range(tiles):
                every = list(range(n_valid))
                eligible = [j for j in every if not c.causal or _historical(j, c, m * q_block, sq, sk_eff[b])]
                full_row = _row(rng, n_valid, eligible)
                full_h.append(full_row)
                if with_mask:
                    mask_h.append(_row(rng, n_valid, [j for j in every if j not in full_row]))
            full_b.append(full_h)
            mask_b.append(mask_h)
        c.full.append(full_b)
        if with_mask:
            c.mask.append(mask_b)


def _draw_shared_table(c: Config, rng, historical: bool) -> None:
    n_valid = cdiv(c.seqlens_k[0], c.block_size)
    eligible = [j for j in range(n_valid) if not historical or _historical(j, c, 0, c.seqlens_q[0], c.seqlens_k[0])]
    c.full = [[[_row(rng, n_valid, eligible)]]]


def _draw_zero_copy(c: Config, rng) -> None:
    """The speculative set: the last spec_len blocks (the diagonal, with the tail); the missed
    set: a gapped choice of the others (fully historical when causal_spec)."""
    n_valid = cdiv(c.seqlens_k[0], c.block_size)
    c.spec_len = int(rng.integers(1, min(n_valid, 4) + 1))
    spec = list(range(n_valid - c.spec_len, n_valid))
    rng.shuffle(spec)
    others = [j for j in range(n_valid - c.spec_len)
              if not c.causal or _historical(j, c, 0, c.seqlens_q[0], c.seqlens_k[0])]
    c.full = [[[_row(rng, n_valid, others)]]]
    c.mask = [[[[int(x) for x in spec]]]]


def _nonempty_rows(c: Config, lists) -> list[tuple[int, int, int]]:
    """The non-empty rows of the query tiles the call has (not the extra ones, never read)."""
    tiles = lambda b: cdiv(c.seqlens_q[b], c.resolved_q_block()) if c.form in ("blocks", "varlen", "paged") else 1
    return [(b, h, m) for b, per_b in enumerate(lists) for h, per_h in enumerate(per_b)
            for m, row in enumerate(per_h) if row and m < tiles(b)]


def _plant_bad(c: Config, rng, adversarial: bool) -> None:
    """Maybe one contract violation (always one in the adversarial subset)."""
    if not adversarial and rng.random() < 0.7:
        return
    per_row = c.form in ("blocks", "varlen", "paged")
    kinds = list(SKIPPED_BAD) + ["dup"]
    if c.causal and per_row:
        kinds.append("causal_full")
    if c.seqused_k is not None:
        kinds.append("seqused_over")
    if c.form == "paged":
        kinds += [PAGE_BAD, PAGE_BAD]
    if per_row and c.form != "varlen" and c.q_block_size is not None:
        kinds += ["m_blocks_short", "q_block_odd"]
    if per_row and c.form != "varlen" and 2 not in (c.heads_k, c.heads, 1):
        kinds.append("head_extent")
    if not per_row:  # one shared 1-D table: its counts are its length
        kinds = ["oob_id", "neg_id"] + (["dup"] if c.form != "partials" else [])
    if adversarial:  # the kernels must stay memory safe on these: run them, unvalidated
        kinds = [k for k in kinds if k in SKIPPED_BAD or k == PAGE_BAD]
        c.validate = "cheap"
    kind = kinds[int(rng.integers(len(kinds)))]
    rows = _nonempty_rows(c, c.full)
    n_valid = lambda b: cdiv(c.effective_seqlens_k()[b], c.block_size)
    if kind in ("oob_id", "neg_id", "dup", "count_over", "count_neg") and not rows:
        return
    if kind in UNDEFINED_BAD:
        c.validate = "full"
    if kind in ("oob_id", "neg_id", "dup"):
        b, h, m = rows[int(rng.integers(len(rows)))]
        row = c.full[b][h][m]
        bad_id = {"oob_id": n_valid(b) + int(rng.integers(0, 3)), "neg_id": -1 - int(rng.integers(0, 3)),
                  "dup": row[0]}[kind]
        row.insert(int(rng.integers(len(row) + 1)), bad_id)
    elif kind in ("count_over", "count_neg"):
        b, h, m = rows[int(rng.integers(len(rows)))]
        c.counts[("full", b, h, m)] = 10 ** 6 if kind == "count_over" else -3
    elif kind == "causal_full":
        candidates = [(b, h, m) for b, per_b in enumerate(c.full) for h, per_h in enumerate(per_b)
                      for m in range(cdiv(c.seqlens_q[b], c.resolved_q_block()))
                      if n_valid(b) and not _historical(n_valid(b) - 1, c, m * c.resolved_q_block(), c.seqlens_q[b],
                                                        c.effective_seqlens_k()[b])]
        if not candidates:
            return
        b, h, m = candidates[int(rng.integers(len(candidates)))]
        row = c.full[b][h][m]
        if n_valid(b) - 1 not in row:
            row.append(n_valid(b) - 1)
        if c.mask is not None and n_valid(b) - 1 in c.mask[b][h][m]:
            c.mask[b][h][m].remove(n_valid(b) - 1)
    elif kind == "seqused_over":
        b = int(rng.integers(c.batch))
        c.seqused_k[b] = c.seqlens_k[b] + 1 + int(rng.integers(0, 50))
    elif kind == PAGE_BAD:
        used = cdiv(max(c.effective_seqlens_k()), c.page_size)
        if not used:
            return
        max_pages = c.seqlens_k[0] // c.page_size
        b = max(range(c.batch), key=lambda i: c.effective_seqlens_k()[i])
        slot = b * max_pages + int(rng.integers(used))
        c.page_order[slot] = int((c.num_pages + 5, -1, 2 ** 31 - 1)[int(rng.integers(3))])
    elif kind == "m_blocks_short":
        if cdiv(c.seqlens_q[0], c.resolved_q_block()) + c.extra_tiles < 2:
            return
        for per_b in c.full + (c.mask or []):
            for per_h in per_b:
                del per_h[-1 - c.extra_tiles:]
        c.extra_tiles = 0
    elif kind == "q_block_odd":
        c.q_block_size += 32
    c.bad = kind


def sanitizer_subset(seed: int, count: int, head_dims=(64, 128)) -> list[Config]:
    """The adversarial configurations the sanitizer runs: one violation each, small shapes."""
    return [draw(seed, i, head_dims, adversarial=True) for i in range(count)]
