"""The selection of upstream flash-attn tests that the GPU gate runs (tests/upstream): it names
parameters upstream's tests have, keeps forward-only cases at the compiled head dims only, and
the archive it unpacks holds the tree upstream/lock.toml pins (by git tree id)."""

import ast
import itertools
import tarfile
from pathlib import Path

import pytest

from forktools import github
from upstream import fa2_forward_selection as selection
from upstream import run_upstream


def parametrizations(test_name: str) -> list:
    """[(names, [value tuples])] of an upstream test's parametrize decorators (no import)."""
    with tarfile.open(run_upstream.find_archive()) as tar:
        source = tar.extractfile("tests/test_flash_attn.py").read().decode()
    tree = ast.parse(source)
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == test_name)
    groups = []
    for decorator in function.decorator_list:
        if isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize":
            names = [n.strip() for n in ast.literal_eval(decorator.args[0]).split(",")]
            try:  # arithmetic such as 128 * 1024, no names
                values = eval(compile(ast.Expression(decorator.args[1]), "<parametrize>", "eval"), {"__builtins__": {}})
            except NameError:  # the dtype list (torch, is_sm75): not a selection key
                continue
            groups.append((names, [tuple(v) if len(names) > 1 else (v,) for v in values]))
    return groups


def _archive_present() -> bool:
    try:
        run_upstream.find_archive()
    except SystemExit:
        return False
    return True


needs_archive = pytest.mark.skipif(not _archive_present(),
                                   reason="the tests archive is in neither .cache/upstream nor $FORKTOOLS_UPSTREAM_MIRROR")


@needs_archive
def test_the_archive_is_the_pinned_one():
    pins = github.load(Path(run_upstream.LOCK))
    github.check(run_upstream.find_archive(), next(pin for pin in pins if pin.archive == run_upstream.ARCHIVE))


@needs_archive
@pytest.mark.parametrize("test_name", sorted(selection.FORWARD_ONLY))
def test_the_selection_keeps_forward_only_compiled_cases(test_name):
    groups = parametrizations(test_name)
    by_name = {name: [v[i] for v in values] for names, values in groups for i, name in enumerate(names)}
    assert {"d", "local"} <= by_name.keys() and {64, 128} <= set(by_name["d"])
    cases = ({name: value for (names, _), values in zip(groups, combo) for name, value in zip(names, values)}
             for combo in itertools.product(*(values for _, values in groups)))
    kept = [case for case in cases if selection.selected(test_name, case)]
    assert kept, test_name
    assert all(case["d"] in (64, 128) and not case["local"] and not case.get("alibi", False) for case in kept)
    if test_name == "test_flash_attn_varlen_causal":
        assert all(case["paged_kv_block_size"] for case in kept)  # unpaged ones run the backward
    else:
        assert 4000 < len(kept) < 6000 and {case["d"] for case in kept} == {64, 128}


def test_tests_with_a_backward_are_not_selected():
    case = {"d": 64, "local": False, "alibi": False, "dropout_p": 0.0, "softcap": 0.0, "paged_kv_block_size": None}
    for name in ("test_flash_attn_output", "test_flash_attn_splitkv", "test_flash_attn_qkvpacked"):
        assert not selection.selected(name, case)
    assert not selection.selected("test_flash_attn_varlen_causal", case)
    assert selection.selected("test_flash_attn_varlen_causal", {**case, "paged_kv_block_size": 256})
    assert not selection.selected("test_flash_attn_varlen_causal", {**case, "paged_kv_block_size": 256, "d": 96})
