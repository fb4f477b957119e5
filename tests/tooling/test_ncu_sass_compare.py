"""benchmarks/ncu_sass_compare.py on a small export written here: repeated sections dropped,
the first kernel against the mean of the others, its most stalled instructions named."""

import gzip
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import ncu_sass_compare  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed","stall_barrier","stall_long_sb","stall_barrier (Not Issued)"')


def section(name, rows):
    lines = [f'"Kernel Name","{name}"', HEADER]
    for address, source, samples, executed, barrier, long_sb in rows:
        lines.append(f'"{address}","{source}","{samples}","{samples}","{executed}","{barrier}","{long_sb}","0"')
    return lines


def test_the_first_kernel_is_compared_with_the_mean_of_the_distinct_others(tmp_path):
    sparse = section("sparse", [("0x100", "  LDG.E R2, desc[UR4][R2.64]", "30", "1,000", "0", "30"),
                                ("0x110", "  @!P0 WARPGROUP.DEPBAR.LE gsb0, 0x0", "50", "1,000", "50", "0")])
    dense_a = section("dense", [("0x200", "  WARPGROUP.DEPBAR.LE gsb0, 0x0", "10", "1,000", "10", "0")])
    dense_b = section("dense", [("0x300", "  WARPGROUP.DEPBAR.LE gsb0, 0x0", "20", "1,000", "20", "0")])
    path = tmp_path / "x-sass.csv.gz"
    with gzip.open(path, "wt") as handle:  # dense_a twice: ncu's export repeats sections
        handle.write("\n".join(sparse + dense_a + dense_b + dense_a) + "\n")
    sections = ncu_sass_compare.read_sections(path)
    assert [s["name"] for s in sections] == ["sparse", "dense", "dense"]
    text = ncu_sass_compare.report(sections, top=2)
    assert "| all | 80 | 15 | 5.333 |" in text and "| executed | 2,000 | 1,000 | 2.000 |" in text
    assert "| stall_barrier | 50 | 15 | 3.333 |" in text and "(Not Issued)" not in text
    assert "| `LDG.E` | 1,000 | 0 | +1,000 |" in text and "| `WARPGROUP.DEPBAR.LE` | 1,000 | 1,000 | +0 |" in text
    most = text.split("most stalled")[1].splitlines()
    assert most[4].startswith("| 0x0010 | `@!P0 WARPGROUP.DEPBAR.LE gsb0, 0x0` | 1,000 | 50 | barrier 50")
    assert most[5].startswith("| 0x0000 | `LDG.E") and most[5].endswith("long_sb 30 |")
