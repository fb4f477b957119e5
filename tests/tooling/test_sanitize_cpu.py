"""tests/sanitize.py's reading of compute-sanitizer output (CPU): kinds of report and where,
the CUDA runtime's cuGetProcAddress probes told apart from kernel faults; its tools, and the
shapes and lists of its many-tile FA-3 cases."""

import os

import pytest

import sanitize
from helpers import SKEWED_LIST_LENGTHS

MEMCHECK = """========= COMPUTE-SANITIZER
========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call to cuGetProcAddress_v2.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: cuGetProcAddress_v2 [0x1234] in libcuda.so.1
========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call to cuGetProcAddress_v2.
========= Invalid __global__ read of size 4 bytes
=========     at void flash::compute_attn_1rowblock_sparse<Traits>(const Flash_fwd_params &)+0x1a0 in flash_fwd_sparse_kernel.h:123
=========     by thread (0,0,0) in block (0,0,0)
========= ERROR SUMMARY: 3 errors
"""
RACECHECK = "\n".join([
    "========= Error: Race reported between Read access at flash::Scheduler::get_next_work(const Params &) const+0xa20 "
    "in tile_scheduler.hpp:699",
    "=========     and Write access at flash::Scheduler::get_next_work(const Params &) const+0xb40 in tile_scheduler.hpp:701",
    "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"])


def test_reports_are_grouped_by_kind_and_place():
    found = sanitize.reports(MEMCHECK)
    assert found[("Program hit CUDA_ERROR_INVALID_VALUE", "cuGetProcAddress_v2")] == 2
    ((what, where),) = [key for key in found if key[0].startswith("Invalid")]
    assert (what, where) == ("Invalid __global__ read", "flash::compute_attn_1rowblock_sparse (flash_fwd_sparse_kernel.h:123)")
    assert sanitize.reports(RACECHECK) == {("Error: Race reported", "flash::Scheduler::get_next_work (tile_scheduler.hpp:699) with "
                                                                    "flash::Scheduler::get_next_work (tile_scheduler.hpp:701)"): 1}


def test_the_first_report_of_each_kind_is_kept_whole():
    first_seen = {}
    found = sanitize.reports(MEMCHECK, first_seen)
    assert set(first_seen) == set(found)
    invalid = next(text for (what, _), text in first_seen.items() if what.startswith("Invalid"))
    assert invalid.splitlines() == MEMCHECK.splitlines()[5:8]


def test_only_the_runtime_probes_count_as_benign():
    assert all(where.startswith(sanitize.BENIGN_API_ERRORS) for (what, where) in sanitize.reports(MEMCHECK)
               if what.startswith("Program hit"))
    assert not "flash::compute_attn".startswith(sanitize.BENIGN_API_ERRORS)


# As compute-sanitizer 2025.x prints them on an H200, names shortened only in length.
SCHEDULER = ("flash::DynamicPersistentTileScheduler<(int)256, (int)128, (bool)0, (bool)1, (bool)1>::WorkTileInfo "
             "flash::DynamicPersistentTileScheduler<(int)256, (int)128, (bool)0, (bool)1, (bool)1>::get_next_work<(bool)1>"
             "(const flash::DynamicPersistentTileScheduler<(int)256, (int)128, (bool)0, (bool)1, (bool)1>::Params &, "
             "const flash::DynamicPersistentTileScheduler<(int)256, (int)128, (bool)0, (bool)1, (bool)1>::WorkTileInfo &) const")
LONG_RACE = "\n".join([
    f"========= Error: Race reported between Write access at {SCHEDULER}+0xe540 in tile_scheduler.hpp:348",
    f"=========     and Read access at {SCHEDULER}+0x8a60 in tile_scheduler.hpp:354 [8 hazards]",
    "========= ",
    "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"])
ELEMENTWISE = ("void at::native::vectorized_elementwise_kernel<(int)8, at::native::AUnaryFunctor<c10::Half, c10::Half, "
               "c10::Half, at::native::binary_internal::MulFunctor<float>>, std::array<char *, (unsigned long)2>>(int, T2, T3)")
