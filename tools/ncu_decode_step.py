#!/usr/bin/env python3
"""Per-kernel times of one rollout decode step from an ncu CSV (gpu__time_duration.sum).

Reads `ncu --csv --metrics gpu__time_duration.sum ...` output of a range of launches of
`opd bench rollout --no-graphs`, cuts it into steps at the sampling kernel (the last kernel of
a step), and prints, for the complete steps, each kernel family's calls and time per step, and
the step's total: where the decode step's time goes, kernel by kernel (kernels serialized by
ncu, so launch gaps are not in these numbers; compare the sum with the bench's decode step).
Usage: tools/ncu_decode_step.py ncu.csv
"""
import csv
import re
import sys
from collections import defaultdict


def family(name):
    n = name.replace("(anonymous namespace)", "anon")
    n = n.split("(")[0].strip()
    n = re.sub(r"<.*", "", n)
    if n.startswith("void "):
        n = n[5:]
    if "nvjet" in n or "gemm" in n.lower() or "cutlass" in n.lower() or "sm90" in n:
        return "gemm:" + n[:60]
    return n[:70]


def main():
    rows = []
    with open(sys.argv[1], newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "ns")
        us = v / 1e3 if unit in ("nsecond", "ns") else v if unit in ("usecond", "us") else v * 1e3
        rows.append((r["Kernel Name"], us))
    cuts = [i for i, (n, _) in enumerate(rows) if "sample" in n.lower()]
    if len(cuts) < 2:
        print("fewer than two sampling kernels in the range: no complete step")
        return
    steps = [rows[cuts[i] + 1: cuts[i + 1] + 1] for i in range(len(cuts) - 1)]
    print(f"{len(rows)} kernels, {len(steps)} complete decode steps")
    for si, st in enumerate(steps):
        fam = defaultdict(lambda: [0, 0.0])
        for n, us in st:
            fam[family(n)][0] += 1
            fam[family(n)][1] += us
        total = sum(us for _, us in st)
        print(f"\nstep {si}: {len(st)} kernels, {total:.1f} us (kernels alone, serialized)")
        for k, (c, us) in sorted(fam.items(), key=lambda kv: -kv[1][1]):
            print(f"  {us:9.1f} us {100 * us / total:5.1f}%  {c:4d} calls  {us / c:7.2f} us/call  {k}")
    # GEMMs by call position within a layer (qkv, o, gate|up, down repeat every layer).
    st = steps[0]
    gemms = [(n, us) for n, us in st if family(n).startswith("gemm:")]
    print(f"\nstep 0 GEMM calls in order ({len(gemms)}): first 12:")
    for n, us in gemms[:12]:
        print(f"  {us:7.2f} us  {n[:100]}")


if __name__ == "__main__":
    main()
