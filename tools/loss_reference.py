#!/usr/bin/env python3
"""Dense float64 PyTorch reference of opd's distillation loss (DESIGN.md "Loss") and the
generator of tests/fixtures/loss/*.safetensors (loss, d hidden, d lm_head by autograd).

P = teacher, Q = student, both at temperature T (logits / T). Per completion token:
- beta=0: forward KL(P||Q); beta=1: reverse KL(Q||P) (TRL / ms-swift convention);
- 0<beta<1: JSD(beta) = beta*KL(P||M) + (1-beta)*KL(Q||M), M = beta*P + (1-beta)*Q.
The per-atom form follows TRL's GKDTrainer.generalized_jsd_loss (F.kl_div with log targets,
mixture by logsumexp of log-probs + log(beta) / log(1-beta)). Support modes:
- full: p and q over all of V;
- topk: p~ = softmax(a), q~ = softmax(z_S / T) over the teacher's K ids;
- topk+tail: K atoms + one rest-of-vocabulary atom; p_k = exp(a_k), p_R = 1 - sum p_k;
  q_k = exp(z_{i_k}/T - LSE(z/T)), q_R = 1 - sum q_k; log-tails log1p(-sum) clamped at
  log(tail_floor) (no gradient there);
- sampled: r = log p(y) - log q(y), loss = -sg(r) log q(y).
sft_alpha adds cross-entropy at temperature 1 on rows flagged as dataset completions.
Loss = sum_r w_r (D_r + sft_alpha [sft_r] CE_r) / n_total over valid rows (padding rows and
weight-0 rows contribute nothing).

Usage: python3 tools/loss_reference.py [--out tests/fixtures/loss]
"""
import argparse
import math
import os

import torch
import torch.nn.functional as F

TAIL_FLOOR = 1e-12
BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]
TEMPS = [0.7, 1.0, 1.3]
MODES = ["full", "topk", "topk+tail", "sampled"]
SFT_ALPHA = 0.3


def gjsd_from_logprobs(student_logp, teacher_logp, beta):
    """Per-row generalized JSD from log-probabilities (last dim = atoms), TRL's convention."""
    if beta == 0:
        jsd = F.kl_div(student_logp, teacher_logp, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_logp, student_logp, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=student_logp.dtype)
        mixture = torch.logsumexp(
            torch.stack([student_logp + torch.log(1 - b), teacher_logp + torch.log(b)]), dim=0)
        kl_teacher = F.kl_div(mixture, teacher_logp, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture, student_logp, reduction="none", log_target=True)
        jsd = b * kl_teacher + (1 - b) * kl_student
    return jsd.sum(-1)


def trl_generalized_jsd(student_logits, teacher_logits, beta, temperature):
    """TRL GKDTrainer.generalized_jsd_loss with reduction='none' summed over the vocabulary."""
    s = F.log_softmax(student_logits / temperature, dim=-1)
    t = F.log_softmax(teacher_logits / temperature, dim=-1)
    return gjsd_from_logprobs(s, t, beta)


def log_tail(total, floor=TAIL_FLOOR):
    """log(1 - total) via log1p, clamped at log(floor) with zero gradient where clamped."""
    ok = total < 1 - floor
    safe = torch.where(ok, total, torch.zeros_like(total))
    return torch.where(ok, torch.log1p(-safe), torch.full_like(total, math.log(floor)))


def row_divergence(mode, beta, T, z, ids, a, y, a_y, teacher_logits=None):
    """Per-row divergence D_r (or the sampled surrogate) for student logits z [N, V]."""
    logq = F.log_softmax(z / T, dim=-1)
    if mode == "full":
        return trl_generalized_jsd(z, teacher_logits, beta, T)
    if mode == "topk":
        return gjsd_from_logprobs(F.log_softmax(z.gather(1, ids) / T, dim=-1),
                                  F.log_softmax(a, dim=-1), beta)
    if mode == "topk+tail":
        logq_k = logq.gather(1, ids)
        tail_q = log_tail(logq_k.exp().sum(-1, keepdim=True))
        tail_p = log_tail(a.exp().sum(-1, keepdim=True))
        return gjsd_from_logprobs(torch.cat([logq_k, tail_q], -1), torch.cat([a, tail_p], -1), beta)
    if mode == "sampled":
        logq_y = logq.gather(1, y[:, None])[:, 0]
        r = (a_y - logq_y).detach()
        return -r * logq_y
    raise ValueError(mode)


