#!/usr/bin/env python3
"""Regenerate the generation fixtures under tests/fixtures/generate/ (one JSON per family).

For each tiny fixture model in tests/fixtures/models/{qwen3,qwen2,llama,llama_bias}, loaded with
Hugging Face transformers in float32 (eager attention), this records:

  greedy:   for a few seeded random prompts, transformers' `generate(do_sample=False)`
            continuation (max_new_tokens=MAX_NEW), once with the model's own eos_token_id and
            once with a substitute EOS (a token the first run produced at step EOS_STEP, so the
            second run must stop at its first occurrence: EOS handling is checked on every
            family even though random weights rarely pick the real EOS). min_margin is the
            smallest top-1 minus top-2 logit over the steps: a near-tie would make the
            comparison depend on rounding, so prompts are chosen with min_margin >= 1e-3.
  sampling: for two prompts, the next-token logits, log_softmax (the model distribution at
            T=1) and, for several (temperature, top_k, top_p, min_p), the sampling
            distribution as transformers forms it: softmax of the scores after its warpers in
            generate's order (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
            MinPLogitsWarper; each added only when active, as in
            GenerationMixin._get_logits_processor). boundary_margin is how far the closest
            token is from a keep/remove boundary (top-p: |cumulative mass - (1 - top_p)|;
            min-p: |p - min_p * p_max| / p_max); configs are kept only when it is >= 1e-4 so
            float32 rounding cannot flip a decision.

The C++ tests (tests/rollout/) compare opd's greedy ids token for token and opd's sampling
distribution element-wise, and chi-square-test opd's sampled frequencies against these
probabilities. CI has no torch: the JSON files are committed.

Usage: python3 tools/make_generate_fixtures.py [--out tests/fixtures/generate]
Needs: torch, transformers.
"""
import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FAMILIES = ["qwen3", "qwen2", "llama", "llama_bias"]
MAX_NEW = 24
EOS_STEP = 5
PROMPT_LENGTHS = [1, 6, 13]
SAMPLING_PROMPT_LENGTHS = [4, 9]
CONFIGS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0),
    (0.6, 0, 1.0, 0.0),
    (1.7, 0, 1.0, 0.0),
    (1.0, 7, 1.0, 0.0),
    (1.0, 0, 0.7, 0.0),
    (1.0, 0, 1.0, 0.3),
    (0.8, 20, 0.9, 0.0),
    (1.3, 30, 0.95, 0.05),
]


def warpers(t, k, p, m):
    procs = LogitsProcessorList()
    if t != 1.0:
        procs.append(TemperatureLogitsWarper(t))
    if k != 0:
        procs.append(TopKLogitsWarper(top_k=k, min_tokens_to_keep=1))
    if p < 1.0:
        procs.append(TopPLogitsWarper(top_p=p, min_tokens_to_keep=1))
    if m != 0.0:
        procs.append(MinPLogitsWarper(min_p=m, min_tokens_to_keep=1))
    return procs


def boundary_margin(scores_in, t, k, p, m):
    """Distance of the closest token to a top-p / min-p decision boundary (inf when inactive)."""
    s = scores_in / t
    margin = float("inf")
    if k:
        kth = torch.topk(s, k).values[-1]
        s = s.masked_fill(s < kth, -float("inf"))
        if (s == kth).sum() > 1:
            margin = 0.0  # a tie at the k-th value
    if p < 1.0:
        sorted_s, _ = torch.sort(s.double(), descending=False)
        cum = sorted_s.softmax(-1).cumsum(-1)
        finite = torch.isfinite(sorted_s)
        margin = min(margin, (cum[finite] - (1 - p)).abs().min().item())
        keep = cum > (1 - p)
        keep[-1] = True
        kept_sorted = sorted_s.masked_fill(~keep, -float("inf"))
        s = kept_sorted  # order no longer matters for min-p
    if m:
        probs = s.double().softmax(-1)
        pm = probs.max()
        finite = probs > 0
        margin = min(margin, ((probs[finite] - m * pm).abs() / pm).min().item())
    return margin


def prompt(gen, n):
    return torch.randint(0, 96, (n,), generator=gen).tolist()


def greedy(model, ids, eos):
    out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                         eos_token_id=eos, pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True, temperature=None, top_p=None, top_k=None)
    cont = out.sequences[0, len(ids):].tolist()
    margin = min((lambda v: (v[0] - v[1]).item())(torch.topk(sc[0], 2).values)
                 for sc in out.scores)
    return cont, margin


def family_fixture(name, seed):
    model_dir = os.path.join(ROOT, "tests", "fixtures", "models", name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    eos = model.config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    gen = torch.Generator().manual_seed(seed)
    fx = {"family": name, "eos_token_ids": eos, "max_new_tokens": MAX_NEW, "greedy": [],
          "sampling": []}
    with torch.no_grad():
        for n in PROMPT_LENGTHS:
            for _attempt in range(100):
                ids = prompt(gen, n)
                cont, margin = greedy(model, ids, eos)
                if margin < 1e-3 or len(cont) <= EOS_STEP:
                    continue
                sub = cont[EOS_STEP]
                cont2, margin2 = greedy(model, ids, [sub])
                if margin2 < 1e-3:
                    continue
                fx["greedy"].append({"prompt": ids, "eos_token_ids": eos, "expected": cont,
                                     "min_margin": margin})
                fx["greedy"].append({"prompt": ids, "eos_token_ids": [sub], "expected": cont2,
                                     "min_margin": margin2})
                break
            else:
                raise SystemExit(f"{name}: no prompt of length {n} without near-ties")
        for n in SAMPLING_PROMPT_LENGTHS:
            ids = prompt(gen, n)
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            entry = {"prompt": ids, "logits": logits.tolist(),
                     "model_logprobs": torch.log_softmax(logits.double(), -1).tolist(),
                     "configs": []}
            for (t, k, p, m) in CONFIGS:
                margin = boundary_margin(logits.clone(), t, k, p, m)
                if margin < 1e-4:
                    print(f"{name}: prompt {n} config {(t, k, p, m)} skipped, margin {margin:.2e}")
                    continue
                scores = warpers(t, k, p, m)(torch.tensor([ids]), logits.clone()[None])
                probs = torch.softmax(scores[0].double(), -1)
                entry["configs"].append({"temperature": t, "top_k": k, "top_p": p, "min_p": m,
                                         "probs": probs.tolist(),
                                         # null: no top-p / min-p boundary (JSON has no inf)
                                         "boundary_margin": None if margin == float("inf")
                                         else margin})
            fx["sampling"].append(entry)
    return fx


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "generate"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for i, name in enumerate(FAMILIES):
        fx = family_fixture(name, seed=4242 + i)
        path = os.path.join(args.out, name + ".json")
        with open(path, "w") as f:
            json.dump(fx, f, separators=(",", ":"), allow_nan=False)
            f.write("\n")
        print(f"{name}: {len(fx['greedy'])} greedy cases, "
              f"{sum(len(e['configs']) for e in fx['sampling'])} sampling configs -> {path}")


if __name__ == "__main__":
    main()
