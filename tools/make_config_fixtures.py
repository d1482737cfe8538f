#!/usr/bin/env python3
"""Writes tests/fixtures/configs/<name>/{config.json, expected.json}: config.json files as
they appear on the Hugging Face Hub (three real model configs, verbatim in content) plus small
variants that exercise defaults, legacy keys and RoPE scaling types; expected.json holds what
transformers makes of each file (AutoConfig + AutoModelForCausalLM.from_config on the meta
device, so the real sizes cost no memory): the resolved fields and model.num_parameters(), and
the model's rotary embedding built on the CPU: its inv_freq and attention_scaling (YaRN's
factor on cos/sin). The C++ config tests compare opd's parser against these values.

Usage: python3 tools/make_config_fixtures.py   (needs transformers and torch; run from anywhere)
"""
import json
import os
import shutil
import sys

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "configs")

# Real configs (Qwen/Qwen3-0.6B, Qwen/Qwen2.5-0.5B, meta-llama/Llama-3.2-1B-Instruct).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

LLAMA_3_2_1B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

# Small variants: each one exercises defaults or spellings the real files above do not.
QWEN3_TINY_DEFAULTS = {
    # no head_dim (Qwen3Config default 128, not hidden/heads), no num_key_value_heads
    # (Qwen3Config default 32, not num_attention_heads), attention_bias on (q/k/v/o biases),
    # untied, transformers-5 `dtype` and `rope_parameters` spelling.
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 96,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 64,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0},
    "rms_norm_eps": 1e-05,
    "dtype": "float32",
    "eos_token_id": [5, 7],
}

QWEN2_TINY_UNTIED = {
    # explicit head_dim different from hidden/heads (Qwen2 honours it), untied, legacy
    # rope_scaling with the old `type` key, no rope_theta (10000), no eos/bos.
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 72,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 12,
    "tie_word_embeddings": False,
    "rope_scaling": {"type": "default"},
    "torch_dtype": "float16",
    "use_sliding_window": False,
    "sliding_window": 4096,
}

LLAMA_TINY_LEGACY_TYPE = {
    # llama3 scaling under the old `type` key and without original_max_position_embeddings
    # (transformers fills in max_position_embeddings), attention_bias on (q/k/v/o biases),
    # both torch_dtype and dtype (dtype wins), no architectures (model_type decides).
    "model_type": "llama",
    "vocab_size": 80,
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attention_bias": True,
    "max_position_embeddings": 4096,
    "rope_theta": 123456.0,
    "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 6.0},
    "torch_dtype": "float16",
    "dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


# Qwen2.5-7B-Instruct's shape with the YaRN block its model card tells users to add for long
# context ({"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}).
QWEN2_5_7B_YARN = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

QWEN3_TINY_YARN_MSCALE = {
    # YaRN with mscale / mscale_all_dim (attention factor from their ratio), beta_fast 0 (Python
    # falsy: the default 32), truncate false, and a top-level original_max_position_embeddings,
    # which transformers puts over the dict's when it builds the rotary embedding.
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "original_max_position_embeddings": 96,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 6.0,
                        "original_max_position_embeddings": 64, "mscale": 0.8,
                        "mscale_all_dim": 1.2, "beta_fast": 0, "beta_slow": 2.0,
                        "truncate": False},
}

LLAMA_TINY_LINEAR = {
    # linear position interpolation under the legacy `type` key; the hidden_act alias "swish".
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "rope_theta": 40000.0,
    "rope_scaling": {"type": "linear", "factor": 2.5},
    "hidden_act": "swish",
}


def saved_by_transformers():
    """A config written by transformers 5 itself (rope_parameters, dtype, explicit head_dim)."""
    cfg = LlamaConfig(
        vocab_size=72, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, head_dim=10, max_position_embeddings=65536,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 2048},
        tie_word_embeddings=True, dtype="bfloat16", bos_token_id=3, eos_token_id=4,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def describe(config_dir):
    cfg = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    layer = model.model.layers[0]
    attn = layer.self_attn
    rope = dict(cfg.rope_parameters)
    embedding_params = {id(p): p.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())
                        for p in m.parameters()}
    eos = cfg.eos_token_id
    eos = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
    expected = {
        "architecture": type(model).__name__,
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": attn.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": float(rope["rope_theta"]),
        "rope_type": rope["rope_type"],
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "attention_bias": attn.q_proj.bias is not None,
        "o_proj_bias": attn.o_proj.bias is not None,
        "qk_norm": hasattr(attn, "q_norm"),
        "hidden_act": cfg.hidden_act,
        "dtype": str(cfg.dtype).removeprefix("torch.") if cfg.dtype is not None else "",
        "eos_token_ids": eos,
        "bos_token_id": -1 if cfg.bos_token_id is None else cfg.bos_token_id,
        "num_parameters": model.num_parameters(),
        "num_embedding_parameters": sum(embedding_params.values()),
    }
    if rope["rope_type"] == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            expected[key] = float(rope[key])
        expected["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    if rope["rope_type"] in ("linear", "yarn"):
        expected["factor"] = float(rope["factor"])
    if rope["rope_type"] == "yarn":
        expected["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    # The rotary embedding itself, on the CPU (the meta model has no values).
    with torch.device("cpu"):
        rotary = type(model.model.rotary_emb)(config=cfg)
    expected["rope_inv_freq"] = [float(x) for x in rotary.inv_freq.float()]
    expected["rope_attention_scaling"] = float(rotary.attention_scaling)
    return expected


def main():
    print(f"transformers {transformers.__version__}, torch {torch.__version__}", file=sys.stderr)
    fixtures = {
        "qwen3_0_6b": QWEN3_0_6B,
        "qwen2_5_0_5b": QWEN2_5_0_5B,
        "llama3_2_1b_instruct": LLAMA_3_2_1B_INSTRUCT,
        "qwen3_tiny_defaults": QWEN3_TINY_DEFAULTS,
        "qwen2_tiny_untied": QWEN2_TINY_UNTIED,
        "llama_tiny_legacy_type": LLAMA_TINY_LEGACY_TYPE,
        "llama_tiny_saved_by_transformers": None,
        "qwen2_5_7b_yarn": QWEN2_5_7B_YARN,
        "qwen3_tiny_yarn_mscale": QWEN3_TINY_YARN_MSCALE,
        "llama_tiny_linear": LLAMA_TINY_LINEAR,
    }
    if os.path.isdir(ROOT):
        shutil.rmtree(ROOT)
    for name, config in fixtures.items():
        d = os.path.join(ROOT, name)
        os.makedirs(d)
        if config is None:
            saved_by_transformers().save_pretrained(d)
        else:
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(config, f, indent=2)
                f.write("\n")
        expected = describe(d)
        expected["generated_by"] = f"tools/make_config_fixtures.py with transformers {transformers.__version__}"
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump(expected, f, indent=2)
            f.write("\n")
        print(name, expected["num_parameters"], file=sys.stderr)


if __name__ == "__main__":
    main()
