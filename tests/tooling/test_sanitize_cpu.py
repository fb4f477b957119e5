"""tests/sanitize.py's reading of compute-sanitizer output (CPU): kinds of report and where,
the CUDA runtime's cuGetProcAddress probes told apart from kernel faults."""

import sanitize

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
