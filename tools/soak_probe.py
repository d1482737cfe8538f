#!/usr/bin/env python3
"""Soak probe: samples a long-running opd process's resources over time (docs/robustness.md,
"Session 17: long runs").

Starts a command (everything after `--`) or watches running processes (--pid), and every
--interval seconds records, per process, from /proc/PID: VmRSS and VmHWM (KiB), open file
descriptors (and how many are sockets), threads, memory mappings (/proc/PID/maps lines, and how
many of them map a *.safetensors file or a deleted file); and for --run-dir: the training step
(the last line of RUN/metrics.jsonl), the run directory's bytes and file count, checkpoint
folders, leftovers of interrupted saves (*.tmp-*, *.old-*, LATEST.tmp-*) and the sizes of
metrics.jsonl, train.log and tensorboard/. --sighup-every S sends SIGHUP to the started command
every S seconds (a run must survive it). --kill9-cycles N instead starts the command N times,
each killed with SIGKILL at a random moment --kill-after A:B seconds after it started (a run
that resumes from its newest checkpoint each time), and samples the run directory after each
kill: leftovers of interrupted saves must not pile up, disk use must stay bounded. Samples go to --csv; at the end a summary prints each
quantity's first value after --warmup seconds, its last value, its maximum, and its growth per
1,000 steps (least-squares slope against the step; with a run directory) and per minute. A
sample taken while the process exits (final evaluation, library teardown) can skew a fit: the
CSV shows where a change happened.

    python3 tools/soak_probe.py --run-dir runs/soak --csv soak.csv --sighup-every 30 -- \
        build/opd train ... --out runs/soak
    python3 tools/soak_probe.py --pid 1234 --label serve --duration 300 --csv serve.csv
    python3 tools/soak_probe.py --run-dir runs/k --kill9-cycles 50 --kill-after 1:4 -- \
        build/opd train ... --max-steps 1000000 --out runs/k

Linux only (reads /proc). Exit status: the started command's, or 0 when only watching.
"""
import argparse
import csv
import os
import signal
import subprocess
import sys
import time


def proc_sample(pid):
    """Resource counts of one process, or None when it is gone."""
    try:
        status = open(f"/proc/{pid}/status").read()
        rss = hwm = 0
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
        fds = sockets = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            fds += 1
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                    sockets += 1
            except OSError:
                pass
        threads = len(os.listdir(f"/proc/{pid}/task"))
        maps = st_maps = deleted_maps = 0
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                maps += 1
                if ".safetensors" in line:
                    st_maps += 1
                if line.rstrip().endswith("(deleted)"):
                    deleted_maps += 1
        return {"rss_kib": rss, "hwm_kib": hwm, "fds": fds, "sockets": sockets,
                "threads": threads, "maps": maps, "safetensors_maps": st_maps,
                "deleted_maps": deleted_maps}
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def last_step(metrics_path):
    """The step of the last complete line of metrics.jsonl (reads only its tail)."""
    try:
        with open(metrics_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 8192))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    for line in reversed(tail.split("\n")[:-1]):  # the part after the last newline may be torn
        at = line.find('"step":')
        if at >= 0:
            digits = ""
            for ch in line[at + 7:].lstrip():
                if not ch.isdigit():
                    break
                digits += ch
            if digits:
                return int(digits)
    return None


def dir_sample(run_dir):
    out = {"run_bytes": 0, "run_files": 0, "checkpoints": 0, "leftovers": 0,
           "metrics_bytes": 0, "log_bytes": 0, "tensorboard_bytes": 0}
    for root, dirs, files in os.walk(run_dir):
        for name in dirs + files:
            if ".tmp-" in name or ".old-" in name:
                out["leftovers"] += 1
        if os.path.basename(root) == "checkpoints":
            out["checkpoints"] = sum(1 for d in dirs if d.startswith("step-") and len(d) == 13)
        for name in files:
            try:
                size = os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
            out["run_bytes"] += size
            out["run_files"] += 1
            if name == "metrics.jsonl" and root == run_dir:
                out["metrics_bytes"] = size
            elif name == "train.log" and root == run_dir:
                out["log_bytes"] = size
            elif os.path.basename(root) == "tensorboard":
                out["tensorboard_bytes"] += size
    out["step"] = last_step(os.path.join(run_dir, "metrics.jsonl"))
    return out


def slope(xs, ys):
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return float("nan")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def summarize(rows, warmup_s):
    rows = [r for r in rows if r["t"] >= warmup_s] or rows
    if not rows:
        print("no samples")
        return
    keys = [k for k in rows[0] if k not in ("t", "step") and isinstance(rows[0][k], (int, float))]
    stepped = [r for r in rows if r.get("step") is not None]
    print(f"samples {len(rows)} after {warmup_s:.0f} s of warm-up, t {rows[0]['t']:.0f}..{rows[-1]['t']:.0f} s",
          end="")
    if stepped:
        print(f", steps {stepped[0]['step']}..{stepped[-1]['step']}", end="")
    print()
    print(f"{'quantity':32s} {'first':>12s} {'last':>12s} {'max':>12s} {'per 1k steps':>13s} {'per minute':>11s}")
    for k in keys:
        vals = [r[k] for r in rows if r.get(k) is not None]
        if not vals:
            continue
        per_min = slope([r["t"] / 60 for r in rows if r.get(k) is not None], vals)
        per_k = (slope([r["step"] / 1000 for r in stepped if r.get(k) is not None],
                       [r[k] for r in stepped if r.get(k) is not None]) if len(stepped) > 1 else float("nan"))
        print(f"{k:32s} {vals[0]:12g} {vals[-1]:12g} {max(vals):12g} {per_k:13.3g} {per_min:11.3g}")


