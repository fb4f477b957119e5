"""bench_sparse.py's `--shapes` selection on the CPU: a part names shapes by name or "name
density", and the crossover rows come only when a part says "crossover" ("Sk32k 0.0625" must not
pull in the crossover's ten decode rows too)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import bench_sparse  # noqa: E402


def names(spec):
    return [f"{shape.name} {shape.density:.4g}" for shape in bench_sparse.select_shapes(spec)]


def test_a_part_names_shapes_by_name_or_name_and_density():
    assert names("full 0.25") == ["prefill B1 S16k H32 full 0.25"]
    assert names("Sk32k 0.0625") == ["decode B8 Sq16 H32/8 Sk32k 0.0625", "decode B8 Sq1 H32/8 Sk32k 0.0625"]
    assert names("B8 Sq16 H32/8 Sk32k 1, causal 0.25") == ["decode B8 Sq16 H32/8 Sk32k 1", "prefill B1 S16k H32 causal 0.25"]


def test_crossover_rows_only_when_named_decode_first():
    crossover = names("crossover")
    assert len(crossover) == len(bench_sparse.CROSSOVER) and crossover[0].startswith("crossover decode B1 Sq1 ")
    assert names("crossover decode") == crossover[:10]
    assert not any(name.startswith("crossover") for name in names("decode"))
    assert names(None) == names("") == [f"{s.name} {s.density:.4g}" for s in bench_sparse.DECODE + bench_sparse.PREFILL
                                        + bench_sparse.CROSSOVER]
