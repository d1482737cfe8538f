#!/usr/bin/env python3
"""Writes tests/fixtures/safetensors/ with the reference Python `safetensors` package (and
transformers for the sharded model), plus JSON descriptions of what each file must contain
computed from the torch tensors that were saved, never from the files themselves:

  basic.safetensors + basic.expected.json
      f32, bf16, f16, f64, i32, i64 tensors, an empty [0, 4] tensor, a scalar [] tensor and
      __metadata__; expected: dtype, shape, raw little-endian bytes (hex) and exact values.
  sharded/  a tiny Qwen3ForCausalLM saved by transformers' save_pretrained in bf16 with a small
      max_shard_size: config.json, model-0000k-of-0000n.safetensors,
      model.safetensors.index.json; sharded.expected.json: per tensor dtype, shape, sha256 of
      the raw bytes and the first values as float.

Usage: python3 tools/make_safetensors_fixtures.py   (needs torch, safetensors, transformers)
"""
import hashlib
import json
import os
import shutil
import sys

import safetensors
import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3Config

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "safetensors")

DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
               torch.float64: "F64", torch.int32: "I32", torch.int64: "I64"}


def raw_bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def values(t):
    flat = t.reshape(-1)
    if t.is_floating_point():
        return [float(v) for v in flat.to(torch.float64).tolist()]
    return [int(v) for v in flat.tolist()]


def basic():
    g = torch.Generator().manual_seed(1234)
    tensors = {
        "f32_matrix": torch.randn(3, 5, generator=g),
        # bf16/f16 from random f32 (rounded by torch), with values beyond f16's 2^-14 normal
        # range included so subnormal decoding is exercised.
        "bf16_matrix": (torch.randn(4, 3, generator=g) * 100).to(torch.bfloat16),
        "f16_vector": torch.tensor([1.5, -2.25, 65504.0, 6.1e-5, 3.0e-7, -0.0, 0.333],
                                   dtype=torch.float16),
        "f64_pair": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "i64_ids": torch.tensor([0, 1, -5, 2**40 + 3, 151935, -(2**62)], dtype=torch.int64),
        "i32_ids": torch.tensor([7, -1, 2**31 - 1, -(2**31), 12], dtype=torch.int32),
        "empty_rows": torch.zeros(0, 4, dtype=torch.float32),
        "scalar": torch.tensor(3.25, dtype=torch.float32),
    }
    metadata = {"format": "pt", "producer": "tools/make_safetensors_fixtures.py"}
    save_file(tensors, os.path.join(ROOT, "basic.safetensors"), metadata=metadata)
    expected = {
        "metadata": metadata,
        "tensors": {name: {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                           "hex": raw_bytes(t).hex(), "values": values(t)}
                    for name, t in tensors.items()},
    }
    with open(os.path.join(ROOT, "basic.expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")


def sharded():
    torch.manual_seed(99)
    cfg = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      tie_word_embeddings=False, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    # Norm weights are initialised to ones; randomise everything so no tensor is constant.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype))
    out = os.path.join(ROOT, "sharded")
    model.save_pretrained(out, max_shard_size="20KB")
    for name in os.listdir(out):
        if name == "generation_config.json":
            os.remove(os.path.join(out, name))
    expected = {}
    for name, t in model.state_dict().items():
        expected[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                          "sha256": hashlib.sha256(raw_bytes(t)).hexdigest(),
                          "first_values": values(t)[:4]}
    with open(os.path.join(ROOT, "sharded.expected.json"), "w") as f:
        json.dump({"tensors": expected, "num_parameters": model.num_parameters()}, f, indent=1)
        f.write("\n")


def main():
    print(f"safetensors {safetensors.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}", file=sys.stderr)
    if os.path.isdir(ROOT):
        shutil.rmtree(ROOT)
    os.makedirs(ROOT)
    basic()
    sharded()
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ROOT) for f in fs)
    print(f"wrote {ROOT}: {total} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
