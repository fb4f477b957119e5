"""The FA-3 host's kernel choice (overlay hopper/sparse_kernel_choice.h), compiled on the CPU under
each FLASH_ATTENTION_DISABLE_* flag the build offers: a narrowed build refuses, by name and before
any kernel, what it compiled out, and never picks a kernel it lacks. The choice of packing and tile
rows is checked here too, and the Python mirror of packing (fa3_ops) against it."""

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
HOPPER_OVERLAY = REPO / "patches" / "overlay" / "flash-attn-3" / "hopper"
sys.path.insert(0, str(REPO / "python"))

from flash_attn_sparse.backends import fa3_ops  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

# Reads one call's shape per line (the SparseCallShape fields in order) and prints the choice.
DRIVER = r"""
#include <cstdio>
#include <iostream>
#include "sparse_kernel_choice.h"
int main() {
    SparseCallShape s;
    int fp16, varlen, paged_cpasync;
    while (std::cin >> s.batch_size >> s.num_heads >> s.num_heads_k >> s.table_heads >> s.seqlen_q >> s.q_block_size
                    >> s.head_dim >> fp16 >> varlen >> s.max_list_blocks >> s.num_sm >> s.num_splits >> s.pack_gqa
                    >> paged_cpasync) {
        s.fp16 = fp16;
        s.varlen = varlen;
        s.paged_cpasync = paged_cpasync;
        SparseKernelChoice const c = choose_sparse_kernel(s);
        std::printf("{\"refusal\": \"%s\", \"pack\": %d, \"num_splits\": %d, \"block_m\": %d, \"tiles_per_row\": %d}\n",
                    c.refusal.c_str(), int(c.pack), c.num_splits, c.block_m, c.tiles_per_row);
    }
}
"""

FLAGS = ["VARLEN", "PACKGQA", "SPLIT", "HDIM64", "HDIM128", "FP16", "PAGEDKV"]
ONE_LIST_ROW = 1 << 30


@pytest.fixture(scope="module")
def chooser(tmp_path_factory):
    """chooser(flag)(calls) -> the choices of a driver built with FLASHATTENTION_DISABLE_<flag>."""
    folder = tmp_path_factory.mktemp("choice")
    (folder / "driver.cpp").write_text(DRIVER)
    built = {}

    def build(flag):
        if flag not in built:
            binary = folder / f"driver_{flag or 'full'}"
            defines = [f"-DFLASHATTENTION_DISABLE_{flag}"] if flag else []
            subprocess.run(["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", *defines, f"-I{HOPPER_OVERLAY}",
                            str(folder / "driver.cpp"), "-o", str(binary)], check=True)
            built[flag] = binary

        def choose(calls):
            lines = "".join(" ".join(str(int(v)) for v in call_fields(**call)) + "\n" for call in calls)
            done = subprocess.run([str(built[flag])], input=lines, capture_output=True, text=True, check=True)
            return [json.loads(line) for line in done.stdout.splitlines()]
        return choose
    return build


def call_fields(batch=1, heads=32, heads_k=8, table_heads=8, seqlen_q=1, q_block_size=None, head_dim=128,
                fp16=False, varlen=False, max_list_blocks=64, num_sm=132, num_splits=0, pack_gqa=-1, paged_cpasync=False):
    return (batch, heads, heads_k, table_heads, seqlen_q, q_block_size or seqlen_q, head_dim, fp16, varlen,
            max_list_blocks, num_sm, num_splits, pack_gqa, paged_cpasync)


def one(chooser, flag=None, **call):
    return chooser(flag)([call])[0]


def test_decode_packs_into_64_row_tiles_and_more_packed_rows_into_128(chooser):
    decode = one(chooser, seqlen_q=4, heads=40, heads_k=8)  # group 5, 20 packed rows
    assert decode == {"refusal": "", "pack": 1, "num_splits": 16, "block_m": 64, "tiles_per_row": ONE_LIST_ROW}
    wide = one(chooser, batch=4, seqlen_q=16, heads=128, heads_k=8)  # group 16, 256 packed rows
    assert (wide["pack"], wide["block_m"]) == (1, 128) and wide["num_splits"] > 1
    unsplit = one(chooser, batch=64, seqlen_q=4, heads=40, heads_k=8)  # 512 tiles: no split
    assert (unsplit["pack"], unsplit["num_splits"], unsplit["block_m"]) == (1, 1, 128)


