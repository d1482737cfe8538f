#!/usr/bin/env python3
"""Dense PyTorch loss head on the W1 shapes, the comparison for `opd bench loss`.

What a PyTorch trainer does (TRL's GKD, ms-swift): logits = h @ W^T in bf16 (a [N, V] bf16
tensor), log-softmax in fp32 at temperature T, gather at the teacher's top-K ids, the generalized
JSD(beta) of DESIGN.md "Loss" in the topk+tail form (K atoms + one rest-of-vocabulary atom per
side, student tail from the exact log-sum-exp, log-tails log1p(-sum) clamped at log(1e-12)), mean
over the rows, backward into h and W. Prints the median ms of event-timed forward+backward calls
and the peak memory beyond inputs and parameter gradients (torch.cuda.max_memory_allocated minus
what was allocated before the call, with .grad already allocated), then one JSON line per N.

    python3 tools/bench_loss_torch.py                 # N = 4096 and 8192, V 151936, H 1024, K 64
    python3 tools/bench_loss_torch.py --compile       # the same loss through torch.compile
"""
import argparse
import json
import math
import statistics

import torch


def topk_tail_jsd(h, w, ids, a, row_w, n_total, beta, temperature, floor=1e-12):
    z = (h @ w.t()).float()  # bf16 GEMM, bf16 logits, upcast: what a bf16 lm_head gives
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    logq = z.gather(1, ids) - lse  # [N, K]
    sum_p = a.exp().sum(-1)
    sum_q = logq.exp().sum(-1)
    log_floor = math.log(floor)
    logp_tail = torch.where(sum_p < 1 - floor, torch.log1p(-sum_p.clamp(max=1 - floor)),
                            torch.full_like(sum_p, log_floor))
    # clamped tails carry no gradient (divergence.h log_tail)
    logq_tail = torch.where(sum_q < 1 - floor, torch.log1p(-sum_q.clamp(max=1 - floor)),
                            torch.full_like(sum_q, log_floor))
    lp = torch.cat([a, logp_tail[:, None]], dim=1)
    lq = torch.cat([logq, logq_tail[:, None]], dim=1)
    if beta == 0.0:
        d = (lp.exp() * (lp - lq)).sum(-1)
    elif beta == 1.0:
        d = (lq.exp() * (lq - lp)).sum(-1)
    else:
        lm = torch.logsumexp(torch.stack([lp + math.log(beta), lq + math.log1p(-beta)]), dim=0)
        d = beta * (lp.exp() * (lp - lm)).sum(-1) + (1 - beta) * (lq.exp() * (lq - lm)).sum(-1)
    return (row_w * d).sum() / n_total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--beta", type=float, default=0.5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="torch.compile the loss function")
    args = ap.parse_args()

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    n_max, v, hdim, k = max(args.rows), args.vocab, args.hidden, args.k
    fn = torch.compile(topk_tail_jsd) if args.compile else topk_tail_jsd
    name = torch.cuda.get_device_name(dev)
    # W1-like inputs: hidden ~ unit scale (after the final norm), lm_head ~ N(0, 0.02).
    h_all = torch.randn(n_max, hdim, device=dev, generator=gen).to(torch.bfloat16)
    w = (0.02 * torch.randn(v, hdim, device=dev, generator=gen)).to(torch.bfloat16).requires_grad_()
    # K distinct teacher ids per row and a sub-distribution of teacher logprobs (fp32).
    ids_all = torch.stack([torch.randperm(v, device=dev, generator=gen)[:k] for _ in range(16)])
    ids_all = ids_all.repeat((n_max + 15) // 16, 1)[:n_max].contiguous()
    g = torch.rand(n_max, k, device=dev, generator=gen) * 4
    a_all = torch.log_softmax(g, -1) + math.log(0.9)

    for n in args.rows:
        h = h_all[:n].clone().requires_grad_()
        ids, a = ids_all[:n], a_all[:n]
        row_w = torch.ones(n, device=dev)

        def step():
            loss = fn(h, w, ids, a, row_w, float(n), args.beta, args.temperature)
            loss.backward()
            return loss

        for _ in range(args.warmup):
            step()  # also allocates h.grad and w.grad (kept: gradients are not "extra")
        torch.cuda.synchronize()
        ms = []
        for _ in range(args.iters):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            stop.record()
            stop.synchronize()
            ms.append(start.elapsed_time(stop))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = step()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        med = statistics.median(ms)
        print(f"dense PyTorch{' (compiled)' if args.compile else ''} on {name}: N={n} V={v} H={hdim} "
              f"K={k} topk+tail beta={args.beta} T={args.temperature}: {med:.3f} ms fwd+bwd, "
              f"peak extra {extra / 2**20:.0f} MiB, loss {loss.item():.6g}")
        print(json.dumps({"bench": "loss_torch", "device": name, "compiled": args.compile, "rows": n,
                          "vocab": v, "hidden": hdim, "k": k, "mode": "topk+tail", "beta": args.beta,
                          "temperature": args.temperature, "dtype": "bf16", "torch": torch.__version__,
                          "ms": med, "extra_peak_bytes": extra, "iters": args.iters,
                          "loss": loss.item()}))
        del h
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
