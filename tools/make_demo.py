#!/usr/bin/env python3
"""Generates the embedded demo's inputs (BENCHMARKS.md W0) under demo/:

  demo/tokenizer/tokenizer.json, tokenizer_config.json  a byte-level BPE
      tokenizer built with Hugging Face `tokenizers` (all 256 bytes, no merges: one token per character),
      with "<|end|>" as the EOS / end-of-completion token
  demo/data/train.jsonl, demo/data/eval.jsonl          the task: two-number addition,
      {"prompt": "47+85=", "completion": "132"}; eval pairs never appear in train
  demo/teacher.config.json, demo/student.config.json   Qwen3-family configs

The teacher weights (demo/teacher/) are made from these with `opd init` + `opd sft`;
scripts/make_demo_teacher.sh runs that. Deterministic: same files on every run (seed below).
Usage: python3 tools/make_demo.py [--out demo]
"""
import argparse
import json
import os
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers import AddedToken

SEED = 20261130
MAX_DIGITS = 2          # operands in [0, 10^MAX_DIGITS)
EVAL_PAIRS = 500
EOS = "<|end|>"


def _byte_of(ch):
    """The byte a ByteLevel character stands for (GPT-2's bytes_to_unicode, inverted)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
                 + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(256) if b not in printable]
    return others[ord(ch) - 256]


def make_tokenizer(out_dir):
    # The full byte-level alphabet (256 tokens, in byte order) so every text is encodable;
    # no merges, so the task's characters are one token each.
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS, "pad_token": EOS, "model_max_length": 64,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
        f.write("\n")
    assert tok.encode("47+85=132").ids == list(b"47+85=132"), tok.encode("47+85=132").ids
    return tok.token_to_id(EOS), tok.get_vocab_size()


def make_data(out_dir):
    rng = random.Random(SEED)
    n = 10 ** MAX_DIGITS
    pairs = [(a, b) for a in range(n) for b in range(n)]
    rng.shuffle(pairs)
    eval_pairs, train_pairs = pairs[:EVAL_PAIRS], pairs[EVAL_PAIRS:]
    os.makedirs(out_dir, exist_ok=True)
    for name, rows in (("train.jsonl", train_pairs), ("eval.jsonl", eval_pairs)):
        with open(os.path.join(out_dir, name), "w") as f:
            for a, b in rows:
                f.write(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n")


def config(hidden, layers, heads, kv_heads, head_dim, inter, vocab, eos):
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "attention_bias": False, "tie_word_embeddings": True, "initializer_range": 0.02,
        "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos, "dtype": "float32",
        "use_sliding_window": False, "sliding_window": None,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "demo"))
    args = ap.parse_args()
    eos, vocab = make_tokenizer(os.path.join(args.out, "tokenizer"))
    make_data(os.path.join(args.out, "data"))
    vocab_padded = 272  # the tokenizer's 257 ids, padded to a multiple of 16
    cfgs = {"teacher.config.json": config(128, 4, 4, 2, 32, 384, vocab_padded, eos),
            "student.config.json": config(64, 2, 4, 2, 16, 192, vocab_padded, eos)}
    for name, cfg in cfgs.items():
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
    print(f"demo inputs written to {os.path.normpath(args.out)} (vocab {vocab}, eos id {eos})")


if __name__ == "__main__":
    main()
