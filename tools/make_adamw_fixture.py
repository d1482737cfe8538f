#!/usr/bin/env python3
"""Writes tests/fixtures/train/adamw.safetensors: several steps of torch.optim.AdamW (CPU,
float32, the default single-tensor implementation) with torch.nn.utils.clip_grad_norm_ on some
steps and a changing learning rate: the oracle for opd's AdamW + global grad-norm clipping
(src/train/optimizer.h, tested in tests/train/test_optimizer.cpp).

Usage: python3 tools/make_adamw_fixture.py [--out tests/fixtures/train/adamw.safetensors]

Tensors (all float32 unless noted; i = parameter index, s = step index from 0):
  p0_i             initial parameter
  g_s_i            gradient given at step s (before clipping)
  p_s_i, m_s_i, v_s_i   parameter, exp_avg, exp_avg_sq after step s
  bf16_s_i         p_s_i rounded to bfloat16 (stored as float32): the model copy
  lr, max_norm     float64 [steps]; max_norm 0 = no clipping that step
  norm             float64 [steps]: clip_grad_norm_'s returned total norm (0 when not clipped)
  hyper            float64 [beta1, beta2, eps, weight_decay]
"""
import argparse
import os

import torch
from safetensors.torch import save_file

SHAPES = [(7,), (33, 17), (257,), (4, 1000), (1,)]
LRS = [1e-3, 2e-3, 5e-4, 1e-3, 3e-3]
MAX_NORM = [1.0, 1.0, 0.0, 0.5, 1.0]
GRAD_SCALE = [0.01, 0.5, 0.2, 0.001, 2.0]  # steps 1 and 4 clip (norm > max), 0 and 3 do not
BETA1, BETA2, EPS, WD = 0.9, 0.95, 1e-8, 0.1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/train/adamw.safetensors")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(20261129)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen) * 0.5) for s in SHAPES]
    out = {f"p0_{i}": p.detach().clone() for i, p in enumerate(params)}
    opt = torch.optim.AdamW(params, lr=LRS[0], betas=(BETA1, BETA2), eps=EPS, weight_decay=WD,
                            foreach=False, fused=False)
    norms = []
    for s, lr in enumerate(LRS):
        for i, p in enumerate(params):
            g = torch.randn(*p.shape, generator=gen) * GRAD_SCALE[s]
            out[f"g_{s}_{i}"] = g.clone()
            p.grad = g
        if MAX_NORM[s] > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM[s])))
        else:
            norms.append(0.0)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        for i, p in enumerate(params):
            st = opt.state[p]
            out[f"p_{s}_{i}"] = p.detach().clone()
            out[f"m_{s}_{i}"] = st["exp_avg"].clone()
            out[f"v_{s}_{i}"] = st["exp_avg_sq"].clone()
            out[f"bf16_{s}_{i}"] = p.detach().to(torch.bfloat16).float()
    f64 = torch.float64
    out["lr"] = torch.tensor(LRS, dtype=f64)
    out["max_norm"] = torch.tensor(MAX_NORM, dtype=f64)
    out["norm"] = torch.tensor(norms, dtype=f64)
    out["hyper"] = torch.tensor([BETA1, BETA2, EPS, WD], dtype=f64)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, args.out,
              metadata={"torch": torch.__version__, "params": str(len(SHAPES)),
                        "steps": str(len(LRS))})
    print(f"wrote {args.out}: {len(out)} tensors, norms {norms}")


if __name__ == "__main__":
    main()