def reference_loss(mode, beta, T, sft_alpha, inp, hidden, lm_head):
    z = hidden @ lm_head.T
    T_idx = TEMPS.index(T)
    teacher_logits = inp["teacher_hidden"] @ inp["teacher_lm_head"].T if mode == "full" else None
    ids = inp["teacher_ids"].long()
    a = inp[f"teacher_logprobs_T{T_idx}"]
    a_y = inp[f"actual_logprobs_T{T_idx}"]
    y = inp["targets"].long()
    used = (inp["weights"] != 0) & (inp["valid"] != 0)
    D = row_divergence(mode, beta, T, z, ids, a, y, a_y, teacher_logits)
    ce = -F.log_softmax(z, dim=-1).gather(1, y[:, None])[:, 0]
    row = D + sft_alpha * inp["sft_rows"].double() * ce
    w = inp["weights"]
    return torch.where(used, w * row, torch.zeros_like(row)).sum() / inp["n_total"]


def make_inputs(seed=1234):
    g = torch.Generator().manual_seed(seed)
    N, H, V, K, Ht = 10, 8, 157, 6, 6
    u = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64) * 2 - 1
    hidden = u(N, H)
    lm_head = 1.5 * u(V, H)
    teacher_hidden = u(N, Ht)
    teacher_lm_head = 2.0 * u(V, Ht)
    t_logits = teacher_hidden @ teacher_lm_head.T
    ids = torch.topk(t_logits, K, dim=-1).indices  # same set at every temperature
    # Shuffle each row's order: the loss must not depend on the order of the K entries.
    perm = torch.argsort(torch.rand(N, K, generator=g), dim=-1)
    ids = ids.gather(1, perm)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[0] = ids[0, 2]  # a target inside the teacher's top-K
    targets[4] = ids[4, 0]
    weights = torch.ones(N, dtype=torch.float64)
    weights[3] = 0.0   # masked row
    weights[5] = 0.5   # a weighted row
    valid = torch.ones(N, dtype=torch.int32)
    valid[7] = 0       # padding row (weight 1 but must not count)
    sft_rows = torch.zeros(N, dtype=torch.int32)
    sft_rows[[0, 1, 2, 4, 7]] = 1
    inp = {
        "hidden": hidden, "lm_head": lm_head,
        "teacher_hidden": teacher_hidden, "teacher_lm_head": teacher_lm_head,
        "teacher_ids": ids.to(torch.int32), "targets": targets.to(torch.int32),
        "weights": weights, "valid": valid, "sft_rows": sft_rows,
        "n_total": torch.tensor([13.0], dtype=torch.float64),
    }
    for i, T in enumerate(TEMPS):
        logp = F.log_softmax(t_logits / T, dim=-1)
        inp[f"teacher_logprobs_T{i}"] = logp.gather(1, ids)
        inp[f"actual_logprobs_T{i}"] = logp.gather(1, targets[:, None])[:, 0]
    return inp


def case_list():
    """(name, mode, beta, T, sft_alpha); mirrored by tests/loss/test_fused_loss.cpp."""
    cases = []
    for mode in MODES:
        for beta in (BETAS if mode != "sampled" else [0.5]):
            for T in TEMPS:
                cases.append((mode, beta, T, 0.0))
        cases.append((mode, 0.5, 0.7, SFT_ALPHA))
        cases.append((mode, 0.0, 1.0, SFT_ALPHA))
    return [(f"{m}/b{b:g}/T{T:g}/sft{s:g}", m, b, T, s) for (m, b, T, s) in cases]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                   "fixtures", "loss"))
    args = ap.parse_args()
    from safetensors.torch import save_file

    os.makedirs(args.out, exist_ok=True)
    inp = make_inputs()
    cases = {}
    for name, mode, beta, T, sft in case_list():
        h = inp["hidden"].clone().requires_grad_(True)
        w = inp["lm_head"].clone().requires_grad_(True)
        loss = reference_loss(mode, beta, T, sft, inp, h, w)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
        cases[f"{name}/loss"] = loss.detach().reshape(1)
        cases[f"{name}/grad_hidden"] = h.grad
        cases[f"{name}/grad_lm_head"] = w.grad
    meta = {"generator": "tools/loss_reference.py", "torch": torch.__version__,
            "tail_floor": repr(TAIL_FLOOR), "cases": str(len(case_list()))}
    save_file({k: v.contiguous() for k, v in inp.items()}, os.path.join(args.out, "inputs.safetensors"),
              metadata=meta)
    save_file({k: v.contiguous() for k, v in cases.items()}, os.path.join(args.out, "cases.safetensors"),
              metadata=meta)
    print(f"wrote {len(case_list())} cases to {args.out}")


if __name__ == "__main__":
    main()
