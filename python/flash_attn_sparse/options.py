"""The options of one sparse forward, as one typed value that travels from the entry points to
validation (calls.SparseCall), routing and the caches."""

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class CallOptions:
    """causal: the bottom-right causal mask on "mask" blocks. softmax_scale: None is
    1 / sqrt(head_dim). num_splits: split-KV count, 0 picks. backend: "auto", "fa2", "fa3" or "fa4".
    validate: None or "cheap" (shapes, no sync), "full" (also list contents; one host sync)."""
    causal: bool = False
    softmax_scale: Optional[float] = None
    num_splits: int = 0
    backend: str = "auto"
    validate: Optional[str] = None
