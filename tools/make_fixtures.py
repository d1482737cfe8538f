#!/usr/bin/env python3
"""Regenerate the transformers parity fixtures under tests/fixtures/models/.

For each supported family (Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM) this builds a
tiny randomly initialised model with Hugging Face transformers, in float32, and saves:
  <family>/config.json, <family>/model.safetensors   (save_pretrained: what opd loads)
  <family>/expected.safetensors:
    input_ids   i32 [T]     the batch packed: sequences of unequal lengths back to back
    cu_seqlens  i32 [B+1]   sequence boundaries in the packed rows
    logits      f32 [T, V]  transformers' logits at every real (non-padding) position
    loss        f64 [1]     mean next-token cross-entropy over the batch (labels -100 on padding)
    rope_inv_freq f32 [D/2] the rotary inverse frequencies (llama3 scaling for llama)
    grad.<name> f32 [...]   d(loss)/d(parameter) for every parameter (named_parameters)
transformers runs the batch right-padded with an attention mask; opd runs it packed, so both
the padding semantics (never attended, no gradient) and the numbers are checked.

The Llama variant with attention_bias (llama_bias) covers the o_proj bias; qwen2_yarn covers
YaRN RoPE scaling: its per-dimension frequency ramp and its attention factor on cos/sin (which
opd applies squared in the attention scale, forward and backward).

Usage: python3 tools/make_fixtures.py [--out tests/fixtures/models] [--only NAME ...]
(--only rewrites just those fixtures; the others keep their committed bytes).
Needs: torch, transformers, safetensors (pip install torch transformers safetensors).
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 96
LENGTHS = [7, 5, 3]  # unequal lengths: padding must not matter

FAMILIES = {
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=VOCAB, hidden_size=48,
        intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=64,
        tie_word_embeddings=True, attention_bias=False, hidden_act="silu", initializer_range=0.1,
        bos_token_id=1, eos_token_id=2),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=VOCAB, hidden_size=48,
        intermediate_size=72, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=64,
        tie_word_embeddings=False, hidden_act="silu", initializer_range=0.1,
        bos_token_id=1, eos_token_id=2),
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=64,
        intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=64,
        # small original_max so the llama3 low/medium/high frequency bands all occur at head_dim 16
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64),
        tie_word_embeddings=True, attention_bias=False, hidden_act="silu", initializer_range=0.1,
        bos_token_id=1, eos_token_id=[2, 3]),
    # Llama with attention_bias: q/k/v *and* o_proj biases (Qwen2 has no o_proj bias), untied.
    "llama_bias": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=32,
        intermediate_size=40, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
        tie_word_embeddings=False, attention_bias=True, hidden_act="silu", initializer_range=0.1,
        bos_token_id=1, eos_token_id=2),
    # Qwen2 with YaRN (session 17). theta 100, original context 256 and beta_fast 4 put the ramp
    # over dimensions 4..7 of head_dim 16's eight frequencies, so extrapolated, interpolated and
    # blended frequencies all occur; attention_factor 1.25 (not the derived one) makes the
    # cos/sin factor large enough to matter at fp32 tolerances.
    "qwen2_yarn": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=VOCAB, hidden_size=32,
        intermediate_size=40, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        rms_norm_eps=1e-6, max_position_embeddings=1024,
        rope_scaling=dict(rope_type="yarn", rope_theta=100.0, factor=4.0,
                          original_max_position_embeddings=256, beta_fast=4.0, beta_slow=1.0,
                          attention_factor=1.25),
        tie_word_embeddings=True, hidden_act="silu", initializer_range=0.1,
        bos_token_id=1, eos_token_id=2),
}


def build(name, cfg_dict, seed):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**cfg_dict)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                             dtype=torch.float32)
    # Norm weights start at 1 and biases at 0: randomize them so their gradients and their
    # role in the forward are actually exercised.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def run(model, seed):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    B, L = len(seqs), max(LENGTHS)
    input_ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    labels = torch.full((B, L), -100, dtype=torch.long)
    for b, s in enumerate(seqs):
        input_ids[b, :len(s)] = s
        mask[b, :len(s)] = 1
        labels[b, :len(s)] = s
    model.zero_grad()
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    logits = torch.cat([out.logits[b, :len(s)] for b, s in enumerate(seqs)])
    packed = torch.cat(seqs).to(torch.int32)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(LENGTHS), 0)), dtype=torch.int32)
    expected = {
        "input_ids": packed,
        "cu_seqlens": cu,
        "logits": logits.detach().float().contiguous(),
        "loss": out.loss.detach().double().reshape(1),
        "rope_inv_freq": model.model.rotary_emb.inv_freq.detach().float().contiguous(),
    }
    for pname, p in model.named_parameters():
        expected["grad." + pname] = p.grad.detach().float().contiguous()
    return expected


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                  "fixtures", "models"))
    ap.add_argument("--only", nargs="*", default=None, help="write only these fixtures")
    args = ap.parse_args()
    for i, (name, cfg) in enumerate(FAMILIES.items()):
        if args.only is not None and name not in args.only:
            continue
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        model = build(name, cfg, seed=1234 + i)
        model.save_pretrained(d, safe_serialization=True)
        expected = run(model, seed=99 + i)
        save_file(expected, os.path.join(d, "expected.safetensors"))
        for junk in ("generation_config.json",):
            p = os.path.join(d, junk)
            if os.path.exists(p):
                os.remove(p)
        print(f"{name}: {sum(p.numel() for p in model.parameters())} params, "
              f"loss {expected['loss'].item():.6f} -> {d}")


if __name__ == "__main__":
    main()