INITCHECK = "\n".join([
    "========= Uninitialized __global__ memory read of size 2 bytes",
    f"=========     at {ELEMENTWISE}+0x390",
    "=========     by thread (96,0,0) in block (0,0,0)",
    "=========     Saved host backtrace up to driver entry point at kernel launch time",
    "=========         Host Frame: cudaLaunchKernel [0x745b7] in libcudart.so.13",
    "=========         Host Frame: _PyEval_EvalFrameDefault [0x1d8896] in python3",
    "=========         Host Frame: attention_ref in reference.py:31",
    "=========         Host Frame: reference in build.py:206",
    "========= ",
    "========= ERROR SUMMARY: 1 error"])


def test_long_template_names_give_the_function_and_line_and_the_launching_python_line():
    assert sanitize.reports(LONG_RACE) == {
        ("Error: Race reported", "flash::DynamicPersistentTileScheduler::get_next_work (tile_scheduler.hpp:348) with "
                                 "flash::DynamicPersistentTileScheduler::get_next_work (tile_scheduler.hpp:354)"): 1}
    assert sanitize.reports(INITCHECK) == {
        ("Uninitialized __global__ memory read",
         "at::native::vectorized_elementwise_kernel, launched from attention_ref in reference.py:31"): 1}


def test_only_races_whose_every_site_is_the_scheduler_handoff_can_be_excused():
    ((what, where),) = sanitize.reports(LONG_RACE)
    assert sanitize.is_scheduler_handoff(what, where)
    varlen = "flash::VarlenDynamicPersistentTileScheduler::get_next_work (tile_scheduler.hpp:693)"
    assert sanitize.is_scheduler_handoff("Warning: Race reported", f"{varlen} with {varlen}")
    # One site elsewhere (a kernel of this series) is not the hand-off, nor a non-race report there.
    kernel = "flash::CollectiveMainloopFwdSm90::load (mainloop_fwd_sm90_tma_gmma_ws.hpp:820)"
    assert not sanitize.is_scheduler_handoff(what, f"{varlen} with {kernel}")
    assert not sanitize.is_scheduler_handoff("Invalid __shared__ read", varlen)
    assert not sanitize.is_scheduler_handoff(what, "flash::Scheduler::get_next_work (tile_scheduler.hpp:699)")


# synccheck's report of a barrier that not every thread of the block reaches.
SYNCCHECK = "\n".join([
    "========= Barrier error detected. Divergent thread(s) in block",
    "=========     at void flash::FlashAttnFwdSm90<Traits>::operator()(Params const &, char *)+0x2f40 in flash_fwd_kernel_sm90.h:412",
    "=========     by thread (128,0,0) in block (3,0,0)",
    "========= ",
    "========= ERROR SUMMARY: 1 error"])


def test_synccheck_is_a_tool_and_its_barrier_errors_are_read():
    assert "synccheck" in sanitize.TOOLS and set(sanitize.MANY_TILE_TOOLS) == {"racecheck", "synccheck"}
    assert sanitize.reports(SYNCCHECK) == {("Barrier error", "flash::FlashAttnFwdSm90::operator (flash_fwd_kernel_sm90.h:412)"): 1}


def barrier_error(function: str, line: str, python: str) -> str:
    return "\n".join([
        "========= Barrier error detected. Invalid arguments",
        f"=========     at void cutlass::arch::{function}(unsigned int)+0x90 in {line}",
        "=========     by thread (0,0,0) in block (0,0,0)",
        "=========     Saved host backtrace up to driver entry point at kernel launch time",
        f"=========         Host Frame: {python}",
        "========= "])


def test_barrier_errors_at_sites_upstream_also_gets_are_set_apart_whoever_launched_them():
    upstream = sanitize.reports(barrier_error("ClusterBarrier::arrive", "barrier.h:508", "__call__ in _ops.py:1269"))
    ours = sanitize.reports(barrier_error("ClusterBarrier::arrive", "barrier.h:508", "run_with in fa3.py:164")
                            + "\n" + barrier_error("cpasync_barrier_arrive", "barrier.h:735", "run_with in fa3.py:164"))
    shared, only_ours = sorted(ours, key=lambda key: "735" in key[1])
    assert sanitize.upstream_barrier_error(*shared, upstream)
    assert not sanitize.upstream_barrier_error(*only_ours, upstream)
    race = ("Error: Race reported", shared[1])  # only barrier errors: a race at the same site is never set apart
    assert not sanitize.upstream_barrier_error(*race, {race})
    assert sanitize.PRINT_LIMIT["synccheck"] >= 10_000  # every report printed: upstream's sites complete


