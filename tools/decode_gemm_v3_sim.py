#!/usr/bin/env python3
"""Host-side emulation of decode GEMM v3's index math (src/kernels/cuda/decode_gemm_v3.cu).

Checks, without a GPU, what a wrong constant in the kernel would break: the k slice of each
split (16-element granules), the stage byte ranges and each stage's expect_tx total, the 16-byte
alignment of every bulk copy, the zero fill (shared memory starts as NaN here, so any element no
copy or fill wrote poisons the result), the ldmatrix row addresses of W (A operand) and x (B
operand), and the epilogue's fragment -> (row, column) map. Matrices are assembled from the lane
registers by the PTX ISA's fragment layouts for ldmatrix.m8n8 and mma.m16n8k16 (row.col), not by
the kernel's formulas, and the result must equal x @ W^T exactly (small integer inputs: every
partial sum is exact in f32). Mirror any change of the kernel's layout here. Usage:
    python3 tools/decode_gemm_v3_sim.py      # a few seconds, one line per case; exit status 1 on a mismatch
"""
import numpy as np, sys
def pitch_bytes(G, s): return 32 * ((G + s - 1) // s) + 16
def run(m, n, k, R, s, rng):
    MT = 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8
    kWarps = R // 16; kXRows = 8 * MT
    x = rng.integers(-4, 5, size=(m, k)).astype(np.float32)
    w = rng.integers(-4, 5, size=(n, k)).astype(np.float32)
    G = (k + 15) // 16
    pitch = pitch_bytes(G, s)
    y = np.full((m, n), np.nan, np.float32)
    assert pitch % 16 == 0 and (pitch // 16) % 2 == 1
    blocks = (n + R - 1) // R
    for rb in range(blocks):
        parts = []
        for split in range(s):
            g0 = G * split // s; g1 = G * (split + 1) // s
            kb = 16 * g0; kl = min(16 * g1, k) - kb
            assert kl > 0 and kl % 8 == 0
            nk = (kl + 15) // 16; slice_bytes = 2 * kl
            ns = max(1, min(min(4, nk), slice_bytes // 256))
            rows_w = min(R, n - rb * R)
            # smem as float array of elements (2 bytes each); NaN = uninitialized
            W = np.full((R, pitch // 2), np.nan, np.float32)
            X = np.full((kXRows, pitch // 2), np.nan, np.float32)
            # zero fill
            for r in range(R + kXRows):
                is_w = r < R
                valid = (r < rows_w) if is_w else (r - R < m)
                b = slice_bytes if valid else 0
                while b < 32 * nk:
                    (W[r] if is_w else X[r - R])[b // 2: b // 2 + 8] = 0; b += 16
            tx = [0] * ns; expect = []
            for st in range(ns):
                lo = 32 * (nk * st // ns); hi = min(32 * (nk * (st + 1) // ns), slice_bytes)
                assert hi > lo and (hi - lo) % 16 == 0
                expect.append((rows_w + m) * (hi - lo))
                for r in range(rows_w):
                    src = (rb * R + r) * k + kb + lo // 2
                    assert (src * 2) % 16 == 0
                    W[r, lo // 2: hi // 2] = w[rb * R + r, kb + lo // 2: kb + hi // 2]; tx[st] += hi - lo
                for r in range(m):
                    X[r, lo // 2: hi // 2] = x[r, kb + lo // 2: kb + hi // 2]; tx[st] += hi - lo
            assert tx == expect
            assert 32 * nk <= pitch - 16
            # math
            acc = np.zeros((kWarps, MT, 32, 4), np.float32)
            Wf = W.reshape(-1); Xf = X.reshape(-1)
            def ld(buf, addr_bytes):  # 8 bf16 of one 16-byte row
                assert addr_bytes % 16 == 0
                e = addr_bytes // 2
                return buf[e:e + 8]
            for warp in range(kWarps):
                if warp * 16 >= rows_w: continue
                for st in range(ns):
                    for kk in range(nk * st // ns, nk * (st + 1) // ns):
                        # A: ldmatrix x4, lane l address row warp*16 + (l & 15), byte (l >> 4)*16 + 32 kk
                        mats = []
                        for q in range(4):
                            rows = [ld(Wf, (warp * 16 + (l & 15)) * pitch + (l >> 4) * 16 + 32 * kk) for l in range(8 * q, 8 * q + 8)]
                            mats.append(np.array(rows))
                        # lane L gets mats[q][L//4, 2(L%4):+2]
                        areg = [[mats[q][L // 4, 2 * (L % 4): 2 * (L % 4) + 2] for q in range(4)] for L in range(32)]
                        A = np.zeros((16, 16), np.float32)
                        for L in range(32):
                            g, t = L // 4, L % 4
                            A[g, 2*t:2*t+2] = areg[L][0]; A[g+8, 2*t:2*t+2] = areg[L][1]
                            A[g, 2*t+8:2*t+10] = areg[L][2]; A[g+8, 2*t+8:2*t+10] = areg[L][3]
                        breg = [[None] * MT for _ in range(32)]
                        if MT == 1:
                            bm = []
                            for q in range(2):
                                rows = [ld(Xf, (l & 7) * pitch + ((l >> 3) & 1) * 16 + 32 * kk) for l in range(8 * q, 8 * q + 8)]
                                bm.append(np.array(rows))
                            for L in range(32):
                                breg[L][0] = (bm[0][L // 4, 2*(L%4):2*(L%4)+2], bm[1][L // 4, 2*(L%4):2*(L%4)+2])
                        else:
                            for j in range(0, MT, 2):
                                bm = []
                                for q in range(4):
                                    rows = [ld(Xf, ((l & 7) + ((l >> 4) << 3)) * pitch + ((l >> 3) & 1) * 16 + j * 8 * pitch + 32 * kk) for l in range(8 * q, 8 * q + 8)]
                                    bm.append(np.array(rows))
                                for L in range(32):
                                    sl = slice(2*(L%4), 2*(L%4)+2)
                                    breg[L][j] = (bm[0][L//4, sl], bm[1][L//4, sl])
                                    breg[L][j+1] = (bm[2][L//4, sl], bm[3][L//4, sl])
                        for j in range(MT):
                            B = np.zeros((16, 8), np.float32)
                            for L in range(32):
                                g, t = L // 4, L % 4
                                B[2*t:2*t+2, g] = breg[L][j][0]; B[2*t+8:2*t+10, g] = breg[L][j][1]
                            D = A @ B
                            for L in range(32):
                                g, t = L // 4, L % 4
                                acc[warp, j, L] += [D[g, 2*t], D[g, 2*t+1], D[g+8, 2*t], D[g+8, 2*t+1]]
            parts.append(acc)
        # reduce in rank order and store (store_fragment)
        tot = parts[0].copy()
        for p in parts[1:]: tot = tot + p
        for rw in range(kWarps):
            for j in range(MT):
                for L in range(32):
                    g, t = L // 4, L % 4
                    for h in range(2):
                        row = rb * R + rw * 16 + 8 * h + g
                        if row >= n: continue
                        for e in range(2):
                            col = 8 * j + 2 * t + e
                            if col < m: y[col, row] = tot[rw, j, L, 2 * h + e]
    ref = x @ w.T
    ok = np.array_equal(y, ref)
    print(f"m {m} n {n} k {k} R {R} s {s}: {'OK' if ok else 'MISMATCH'}", flush=True)
    return ok
rng = np.random.default_rng(0)
allok = True  # (m, n, k, rows per CTA, splits): odd sizes, half granules, 1-8 splits
for (m, n, k, R, s) in [(1, 7, 8, 64, 1), (3, 65, 24, 64, 2), (17, 130, 264, 128, 3), (64, 70, 520, 64, 2),
                        (33, 20, 1032, 128, 4), (9, 16, 1032, 64, 8), (64, 1, 40, 128, 1), (5, 129, 4104, 64, 5)]:
    allok &= run(m, n, k, R, s, rng)
print("ALL OK" if allok else "FAIL")
sys.exit(0 if allok else 1)
