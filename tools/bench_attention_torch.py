#!/usr/bin/env python3
"""PyTorch SDPA anchor for `opd bench attention`: times
torch.nn.functional.scaled_dot_product_attention (causal, bf16, head_dim 128) forward and
backward on the same shapes (8 x 768 and 4 x 4096 tokens, 16 query heads, 8 and 16 kv heads),
for each SDPA backend that accepts the shape (flash, cuDNN, memory-efficient, math) and reports
the best, with CUDA events, median of --iters after --warmup. FLOPs use the causal convention
of opd's bench: forward 4 B H L^2 D / 2, backward 2.5x that.

Layout: [B, H, L, D] contiguous (SDPA's preferred layout; opd works on packed [T, H, D]).
GQA (Hkv < Hq): enable_gqa=True where the backend supports it, otherwise k/v are expanded with
repeat_interleave outside the timed region (so that backend is timed on Hq kv heads).

Usage: python3 tools/bench_attention_torch.py [--iters 30] [--warmup 5] [--json]
"""
import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(8, 768, 16, 8, 128), (8, 768, 16, 16, 128), (4, 4096, 16, 8, 128), (4, 4096, 16, 16, 128)]
BACKENDS = [
    ("flash", SDPBackend.FLASH_ATTENTION),
    ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ("efficient", SDPBackend.EFFICIENT_ATTENTION),
]


def median_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def bench_backend(backend, b, l, hq, hkv, d, warmup, iters):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(h):
        return (torch.rand(b, h, l, d, device="cuda", generator=gen) * 2 - 1).to(torch.bfloat16)

    q, k, v, dout = rnd(hq), rnd(hkv), rnd(hkv), rnd(hq)
    gqa_native = True
    q.requires_grad_(True)
    kk, vv = k.clone().requires_grad_(True), v.clone().requires_grad_(True)

    def attn(kk_, vv_, gqa):
        if hkv != hq and gqa:
            return F.scaled_dot_product_attention(q, kk_, vv_, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, kk_, vv_, is_causal=True)

    with sdpa_kernel([backend]):
        try:
            out = attn(kk, vv, True)
        except RuntimeError:
            if hkv == hq:
                raise
            # This backend has no native GQA: expand kv heads (outside the timed region).
            gqa_native = False
            rep = hq // hkv
            kk = k.repeat_interleave(rep, dim=1).requires_grad_(True)
            vv = v.repeat_interleave(rep, dim=1).requires_grad_(True)
            out = attn(kk, vv, False)
        fwd_ms = median_ms(lambda: attn(kk, vv, gqa_native), warmup, iters)
        bwd_ms = median_ms(
            lambda: torch.autograd.grad(out, (q, kk, vv), dout, retain_graph=True), warmup, iters)
    return fwd_ms, bwd_ms, gqa_native


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention_torch: no CUDA device", file=sys.stderr)
        return 1
    device = torch.cuda.get_device_name(0)
    results = []
    if not args.json:
        print(f"torch {torch.__version__} SDPA on {device}, causal bf16, median of {args.iters}")
        print(f"{'shape B x L, Hq/Hkv':22s} {'backend':10s} {'gqa':6s} {'fwd ms':>9s} {'fwd TF/s':>9s}"
              f" {'bwd ms':>9s} {'bwd TF/s':>9s}")
    for (b, l, hq, hkv, d) in SHAPES:
        fwd_flop = 4.0 * b * hq * l * l * d / 2
        bwd_flop = 2.5 * fwd_flop
        entry = {"batch": b, "seqlen": l, "hq": hq, "hkv": hkv, "head_dim": d, "backends": {}}
        for name, backend in BACKENDS:
            try:
                fwd_ms, bwd_ms, native = bench_backend(backend, b, l, hq, hkv, d, args.warmup, args.iters)
            except RuntimeError as e:  # backend refuses this shape / build
                entry["backends"][name] = {"error": str(e).splitlines()[0][:200]}
                if not args.json:
                    print(f"{b} x {l}, {hq}/{hkv}".ljust(22), f"{name:10s} unavailable: "
                          f"{str(e).splitlines()[0][:80]}")
                continue
            r = {"fwd_ms": fwd_ms, "fwd_tflops": fwd_flop / fwd_ms / 1e9,
                 "bwd_ms": bwd_ms, "bwd_tflops": bwd_flop / bwd_ms / 1e9, "gqa_native": native}
            entry["backends"][name] = r
            if not args.json:
                print(f"{b} x {l}, {hq}/{hkv}".ljust(22), f"{name:10s} {'native' if native else 'expand':6s}"
                      f" {fwd_ms:9.4f} {r['fwd_tflops']:9.1f} {bwd_ms:9.4f} {r['bwd_tflops']:9.1f}")
        ok = {k: v for k, v in entry["backends"].items() if "error" not in v}
        if ok:
            entry["best_fwd"] = max(ok.items(), key=lambda kv: kv[1]["fwd_tflops"])[0]
            entry["best_bwd"] = max(ok.items(), key=lambda kv: kv[1]["bwd_tflops"])[0]
            entry["best_fwd_tflops"] = ok[entry["best_fwd"]]["fwd_tflops"]
            entry["best_bwd_tflops"] = ok[entry["best_bwd"]]["bwd_tflops"]
        results.append(entry)
    if args.json:
        print(json.dumps({"bench": "attention_torch_sdpa", "device": device, "torch": torch.__version__,
                          "results": results}))
    else:
        print("summary (best backend, TFLOP/s; 70% goal in brackets):")
        for e in results:
            if "best_fwd" in e:
                print(f"  B {e['batch']} L {e['seqlen']} Hq {e['hq']} Hkv {e['hkv']}: "
                      f"fwd {e['best_fwd_tflops']:.1f} ({e['best_fwd']}) [{0.7 * e['best_fwd_tflops']:.1f}]  "
                      f"bwd {e['best_bwd_tflops']:.1f} ({e['best_bwd']}) [{0.7 * e['best_bwd_tflops']:.1f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
