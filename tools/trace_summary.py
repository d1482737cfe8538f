#!/usr/bin/env python3
"""Where a GPU timeline is idle: the summary of a trace from tools/trace/opd_trace.cpp.

The trace (CSV: kind,start,end,stream,name,detail; kinds K kernel, M memcpy, S memset,
Y synchronization, A host API call >= 5 us) is cut into segments wherever the GPU is idle for
at least --split-ms (a bench's iterations and phases are separated by host work, so each
becomes a segment). Per segment of at least --min-ms: wall time from its first GPU operation to
its last, busy time (the union of kernel, copy and memset intervals), idle time, the idle gaps
by size, the largest gaps with the operations around them and the host calls that overlap them
(a cudaStreamSynchronize inside a gap says the host waited and then had to refill the queue),
and the kernel families by total time.
Usage: tools/trace_summary.py [--split-ms 2] [--min-ms 5] [--top 8] [--segments 0,3] trace.csv
"""
import argparse
import csv
import functools
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ncu_summary  # noqa: E402  (tools/ncu_summary.py: the kernel-family naming)

BUCKETS = [(0, 2e3), (2e3, 5e3), (5e3, 20e3), (20e3, 100e3), (100e3, 1e6), (1e6, float("inf"))]


def demangle(names):
    """Mangled -> readable, through c++filt where it exists (names returned unchanged else)."""
    names = sorted(set(names))
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout
    lines = out.split("\n")
    return {n: (lines[i] if i < len(lines) and lines[i] else n) for i, n in enumerate(names)}


@functools.lru_cache(maxsize=None)
def family(name):
    """A kernel's family: ncu_summary's (no template arguments or parameters; cuBLAS's nvjet
    kernels keep their tile name), without opd's namespaces."""
    n = ncu_summary.family(name)
    return n.split("::")[-1] if n.startswith("opd::") else n


def load(path):
    gpu, host = [], []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row = (int(r["start"]), int(r["end"]), r["kind"], r["name"], r["detail"], r["stream"])
            (gpu if r["kind"] in "KMS" else host).append(row)
    gpu.sort()
    host.sort()
    names = demangle([g[3] for g in gpu if g[2] == "K"])
    gpu = [(s, e, k, names.get(n, n) if k == "K" else f"{n} {d}B", d, st) for s, e, k, n, d, st in gpu]
    return gpu, host


def op_label(op):
    return family(op[3]) if op[2] == "K" else op[3].split(" ")[0] + (" " + op[4] + " B" if op[2] == "M" else "")


def segments(gpu, split_ns):
    """Lists of GPU ops separated by idle gaps >= split_ns; the union's gaps inside each."""
    segs, cur, end = [], [], None
    for op in gpu:
        if cur and op[0] - end >= split_ns:
            segs.append(cur)
            cur = []
        end = op[1] if not cur else max(end, op[1])
        cur.append(op)
    if cur:
        segs.append(cur)
    return segs


def analyze(seg):
    """busy ns, [(gap ns, gap start, index of the op before, index of the op after)]"""
    busy, gaps = 0, []
    run_s, run_e, last_i = seg[0][0], seg[0][1], 0
    for i, op in enumerate(seg[1:], 1):
        if op[0] > run_e:
            busy += run_e - run_s
            gaps.append((op[0] - run_e, run_e, last_i, i))
            run_s, run_e = op[0], op[1]
        elif op[1] > run_e:
            run_e = op[1]
        if op[1] >= seg[last_i][1]:
            last_i = i
    busy += run_e - run_s
    return busy, gaps


def report(i, seg, host, top, out):
    t0, t1 = seg[0][0], max(op[1] for op in seg)
    wall = t1 - t0
    busy, gaps = analyze(seg)
    kernels = sum(1 for op in seg if op[2] == "K")
    print(f"\n== segment {i}: wall {wall / 1e6:.3f} ms, busy {busy / 1e6:.3f} ms, idle "
          f"{(wall - busy) / 1e6:.3f} ms ({100.0 * (wall - busy) / max(wall, 1):.1f}%), "
          f"{kernels} kernels, {len(seg) - kernels} copies/memsets", file=out)
    print("   idle gaps by size:", file=out)
    for lo, hi in BUCKETS:
        sel = [g[0] for g in gaps if lo <= g[0] < hi]
        if sel:
            hi_s = "inf" if hi == float("inf") else f"{hi / 1e3:g}"
            print(f"     [{lo / 1e3:g}, {hi_s}) us: {len(sel):7d} gaps, {sum(sel) / 1e6:9.3f} ms", file=out)
    print(f"   largest gaps (us, at ms from the segment's start: op before -> op after | host calls inside):", file=out)
    for g, gs, a, b in sorted(gaps, reverse=True)[:top]:
        ge = gs + g
        calls = sorted({h[3] if h[2] == "A" else "sync:" + h[4] for h in host if h[0] < ge and h[1] > gs})
        print(f"     {g / 1e3:9.1f} at {(gs - t0) / 1e6:8.3f}: {op_label(seg[a])} -> {op_label(seg[b])}"
              f" | {', '.join(calls) if calls else '-'}", file=out)
    fam = {}
    for op in seg:
        key = op_label(op) if op[2] == "K" else op[3].split(" ")[0]
        n, t = fam.get(key, (0, 0))
        fam[key] = (n + 1, t + op[1] - op[0])
    print("   by family (total ms, count, mean us; overlapping streams counted twice):", file=out)
    for key, (n, t) in sorted(fam.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"     {t / 1e6:9.3f} {n:7d} {t / n / 1e3:9.2f}  {key}", file=out)
    return wall, busy


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--split-ms", type=float, default=2.0, help="idle time that starts a new segment")
    ap.add_argument("--min-ms", type=float, default=5.0, help="segments shorter than this are only counted")
    ap.add_argument("--top", type=int, default=8, help="gaps and families listed per segment")
    ap.add_argument("--segments", default="", help="comma-separated segment numbers to detail (default all)")
    a = ap.parse_args(argv)
    gpu, host = load(a.trace)
    if not gpu:
        print("no GPU operations in the trace")
        return 1
    segs = segments(gpu, int(a.split_ms * 1e6))
    want = {int(s) for s in a.segments.split(",") if s.strip()}
    shown = 0
    for i, seg in enumerate(segs):
        wall = max(op[1] for op in seg) - seg[0][0]
        if (want and i not in want) or (not want and wall < a.min_ms * 1e6):
            continue
        report(i, seg, host, a.top, sys.stdout)
        shown += 1
    print(f"\n{len(segs)} segments ({shown} shown), {len(gpu)} GPU operations, {len(host)} host records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
