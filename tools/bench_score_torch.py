#!/usr/bin/env python3
"""PyTorch twin of `opd bench score`: W1 teacher scoring done the way a Python stack does it
with HF transformers (the BENCHMARKS.md anchor "teacher top-K scoring"): Qwen3ForCausalLM with
the Qwen3-1.7B shape (random init, std 0.02, bf16, sdpa attention), 64 sequences x 768 random
token ids (256 prompt + 512 scored positions), one forward per micro-batch, log_softmax over the
full vocabulary of the positions that predict the completion (at temperature T), top-K (K = 64)
and the logprob of the actual token; only [rows x K] ids/logprobs are copied to the host, as
opd's scorer returns them. Timed like opd's: --warmup untimed calls, then the median wall time
of --iters calls of the whole batch (synchronized).

Usage (GPU machine): python3 tools/bench_score_torch.py [--json] [--micro-batch 16] ...
The last line printed is one JSON object (median_s, scored_tokens_per_s, peak_allocated_bytes).
"""
import argparse
import json
import statistics
import time

import torch


def build_model(args):
    from transformers import Qwen3ForCausalLM

    from qwen3_shape import qwen3_config

    cfg = qwen3_config(2048, 6144, args.layers, use_cache=False)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.eval()
    return model


@torch.no_grad()
def score(model, ids, args):
    """Top-K ids/logprobs and actual-token logprobs of the completion positions, on the host."""
    P, K, T = args.prompt, args.k, args.temperature
    out_ids, out_lp, out_actual = [], [], []
    for b in range(0, ids.shape[0], args.micro_batch):
        x = ids[b:b + args.micro_batch]
        # Positions P-1 .. S-2 predict tokens P .. S-1 (the scored completion).
        hidden = model.model(input_ids=x[:, :-1]).last_hidden_state[:, P - 1:]
        logits = model.lm_head(hidden).float() / T               # [mb, completion, V]
        lp = torch.log_softmax(logits, dim=-1)
        top_lp, top_ids = lp.topk(K, dim=-1)
        actual = lp.gather(-1, x[:, P:].unsqueeze(-1)).squeeze(-1)
        out_ids.append(top_ids.to(torch.int32).cpu())
        out_lp.append(top_lp.cpu())
        out_actual.append(actual.cpu())
    return torch.cat(out_ids), torch.cat(out_lp), torch.cat(out_actual)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--micro-batch", type=int, default=16,
                    help="sequences per forward (dense logits: mb x 512 x 151936 f32 each)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    model = build_model(args)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    ids = torch.randint(0, 151936, (args.sequences, args.prompt + args.completion),
                        generator=g).to(args.device)
    scored = args.sequences * args.completion
    forwarded = args.sequences * (args.prompt + args.completion - 1)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.warmup + args.iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        score(model, ids, args)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
        if not args.json:
            print(f"  torch call {i}{' (warm-up)' if i < args.warmup else ''}: {dt:.4f} s", flush=True)
    s = statistics.median(times)
    out = {
        "bench": "score_torch", "sequences": args.sequences, "prompt": args.prompt,
        "completion": args.completion, "layers": args.layers, "k": args.k,
        "micro_batch": args.micro_batch, "median_s": s, "all_s": times,
        "scored_tokens_per_s": scored / s, "forwarded_tokens_per_s": forwarded / s,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "torch": torch.__version__,
    }
    if not args.json:
        print(f"torch: {s:.4f} s, {scored / s:.0f} scored tok/s, {forwarded / s:.0f} forwarded tok/s, "
              f"peak {out['peak_allocated_bytes'] / 2**30:.2f} GiB")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
