"""The import graphs of python/flash_attn_sparse and python/forktools (every import statement,
module level or inside a function) have no cycle, and no module of python/flash_attn_sparse/
grows past ~400 lines."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "python/flash_attn_sparse"
TOOLING = Path(__file__).parents[2] / "python/forktools"


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set, package_dir: Path = PACKAGE) -> set:
    """The package modules `path` imports: `from .x import y` counts x.y if that is a module, else x."""
    name = _module_name(path, package_dir)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            submodules = {f"{target}.{alias.name}" for alias in node.names} & modules
            found.update(submodules)
            if target in modules and len(submodules) < len(node.names):  # a name defined by the module itself
                found.add(target)
    found.discard(name)
    return found


def _graph(package: Path = PACKAGE) -> dict:
    paths = sorted(package.rglob("*.py"))
    modules = {_module_name(p, package) for p in paths}
    return {_module_name(p, package): _imports(p, modules, package) for p in paths}


def _cycle(graph: dict):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return stack[stack.index(imported):] + [imported]
            if imported not in state and (found := visit(imported)):
                return found
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_graph_sees_the_backends():
    graph = _graph()
    assert "flash_attn_sparse.backends.fa4" in graph["flash_attn_sparse.backends"]
    assert "flash_attn_sparse.backends.cute" in graph["flash_attn_sparse.backends.fa4"]


def test_graph_sees_the_tooling_s_function_level_imports():
    graph = _graph(TOOLING)
    assert {"forktools.build_fa3", "forktools.wheelbuild", "forktools.toolchain"} <= graph["forktools.build"]
    assert "forktools.github" in graph["forktools.sources"]


@pytest.mark.parametrize("package", [PACKAGE, TOOLING], ids=lambda p: p.name)
def test_no_import_cycle(package):
    graph = _graph(package)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_over_400_lines():
    lengths = {p.name: len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert max(lengths.values()) <= 400, lengths
