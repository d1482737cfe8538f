#!/usr/bin/env python3
"""Compact per-kernel table of an ncu CSV (`ncu --csv --page raw --metrics a,b,...`).

One row per run of consecutive launches of one kernel family (name without template arguments
and parameters; cuBLAS's nvjet kernels keep their full tile name), in launch order: the number
of launches and the mean of each metric over them (a bench case's timed repeats become one
row), so a profile of `opd bench kernels --filter decode_linear` shows the cuBLASLt kernels of
the 64-row decode GEMMs (issue 6: why they are latency-bound) and their metrics side by side.
With --totals: one row per kernel family over the whole profile (launches, and each metric's
sum over them), largest first by the first metric: where a multi-kernel op (e.g. the fused
loss's tile loop, `opd bench loss --rows 4096 --iters 1`) spends its time.
Usage: tools/ncu_summary.py [--totals] ncu.csv
"""
import csv
import re
import sys


def family(name):
    if "nvjet" in name:
        return name.split("(")[0][:60]
    n = name.replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
    n = re.sub(r"<.*", "", n.split("(")[0]).strip()
    return (n[5:] if n.startswith("void ") else n)[:60]


def main():
    totals = "--totals" in sys.argv[1:]
    path = [a for a in sys.argv[1:] if a != "--totals"][0]
    with open(path, newline="") as f:
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
        if totals:  # one entry per family, wherever its launches are
            hit = [t for t in table if t[0] == fam]
            if hit:
                table.remove(hit[0])
                table.append(hit[0])
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
    if totals:
        table.sort(key=lambda t: -t[2][0] if t[2] else 0)
        print("(totals: each metric summed over the family's launches)")
        for fam, count, sums in table:
            print(f"{count:8d}  " + "  ".join(f"{v:28.3f}" for v in sums) + f"  {fam}")
        return
    for fam, count, sums in table:
        print(f"{count:8d}  " + "  ".join(f"{v / count:28.3f}" for v in sums) + f"  {fam}")


if __name__ == "__main__":
    main()
