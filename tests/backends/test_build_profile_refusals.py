"""A narrowed (dev) flash_attn wheel says what it lacks.

The patched flash_attn_interface (patch flash-attn/0006 + overlay flash_attn/build_profile.py) is
imported from the materialized tree in a child interpreter (its torch custom ops must not meet an
installed flash_attn's), with flash_attn._build_profile and flash_attn_2_cuda stubbed: the C++
stub records each call, so a refusal is seen to come before C++. The dev profile must warn once
on import and refuse backward (through autograd of flash_attn_func), another head dim, an uneven
head dim, alibi, softcap, dropout and local windows; the full profile must run all of them.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "python"))  # for forktools; appended, so an installed flash_attn_sparse still wins

from forktools import build, series  # noqa: E402
from forktools.layout import Layout  # noqa: E402

FA2_SDIST = REPO / ".cache" / "upstream" / "flash_attn-2.8.3.post2.tar.gz"
pytestmark = pytest.mark.skipif(not FA2_SDIST.exists(), reason=f"{FA2_SDIST.name} absent (run `nox -s upstream`)")

PROBE = textwrap.dedent('''
    import json, sys, types, warnings
    import torch
    tree, profile, head_dims, disabled = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    package = types.ModuleType("flash_attn"); package.__path__ = [tree + "/flash_attn"]
    recorded = types.ModuleType("flash_attn._build_profile")
    recorded.PROFILE, recorded.HEAD_DIMS, recorded.DISABLED = profile, tuple(head_dims), tuple(disabled)
    reached = []
    def fwd(q, k, v, *rest):
        reached.append("fwd")
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1]), None, torch.zeros(2)
    def fwd_kvcache(q, *rest):
        reached.append("fwd_kvcache")
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    def bwd(dout, q, k, v, out, lse, dq, dk, dv, *rest):
        reached.append("bwd")
        return dq, dk, dv, torch.zeros_like(lse)
    cuda = types.ModuleType("flash_attn_2_cuda"); cuda.fwd, cuda.fwd_kvcache, cuda.bwd = fwd, fwd_kvcache, bwd
    sys.modules.update({"flash_attn": package, "flash_attn._build_profile": recorded, "flash_attn_2_cuda": cuda})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import flash_attn.flash_attn_interface as fa
        import flash_attn.build_profile  # noqa: F401  (already imported: no second warning)
    # CPU tensors cannot dispatch the CUDA custom ops: call their Python bodies.
    fa._wrapped_flash_attn_forward = fa._flash_attn_forward._init_fn
    fa._wrapped_flash_attn_backward = fa._flash_attn_backward._init_fn
    def qkv(d, requires_grad=False):
        return [torch.randn(1, 256, 2, d, requires_grad=requires_grad) for _ in range(3)]
    def backward():
        q, k, v = qkv(128, requires_grad=True)
        fa.flash_attn_func(q, k, v, causal=True).sum().backward()
    cases = {
        "forward_128": lambda: fa.flash_attn_func(*qkv(128), causal=True),
        "forward_64_window_beyond_keys": lambda: fa.flash_attn_func(*qkv(64), window_size=(512, 512)),
        "kvcache_64": lambda: fa.flash_attn_with_kvcache(qkv(64)[0][:, :1], *qkv(64)[1:], causal=True),
        "backward": backward,
        "head_dim_96": lambda: fa.flash_attn_func(*qkv(96)),
        "head_dim_256": lambda: fa.flash_attn_func(*qkv(256)),
        "uneven_head_dim_120": lambda: fa.flash_attn_func(*qkv(120)),
        "alibi": lambda: fa.flash_attn_func(*qkv(128), alibi_slopes=torch.ones(2)),
        "softcap": lambda: fa.flash_attn_func(*qkv(128), softcap=30.0),
        "dropout": lambda: fa.flash_attn_func(*qkv(128), dropout_p=0.1),
        "local": lambda: fa.flash_attn_func(*qkv(128), causal=True, window_size=(64, 0)),
        "local_kvcache": lambda: fa.flash_attn_with_kvcache(qkv(128)[0][:, :1], *qkv(128)[1:], window_size=(64, 0)),
    }
    results = {}
    for name, call in cases.items():
        reached.clear()
        try:
            call()
            results[name] = {"error": None, "reached": list(reached)}
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {error}", "reached": list(reached)}
    warned = [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, UserWarning)
              and "developer build" in str(w.message)]
    print(json.dumps({"warnings": warned, "results": results}))
''')
RUNS = ["forward_128", "forward_64_window_beyond_keys", "kvcache_64"]
REFUSED = ["backward", "head_dim_96", "head_dim_256", "uneven_head_dim_120", "alibi", "softcap", "dropout",
           "local", "local_kvcache"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fa2")
    series.materialize(Layout.at(REPO).with_trees(root / "trees"), "flash-attn", root / "flash-attn")
    return root / "flash-attn"


def _probe(tree: Path, profile: str, head_dims, disabled) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(tree), profile, json.dumps(head_dims), json.dumps(disabled)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_dev_profile_warns_once_and_refuses_what_it_compiled_out(tree):
    head_dims = [d for d in (32, 64, 96, 128, 192, 256) if d not in build.DEV_HEAD_DIMS_OFF]
    probe = _probe(tree, "dev", head_dims, build.DEV_FEATURES_OFF)
    assert len(probe["warnings"]) == 1, probe["warnings"]
    assert probe["warnings"][0].startswith("DeveloperBuildWarning: ")
    assert "forward only" in probe["warnings"][0] and "64/128" in probe["warnings"][0]
    results = probe["results"]
    for name in RUNS:
        assert results[name]["error"] is None and results[name]["reached"], (name, results[name])
    for name in REFUSED:
        error = results[name]["error"]
        assert error and error.startswith("CompiledOutError: "), (name, results[name])
        assert "profile 'dev'" in error and "FLASH_ATTN_SPARSE_PROFILE=full nox -s build" in error, error
        # before C++: a refused forward reaches nothing, a backward only its (compiled) forward
        assert results[name]["reached"] == (["fwd"] if name == "backward" else []), (name, results[name])


def test_full_profile_neither_warns_nor_refuses(tree):
    probe = _probe(tree, "full", [32, 64, 96, 128, 192, 256], [])
    assert probe["warnings"] == []
    for name, result in probe["results"].items():
        assert result["error"] is None and result["reached"], (name, result)


def test_the_build_names_its_profile(tmp_path):
    layout = Layout.at(REPO).with_trees(tmp_path / "trees")
    env = build.build_env(layout, "dev", ["90"], "sparse.x.dev")
    assert env["FLASH_ATTN_SPARSE_PROFILE"] == "dev"
    assert all(env[f"FLASH_ATTENTION_DISABLE_{f}"] == "TRUE" for f in build.DEV_FEATURES_OFF)


@pytest.mark.gpu
def test_installed_dev_wheel_warns_and_refuses_on_the_gpu():
    """The installed wheel (nox -s build, dev profile): the same through CUDA and torch's custom ops."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    profile = pytest.importorskip("flash_attn.build_profile")
    if profile.PROFILE != "dev":
        pytest.skip(f"the installed flash_attn is the {profile.PROFILE!r} build")
    from flash_attn import flash_attn_func
    child = subprocess.run([sys.executable, "-W", "always", "-c", "import flash_attn, flash_attn.flash_attn_interface"],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stderr.count("DeveloperBuildWarning") == 1, child.stderr[-3000:]
    q, k, v = (torch.randn(1, 256, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    reference = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)),
                                                                 is_causal=True).transpose(1, 2)
    assert (flash_attn_func(q, k, v, causal=True).float() - reference).abs().max() < 2e-2
    with pytest.raises(profile.CompiledOutError, match="head dim 96"):
        flash_attn_func(*(torch.randn(1, 256, 2, 96, device="cuda", dtype=torch.bfloat16) for _ in range(3)))
    with pytest.raises(profile.CompiledOutError, match="window_size"):
        flash_attn_func(q, k, v, causal=True, window_size=(64, 0))
    with pytest.raises(profile.CompiledOutError, match="softcap"):
        flash_attn_func(q, k, v, softcap=30.0)
    q_grad = q.clone().requires_grad_()
    with pytest.raises(profile.CompiledOutError, match="backward"):
        flash_attn_func(q_grad, k, v, causal=True).sum().backward()
