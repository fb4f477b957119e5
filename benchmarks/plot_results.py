"""Plot a results JSON of bench_sparse.py: time per method against density, per shape.

    python benchmarks/plot_results.py benchmarks/results/<run>.json   # writes <run>.png beside it

Each shape gets one panel per group of methods (this against its peers, against the ceilings,
the speculative forms, the backends and plans, dense kernels over the listed keys), so no panel
holds more than eight series; a method keeps its colour and marker in every panel, and one
legend sits below the panels, off the data.
"""

import json
import sys
from pathlib import Path

PANELS = {
    "vs peers": ["auto", "fa2_sparse", "fa4_sparse", "flex_attention", "fa2_dense", "sdpa_flash", "sdpa_cudnn"],
    "vs ceilings": ["auto", "fa4_direct", "fa4_direct tile128", "copy_same_bytes", "read_listed_blocks",
                    "read_listed_walk2", "read_listed_walk4"],
    "speculative": ["union_one_pass", "speculative_two_pass", "speculative_two_pass fa4", "speculative_zero_copy"],
    "backends and plans": ["auto", "fa3_sparse", "plan_run auto", "plan_run fa2", "plan_run fa3"],
    "dense over the listed keys": ["auto", "fa3_sparse", "fa3_dense_listed", "fa2_dense_listed", "cudnn_listed",
                                   "fa4_pristine_blocksparse"],
}
MARKERS = "osD^vPX"  # a colour that comes round again comes with another marker
MAX_SERIES = 8
COLUMNS = 3


def panel_groups(methods: list[str]) -> list[tuple[str, list[str]]]:
    """(title, methods) per panel: the fixed groups that have data, then the rest in eights."""
    groups = [(title, [m for m in wanted if m in methods]) for title, wanted in PANELS.items()]
    groups = [(title, chosen) for title, chosen in groups if chosen]
    rest = [m for m in methods if not any(m in wanted for wanted in PANELS.values())]
    groups += [("other", rest[i:i + MAX_SERIES]) for i in range(0, len(rest), MAX_SERIES)]
    return groups


def plot(json_path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(json_path.read_text())
    rows = result["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    # tab10 then Dark2: 18 colours no two alike; "auto" (the product) black and on top.
    palette = [c for c in plt.get_cmap("tab10").colors if c != plt.get_cmap("tab10").colors[7]]
    palette += plt.get_cmap("Dark2").colors
    others = [m for m in methods if m != "auto"]
    colour = {method: palette[i % len(palette)] for i, method in enumerate(others)} | {"auto": "black"}
    marker = {method: MARKERS[i // len(palette) % len(MARKERS)] for i, method in enumerate(others)} | {"auto": "o"}
    panels = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        present = [m for m in methods if any(r["shape"] == shape and r["method"] == m for r in rows)]
        panels += [(shape, title, chosen) for title, chosen in panel_groups(present)]
    columns = min(COLUMNS, len(panels))
    lines = -(-len(panels) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4.6 * columns, 3.6 * lines), squeeze=False)
    handles = {}
    for ax, (shape, title, chosen) in zip(axes.flat, panels):
        for method in chosen:
            points = sorted((r["density"], r["ms"]) for r in rows if r["shape"] == shape and r["method"] == method)
            (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker[method], color=colour[method],
                              label=method, linewidth=2.2 if method == "auto" else 1.2,
                              zorder=3 if method == "auto" else 2)
            handles.setdefault(method, line)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("density (fraction of blocks listed)", fontsize=8)
        ax.set_ylabel("ms (median)", fontsize=8)
        ax.set_title(f"{shape}\n{title}", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{result['gpu']}, {result['date']}: copy {result['copy_tbps']:.2f} TB/s, "
                 f"bf16 matmul {result['matmul_tflops']:.0f} TFLOP/s (measured in the run)", fontsize=10)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(6, len(handles)), fontsize=8,
               frameon=False)
    legend_rows = -(-len(handles) // 6)
    fig.tight_layout(rect=(0, 0.12 * legend_rows / lines, 1, 0.97))
    out = json_path.with_suffix(".png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(plot(Path(path)))
