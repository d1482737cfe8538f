#!/usr/bin/env python3
"""How far the `topk` and `topk+tail` support modes are from `full` as K varies, on a
"real-ish" next-token distribution (DESIGN.md "Loss"; formulas from tools/loss_reference.py).

Teacher logits per position: Zipf-like, -a * log(rank) + N(0, 0.5^2) over a random permutation
of V = 32768 ids, the exponent a drawn per position from [0.8, 2.0] (flat to peaky rows).
Student logits: 0.8 * teacher + N(0, 1) per id (a correlated but imperfect student).
For each beta and K, over 256 positions at T = 1: the mean divergence of each mode, its
relative gap to full, and the cosine between its gradient w.r.t. the student logits and the
full-mode gradient (what the optimizer actually sees), all in float64.

Usage: python3 tools/loss_support_study.py  (prints the markdown table of docs/loss.md)
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from loss_reference import row_divergence  # noqa: E402

V, N, T = 32768, 256, 1.0
KS = [1, 8, 64, 256]
BETAS = [0.0, 0.5, 1.0]


def make_logits(seed=0):
    g = torch.Generator().manual_seed(seed)
    a = 0.8 + 1.2 * torch.rand(N, 1, generator=g, dtype=torch.float64)
    ranks = torch.arange(1, V + 1, dtype=torch.float64)[None, :]
    zipf = -a * torch.log(ranks) + 0.5 * torch.randn(N, V, generator=g, dtype=torch.float64)
    perm = torch.argsort(torch.rand(N, V, generator=g), dim=-1)
    teacher = torch.empty_like(zipf).scatter_(1, perm, zipf)
    student = 0.8 * teacher + torch.randn(N, V, generator=g, dtype=torch.float64)
    return teacher, student


def divergence_and_grad(mode, beta, z, t_logits, K):
    z = z.clone().requires_grad_(True)
    logp = F.log_softmax(t_logits / T, dim=-1)
    ids = torch.topk(logp, K, dim=-1).indices if K else None
    a = logp.gather(1, ids) if K else None
    d = row_divergence(mode, beta, T, z, ids, a, None, None, t_logits)
    d.sum().backward()
    return d.detach(), z.grad


def main():
    teacher, student = make_logits()
    p = F.softmax(teacher, -1)
    top1 = p.max(-1).values
    ent = -(p * F.log_softmax(teacher, -1)).sum(-1)
    print(f"teacher: top-1 prob mean {top1.mean():.3f} (min {top1.min():.3f}, max {top1.max():.3f}), "
          f"entropy mean {ent.mean():.2f} nats; V = {V}, {N} positions, T = {T}\n")
    mass = {K: torch.topk(p, K, -1).values.sum(-1).mean().item() for K in KS}
    print("| beta | K | teacher top-K mass | full D | topk D (rel. gap) | topk+tail D (rel. gap) "
          "| grad cosine topk / topk+tail vs full |")
    print("|---|---|---|---|---|---|---|")
    for beta in BETAS:
        d_full, g_full = divergence_and_grad("full", beta, student, teacher, 0)
        for K in KS:
            row = [f"{beta:g}", str(K), f"{mass[K]:.3f}", f"{d_full.mean():.4f}"]
            cos = []
            for mode in ("topk", "topk+tail"):
                d, g = divergence_and_grad(mode, beta, student, teacher, K)
                gap = (d.mean() - d_full.mean()) / d_full.mean()
                row.append(f"{d.mean():.4f} ({gap:+.1%})")
                cos.append(F.cosine_similarity(g, g_full, dim=-1).mean().item())
            row.append(f"{cos[0]:.3f} / {cos[1]:.3f}")
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
