#!/usr/bin/env python3
"""Schedule model of the 5-product attention backward (OPD_ATTENTION_BWD=wgmma-dq,
src/kernels/cuda/attention_bwd_wgmma.cu): how much the deterministic dQ chain (key tile t of a
sequence adds into a (64-query block, head) only after tile t - 1) stretches the grid beyond
its ideal length (total steps / SMs), for the two step orders a CTA could use.

Model: CTAs (key tile x kv head, the AttentionPlan's k_tiles order) start in blockIdx order on
`--sms` slots, one CTA per SM. A step (one query head x one 64-query block) takes `c` until the
dQ product is done, then waits for its turn and spends `a` on the add; its counter is released
at the next step's dS barrier (`f` x c into it) or when the CTA ends. Units: one step. Orders:
desc = last query block first, heads inner (the kernel's); asc = heads outer, blocks ascending
(the 4-product kernel's); nolock = no chain (wave quantization only).
Usage: python3 tools/attn_bwd5_schedule_model.py [--sms 132] [--add 0.1]
"""
import argparse
import heapq


def simulate(batch, seqlen, hq, hkv, order, sms, c=1.0, a=0.1, f=0.6):
    group = hq // hkv
    n_tiles = (seqlen + 127) // 128
    n_blocks = (seqlen + 63) // 64
    # k_tiles: most queries after the tile first (stable), kv head fastest.
    tiles = sorted(((b, t) for b in range(batch) for t in range(n_tiles)),
                   key=lambda x: -(seqlen - 128 * x[1]))
    released = {}  # (sequence, kv head, (block, head), tile) -> release time
    free = [0.0] * sms
    makespan = busy = 0.0
    for b, t in tiles:
        for g in range(hkv):
            now = heapq.heappop(free)
            n_qb = n_blocks - 2 * t
            steps = []
            for it in range(group * n_qb):
                if order == "asc":
                    steps.append((2 * t + it % n_qb, it // n_qb))
                else:
                    steps.append((n_blocks - 1 - it // group, it % group))
            prev = None
            for pair in steps:
                if prev is not None:
                    released[(b, g, prev, t)] = now + f * c
                now += c
                if t > 0 and order != "nolock":
                    now = max(now, released[(b, g, pair, t - 1)])
                now += a
                prev = pair
            released[(b, g, prev, t)] = now
            busy += len(steps) * (c + a)
            makespan = max(makespan, now)
            heapq.heappush(free, now)
    return makespan, busy / sms


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132, help="SMs (default 132, H100/H200 SXM)")
    ap.add_argument("--add", type=float, default=0.1, help="add time per step in steps (default 0.1)")
    args = ap.parse_args()
    for shape in [(8, 768, 16, 8), (8, 768, 16, 16), (4, 4096, 16, 8), (4, 4096, 16, 16)]:
        row = []
        for order in ("nolock", "desc", "asc"):
            makespan, ideal = simulate(*shape, order, args.sms, a=args.add)
            row.append(f"{order} {makespan / ideal:.3f}")
        print(f"{shape[0]} x {shape[1]}, {shape[2]}/{shape[3]}: makespan / ideal: " + ", ".join(row))


if __name__ == "__main__":
    main()
