"""Compare the first kernel of an ncu per-SASS-instruction export with the ones after it.

The runner's ncu steps (`ncu-fa3-prefill`, `ncu-fa3-decode`, `ncu-source`) export the source page
as CSV (`ncu --import R --page source --print-source sass --csv`, gzipped into `NAME-sass.csv.gz`):
one section per profiled launch, a "Kernel Name" line, a header line, a row per instruction. The
profile scripts put the sparse kernel first and its dense peers after it (sections repeated
byte for byte are dropped), so this prints, sparse against the mean of the others:
- executed warp instructions and stall samples (all, not issued), and the samples per stall reason;
- the opcodes whose executed counts differ most;
- the sparse kernel's most stalled instructions, with their two largest stall reasons.

    python benchmarks/ncu_sass_compare.py fa3-prefill-sass.csv.gz [--top 25] > compare.md

Samples follow cycles, not microseconds (a kernel clocked higher takes fewer us per sample):
compare them with the details page's elapsed cycles.
"""

import argparse
import csv
import gzip
import re
from collections import Counter
from pathlib import Path

ALL = "Warp Stall Sampling (All Samples)"
NOT_ISSUED = "Warp Stall Sampling (Not-issued Samples)"
EXECUTED = "Instructions Executed"
PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


def number(text: str) -> float:
    return 0.0 if text in ("", "-") else float(text.replace(",", ""))


def read_sections(path: Path) -> list:
    """[{"name", "rows": [dict per instruction]}] in file order, repeated sections dropped."""
    opener = gzip.open if path.suffix == ".gz" else open
    sections, header = [], None
    with opener(path, "rt", newline="") as handle:
        for row in csv.reader(handle):
            if not row:
                continue
            if row[0] == "Kernel Name":
                sections.append({"name": row[1], "rows": []})
            elif row[0] == "Address":
                header = row
            else:
                sections[-1]["rows"].append(dict(zip(header, row)))
    unique = []
    for section in sections:
        if not any(section["name"] == u["name"] and section["rows"] == u["rows"] for u in unique):
            unique.append(section)
    return unique


def opcode(source: str) -> str:
    text = PREDICATE.sub("", source.strip())
    return text.split()[0] if text else ""


def stall_columns(row: dict) -> list:
    """The per-reason sample columns (all samples, not the not-issued twins)."""
    return [name for name in row if name.startswith("stall_") and "Not Issued" not in name]


def totals(rows: list) -> dict:
    reasons = stall_columns(rows[0]) if rows else []
    found = {"executed": sum(number(r[EXECUTED]) for r in rows), "all": sum(number(r[ALL]) for r in rows),
             "not issued": sum(number(r[NOT_ISSUED]) for r in rows)}
    found.update({reason: sum(number(r[reason]) for r in rows) for reason in reasons})
    return found


def opcode_mix(rows: list) -> Counter:
    mix = Counter()
    for r in rows:
        mix[opcode(r["Source"])] += number(r[EXECUTED])
    return mix


def mean(dicts: list) -> dict:
    keys = set().union(*dicts)
    return {k: sum(d.get(k, 0.0) for d in dicts) / len(dicts) for k in keys}


def report(sections: list, top: int) -> str:
    first, others = sections[0], sections[1:]
    lines = [f"first kernel: {first['name'][:160]}", f"compared with the mean of {len(others)} kernel(s) after it", ""]
    mine, theirs = totals(first["rows"]), mean([totals(s["rows"]) for s in others])
    lines += ["| count | first | others (mean) | first / others |", "|---|---|---|---|"]
    order = ["executed", "all", "not issued"] + sorted((k for k in mine if k not in ("executed", "all", "not issued")),
                                                       key=lambda k: -max(mine[k], theirs.get(k, 0.0)))
    for key in order:
        other = theirs.get(key, 0.0)
        ratio = f"{mine[key] / other:.3f}" if other else "-"
        lines.append(f"| {key} | {mine[key]:,.0f} | {other:,.0f} | {ratio} |")
    mix_first, mix_others = opcode_mix(first["rows"]), mean([opcode_mix(s["rows"]) for s in others])
    differences = sorted(set(mix_first) | set(mix_others), key=lambda op: -abs(mix_first[op] - mix_others.get(op, 0.0)))
    lines += ["", "| opcode | first executed | others (mean) | difference |", "|---|---|---|---|"]
    for op in differences[:15]:
        lines.append(f"| `{op}` | {mix_first[op]:,.0f} | {mix_others.get(op, 0.0):,.0f} | "
                     f"{mix_first[op] - mix_others.get(op, 0.0):+,.0f} |")
    base = int(first["rows"][0]["Address"], 16)
    reasons = stall_columns(first["rows"][0])
    lines += ["", f"the first kernel's {top} most stalled instructions (offset from its first):", "",
              "| offset | instruction | executed | samples | largest reasons |", "|---|---|---|---|---|"]
    for r in sorted(first["rows"], key=lambda r: -number(r[ALL]))[:top]:
        largest = sorted(reasons, key=lambda k: -number(r[k]))[:2]
        named = ", ".join(f"{k.removeprefix('stall_')} {number(r[k]):,.0f}" for k in largest if number(r[k]))
        lines.append(f"| {int(r['Address'], 16) - base:#06x} | `{r['Source'].strip()[:70]}` | {number(r[EXECUTED]):,.0f} | "
                     f"{number(r[ALL]):,.0f} | {named} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path, help="an ncu source-page export, .csv or .csv.gz")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    sections = read_sections(args.csv)
    if len(sections) < 2:
        raise SystemExit(f"{args.csv}: {len(sections)} distinct kernel section(s); need the first and at least one other")
    print(report(sections, args.top))


if __name__ == "__main__":
    main()
