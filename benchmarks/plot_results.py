"""Plot a results JSON of bench_sparse.py: time per method for every shape and density.

    python benchmarks/plot_results.py benchmarks/results/<run>.json   # writes <run>.png beside it
"""

import json
import sys
from pathlib import Path


def plot(json_path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(json_path.read_text())
    rows = result["rows"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for method in dict.fromkeys(r["method"] for r in rows if r["shape"] == shape):
            points = sorted((r["density"], r["ms"]) for r in rows if r["shape"] == shape and r["method"] == method)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("density (fraction of blocks listed)")
        ax.set_ylabel("ms (median)")
        ax.set_title(shape, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['gpu']}, {result['date']}: copy {result['copy_tbps']:.2f} TB/s, "
                 f"bf16 matmul {result['matmul_tflops']:.0f} TFLOP/s (measured in the run)", fontsize=10)
    fig.tight_layout()
    out = json_path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(plot(Path(sys.argv[1])))
