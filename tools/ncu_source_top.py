#!/usr/bin/env python3
"""Top instructions of one kernel by warp-stall samples, from `ncu -i REPORT --page source --csv
--print-source sass` (stdin or a file): address, samples (all / not issued), executed count and
the SASS text, so a profile says which instruction the warps wait at. Used by
scripts/gpu_check.sh on the GPU machine (no ncu here)."""
import csv
import sys


def main() -> None:
    src = open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    rows = list(csv.reader(src))
    head_i = next((i for i, r in enumerate(rows) if any("Warp Stall Sampling" in c for c in r)), None)
    if head_i is None:
        print("no 'Warp Stall Sampling' column found; header candidates:", rows[:3])
        return
    head = rows[head_i]
    def col(name):
        return next((i for i, c in enumerate(head) if c.startswith(name)), None)
    c_all = col("Warp Stall Sampling (All")
    c_not = col("Warp Stall Sampling (Not")
    c_exe = col("Instructions Executed")
    c_src = col("Source")
    c_adr = col("Address")
    def num(r, c):
        try:
            return float(r[c].replace(",", "")) if c is not None and r[c] else 0.0
        except ValueError:
            return 0.0
    body = [r for r in rows[head_i + 1:] if len(r) == len(head)]
    total = sum(num(r, c_all) for r in body) or 1.0
    body.sort(key=lambda r: -num(r, c_all))
    print(f"{len(body)} instructions, {total:.0f} stall samples")
    for r in body[:top]:
        print(f"{r[c_adr] if c_adr is not None else '':>8} {100 * num(r, c_all) / total:5.1f}% "
              f"(not issued {num(r, c_not):6.0f}) exec {num(r, c_exe):8.0f}  {r[c_src][:90]}")


if __name__ == "__main__":
    main()
