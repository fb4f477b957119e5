"""The protocol every backend module follows (backends/__init__.py lists them): what routing
weighs, and a call's forward planned once and run many times."""

from dataclasses import dataclass
from typing import Optional, Protocol, Tuple

from torch import Tensor


@dataclass(frozen=True)
class Traits:
    """The facts of one call on one backend that routing weighs."""
    packed_group: int  # query heads whose rows share one tile (the GQA group where packed, else 1)


class Planned(Protocol):
    """One call's forward, bound once: every run launches it over new q, k, v of the planned facts
    (shapes, strides, dtypes, devices) and returns (out, lse)."""

    checks_facts: bool  # whether run itself refuses tensors laid out otherwise than planned

    def run(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> Tuple[Tensor, Tensor]:
        """Over the planned lists and offsets, into an out laid out like the planned one."""

    def run_any_out(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> Tuple[Tensor, Tensor]:
        """As run, into any out like q with a contiguous last dimension."""

    def run_with(self, q: Tensor, k: Tensor, v: Tensor, out: Optional[Tensor], blocks, tensors: dict) -> Tuple[Tensor, Tensor]:
        """Over new lists (SparseBlocks) and tensors (cu_seqlens_q, cu_seqlens_k, seqused_k,
        page_table) of the planned facts; out None: a new one."""


class Backend(Protocol):
    def refusal(self, call) -> Optional[str]:
        """Why it cannot run this call (shapes only, never syncs), or None."""

    def traits(self, call) -> Traits: ...

    def num_splits(self, call) -> int:
        """Its split-KV count for the call (the requested one, if any)."""

    def plan(self, call, splits: int, out: Optional[Tensor], keep_buffers: bool = True) -> Planned:
        """The call's forward bound once, for outs like `out` (None: new ones like q). keep_buffers:
        the plan may hold its LSE and split buffers between runs (a SparsePlan), else each run
        allocates them (a cached one-shot call)."""

    def run(self, call, splits: int, out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """The forward once, traceable where the backend is (torch.compile): out like q (into
        `out` if given), lse (batch, heads, seqlen_q) or (heads, total_q)."""