def kill9_cycles(a, cmd):
    import random
    rng = random.Random(a.seed)
    lo, hi = (float(x) for x in a.kill_after.split(":"))
    rows = []
    start = time.time()
    for cycle in range(1, a.kill9_cycles + 1):
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        delay = rng.uniform(lo, hi)
        try:
            child.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        row = {"t": round(time.time() - start, 2), "cycle": cycle, "killed_after_s": round(delay, 2),
               "rc": child.returncode}
        if a.run_dir:
            row.update(dir_sample(a.run_dir))
            ckpt = os.path.join(a.run_dir, "checkpoints")
            names = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
            row["checkpoint_entries"] = " ".join(names)
        rows.append(row)
        print(row, flush=True)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]), extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    numeric = [k for k in rows[0] if isinstance(rows[0][k], (int, float)) and k not in ("t", "cycle", "rc", "killed_after_s")]
    print(f"{len(rows)} SIGKILL cycles in {time.time() - start:.0f} s")
    print(f"{'quantity':24s} {'after 1st':>12s} {'last':>12s} {'max':>12s} {'per cycle (fit)':>16s}")
    for k in numeric:
        vals = [r[k] for r in rows if r.get(k) is not None]
        if vals:
            print(f"{k:24s} {vals[0]:12g} {vals[-1]:12g} {max(vals):12g} "
                  f"{slope([r['cycle'] for r in rows if r.get(k) is not None], vals):16.3g}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    ap.add_argument("--run-dir", help="an opd run directory (--out) to watch")
    ap.add_argument("--pid", type=int, action="append", default=[], help="a running process to watch (repeatable)")
    ap.add_argument("--label", action="append", default=[], help="names for --pid, in order")
    ap.add_argument("--duration", type=float, default=0, help="stop after S seconds (0: when the command ends)")
    ap.add_argument("--sighup-every", type=float, default=0, help="SIGHUP the started command every S seconds")
    ap.add_argument("--warmup", type=float, default=20, help="seconds left out of the summary")
    ap.add_argument("--csv", help="write every sample here")
    ap.add_argument("--kill9-cycles", type=int, default=0, help="start and SIGKILL the command N times")
    ap.add_argument("--kill-after", default="1:4", help="A:B: each SIGKILL lands uniformly in [A, B] s")
    ap.add_argument("--seed", type=int, default=0, help="of the SIGKILL moments")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command to start and watch")
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if a.kill9_cycles:
        return kill9_cycles(a, cmd)
    procs = [(a.label[i] if i < len(a.label) else f"pid{p}", p) for i, p in enumerate(a.pid)]
    child = None
    if cmd:
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(os.devnull, "w"))
        procs.insert(0, ("cmd", child.pid))
    start = time.time()
    next_hup = a.sighup_every if a.sighup_every > 0 else None
    hups = 0
    rows = []
    writer = None
    csv_file = open(a.csv, "w", newline="") if a.csv else None
    while True:
        t = time.time() - start
        row = {"t": round(t, 2)}
        alive = False
        for label, pid in procs:
            s = proc_sample(pid)
            if s is None:
                continue
            if child is not None and pid == child.pid and child.poll() is not None:
                continue  # a zombie: its /proc entry says nothing useful
            alive = True
            for k, v in s.items():
                row[f"{label}.{k}"] = v
        if a.run_dir:
            row.update(dir_sample(a.run_dir))
        row["sighups"] = hups
        if alive:
            rows.append(row)
            if csv_file:
                if writer is None:
                    writer = csv.DictWriter(csv_file, fieldnames=list(row), extrasaction="ignore")
                    writer.writeheader()
                writer.writerow(row)
                csv_file.flush()
        if child is not None and child.poll() is not None:
            break
        if child is None and not alive:
            break
        if a.duration and t >= a.duration:
            break
        if next_hup is not None and child is not None and t >= next_hup:
            child.send_signal(signal.SIGHUP)
            hups += 1
            next_hup += a.sighup_every
        time.sleep(a.interval)
    rc = 0
    if child is not None:
        if child.poll() is None:
            child.terminate()
        rc = child.wait()
        print(f"command exited {rc} after {time.time() - start:.0f} s; {hups} SIGHUP(s) sent")
    if a.run_dir:  # the final state of the run directory, after the process ended
        print("run directory at the end:", dir_sample(a.run_dir))
    summarize(rows, a.warmup)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
