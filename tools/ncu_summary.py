#!/usr/bin/env python3
"""Compact per-kernel table of an ncu CSV (`ncu --csv --page raw --metrics a,b,...`).

One row per run of consecutive launches of one kernel family (name without template arguments
and parameters; cuBLAS's nvjet kernels keep their full tile name), in launch order: the number
of launches and the mean of each metric over them (a bench case's timed repeats become one
row), so a profile of `opd bench kernels --filter decode_linear` shows the cuBLASLt kernels of
the 64-row decode GEMMs (issue 6: why they are latency-bound) and their metrics side by side.
Usage: tools/ncu_summary.py ncu.csv
"""
import csv
import re
import sys


def family(name):
    if "nvjet" in name:
        return name.split("(")[0][:60]
    n = name.replace("(anonymous namespace)::", "")
    n = re.sub(r"<.*", "", n.split("(")[0]).strip()
    return (n[5:] if n.startswith("void ") else n)[:60]


def main():
    with open(sys.argv[1], newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    reader = csv.reader(lines)
    header = next(reader)
    units = next(reader)  # --page raw: the second row holds the units
    skip = {"ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
            "Device", "CC", "Block Size", "Grid Size", "Section Name"}
    cols = [i for i, h in enumerate(header) if h not in skip and "__" in h]
    name_col = header.index("Kernel Name")
    table = []  # [family, launches, sums], one entry per run of consecutive launches
    for row in reader:
        fam = family(row[name_col])
        if not table or table[-1][0] != fam:
            table.append([fam, 0, [0.0] * len(cols)])
        acc = table[-1][1:]
        table[-1][1] += 1
        for j, i in enumerate(cols):
            try:
                acc[1][j] += float(row[i].replace(",", ""))
            except ValueError:
                pass
    short = [header[i].replace("__", ".")[:28] for i in cols]
    print("launches  " + "  ".join(f"{s:>28}" for s in short) + "  kernel")
    print("          " + "  ".join(f"{units[i][:28]:>28}" for i in cols))
    for fam, count, sums in table:
        print(f"{count:8d}  " + "  ".join(f"{v / count:28.3f}" for v in sums) + f"  {fam}")


if __name__ == "__main__":
    main()
