"""upstream/lock.toml's tables: read one kind of them, and find a pin by name."""

from __future__ import annotations

import tomllib
from pathlib import Path

from forktools import ToolError


def tables(lock: Path, kind: str) -> list[dict]:
    """The [[kind]] tables of the lock file, in order."""
    with open(lock, "rb") as file:
        return tomllib.load(file).get(kind, [])


def named(pins: list, name: str, kind: str):
    """The pin called `name` among pins (of the lock's [[kind]] tables)."""
    for pin in pins:
        if pin.name == name:
            return pin
    raise ToolError(f"the lock file pins no [[{kind}]] named {name!r} (it has: {', '.join(pin.name for pin in pins)})")
