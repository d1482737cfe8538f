#!/usr/bin/env python3
"""PyTorch side of `opd bench kernels`: the same kernels (same names, W1 student shapes, bf16)
done the way PyTorch eager does them, timed the same way (CUDA events, warm-up, median of
--iters, inputs rotated among copies when one call's bytes fit twice in L2).

Usage (on the GPU machine, in one command):
  ./opd bench kernels --json > opd_kernels.txt && \
  python3 tools/bench_kernels_torch.py --opd opd_kernels.txt

With --opd, the last JSON line of opd's output is read and a side-by-side table printed
(opd ms, torch ms, torch/opd). The last line printed is one JSON object with both.
Equivalents: F.linear / torch.mm / addmm (f32 accumulation of dW where torch offers out_dtype,
else bf16 product + f32 add, autograd's path), F.rms_norm (+ the residual add), HF
apply_rotary_pos_emb with precomputed cos/sin, F.silu(g) * u, F.embedding and
aten.embedding_dense_backward, F.cross_entropy(reduction="none"), torch.optim.AdamW(fused=True)
+ a foreach copy to the bf16 weights (+ clip_grad_norm_ for the clipped step).
Generation/scoring kernels: decode attention = F.scaled_dot_product_attention(enable_gqa) over a
dense contiguous KV cache [64, 8, ctx, 128] (HF static-cache style; no paging), sampling = HF's
warpers (top-k, top-p by sort + cumsum, min-p) + softmax + torch.multinomial, top-K lm_head =
dense logits (F.linear) -> float -> log_softmax -> topk(64) + gather of the actual token.
"""
import argparse
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F

T, H, I, V = 8 * 768, 1024, 3072, 151936
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 8, 128, 28
BF = torch.bfloat16
DEV = "cuda"
GEMM_CEILING, COPY_CEILING = 776.0, 4150.0


def rand(shape, dtype=BF, lo=-1.0, hi=1.0, requires_grad=False):
    t = torch.empty(shape, device=DEV, dtype=torch.float32).uniform_(lo, hi).to(dtype)
    return t.requires_grad_(requires_grad)


def rotation_sets(bytes_per_set):
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    if bytes_per_set >= 2 * l2:
        return 1
    return min(16, int(2 * l2 / max(bytes_per_set, 1)) + 1)


def time_ms(fn, sets, warmup, iters):
    for i in range(warmup):
        fn(i % sets)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda._sleep(int(2e6))  # hold the stream so the loop is queued ahead (cycles, ~1 ms)
    for i in range(iters):
        starts[i].record()
        fn(i % sets)
        stops[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, stops))


def has_out_dtype():
    try:
        a = torch.ones(16, 16, device=DEV, dtype=BF)
        torch.mm(a, a, out_dtype=torch.float32)
        return True
    except Exception:
        return False


