#!/usr/bin/env python3
"""transformers twin of `opd bench rollout`: the W1 rollout phase done with HF `generate`
(BENCHMARKS.md anchors on the lent H200: 48.0 s eager, 6.18 s with a static cache +
torch.compile): Qwen3ForCausalLM with the Qwen3-0.6B shape (random init, std 0.02), bf16, sdpa
attention, 64 prompts of 256 random ids (no padding: all the same length), 512 new tokens each
sampled at temperature 1 with top-k/top-p off and EOS ignored (min_new_tokens = max_new_tokens).

Modes (--modes, comma-separated):
  eager     model.generate with the default dynamic cache.
  compiled  cache_implementation="static" and the forward compiled with torch.compile
            (mode "reduce-overhead", CUDA graphs), as the transformers docs recommend; the first
            generate compiles (untimed warm-up), the second is timed.
Each mode: a short warm-up generate (8 tokens; for compiled the full length, which compiles),
then one timed generate. Prints one line per mode and, last, one JSON object
{"eager": {"seconds", "tokens_per_s", "peak_allocated_bytes"}, "compiled": {...}}; a mode that
fails carries {"error": "..."} instead (e.g. torch.compile without a working compiler).

Usage (GPU machine): python3 tools/bench_rollout_torch.py [--json] [--modes eager,compiled]
"""
import argparse
import json
import time
import traceback

import torch


def build_model(args):
    from transformers import Qwen3ForCausalLM

    from qwen3_shape import qwen3_config

    cfg = qwen3_config(1024, 3072, args.layers, use_cache=True)
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).to("cuda")
    model.eval()
    return model


def generate(model, ids, new_tokens, temperature, **extra):
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
              eos_token_id=None)
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kw.update(do_sample=False)
    kw.update(extra)
    with torch.inference_mode():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)


def timed(model, ids, args, **extra):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = generate(model, ids, args.new_tokens, args.temperature, **extra)
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    got = out.shape[1] - ids.shape[1]
    assert got == args.new_tokens, f"generated {got} tokens, expected {args.new_tokens}"
    tokens = ids.shape[0] * args.new_tokens
    return {"seconds": s, "tokens_per_s": tokens / s,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    model = build_model(args)
    g = torch.Generator().manual_seed(args.seed + 17)
    ids = torch.randint(0, 151936, (args.prompts, args.prompt_len), generator=g).to("cuda")
    result = {"bench": "rollout_torch", "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0)}
    try:
        import transformers
        result["transformers"] = transformers.__version__
    except Exception:
        pass
    for mode in [m for m in args.modes.split(",") if m]:
        try:
            if mode == "eager":
                generate(model, ids, 8, args.temperature)  # warm-up: kernels, allocator
                r = timed(model, ids, args)
            elif mode == "compiled":
                model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
                t0 = time.perf_counter()
                generate(model, ids, args.new_tokens, args.temperature,
                         cache_implementation="static")  # compiles
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
                r = timed(model, ids, args, cache_implementation="static")
                r["first_call_seconds"] = compile_s
            else:
                raise ValueError(f"unknown mode {mode}")
            print(f"transformers generate ({mode}): {r['seconds']:.3f} s, "
                  f"{r['tokens_per_s']:.0f} tokens/s, peak {r['peak_allocated_bytes'] / 2**30:.2f} GiB",
                  flush=True)
        except Exception as e:  # report and go on: the other mode may still run
            traceback.print_exc()
            r = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"transformers generate ({mode}) failed: {r['error']}", flush=True)
        result[mode] = r
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
