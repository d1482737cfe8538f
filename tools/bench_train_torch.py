#!/usr/bin/env python3
"""PyTorch twin of `opd bench train`: the W1 student training step done the way TRL's
GKDTrainer does it on HF transformers (BENCHMARKS.md anchor): Qwen3ForCausalLM with the
Qwen3-0.6B shape (random init, std 0.02), sdpa attention, dense logits [B, S, V], the same
generalized JSD (beta 0.5, T 1, topk+tail over the teacher's K = 64 ids plus one tail atom per
side, mean over all completion tokens of the step), gradient accumulation over micro-batches,
clip_grad_norm_, fused AdamW. Same sizes, seeds do not matter for speed.

Precision (--params): fp32-autocast (default) = f32 parameters and master weights with
torch.autocast(bfloat16), what HF Trainer does with bf16=True on an f32 model, comparable to
opd's f32 master weights + bf16 compute; bf16 = parameters in bf16 (no master copy).

Usage (GPU machine): python3 tools/bench_train_torch.py [--json] [--recompute] ...
`opd bench train --with-torch` runs it with the same options and prints the ratio. The last
line printed is one JSON object (step_s, tokens_per_s, peak_allocated_bytes, ...).
"""
import argparse
import json
import math
import statistics
import time

import torch


def build_model(args):
    from transformers import Qwen3ForCausalLM

    from qwen3_shape import qwen3_config

    cfg = qwen3_config(1024, 3072, args.layers, use_cache=False)
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(cfg)
    if args.params == "bf16":
        model = model.to(torch.bfloat16)
    model = model.to(args.device)
    if args.recompute:
        model.gradient_checkpointing_enable()
    model.train()
    return model


def jsd_topk_tail(logits, ids, teacher_lp, beta, temperature):
    """Per-row JSD(beta) over K + 1 atoms (teacher top-K + tail), student from dense logits."""
    z = logits.float() / temperature
    logq_full = torch.log_softmax(z, dim=-1)
    lq = logq_full.gather(-1, ids)
    lp = teacher_lp
    floor = 1e-7

    def with_tail(l):
        mass = l.exp().sum(-1, keepdim=True).clamp(max=1 - floor)
        return torch.cat([l, torch.log1p(-mass)], dim=-1)

    lp, lq = with_tail(lp), with_tail(lq)
    lm = torch.logsumexp(torch.stack([lp + math.log(beta), lq + math.log(1 - beta)]), dim=0)
    kl_pm = (lp.exp() * (lp - lm)).sum(-1)
    kl_qm = (lq.exp() * (lq - lm)).sum(-1)
    return beta * kl_pm + (1 - beta) * kl_qm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--params", choices=["fp32-autocast", "bf16"], default="fp32-autocast")
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke test of the script")
    args = ap.parse_args()
    if not 0 < args.beta < 1:
        raise SystemExit("this twin implements 0 < beta < 1 (the W1 setting)")

    dev = args.device
    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=dev == "cuda")
    S, P, C, K, V = args.prompt + args.completion, args.prompt, args.completion, args.k, 151936
    B = args.micro_batch
    n_mb = args.sequences // B
    n_total = args.sequences * C
    g = torch.Generator(device=dev).manual_seed(args.seed + 17)
    mbs = []
    for _ in range(n_mb):
        ids = torch.randint(0, V, (B, S), device=dev, generator=g)
        base = torch.randint(0, V, (B, C, 1), device=dev, generator=g)
        stride = torch.randint(1, max(2, (V - 1) // K + 1), (B, C, 1), device=dev, generator=g)
        top_ids = (base + stride * torch.arange(K, device=dev)) % V
        decay = 0.06 + 0.1 * torch.rand((B, C, 1), device=dev, generator=g)  # mass 0.34-0.84
        top_lp = -3.0 - decay * torch.arange(K, device=dev)
        mbs.append((ids, top_ids, top_lp.float()))
    autocast = args.params == "fp32-autocast"

    def step():
        total = 0.0
        for ids, top_ids, top_lp in mbs:
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=ids).logits  # dense [B, S, V], as TRL computes it
            comp = logits[:, P - 1:S - 1]  # rows predicting the completion tokens
            loss = jsd_topk_tail(comp, top_ids, top_lp, args.beta, args.temperature).sum() / n_total
            loss.backward()
            total += loss.detach()
            del logits, comp, loss
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm) \
            if args.max_grad_norm > 0 else torch.tensor(0.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total), float(gn)

    cuda = dev == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        loss, gn = step()
        sync()
        dt = time.perf_counter() - t0
        if not args.json:
            print(f"  torch step {i}{' (warm-up)' if i < args.warmup else ''}: {dt * 1e3:.1f} ms, "
                  f"loss {loss:.6f}, grad norm {gn:.4g}", flush=True)
        if i >= args.warmup:
            times.append(dt)
    s = statistics.median(times)
    tokens = args.sequences * S
    attn = 3 * 2 * S * S * 128 * 16 * args.layers * args.sequences
    flops = 6 * params * tokens + attn
    out = {
        "bench": "train_torch", "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__, "params_mode": args.params, "recompute": args.recompute,
        "params": params, "step_s": s, "step_s_all": times, "tokens_per_s": tokens / s,
        "tflops": flops / s / 1e12, "mfu_measured_peak": flops / s / 776e12,
        "mfu_spec_peak": flops / s / 989e12,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else 0, "loss": loss,
    }
    if not args.json:
        print(f"torch: {s:.3f} s/step, {tokens / s:.0f} tokens/s, MFU {100 * flops / s / 776e12:.1f}% "
              f"of 776 TFLOP/s, peak {out['peak_allocated_bytes'] / 2**30:.2f} GiB")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
