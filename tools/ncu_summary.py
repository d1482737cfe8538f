#!/usr/bin/env python3
"""Compact per-kernel table of an ncu CSV (`ncu --csv --page raw --metrics a,b,...`).

One row per run of consecutive launches of one kernel family (name without template arguments
and parameters; cuBLAS's nvjet kernels keep their full tile name), in launch order: the number
of launches and the mean of each metric over them (a bench case's timed repeats become one
row), so a profile of `opd bench kernels --filter decode_linear` shows the cuBLASLt kernels of
the 64-row decode GEMMs (issue 6: why they are latency-bound) and their metrics side by side.
With --totals: one row per kernel family over the whole profile (launches, and each metric's
sum over them), largest first by the first metric: where a multi-kernel op (e.g. the fused
loss's tile loop, `opd bench loss --rows 4096 --iters 1`) spends its time. With --by-grid the
totals are kept apart per launch shape (family, grid, block): which sizes of a memory-bound
kernel are slow. With a dram__bytes metric beside gpu__time_duration, the totals also print the
achieved rate in GB/s.
Usage: tools/ncu_summary.py [--totals] [--by-grid] ncu.csv
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
    by_grid = "--by-grid" in sys.argv[1:]
    totals = "--totals" in sys.argv[1:] or by_grid
    path = [a for a in sys.argv[1:] if a not in ("--totals", "--by-grid")][0]
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    reader = csv.reader(lines)
    header = next(reader)
    units = next(reader)  # --page raw: the second row holds the units
    skip = {"ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
            "Device", "CC", "Block Size", "Grid Size", "Section Name"}
    # The requested metrics: --print-units base also prints every device attribute; of a metric
    # with .avg/.max/.min/.sum rollups, the .sum.
    cols = [i for i, h in enumerate(header) if h not in skip and "__" in h and
            h.startswith(("gpu__", "dram__", "sm__", "smsp__", "l1tex__", "lts__")) and
            not h.endswith((".avg", ".max", ".min"))]
    name_col = header.index("Kernel Name")
    grid_cols = [header.index(h) for h in ("Grid Size", "Block Size") if h in header]
    table = []  # [family, launches, sums], one entry per run of consecutive launches
    for row in reader:
        fam = family(row[name_col])
        if by_grid:
            fam = fam[:44] + " " + " ".join(row[i] for i in grid_cols)
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
        t = next((j for j, i in enumerate(cols) if header[i].startswith("gpu__time_duration")), None)
        b = next((j for j, i in enumerate(cols) if header[i].startswith("dram__bytes")), None)
        scale = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0}
        bscale = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}
        for fam, count, sums in table:
            rate = ""
            if t is not None and b is not None and sums[t] > 0:
                secs = sums[t] * scale.get(units[cols[t]], 1e-9)
                gbs = sums[b] * bscale.get(units[cols[b]], 1.0) / secs / 1e9
                rate = f"  {gbs:7.0f} GB/s"
            print(f"{count:8d}  " + "  ".join(f"{v:28.3f}" for v in sums) + rate + f"  {fam}")
        return
    for fam, count, sums in table:
        print(f"{count:8d}  " + "  ".join(f"{v / count:28.3f}" for v in sums) + f"  {fam}")


if __name__ == "__main__":
    main()
