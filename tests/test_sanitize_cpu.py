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
    assert what == "Invalid __global__ read" and where.startswith("void flash::compute_attn_1rowblock_sparse")
    assert sanitize.reports(RACECHECK) == {("Error: Race reported", "flash::Scheduler::get_next_work(const Params &) const"): 1}


def test_only_the_runtime_probes_count_as_benign():
    assert all(where.startswith(sanitize.BENIGN_API_ERRORS) for (what, where) in sanitize.reports(MEMCHECK)
               if what.startswith("Program hit"))
    assert not "flash::compute_attn".startswith(sanitize.BENIGN_API_ERRORS)
