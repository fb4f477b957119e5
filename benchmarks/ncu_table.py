"""Pivot `ncu --csv --metrics ...` output: one row per metric, one column per profiled kernel launch.

    python benchmarks/ncu_table.py ncu.csv
"""

import csv
import sys
from collections import OrderedDict


def main(path: str) -> None:
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]  # the program's own output is not CSV
    columns, table = [], OrderedDict()
    for row in csv.DictReader(lines):
        column = f"{row['ID']}:{row['Kernel Name'].split('<')[0].replace('void ', '')}"
        if column not in columns:
            columns.append(column)
        metric = row["Metric Name"].replace("smsp__average_warps_issue_stalled_", "stall_").replace("_per_issue_active.ratio", "")
        table.setdefault(f"{metric} ({row['Metric Unit']})", {})[column] = row["Metric Value"]
    print("| metric | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for metric, values in table.items():
        print(f"| {metric} | " + " | ".join(values.get(c, "") for c in columns) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
