#!/usr/bin/env python3
"""TensorBoard oracle for opd's hand-written event files (src/train/metrics.cpp).

Loads EVENT_DIR with tensorboard's EventAccumulator (the reader behind TensorBoard's scalar
dashboard, which also verifies the TFRecord CRCs and applies the SessionLog.START purge on
resume) and compares every scalar with EXPECTED_JSON: {"tag": [[step, value or null], ...]}.
Values are compared exactly as float32 (simple_value is a float); null means NaN.

Usage: tb_oracle.py EVENT_DIR EXPECTED_JSON
Exit: 0 all equal (prints "OK <n> tags <m> scalars"), 1 mismatch, 3 tensorboard not installed.
"""
import json
import math
import os
import struct
import sys


def f32(v):
    return struct.unpack("<f", struct.pack("<f", v))[0]


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError as e:
        print(f"python package 'tensorboard' is not installed ({e})", file=sys.stderr)
        return 3
    event_dir, expected_path = sys.argv[1], sys.argv[2]
    with open(expected_path) as f:
        expected = json.load(f)

    acc = event_accumulator.EventAccumulator(event_dir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = sorted(acc.Tags()[event_accumulator.SCALARS])
    errors = []
    if tags != sorted(expected):
        errors.append(f"tags {tags} != expected {sorted(expected)}")
    n = 0
    for tag in sorted(set(tags) & set(expected)):
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        want = [(int(s), v) for s, v in expected[tag]]
        if [s for s, _ in got] != [s for s, _ in want]:
            errors.append(f"{tag}: steps {[s for s, _ in got]} != expected {[s for s, _ in want]}")
            continue
        for (step, g), (_, w) in zip(got, want):
            n += 1
            ok = math.isnan(g) if w is None else (g == f32(w))
            if not ok:
                errors.append(f"{tag} step {step}: got {g!r}, expected {w!r}")
    if errors:
        print("\n".join(errors))
        return 1
    print(f"OK {len(tags)} tags {n} scalars")
    return 0


if __name__ == "__main__":
    sys.exit(main())