def test_the_many_tile_cases_have_more_tiles_than_sms_and_skewed_lists():
    """Batched and varlen, packed GQA (per-K/V-head lists) and not: several tiles per SM of an
    H100, list lengths of every SKEWED_LIST_LENGTHS across tiles, an empty sequence."""
    batched_q = [sanitize.MANY_TILE_SEQLEN_Q] * sanitize.MANY_TILE_BATCH
    batched_k = [sanitize.MANY_TILE_SEQLEN_Q + sanitize.MANY_TILE_KEYS_BEFORE_DIAGONAL] * sanitize.MANY_TILE_BATCH
    assert 0 in sanitize.MANY_TILE_VARLEN_Q
    for table_heads in (sanitize.MANY_TILE_HEADS_K, sanitize.MANY_TILE_HEADS):
        for seqlens_q, seqlens_k in ((batched_q, batched_k), (sanitize.MANY_TILE_VARLEN_Q, sanitize.MANY_TILE_VARLEN_K)):
            assert sanitize.kernel_tiles(seqlens_q, table_heads) >= 2 * 132
            for causal in (False, True):
                full, mask = sanitize.many_tile_lists(table_heads, causal, seqlens_q, seqlens_k, seed=1)
                lengths = [len(f) + len(m) for full_b, mask_b in zip(full, mask) for full_h, mask_h in zip(full_b, mask_b)
                           for f, m in zip(full_h, mask_h)]
                assert set(lengths) >= set(SKEWED_LIST_LENGTHS) and lengths != sorted(lengths)
                assert any(row != sorted(row) for full_b in full for full_h in full_b for row in full_h)


def test_the_many_tile_plans_cover_every_path_in_order():
    """The calls synccheck checks one process each (--case-index): packed and not, causal and not,
    batched and varlen, split and not, for the sparse kernel and upstream's dense one."""
    plan = sanitize.many_tile_plan()
    assert {(layout, heads, causal) for layout, heads, causal, _ in plan} == {
        (layout, heads, causal) for layout in ("batched", "varlen")
        for heads in (sanitize.MANY_TILE_HEADS_K, sanitize.MANY_TILE_HEADS) for causal in (False, True)}
    assert {splits > 1 for *_, splits in plan} == {False, True} and len(plan) == 9
    assert {(layout, causal) for layout, _, causal in sanitize.UPSTREAM_MANY_TILE_PLAN} == {
        (layout, causal) for layout in ("batched", "varlen") for causal in (False, True)}


@pytest.fixture
def synccheck_stand_in(tmp_path, monkeypatch):
    """A compute-sanitizer on PATH that reports one barrier error per process and exits 1, as
    synccheck does when it ends a launch; it echoes its last argument to stderr."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text('#!/bin/sh\nfor a; do last=$a; done\necho "========= Barrier error detected. Missing wait."\n'
                    'echo "=========     at f()+0x10 in barrier.h:508"\necho "========= ERROR SUMMARY: 1 error"\n'
                    'echo "case $last" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")


def test_synccheck_checks_each_call_in_a_process_of_its_own(synccheck_stand_in):
    code, stdout, stderr = sanitize.run_tool("synccheck", ["python", "x.py"], calls=3)
    assert code == 1 and stderr.split() == ["case", "0", "case", "1", "case", "2"]
    assert stdout.count("Barrier error") == 3 and stdout.endswith("ERROR SUMMARY: 3 errors over 3 processes\n")
    code, stdout, stderr = sanitize.run_tool("racecheck", ["python", "x.py"], calls=3)  # one process
    assert stdout.count("Barrier error") == 1 and stderr.split() == ["case", "x.py"]


def test_a_launch_synccheck_ended_on_upstreams_reports_is_clean_only_call_by_call(synccheck_stand_in):
    upstream = {"synccheck": {("Barrier error", "f (barrier.h:508)")}}
    assert sanitize.sanitize(["python", "x.py"], tools=("synccheck",), baseline=upstream, calls=2) == 0
    # One process over many calls: its first launch ended, the rest unchecked: not clean.
    assert sanitize.sanitize(["python", "x.py"], tools=("synccheck",), baseline=upstream) == 1
    assert sanitize.sanitize(["python", "x.py"], tools=("synccheck",), calls=2) == 1  # not upstream's: a finding
