#!/usr/bin/env python3
"""How far a bf16 model is from the f32 model with the same (bf16-rounded) weights, on the
fixture models, with HF transformers on the CPU (a bf16 model rounds every activation and
activation gradient). Calibrates the bf16 tolerances of tests/cuda/test_cuda_model.cpp.
Run from the repository root: python3 tools/bf16_error_estimate.py
Result (transformers 5.24, torch 2.15 CPU, 2026-11-30): logits rel_l2 0.55-1.04%, max_rel
<= 1.5%; worst gradient rel_l2 <= 2.4%, max_rel <= 3.8% (qwen3 post_attention_layernorm).
"""
import torch
from transformers import AutoModelForCausalLM
torch.manual_seed(0)
for fx in ["qwen3", "qwen2", "llama", "llama_bias"]:
    d = f"tests/fixtures/models/{fx}"
    m32 = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager")
    V = m32.config.vocab_size
    # bf16-rounded weights in f32 as the reference
    sd = {k: v.to(torch.bfloat16).float() for k, v in m32.state_dict().items()}
    m32.load_state_dict(sd)
    m16 = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager")
    m16.load_state_dict(sd); m16 = m16.to(torch.bfloat16)
    ids = torch.tensor([[(i * 29 + 11) % V for i in range(37)]])
    worst = {}
    l32 = m32(ids).logits
    l16 = m16(ids).logits.float()
    rel = ((l16 - l32).norm() / l32.norm()).item(); mx = ((l16 - l32).abs().max() / l32.abs().max()).item()
    g = torch.rand_like(l32) * 2 - 1
    g = g.to(torch.bfloat16).float()
    (l32 * g).sum().backward()
    (m16(ids).logits.float() * g).sum().backward()
    p16 = dict(m16.named_parameters())
    res = []
    for n, p in m32.named_parameters():
        a = p.grad; b = p16[n].grad.float()
        res.append((((b - a).norm() / a.norm()).item(), ((b - a).abs().max() / a.abs().max()).item(), n))
    res.sort(reverse=True)
    print(fx, "logits rel_l2 %.3g max_rel %.3g" % (rel, mx), "worst grads:", ["%s %.3g/%.3g" % (n, r, m) for r, m, n in res[:3]])
