"""The protocol every backend module follows (backends/__init__.py lists them), and the facts a
backend reports for routing."""

from dataclasses import dataclass
from typing import Optional, Protocol, Tuple

from torch import Tensor


@dataclass(frozen=True)
class Traits:
    """The facts of one call on one backend that routing weighs."""
    packed_group: int  # query heads whose rows share one tile (the GQA group where packed, else 1)


class Backend(Protocol):
    def refusal(self, call) -> Optional[str]: ...

    def traits(self, call) -> Traits: ...

    def num_splits(self, call) -> int: ...

    def run(self, call, splits: int, out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]: ...
