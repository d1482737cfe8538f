#!/usr/bin/env python3
"""Writes tests/fixtures/ops/<op>.safetensors: inputs, outputs and gradients of one modest case
per kernel, computed by PyTorch in float64 with a fixed seed (the oracle the C++ reference
kernels are compared against in tests/kernels/test_fixtures.cpp).

Usage: python3 tools/make_op_fixtures.py [--out tests/fixtures/ops]
Gradients are those of the scalar L = sum(output * d<output>) for a random d<output> (for
cross-entropy: L = scale * sum(losses)), obtained with torch.autograd, so every output
element matters. Parameter gradients (dw, dbias, dtable) are the gradient alone (the C++ test
adds it to a random starting buffer, since ops accumulate into parameter gradients).
"""
import argparse
import math
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

F64 = torch.float64


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=F64)


def grads(loss, inputs):
    return torch.autograd.grad(loss, inputs)


def embedding(gen):
    vocab, hidden, n = 10, 6, 13  # n > vocab: repeated ids must accumulate
    ids = torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int32)
    ids[0] = vocab - 1  # both ends of the valid range
    ids[1] = 0
    table = randn(gen, vocab, hidden).requires_grad_()
    out = F.embedding(ids.long(), table)
    dout = randn(gen, n, hidden)
    (dtable,) = grads((out * dout).sum(), [table])
    return dict(ids=ids, table=table, out=out, dout=dout, dtable=dtable)


def rmsnorm(gen):
    n, h, eps = 5, 12, 1e-6
    x = randn(gen, n, h).requires_grad_()
    w = (1 + 0.5 * randn(gen, h)).requires_grad_()
    # Hugging Face LlamaRMSNorm / Qwen3RMSNorm: x * rsqrt(mean(x^2) + eps) * w.
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    y = w * (x * rstd)
    dy = randn(gen, n, h)
    dx, dw = grads((y * dy).sum(), [x, w])
    return dict(x=x, w=w, eps=torch.tensor([eps], dtype=F64), y=y, rstd=rstd.squeeze(-1),
                dy=dy, dx=dx, dw=dw)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(gen):
    n, heads, d, theta = 9, 3, 8, 10000.0
    # Two packed sequences (positions restart at 0) and one large position.
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 1000], dtype=torch.int32)
    # inv_freq exactly as Hugging Face computes it (float32), stored as float32.
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    x = randn(gen, n, heads, d).requires_grad_()
    freqs = positions.to(F64)[:, None] * inv_freq.to(F64)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [n, 1, d], broadcast over heads
    y = x * emb.cos() + rotate_half(x) * emb.sin()  # HF apply_rotary_pos_emb
    dy = randn(gen, n, heads, d)
    (dx,) = grads((y * dy).sum(), [x])
    return dict(x=x, positions=positions, inv_freq=inv_freq, y=y, dy=dy, dx=dx)


def attention(gen):
    lengths, hq, hkv, d = [5, 3], 4, 2, 8
    n, group, scale = sum(lengths), hq // hkv, 1.0 / math.sqrt(d)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    q = randn(gen, n, hq, d).requires_grad_()
    k = randn(gen, n, hkv, d).requires_grad_()
    v = randn(gen, n, hkv, d).requires_grad_()
    outs, lses = [], []
    for b in range(len(lengths)):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        qb = q[s0:s1].transpose(0, 1)  # [hq, L, d]
        kb = k[s0:s1].transpose(0, 1).repeat_interleave(group, dim=0)  # query head h -> h // group
        vb = v[s0:s1].transpose(0, 1).repeat_interleave(group, dim=0)
        scores = scale * qb @ kb.transpose(1, 2)
        causal = torch.ones(s1 - s0, s1 - s0, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [hq, L]
        ob = torch.softmax(scores, dim=-1) @ vb
        # Second opinion from PyTorch's own kernel (GQA + causal).
        ref = F.scaled_dot_product_attention(qb[None], k[s0:s1].transpose(0, 1)[None],
                                             v[s0:s1].transpose(0, 1)[None], is_causal=True,
                                             scale=scale, enable_gqa=True)[0]
        assert torch.allclose(ob, ref, rtol=1e-12, atol=1e-12)
        outs.append(ob.transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    out, lse = torch.cat(outs), torch.cat(lses)
    dout = randn(gen, n, hq, d)
    dq, dk, dv = grads((out * dout).sum(), [q, k, v])
    return dict(q=q, k=k, v=v, cu_seqlens=cu, scale=torch.tensor([scale], dtype=F64), out=out,
                lse=lse, dout=dout, dq=dq, dk=dk, dv=dv)


def swiglu(gen):
    n, inter = 5, 7
    gate = (3 * randn(gen, n, inter)).requires_grad_()  # wide range: both sigmoid branches
    up = randn(gen, n, inter).requires_grad_()
    out = F.silu(gate) * up
    dout = randn(gen, n, inter)
    dgate, dup = grads((out * dout).sum(), [gate, up])
    return dict(gate=gate, up=up, out=out, dout=dout, dgate=dgate, dup=dup)


def linear(gen):
    n, fan_in, fan_out = 5, 7, 6
    x = randn(gen, n, fan_in).requires_grad_()
    w = randn(gen, fan_out, fan_in).requires_grad_()
    bias = randn(gen, fan_out).requires_grad_()
    y = F.linear(x, w, bias)
    dy = randn(gen, n, fan_out)
    dx, dw, dbias = grads((y * dy).sum(), [x, w, bias])
    return dict(x=x, w=w, bias=bias, y=y, dy=dy, dx=dx, dw=dw, dbias=dbias)


def cross_entropy(gen):
    n, vocab, scale = 6, 11, 0.37
    logits = (4 * randn(gen, n, vocab)).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int32)
    targets[2] = -100  # ignored row
    targets[0] = vocab - 1
    losses = F.cross_entropy(logits, targets.long(), ignore_index=-100, reduction="none")
    lse = torch.logsumexp(logits, dim=-1)
    (dlogits,) = grads(scale * losses.sum(), [logits])
    return dict(logits=logits, targets=targets, losses=losses, lse=lse,
                scale=torch.tensor([scale], dtype=F64), dlogits=dlogits,
                num_valid=torch.tensor([int((targets != -100).sum())], dtype=torch.int64))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--out", default=os.path.join(root, "tests", "fixtures", "ops"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for seed, make in enumerate([embedding, rmsnorm, rope, attention, swiglu, linear,
                                 cross_entropy]):
        gen = torch.Generator().manual_seed(1234 + seed)
        tensors = {name: t.detach().contiguous() for name, t in make(gen).items()}
        path = os.path.join(args.out, f"{make.__name__}.safetensors")
        # One metadata key: safetensors orders several keys at random, and the files should be
        # byte-reproducible.
        save_file(tensors, path,
                  metadata={"generator": f"tools/make_op_fixtures.py, torch {torch.__version__}"})
        print(f"{path}: {os.path.getsize(path)} bytes, {sorted(tensors)}")


if __name__ == "__main__":
    main()
