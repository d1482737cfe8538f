#!/usr/bin/env python3
"""HF transformers anchor of `opd bench w1`: one W1 on-policy distillation step done the way
TRL's GKDTrainer does it (BENCHMARKS.md "Anchor"): HF `generate` (eager, sampling at T 1, EOS
ignored via min_new_tokens) for the rollout; then per micro-batch the teacher forward inside the
training step (dense logits, no_grad), the student forward (dense logits), TRL's
generalized_jsd_loss over the full vocabulary (beta 0.5, T 1) on the completion positions,
backward; clip_grad_norm_ and fused AdamW (lr 1e-5) once per 64 sequences. Student Qwen3-0.6B
shape, teacher Qwen3-1.7B shape, random init, sdpa attention; student f32 parameters under
bf16 autocast (HF Trainer with bf16=True), teacher in bf16. Also times the teacher top-K
scoring alone (forward + log_softmax + topk on the completion rows).

Usage (GPU machine): python3 tools/bench_w1_torch.py [--opd-step-s S] [--json]
The last line printed is one JSON object.
"""
import argparse
import json
import math
import time

import torch


def qwen3(hidden, inter, layers, seed, dtype, device):
    from transformers import Qwen3ForCausalLM

    from qwen3_shape import qwen3_config

    cfg = qwen3_config(hidden, inter, layers, use_cache=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return model.to(dtype)


def generalized_jsd(s_logits, t_logits, beta, temperature):
    """TRL GKDTrainer.generalized_jsd_loss (beta strictly between 0 and 1), summed over rows."""
    s_lp = torch.log_softmax(s_logits.float() / temperature, dim=-1)
    t_lp = torch.log_softmax(t_logits.float() / temperature, dim=-1)
    mix = torch.logsumexp(torch.stack([s_lp + math.log(1 - beta), t_lp + math.log(beta)]), dim=0)
    kl_t = torch.nn.functional.kl_div(mix, t_lp, reduction="none", log_target=True)
    kl_s = torch.nn.functional.kl_div(mix, s_lp, reduction="none", log_target=True)
    return (beta * kl_t + (1 - beta) * kl_s).sum()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--completion-len", type=int, default=512)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--opd-step-s", type=float, default=0.0, help="opd's step time, for the ratio")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    dev = "cuda"
    sync = torch.cuda.synchronize
    student = qwen3(1024, 3072, args.layers, args.seed, torch.float32, dev)
    teacher = qwen3(2048, 6144, args.layers, args.seed + 1, torch.bfloat16, dev).eval()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5, weight_decay=0.0, fused=True)
    P, C, B, V = args.prompt_len, args.completion_len, args.micro_batch, 151936
    g = torch.Generator(device=dev).manual_seed(args.seed + 17)
    prompts = torch.randint(0, V, (args.prompts, P), device=dev, generator=g)
    torch.cuda.reset_peak_memory_stats()

    # 1. rollout: HF generate, eager, as TRL calls it (autocast bf16 on the f32 student)
    student.eval()
    sync()
    t0 = time.perf_counter()
    with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16):
        seqs = student.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                max_new_tokens=C, min_new_tokens=C, pad_token_id=0)
    sync()
    rollout_s = time.perf_counter() - t0
    assert seqs.shape == (args.prompts, P + C), seqs.shape

    # 2. teacher top-K scoring alone (what opd's scorer returns), for reference
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        for b in range(0, args.prompts, B):
            lg = teacher(input_ids=seqs[b:b + B]).logits[:, P - 1:P + C - 1]
            lp = torch.log_softmax(lg.float(), dim=-1)
            top = lp.topk(args.k, dim=-1)
            del lg, lp, top
    sync()
    score_s = time.perf_counter() - t0

    # 3. student train with the teacher forward inside (TRL), twice: warm-up, then timed
    student.train()
    n_total = args.prompts * C

    def train_step():
        total = 0.0
        for b in range(0, args.prompts, B):
            ids = seqs[b:b + B]
            with torch.no_grad():
                t_logits = teacher(input_ids=ids).logits[:, P - 1:P + C - 1]
            with torch.autocast(dev, dtype=torch.bfloat16):
                s_logits = student(input_ids=ids).logits[:, P - 1:P + C - 1]
            loss = generalized_jsd(s_logits, t_logits, 0.5, 1.0) / n_total
            loss.backward()
            total += float(loss.detach())
            del t_logits, s_logits, loss
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    train_step()
    sync()
    t0 = time.perf_counter()
    loss = train_step()
    sync()
    train_s = time.perf_counter() - t0
    step_s = rollout_s + train_s
    out = {"bench": "w1_torch", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "rollout_s": rollout_s, "rollout_tok_s": n_total / rollout_s,
           "score_topk_s": score_s, "score_tok_s": n_total / score_s,
           "train_with_teacher_s": train_s, "step_s": step_s, "loss": loss,
           "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
           "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    if args.opd_step_s > 0:
        out["opd_speedup"] = step_s / args.opd_step_s
    if not args.json:
        print(f"HF anchor: rollout {rollout_s:.2f} s ({n_total / rollout_s:.0f} tok/s), teacher top-K "
              f"{score_s:.3f} s ({n_total / score_s:.0f} tok/s), train with teacher inside "
              f"{train_s:.3f} s, step {step_s:.2f} s, peak {out['peak_allocated_gib']:.1f} GiB"
              + (f"; opd is {out['opd_speedup']:.1f}x faster" if args.opd_step_s > 0 else ""),
              flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