def cases():
    out = []  # (name, shape, is_flops, work, bytes_per_set, make(s) -> fn)
    mm_f32 = has_out_dtype()

    def linear(layer, n, k_in, k_out):
        flops = 2.0 * n * k_in * k_out
        nbytes = 2.0 * (n * k_in + k_in * k_out + n * k_out)
        shape = f"{n}x{k_in}x{k_out}"

        def fwd(s):
            x, w = rand((n, k_in)), rand((k_out, k_in), lo=-0.05, hi=0.05)
            return lambda: F.linear(x, w)

        def bwd_in(s):
            dy, w = rand((n, k_out)), rand((k_out, k_in), lo=-0.05, hi=0.05)
            return lambda: torch.mm(dy, w)

        def bwd_w(s):
            dy, x = rand((n, k_out)), rand((n, k_in))
            dw = rand((k_out, k_in), torch.float32)
            if mm_f32:
                return lambda: dw.add_(torch.mm(dy.t(), x, out_dtype=torch.float32))
            return lambda: dw.add_(torch.mm(dy.t(), x))

        out.append((f"gemm.{layer}.fwd", shape, True, flops, nbytes, fwd))
        out.append((f"gemm.{layer}.bwd_input", shape, True, flops, nbytes, bwd_in))
        out.append((f"gemm.{layer}.bwd_weight", shape, True, flops, nbytes, bwd_w))

    linear("q_proj", T, H, HEADS * HEAD_DIM)
    linear("kv_proj", T, H, KV_HEADS * HEAD_DIM)
    linear("o_proj", T, HEADS * HEAD_DIM, H)
    linear("gate_up", T, H, I)
    linear("down", T, I, H)
    linear("lm_head", T, H, V)
    linear("square8192", 8192, 8192, 8192)

    th = T * H * 2.0

    def rms_res_fwd(s):
        x, r, w = rand((T, H)), rand((T, H)), rand((H,), lo=0.5, hi=1.5)
        def f():
            s_ = x + r
            return s_, F.rms_norm(s_, (H,), w, 1e-6)
        return f

    def rms_res_bwd(s):
        sm = rand((T, H), requires_grad=True)
        w = rand((H,), lo=0.5, hi=1.5, requires_grad=True)
        y = F.rms_norm(sm, (H,), w, 1e-6)
        dy, dres = rand((T, H)), rand((T, H))
        def f():
            ds, dw = torch.autograd.grad(y, (sm, w), dy, retain_graph=True)
            return ds + dres, dw
        return f

    out.append(("rmsnorm_residual.fwd", f"{T}x{H}x1", False, 4 * th + 2 * H, 4 * th, rms_res_fwd))
    out.append(("rmsnorm_residual.bwd", f"{T}x{H}x1", False, 4 * th + 6 * H, 4 * th, rms_res_bwd))

    qrows = T * HEADS
    qb = qrows * HEAD_DIM * 2.0

    def rms_qk_fwd(s):
        x, w = rand((qrows, HEAD_DIM)), rand((HEAD_DIM,), lo=0.5, hi=1.5)
        return lambda: F.rms_norm(x, (HEAD_DIM,), w, 1e-6)

    def rms_qk_bwd(s):
        x = rand((qrows, HEAD_DIM), requires_grad=True)
        w = rand((HEAD_DIM,), lo=0.5, hi=1.5, requires_grad=True)
        y = F.rms_norm(x, (HEAD_DIM,), w, 1e-6)
        dy = rand((qrows, HEAD_DIM))
        return lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True)

    out.append(("rmsnorm_qk.fwd", f"{qrows}x{HEAD_DIM}x1", False, 2 * qb, 2 * qb, rms_qk_fwd))
    out.append(("rmsnorm_qk.bwd", f"{qrows}x{HEAD_DIM}x1", False, 3 * qb, 3 * qb, rms_qk_bwd))

    def rope_fwd(s):
        q = rand((T, HEADS, HEAD_DIM))
        pos = torch.randint(0, 768, (T,), device=DEV)
        inv = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device=DEV, dtype=torch.float32) / HEAD_DIM))
        freqs = pos.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(BF)[:, None, :], emb.sin().to(BF)[:, None, :]

        def rotate_half(x):
            x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
            return torch.cat((-x2, x1), dim=-1)

        return lambda: q * cos + rotate_half(q) * sin

    out.append(("rope.fwd", f"{T}x{HEADS}x{HEAD_DIM}", False, 2 * qb + 4 * T, 2 * qb, rope_fwd))
    out.append(("rope.fwd.op_with_position_check", f"{T}x{HEADS}x{HEAD_DIM}", False, 2 * qb + 4 * T,
                2 * qb, rope_fwd))

    ti = T * I * 2.0

    def swiglu_fwd(s):
        g, u = rand((T, I), lo=-4, hi=4), rand((T, I))
        return lambda: F.silu(g) * u

    def swiglu_bwd(s):
        g = rand((T, I), lo=-4, hi=4, requires_grad=True)
        u = rand((T, I), requires_grad=True)
        y = F.silu(g) * u
        dy = rand((T, I))
        return lambda: torch.autograd.grad(y, (g, u), dy, retain_graph=True)

    out.append(("swiglu.fwd", f"{T}x{I}x1", False, 3 * ti, 3 * ti, swiglu_fwd))
    out.append(("swiglu.bwd", f"{T}x{I}x1", False, 5 * ti, 5 * ti, swiglu_bwd))

    def add(s):
        a, b, c = rand((T, H)), rand((T, H)), torch.empty((T, H), device=DEV, dtype=BF)
        return lambda: torch.add(a, b, out=c)

    out.append(("add", f"{T}x{H}x1", False, 3 * th, 3 * th, add))

    table = rand((V, H))

    def emb_fwd(s):
        ids = torch.randint(0, V, (T,), device=DEV)
        return lambda: F.embedding(ids, table)

    def emb_bwd(s):
        ids = torch.randint(0, V, (T,), device=DEV)
        dout = rand((T, H))
        dtable = torch.zeros((V, H), device=DEV, dtype=torch.float32)
        # autograd's path: a dense bf16 [V, H] gradient, then accumulated into the f32 grad.
        return lambda: dtable.add_(torch.ops.aten.embedding_dense_backward(dout, ids, V, -1, False))

    out.append(("embedding.fwd", f"{T}x{V}x{H}", False, 2 * th + 4 * T, 2 * th, emb_fwd))
    out.append(("embedding.fwd.op_with_id_check", f"{T}x{V}x{H}", False, 2 * th + 4 * T, 2 * th, emb_fwd))
    out.append(("embedding.bwd", f"{T}x{V}x{H}", False, th + 8.0 * T * H + 4 * T, th, emb_bwd))

    ce_rows = 1024
    ce_bytes = ce_rows * V * 2.0

    def ce_fwd(s):
        z = rand((ce_rows, V), lo=-8, hi=8)
        y = torch.randint(0, V, (ce_rows,), device=DEV)
        return lambda: F.cross_entropy(z, y, reduction="none")

    def ce_bwd(s):
        z = rand((ce_rows, V), lo=-8, hi=8, requires_grad=True)
        y = torch.randint(0, V, (ce_rows,), device=DEV)
        loss = F.cross_entropy(z, y, reduction="mean")
        return lambda: torch.autograd.grad(loss, (z,), retain_graph=True)

    out.append(("cross_entropy.fwd", f"{ce_rows}x{V}x1", False, ce_bytes, ce_bytes, ce_fwd))
    out.append(("cross_entropy.fwd.op_with_target_check", f"{ce_rows}x{V}x1", False, ce_bytes,
                ce_bytes, ce_fwd))
    out.append(("cross_entropy.bwd", f"{ce_rows}x{V}x1", False, 2 * ce_bytes, 2 * ce_bytes, ce_bwd))

    shapes = [(V, H), (H,)]
    for _ in range(LAYERS):
        shapes += [(HEADS * HEAD_DIM, H), (KV_HEADS * HEAD_DIM, H), (KV_HEADS * HEAD_DIM, H),
                   (H, HEADS * HEAD_DIM), (I, H), (I, H), (H, I), (H,), (H,), (HEAD_DIM,), (HEAD_DIM,)]
    numel = sum(math.prod(s) for s in shapes)
    state = {}

    def adamw(clip):
        def make(s):
            if "opt" not in state:
                params = [torch.nn.Parameter(rand(sh, torch.float32)) for sh in shapes]
                for p in params:
                    p.grad = rand(p.shape, torch.float32, lo=-1e-3, hi=1e-3)
                state["params"] = params
                state["model"] = [torch.empty(sh, device=DEV, dtype=BF) for sh in shapes]
                state["opt"] = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), eps=1e-8,
                                                 weight_decay=0.1, fused=True)
            params, model, opt = state["params"], state["model"], state["opt"]

            def f():
                if clip:
                    torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                torch._foreach_copy_(model, params)
            return f
        return make

    out.append(("adamw.step", f"{numel} params", False, 30.0 * numel, 30.0 * numel, adamw(False)))
    out.append(("adamw.step_clipped", f"{numel} params", False, 34.0 * numel, 34.0 * numel,
                adamw(True)))

    # ---- generation / scoring (issues 6, 7): same names as opd's add_generation_cases.
    for ctx in (256, 512, 768):
        B = 64
        kv = 2.0 * B * ctx * KV_HEADS * HEAD_DIM * 2
        nbytes = kv + 2.0 * B * HEADS * HEAD_DIM * 2

        def decode(s, ctx=ctx, B=B):
            q = rand((B, HEADS, 1, HEAD_DIM))
            k, v = rand((B, KV_HEADS, ctx, HEAD_DIM)), rand((B, KV_HEADS, ctx, HEAD_DIM))
            return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        out.append((f"paged_attention.decode_ctx{ctx}", f"{B}x{HEADS}/{KV_HEADS}x{HEAD_DIM} bs16",
                    False, nbytes, nbytes, decode))

    def sample(filtered):
        def make(s):
            z = rand((64, V), torch.float32, -8, 8)
            gen = torch.Generator(device=DEV)
            gen.manual_seed(7 + s)

            def f():
                x = z
                if filtered:
                    kth = torch.topk(x, 50, dim=-1).values[:, -1:]
                    x = x.masked_fill(x < kth, -math.inf)
                    sx, idx = torch.sort(x, descending=True, dim=-1)
                    cum = sx.softmax(-1).cumsum(-1)
                    drop = cum - sx.softmax(-1) >= 0.9
                    sx = sx.masked_fill(drop, -math.inf)
                    x = torch.full_like(x, -math.inf).scatter(-1, idx, sx)
                    p = x.softmax(-1)
                    x = x.masked_fill(p < 0.02 * p.max(-1, keepdim=True).values, -math.inf)
                p = x.softmax(-1)
                ids = torch.multinomial(p, 1, generator=gen)
                return ids, torch.log_softmax(z, -1).gather(-1, ids)
            return f
        return make

    out.append(("sample.t1", f"64x{V} f32", False, 4.0 * 64 * V, 4.0 * 64 * V, sample(False)))
    out.append(("sample.topk50_topp0.9_minp0.02", f"64x{V} f32", False, 4.0 * 64 * V,
                4.0 * 64 * V, sample(True)))

    R, HT, K = 4096, 2048, 64

    def topk_lm_head(s):
        h, w = rand((R, HT)), rand((V, HT), lo=-0.05, hi=0.05)
        actual = torch.randint(0, V, (R, 1), device=DEV)

        def f():
            lp = F.linear(h, w).float().log_softmax(-1)
            top = lp.topk(K, dim=-1)
            return top, lp.gather(-1, actual)
        return f

    for tile, chunk in ((16384, 2048), (8192, 4096)):
        out.append((f"topk_lm_head.k64_tile{tile}_chunk{chunk}", f"{R}x{HT}x{V}", True,
                    2.0 * R * HT * V, 2.0 * (R + V) * HT, topk_lm_head))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--filter", default="")
    ap.add_argument("--opd", help="file whose last JSON line is `opd bench kernels` output")
    args = ap.parse_args()
    assert args.iters >= 20, "--iters must be >= 20"
    torch.manual_seed(0)
    device = torch.cuda.get_device_name(0)
    rows = []
    for name, shape, is_flops, work, nbytes, make in cases():
        if args.filter and args.filter not in name:
            continue
        sets = rotation_sets(nbytes)
        fns = [make(s) for s in range(sets)]
        with torch.no_grad() if not name.endswith(".bwd") else torch.enable_grad():
            ms = time_ms(lambda s: fns[s](), sets, args.warmup, args.iters)
        rate = work / (ms * 1e-3) / (1e12 if is_flops else 1e9)
        frac = rate / (GEMM_CEILING if is_flops else COPY_CEILING)
        rows.append(dict(name=name, shape=shape, ms=ms, rate=rate, unit="TF" if is_flops else "GB",
                         ceiling_fraction=frac))
        print(f"  {name:40s} {ms:9.4f} ms", file=sys.stderr)
        del fns
        torch.cuda.empty_cache()

    opd = {}
    if args.opd:
        with open(args.opd) as f:
            lines = [l for l in f.read().splitlines() if l.startswith("{")]
        for r in json.loads(lines[-1])["results"]:
            opd[r["name"]] = r
    print(f"torch {torch.__version__} kernels on {device} (median of {args.iters})")
    print(f"{'kernel':40s} {'shape':22s} {'torch ms':>10s} {'rate':>9s} {'ceiling':>8s}"
          + (f" {'opd ms':>10s} {'torch/opd':>10s}" if opd else ""))
    for r in rows:
        line = (f"{r['name']:40s} {r['shape']:22s} {r['ms']:10.4f} {r['rate']:6.1f} {r['unit']} "
                f"{100 * r['ceiling_fraction']:7.1f}%")
        if r["name"] in opd:
            o = opd[r["name"]]
            r["opd_ms"] = o["ms"]
            r["torch_over_opd"] = r["ms"] / o["ms"]
            line += f" {o['ms']:10.4f} {r['ms'] / o['ms']:9.2f}x"
        print(line)
    print(json.dumps({"bench": "kernels_torch", "device": device, "torch": torch.__version__,
                      "iters": args.iters, "results": rows}))


if __name__ == "__main__":
    main()
