"""The backend protocol holds (backends/protocol.py): every backend module implements it, and no
module outside backends/ reaches into a backend module's private names (CPU, from the source)."""

import ast
import inspect
from pathlib import Path

import pytest

from flash_attn_sparse.backends import BACKENDS, protocol

PACKAGE = Path(__file__).parents[2] / "python" / "flash_attn_sparse"
BACKEND_MODULES = {path.stem for path in (PACKAGE / "backends").glob("*.py")} - {"__init__"}


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_implements_the_protocol(name):
    backend = BACKENDS[name]
    for method in ("refusal", "traits", "num_splits", "plan", "run"):
        assert callable(getattr(backend, method, None)), f"{name} lacks {method}"
        expected = list(inspect.signature(getattr(protocol.Backend, method)).parameters)[1:]
        assert list(inspect.signature(getattr(backend, method)).parameters)[:len(expected)] == expected, (name, method)
    planned = backend.Planned
    for method in ("run", "run_any_out", "run_with"):
        assert callable(getattr(planned, method, None)), f"{name}.Planned lacks {method}"
    assert hasattr(planned, "checks_facts")


def _private_uses(path: Path):
    """(line, name) of every backends.<module>._private name the file imports or reads."""
    tree = ast.parse(path.read_text())
    aliases = {}  # local name -> backend module name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and "backends" in node.module.split("."):
            module = node.module.split(".")[-1]
            for alias in node.names:
                if module in BACKEND_MODULES and alias.name.startswith("_"):
                    found.append((node.lineno, f"{module}.{alias.name}"))
                if module == "backends" and alias.name in BACKEND_MODULES:
                    aliases[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_")):
            found.append((node.lineno, f"{aliases[node.value.id]}.{node.attr}"))
    return found


def test_nothing_outside_backends_reaches_into_a_backend_modules_private_names():
    outside = [path for path in PACKAGE.rglob("*.py") if "backends" not in path.relative_to(PACKAGE).parts]
    assert outside
    uses = {str(path.relative_to(PACKAGE)): found for path in outside if (found := _private_uses(path))}
    assert not uses


def test_the_boundary_check_sees_a_private_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from .backends import fa3\nfrom .backends.fa2 import _hidden\nfa3._secret()\n")
    assert _private_uses(sample) == [(2, "fa2._hidden"), (3, "fa3._secret")]


def test_routing_plan_and_the_entry_points_name_no_backend_module():
    """They reach backends through BACKENDS (and the kernels' shared services: device, fa2_ops'
    combine and head-dim rules), so adding a backend touches none of them."""
    for name in ("routing.py", "plan.py", "interface.py", "speculative.py"):
        tree = ast.parse((PACKAGE / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("backends"):
                assert {alias.name for alias in node.names} <= {"BACKENDS", "Traits", "Planned"}, (name, node.lineno)
