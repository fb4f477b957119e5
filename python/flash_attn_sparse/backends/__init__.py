"""The backends a sparse forward can run on, each one module behind one protocol
(protocol.py: refusal, traits, num_splits, plan -> Planned, run; run_partial where a backend
writes fp32 partials). routing.choose picks among them; nothing outside backends/ reaches into
a backend module past the protocol. A new backend is one module here plus its line in BACKENDS.
"""

from . import fa2, fa3, fa4
from .protocol import Backend, Planned, Traits

BACKENDS: "dict[str, Backend]" = {"fa2": fa2, "fa3": fa3, "fa4": fa4}

__all__ = ["BACKENDS", "Backend", "Planned", "Traits"]