def test_group_one_split_calls_take_the_packed_decode_tile_unless_packing_is_refused(chooser):
    assert one(chooser, seqlen_q=1, heads=8, heads_k=8)["block_m"] == 64
    assert one(chooser, seqlen_q=1, heads=8, heads_k=8, pack_gqa=0) | {"num_splits": 0} == {
        "refusal": "", "pack": 0, "num_splits": 0, "block_m": 128, "tiles_per_row": ONE_LIST_ROW}
    assert one(chooser, seqlen_q=256, q_block_size=128, heads=8, heads_k=8)["pack"] == 0  # more rows than one tile


def test_packing_needs_lists_shared_by_the_group_and_whole_tiles_per_list_row(chooser):
    assert one(chooser, seqlen_q=4, table_heads=32)["pack"] == 0  # per-query-head lists
    assert "pack_gqa needs shared" in one(chooser, seqlen_q=4, table_heads=32, pack_gqa=1)["refusal"]
    rows = one(chooser, seqlen_q=512, q_block_size=32, heads=32, heads_k=8)  # 32 * 4 = 128 packed rows a list row
    assert (rows["pack"], rows["tiles_per_row"]) == (1, 1)
    assert "multiple of 128" in one(chooser, seqlen_q=512, q_block_size=32, heads=24, heads_k=8)["refusal"]


def test_pages_not_holding_whole_blocks_take_packed_kernels_only(chooser):
    """Their cp.async kernels are instantiated packed: a group of one packs too, per-query-head
    lists (or pack_gqa=False) are refused with the reason, prefill packs when its tiles allow."""
    for heads, seqlen_q, splits in ((8, 1, 0), (8, 1, 1), (32, 4, 0), (32, 1000, 1), (24, 256, 0)):
        choice = one(chooser, heads=heads, seqlen_q=seqlen_q, q_block_size=128 if seqlen_q > 128 else None,
                     num_splits=splits, paged_cpasync=True)
        assert choice["refusal"] == "" and choice["pack"] == 1, (heads, seqlen_q, choice)
    assert one(chooser, heads=8, seqlen_q=1, num_splits=1)["pack"] == 0  # contiguous: a group of one stays unpacked
    for refused in (dict(table_heads=32), dict(pack_gqa=0), dict(seqlen_q=512, q_block_size=32, heads=24)):
        assert "need packed tiles" in one(chooser, **{"seqlen_q": 4, "paged_cpasync": True, **refused})["refusal"]


@pytest.mark.parametrize("flag", FLAGS)
def test_a_narrowed_build_refuses_by_name_what_it_compiled_out(chooser, flag):
    needs = {"VARLEN": dict(varlen=True), "PACKGQA": dict(seqlen_q=4, pack_gqa=1), "SPLIT": dict(num_splits=4),
             "HDIM64": dict(head_dim=64), "HDIM128": dict(head_dim=128), "FP16": dict(fp16=True),
             "PAGEDKV": dict(seqlen_q=4, paged_cpasync=True)}[flag]
    assert one(chooser, None, **needs)["refusal"] == ""
    refusal = one(chooser, flag, **needs)["refusal"]
    assert f"FLASH_ATTENTION_DISABLE_{flag})" in refusal, refusal
    assert one(chooser, flag, **({"head_dim": 64} if flag == "HDIM128" else {}))["refusal"] == ""


@pytest.mark.parametrize("flag", ["PACKGQA", "SPLIT"])
def test_a_narrowed_build_chooses_only_kernels_it_has(chooser, flag):
    calls = [dict(batch=b, seqlen_q=s, heads=g * 8, heads_k=8, table_heads=t)
             for b, s, g, t in itertools.product((1, 8, 64), (1, 16, 512), (1, 3, 8), (1, 8))]
    for call, choice in zip(calls, chooser(flag)(calls)):
        assert choice["refusal"] == "", (call, choice)
        assert (choice["pack"] if flag == "PACKGQA" else choice["num_splits"] > 1) == 0, (call, choice)
        assert choice["block_m"] == 128, (call, choice)


