"""Stage 4 on a CPU: flash-attn-4's SM90 block-sparse forward, with this series' patches,
compiles for sm_90a without a GPU.

flash-attn-4 supports CPU-only compilation (FLASH_ATTENTION_ARCH picks the kernel path,
CUTE_DSL_ARCH the target, FLASH_ATTENTION_NUM_SMS the SM count), and under torch's FakeTensorMode
its interface traces and compiles the kernel but launches nothing. Each case runs in a fresh
interpreter (the arch is read once per process) over the patched tree materialized from the
pinned sdist, so a stage-4 patch that breaks the SM90 kernel's tracing or compilation fails here
before any GPU run. Needs the CuTe-DSL runtime (the `fa4 compile` requirements in .ci/run);
without it the cases skip with that reason.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "python"))  # for forktools; appended, so an installed flash_attn_sparse still wins

from forktools import series  # noqa: E402
from forktools.layout import Layout  # noqa: E402

FA4_SDIST = REPO / ".cache" / "upstream" / "flash_attn_4-4.0.0b36.tar.gz"
RUNTIME = ("cutlass", "quack", "triton", "tvm_ffi")
MISSING = [name for name in RUNTIME if importlib.util.find_spec(name) is None]

pytestmark = [
    pytest.mark.stage4,
    pytest.mark.skipif(not FA4_SDIST.exists(), reason=f"{FA4_SDIST.name} absent (run `nox -s upstream`)"),
    pytest.mark.skipif(bool(MISSING), reason=f"the CuTe-DSL runtime is not installed ({', '.join(MISSING)} missing): "
                       "pip install 'nvidia-cutlass-dsl[cu13]==4.8.1' quack-kernels==0.6.5 "
                       "apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 triton"),
]

CROSS_COMPILE_ENV = {"FLASH_ATTENTION_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a", "FLASH_ATTENTION_NUM_SMS": "132"}


@pytest.fixture(scope="module")
def patched_fa4(tmp_path_factory) -> Path:
    """A directory holding flash_attn/cute = the patched flash-attn-4 tree (as its wheel lays it out)."""
    root = tmp_path_factory.mktemp("fa4")
    layout = Layout.at(REPO).with_trees(root / "trees")  # its cache holds FA4_SDIST
    package = root / "pkg" / "flash_attn"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")  # a regular package, so an installed flash_attn cannot shadow it
    series.materialize(layout, "flash-attn-4", package / "cute")
    return root / "pkg"


def compile_case(name: str) -> str:
    """Runs in the child interpreter: trace and compile one forward under FakeTensorMode."""
    import torch
    from flash_attn.cute import interface
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from torch._subclasses.fake_tensor import FakeTensorMode

    heads, heads_k, dim = 8, 2, 128
    with FakeTensorMode(allow_non_fake_inputs=True):
        empty = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="cuda")
        if name == "batched_causal_128":
            batch, seqlen, block = 2, 1024, 128
            m_blocks = n_blocks = seqlen // block
            q, k = empty(batch, seqlen, heads, dim), empty(batch, seqlen, heads_k, dim)
            counts = lambda: empty(batch, heads, m_blocks, dtype=torch.int32)
            ids = lambda: empty(batch, heads, m_blocks, n_blocks, dtype=torch.int32)
            tensors = BlockSparseTensorsTorch(counts(), ids(), counts(), ids(), block_size=(block, block))
            out, lse = interface.flash_attn_func(q, k, torch.empty_like(k), causal=True,
                                                 block_sparse_tensors=tensors, return_lse=True)
        elif name == "varlen_block_64":  # the path of patch flash-attn-4/0001 (tile_n follows the block)
            batch, max_seqlen, block = 3, 512, 64
            total = batch * max_seqlen
            m_blocks_total, entries = batch * (max_seqlen // 128), batch * (max_seqlen // 128) * (max_seqlen // block)
            q, k = empty(total, heads, dim), empty(total, heads_k, dim)
            cu_seqlens = empty(batch + 1, dtype=torch.int32)
            counts = lambda: empty(heads, m_blocks_total, dtype=torch.int32)
            ids = lambda: empty(heads, entries, dtype=torch.int32)
            tensors = BlockSparseTensorsTorch(counts(), ids(), counts(), ids(),
                                              cu_total_m_blocks=empty(batch + 1, dtype=torch.int32),
                                              cu_block_idx_offsets=empty(batch + 1, dtype=torch.int32),
                                              block_size=(128, block))
            out, lse = interface.flash_attn_varlen_func(
                q, k, torch.empty_like(k), cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, causal=False,
                block_sparse_tensors=tensors, return_lse=True)
        elif name == "decode_split_kv":  # stage 4's split-KV over per-K/V-head lists (PackGQA, fp32 partials)
            batch, seqlen_q, seqlen_k, block = 4, 16, 8192, 128
            q, k = empty(batch, seqlen_q, heads, dim), empty(batch, seqlen_k, heads_k, dim)
            counts = lambda: empty(batch, heads_k, 1, dtype=torch.int32)
            ids = lambda: empty(batch, heads_k, 1, seqlen_k // block, dtype=torch.int32)
            tensors = BlockSparseTensorsTorch(counts(), ids(), counts(), ids(), block_size=(128, block))
            out, lse = interface.flash_attn_func(q, k, torch.empty_like(k), block_sparse_tensors=tensors,
                                                 return_lse=True, num_splits=3)
        elif name == "decode_split_kv_tile64":  # as a decode call reaches it: 64-row query blocks (fa4.small_tile),
            batch, seqlen_q, seqlen_k, block = 4, 1, 8192, 128  # the full lists as given, one broadcast zero mask count
            q, k = empty(batch, seqlen_q, heads, dim), empty(batch, seqlen_k, heads_k, dim)
            full_ids = empty(batch, heads_k, 1, seqlen_k // block, dtype=torch.int32)
            tensors = BlockSparseTensorsTorch(empty(1, 1, 1, dtype=torch.int32), full_ids,
                                              empty(batch, heads_k, 1, dtype=torch.int32), full_ids, block_size=(64, block))
            out, lse = interface.flash_attn_func(q, k, torch.empty_like(k), block_sparse_tensors=tensors,
                                                 return_lse=True, num_splits=3)
        elif name == "decode_mask_source":  # the gathered speculative call in one launch: mask lists read k_spec
            batch, seqlen_q, seqlen_k, seqlen_spec, block = 4, 16, 8192, 512, 128
            q, k = empty(batch, seqlen_q, heads, dim), empty(batch, seqlen_k, heads_k, dim)
            k_spec = empty(batch, seqlen_spec, heads_k, dim)
            counts = lambda: empty(batch, heads_k, 1, dtype=torch.int32)
            ids = lambda: empty(batch, heads_k, 1, seqlen_k // block, dtype=torch.int32)
            tensors = BlockSparseTensorsTorch(counts(), ids(), counts(), ids(), block_size=(64, block))
            out, lse, *_ = interface._flash_attn_fwd(q, k, torch.empty_like(k), causal=True, block_sparse_tensors=tensors,
                                                     return_lse=True, num_splits=2,
                                                     mask_block_kv=(k_spec, torch.empty_like(k_spec)))
        else:
            raise ValueError(name)
    compiled = interface._flash_attn_fwd.compile_cache.cache
    if len(compiled) != 1 or not next(iter(compiled.values())).has_gpu_module:
        raise RuntimeError(f"expected one compiled SM90 kernel with a GPU module, got {compiled!r}")
    if name == "decode_mask_source" and next(iter(compiled))[-1] is not True:  # the key's last field: a mask source
        raise RuntimeError("the kernel was compiled without its mask-list K/V source")
    if name.startswith("decode_split_kv") and not interface._flash_attn_fwd_combine.compile_cache.cache:
        raise RuntimeError("the split partials were not combined")
    return f"compiled {name}: out {tuple(out.shape)}, lse {tuple(lse.shape)}"


@pytest.mark.parametrize("case", ["batched_causal_128", "varlen_block_64", "decode_split_kv", "decode_split_kv_tile64",
                                  "decode_mask_source"])
def test_sm90_block_sparse_forward_compiles_without_a_gpu(patched_fa4: Path, case: str):
    env = {**os.environ, **CROSS_COMPILE_ENV,
           "PYTHONPATH": os.pathsep.join([str(patched_fa4), str(Path(__file__).resolve().parent), str(REPO / "tests"),
                                        os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", f"import test_stage4_fa4_compile as t; print(t.compile_case({case!r}))"],
                           env=env, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stderr[-4000:]
    assert f"compiled {case}" in child.stdout
