#!/usr/bin/env python3
"""Fixtures for opd's GGUF reader and dequantization tests (tests/gguf/).

Writes tests/fixtures/gguf/dequant.gguf: a small GGUF v3 file holding one tensor of random blocks
for every type opd dequantizes (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) and metadata
of every GGUF value type, and tests/fixtures/gguf/dequant_expected.safetensors: each tensor
dequantized to float32 by the reference below, written from the format definitions (ggml's
block layouts; the k-quants description in llama.cpp PR 1684), independently of opd's C++.
When the `gguf` package (llama.cpp's python reader) is installed, every tensor is also
dequantized with gguf.quants and must agree exactly: a second, independent oracle.

Usage: python3 tools/make_dequant_fixtures.py [--out tests/fixtures/gguf]
"""
import argparse
import os
import struct

import numpy as np

QK = 32
QK_K = 256
# ggml type numbers and (block elements, block bytes)
TYPES = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20),
    "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210), "BF16": (30, 1, 2),
}


def f16(b, off):
    return np.frombuffer(b[off:off + 2], dtype="<f2")[0].astype(np.float32)


def scale_min_k4(s, j):
    """6-bit scale and min of sub-block j (0..7) from the 12 packed bytes."""
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4)
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
    return sc, mn


def deq_block(name, b):
    f = np.float32
    y = np.zeros(TYPES[name][1], dtype=np.float32)
    if name == "Q8_0":
        d = f16(b, 0)
        q = np.frombuffer(b[2:34], dtype=np.int8).astype(np.float32)
        return q * d
    if name in ("Q4_0", "Q4_1"):
        d = f16(b, 0)
        off = 2 if name == "Q4_0" else 4
        qs = np.frombuffer(b[off:off + 16], dtype=np.uint8)
        lo = (qs & 15).astype(np.int32)
        hi = (qs >> 4).astype(np.int32)
        if name == "Q4_0":
            y[:16] = (lo - 8).astype(f) * d
            y[16:] = (hi - 8).astype(f) * d
        else:
            m = f16(b, 2)
            y[:16] = lo.astype(f) * d + m
            y[16:] = hi.astype(f) * d + m
        return y
    if name in ("Q4_K", "Q5_K"):
        d, dmin = f16(b, 0), f16(b, 2)
        s = list(b[4:16])
        if name == "Q4_K":
            qh = None
            qs = np.frombuffer(b[16:144], dtype=np.uint8)
        else:
            qh = np.frombuffer(b[16:48], dtype=np.uint8)
            qs = np.frombuffer(b[48:176], dtype=np.uint8)
        for g in range(4):
            sc0, mn0 = scale_min_k4(s, 2 * g)
            sc1, mn1 = scale_min_k4(s, 2 * g + 1)
            d0, m0 = f(d * f(sc0)), f(dmin * f(mn0))
            d1, m1 = f(d * f(sc1)), f(dmin * f(mn1))
            q = qs[32 * g:32 * g + 32]
            lo = (q & 15).astype(np.int32)
            hi = (q >> 4).astype(np.int32)
            if qh is not None:
                lo = lo + (((qh >> (2 * g)) & 1).astype(np.int32) << 4)
                hi = hi + (((qh >> (2 * g + 1)) & 1).astype(np.int32) << 4)
            y[64 * g:64 * g + 32] = d0 * lo.astype(f) - m0
            y[64 * g + 32:64 * g + 64] = d1 * hi.astype(f) - m1
        return y
    if name == "Q6_K":
        ql_all = np.frombuffer(b[0:128], dtype=np.uint8)
        qh_all = np.frombuffer(b[128:192], dtype=np.uint8)
        sc_all = np.frombuffer(b[192:208], dtype=np.int8)
        d = f16(b, 208)
        for h in range(2):
            ql = ql_all[64 * h:64 * h + 64].astype(np.int32)
            qh = qh_all[32 * h:32 * h + 32].astype(np.int32)
            sc = sc_all[8 * h:8 * h + 8]
            vals = [
                (ql[0:32] & 15) | (((qh >> 0) & 3) << 4),
                (ql[32:64] & 15) | (((qh >> 2) & 3) << 4),
                (ql[0:32] >> 4) | (((qh >> 4) & 3) << 4),
                (ql[32:64] >> 4) | (((qh >> 6) & 3) << 4),
            ]
            for k in range(4):
                for l in range(32):
                    e = l + 32 * k
                    y[128 * h + e] = f(d * f(sc[e // 16])) * f(vals[k][l] - 32)
        return y
    raise ValueError(name)


def dequant(name, raw, n):
    if name == "F32":
        return np.frombuffer(raw, dtype="<f4").copy()
    if name == "F16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float32)
    if name == "BF16":
        u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return u.view(np.float32)
    _, be, bb = TYPES[name]
    return np.concatenate([deq_block(name, raw[i * bb:(i + 1) * bb]) for i in range(n // be)])


def random_half(rng, n, scale):
    return (rng.standard_normal(n) * scale).astype("<f2").tobytes()


def random_blocks(rng, name, nblocks):
    """Random bytes for the quants; finite, moderate half-float scales (sign included)."""
    out = bytearray()
    for _ in range(nblocks):
        if name == "Q8_0":
            out += random_half(rng, 1, 0.01) + rng.integers(0, 256, 32, dtype=np.uint8).tobytes()
        elif name == "Q4_0":
            out += random_half(rng, 1, 0.02) + rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
        elif name == "Q4_1":
            out += random_half(rng, 2, 0.02) + rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
        elif name == "Q4_K":
            out += random_half(rng, 2, 0.001) + rng.integers(0, 256, 140, dtype=np.uint8).tobytes()
        elif name == "Q5_K":
            out += random_half(rng, 2, 0.001) + rng.integers(0, 256, 172, dtype=np.uint8).tobytes()
        elif name == "Q6_K":
            out += rng.integers(0, 256, 208, dtype=np.uint8).tobytes() + random_half(rng, 1, 0.0005)
        else:
            raise ValueError(name)
    return bytes(out)


# --- a minimal GGUF v3 writer (spec: ggml docs/gguf.md) -----------------------------------
def gstr(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
          11: "<q", 12: "<d"}


def gval(t, v):
    if t in SCALAR:
        return struct.pack(SCALAR[t], v)
    if t == 8:
        return gstr(v)
    if t == 9:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(gval(et, x) for x in items)
    raise ValueError(t)


def write_gguf(path, kvs, tensors, alignment=32):
    """kvs: [(key, type, value)]; tensors: [(name, ne list, ggml type number, raw bytes)]."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    for k, t, v in kvs:
        head += gstr(k) + struct.pack("<I", t) + gval(t, v)
    offset = 0
    data = b""
    for name, ne, ty, raw in tensors:
        pad = (-offset) % alignment
        data += b"\0" * pad
        offset += pad
        head += gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        head += struct.pack("<IQ", ty, offset)
        data += raw
        offset += len(raw)
    head += b"\0" * ((-len(head)) % alignment)
    with open(path, "wb") as fh:
        fh.write(head + data)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gguf"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(20261130)
    tensors, expected = [], {}
    # ne = [row length, rows]: several blocks per row and several rows, so row-major order and
    # block order are both exercised.
    shapes = {"F32": [40, 3], "F16": [40, 3], "BF16": [40, 3], "Q8_0": [96, 3], "Q4_0": [96, 3],
              "Q4_1": [96, 3], "Q4_K": [512, 3], "Q5_K": [512, 3], "Q6_K": [512, 3]}
    for name, ne in shapes.items():
        ty, be, bb = TYPES[name]
        n = ne[0] * ne[1]
        if name == "F32":
            raw = rng.standard_normal(n).astype("<f4").tobytes()
        elif name == "F16":
            raw = rng.standard_normal(n).astype("<f2").tobytes()
        elif name == "BF16":
            raw = (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            raw = random_blocks(rng, name, n // be)
        assert len(raw) == n // be * bb
        tname = f"t_{name.lower()}"
        tensors.append((tname, ne, ty, raw))
        ref = dequant(name, raw, n)
        assert np.all(np.isfinite(ref)) and np.std(ref) > 0, name
        expected[tname] = ref.reshape(ne[1], ne[0])
    try:
        import gguf.quants as gq
        from gguf import GGMLQuantizationType as Q
        for tname, ne, ty, raw in tensors:
            other = gq.dequantize(np.frombuffer(raw, dtype=np.uint8).reshape(ne[1], -1), Q(ty))
            np.testing.assert_array_equal(other.astype(np.float32), expected[tname], err_msg=tname)
        print("make_dequant_fixtures: gguf.quants agrees exactly on every type")
    except ImportError:
        print("make_dequant_fixtures: `gguf` not installed; second oracle skipped")
    kvs = [
        ("general.architecture", 8, "test"),
        ("general.alignment", 4, 64),
        ("test.u8", 0, 200), ("test.i8", 1, -100), ("test.u16", 2, 60000), ("test.i16", 3, -30000),
        ("test.u32", 4, 4000000000), ("test.i32", 5, -2000000000), ("test.f32", 6, 0.25),
        ("test.bool", 7, True), ("test.string", 8, "héllo"), ("test.u64", 10, 2**63 + 5),
        ("test.i64", 11, -2**62), ("test.f64", 12, -1.5e300),
        ("test.array_i32", 9, (5, [1, -2, 3])),
        ("test.array_str", 9, (8, ["a", "", "ü"])),
        ("test.array_nested", 9, (9, [(4, [7, 8]), (4, [])])),
    ]
    # Alignment 64 (not the default 32) so the reader must honour general.alignment.
    write_gguf(os.path.join(a.out, "dequant.gguf"), kvs, tensors, alignment=64)
    from safetensors.numpy import save_file
    save_file(expected, os.path.join(a.out, "dequant_expected.safetensors"))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