def test_the_python_mirror_of_packing_agrees_with_the_host(chooser):
    calls = [dict(seqlen_q=s, q_block_size=qb, heads=g * 8, heads_k=8, table_heads=t, batch=64)
             for s, qb, g, t in itertools.product((1, 7, 16, 256, 1000), (1, 16, 64, 128, 4096), (2, 3, 5, 6, 7, 8, 16),
                                                  (1, 8, None))]
    for call in calls:
        call["table_heads"] = call["table_heads"] or call["heads"]
    for call, choice in zip(calls, chooser(None)(calls)):
        mirror = fa3_ops._packs_query_heads(call["heads"] // 8, call["table_heads"], call["heads"],
                                            call["q_block_size"], call["seqlen_q"])
        assert bool(choice["pack"]) == mirror or choice["refusal"], (call, choice)
    # With pages that do not hold whole blocks the host packs exactly where fa3_ops._packable says.
    for call in calls:
        call["paged_cpasync"] = True
    for call, choice in zip(calls, chooser(None)(calls)):
        packable = fa3_ops._packable(call["heads"] // 8, call["table_heads"], call["heads"], call["q_block_size"],
                                     call["seqlen_q"])
        assert bool(choice["pack"]) == packable and (choice["refusal"] == "") == packable, (call, choice)


@pytest.mark.parametrize("flag", [None, *FLAGS])
def test_the_build_reports_what_it_compiled_out(tmp_path, flag):
    """sparse_build_disabled (flash_attn_3._C.sparse_disabled), which fa3_ops.disabled reads to
    route around what a narrowed build lacks, names exactly the flags it was compiled with."""
    (tmp_path / "report.cpp").write_text('#include <cstdio>\n#include "sparse_kernel_choice.h"\n'
                                         'int main() { for (auto const &f : sparse_build_disabled()) std::printf("%s\\n", f.c_str()); }\n')
    defines = [f"-DFLASHATTENTION_DISABLE_{flag}"] if flag else []
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", *defines, f"-I{HOPPER_OVERLAY}", str(tmp_path / "report.cpp"),
                    "-o", str(tmp_path / "report")], check=True)
    printed = subprocess.run([str(tmp_path / "report")], capture_output=True, text=True, check=True).stdout.split()
    assert printed == ([flag] if flag else [])


@pytest.mark.parametrize("flag, call, reason", [
    ("VARLEN", dict(varlen=True), "DISABLE_VARLEN"), ("FP16", dict(dtype=torch.float16), "DISABLE_FP16"),
    ("HDIM64", dict(head_dim=64), "DISABLE_HDIM64"), ("HDIM128", dict(), "DISABLE_HDIM128"),
])
def test_the_python_refusal_routes_around_what_the_build_lacks(monkeypatch, flag, call, reason):
    """fa3_ops.refusal names a compiled-out feature the call needs, so `auto` takes another backend
    instead of a refusal from the host; a build without PackGQA packs nothing."""
    from flash_attn_sparse import SparseBlocks
    monkeypatch.setitem(fa3_ops._DISABLED, "answer", (flag,))
    monkeypatch.setattr(fa3_ops, "_on_sm90", lambda q: True)
    d = call.get("head_dim", 128)
    q = torch.zeros(1, 4, 8, d, dtype=call.get("dtype", torch.bfloat16))
    k = torch.zeros(1, 256, 2, d, dtype=q.dtype)
    if call.get("varlen"):
        q, k = q[0], k[0]
        blocks = SparseBlocks(torch.ones(2, 1, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32),
                              cu_total_m_blocks=torch.tensor([0, 1], dtype=torch.int32),
                              cu_block_idx_offsets=torch.tensor([0, 1], dtype=torch.int32), block_size=128)
    else:
        blocks = SparseBlocks(torch.ones(1, 2, 1, dtype=torch.int32), torch.zeros(1, 2, 1, 1, dtype=torch.int32), block_size=128)
    assert reason in fa3_ops.refusal(q, k, blocks, varlen=bool(call.get("varlen")), max_seqlen_q=4)
    monkeypatch.setitem(fa3_ops._DISABLED, "answer", ())
    assert fa3_ops.refusal(q, k, blocks, varlen=bool(call.get("varlen")), max_seqlen_q=4) is None
    monkeypatch.setitem(fa3_ops._DISABLED, "answer", ("PACKGQA",))
    assert not fa3_ops._packs_query_heads(4, 2, 8, 128, 4)
