#!/usr/bin/env bash
# Runs on the lent GPU machine: the test binaries built on a CPU machine (carried in
# .carry/bundle.txz (scripts/gpu_bundle.sh): bin/ and lib/ with the OpenBLAS runtime, which that machine lacks), the
# GPU suite plain and under compute-sanitizer memcheck/racecheck, the CPU suites, then the
# benchmarks side by side with their PyTorch counterparts. Every step has a time limit; logs
# go to $OUT; a short summary is printed last.
# Usage: scripts/gpu_check.sh [tests|bench|dist|w1|score|rollout|decode|all|quick-tests|quick-bench|
#        racecheck-gen|pair|final|final4|final4b|poison|w2probe|fresh|final5|last5|next6a|next6b|s7b|s7c|s7d|s7e|s8b|s8c|s8d|s8e|s8f|s8g|s8h|s8i|s8j|s9a|s9b|s9c|s9d|s9e|s9f|s9g|s10a|s10b|s10c|s10d|s10e|s10f|s10g|s10h|s10i|s10j|s10k|s10l|s10m|s11a|s11b|s11c|s11d|s11e|s11f|s11g|s12a|s12b|s12c|s12d|s12e|s12f|s12g|s12h|s12i|s13a|s13b|s13c|s13d|s13e|s13f|s14a|s14b|s14c|s14d|s14e|s14f|s14g|s15a|s15b|s15c|s15d|s16a|s16b|s16c|s16d|s16e|s16f|s16g|s16h|s16i|s17a|s17b|s17c|gemm-prof|anchor|product|memory|pdl|
#        attn-bwd|attn-bwd5|context]
# (default all)
# attn-bwd (~5 min, issue 4): the wgmma backward kernels (never run before): the attention
# tests, the attention + model tests with OPD_ATTENTION_BWD=wgmma and =wgmma-all, memcheck of
# the new kernels' small cases, then `opd bench attention` (rows bwd-wgmma/<k>, bwd-wgmma-all)
# with its PyTorch twin in the same call.
# rollout: the CUDA rollout engine's tests (plain and a memcheck subset), `opd bench rollout`
# (graphs, --no-graphs, --no-fused), the paged-attention and sampling kernels alone, and the
# transformers twin (eager, then compiled): ~5-7 minutes, one 10-minute device call.
# decode (~2 min, issue 6): the CUDA rollout/decode-fused/GEMM tests, `opd bench rollout`
# (default, then --tuned-gemm, --max-step-tokens 512, --keep-state), one W1 decode
# step kernel by kernel under ncu (tools/ncu_decode_step.py), and `opd bench w1` with the
# rollout's debug timing lines (fixed costs per rollout inside the trainer).
# quick-*: what fits one 10-minute device call: the GPU suite, the model tests and the
# generation/scoring kernels under memcheck; the W1 training bench and the kernel benches with
# their PyTorch twins. dist: the 2-GPU NCCL suite and `opd bench dist` under `opd launch`, on a
# machine with 2+ GPUs (e.g. nvidia-h200-x2). w1: the GPU trainer tests and `opd bench w1`
# with its HF transformers anchor. score (~4 min): the CUDA scorer tests, the top-K row kernels
# under racecheck, `opd bench score` (in process + loopback server) and its PyTorch twin.
# pdl (~5 min, issue 6): programmatic dependent launch of the decode kernels and the cluster
# sampler: their tests plain, under memcheck, and racecheck on opd's kernels (GEMM-free tests);
# `opd bench rollout` without both, with PDL, with the cluster sampler, with both (3 runs each;
# then eager without / with PDL); the sampling kernels alone (cluster kernel vs the
# one-CTA-per-row kernel, same run).
# context (~5 min, issues 6/7): attention over cached context (AttentionPlan(cu_q, cu_k)) and
# PagedForward's context prefill: their tests plain and under memcheck, then the A/B benches
# (`opd bench rollout --max-step-tokens 128` and `opd bench score --no-server --shared-prompt
# always|never` with --context-prefill off/on; the option is off by default).
set -uo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
if [[ -f .carry/bundle.txz ]]; then  # scripts/gpu_bundle.sh; Python's tarfile where xz is missing
  tar -C .carry -xJf .carry/bundle.txz 2>/dev/null ||
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
        .carry/bundle.txz .carry
elif [[ -f .carry/bundle.tgz ]]; then tar -C .carry -xzf .carry/bundle.tgz; fi
export LD_LIBRARY_PATH="$PWD/.carry/lib:${LD_LIBRARY_PATH:-}"
export OPD_SOURCE_DIR="$PWD" OPD_BINARY="$PWD/.carry/bin/opd" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/opd_out}"
mkdir -p "$OUT"
B=.carry/bin
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
summary=()
# The top-K tests that run no GEMM (the row kernels on given logits, both merge paths).
RACE_TOPK='CudaTopKLmHead.RowKernelsOnGivenLogits*'
run() {  # name, limit_s, command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s%N)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  local tail=$(grep -E "^\[  (PASSED|FAILED)  \]|ERROR SUMMARY|RACECHECK SUMMARY|tests? (ran|from)|^opd: |^     MFU|^opd vs PyTorch|whole step|^HF anchor|scaling efficiency|^\{.bench|^torch:" "$OUT/$name.log" | tail -3 | tr '\n' ' ')
  summary+=("$(printf '%-16s rc=%-3d %7.1fs  %s' "$name" "$rc" "$((ms / 100))e-1" "${tail:0:160}")")
}
# A/B runs (modes s9b-s9e): version (base = the carried opd_base, new = opd), file under $OUT, a
# grep pattern, a time limit, the opd arguments; the matching lines, prefixed with the version,
# are appended to the file. Modes alternate base new base new in one call.
ab_run() {
  local v=$1 file=$2 pat=$3 limit=$4; shift 4
  local bin=$B/opd; [[ $v == base ]] && bin=$B/opd_base
  timeout "$limit" "$bin" "$@" 2>&1 | grep -- "$pat" | sed "s/^/$v /" >>"$OUT/$file"
}
# W2 with ZeRO-2 (modes s9f, s10j, nvidia-h200-x2): `opd bench w2 --nproc 2 --zero-stage 2`
# within $1 seconds (W1 on one GPU, then W1 per GPU on two, scaling efficiency).
w2_zero2() {
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  run bench_w2_z2 "$1" $B/opd bench w2 --nproc 2 --zero-stage 2
  grep -h "step\|scaling\|peak" "$OUT/bench_w2_z2.log" | grep -v "^\[" | head -20
}
# The decode linear's checks (session 10, modes s10a, s10c, s10g): its tests with the PDL,
# decode-fused and paged-attention suites, memcheck and racecheck of the kernel, and its kernel
# rows against cuBLASLt.
dl_checks() {
  run dl_tests 150 $B/test_cuda --gtest_filter='CudaDecodeLinear*:CudaRollout.DecodeLinear*:CudaRollout.Pdl*:CudaDecodeFused.*:CudaPagedAttention.*'
  run memcheck_dl 90 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaDecodeLinear.RowBits*:CudaDecodeLinear.Pdl*:CudaDecodeLinear.Refuses*'
  run racecheck_dl 60 compute-sanitizer --tool racecheck --error-exitcode 9 \
      --kernel-name kns=decode_linear $B/test_cuda --gtest_filter='CudaDecodeLinear.RowBits*'
  run bench_dl 60 $B/opd bench kernels --filter decode_linear.
}
# `opd bench rollout` with --no-decode-linear / --decode-linear alternating, two runs each
# (modes s10a, s10c; the decode linear on all four GEMMs as it then was).
dl_onoff_ab() {
  local v flag
  for v in off on off on; do
    flag=--no-decode-linear; [[ $v == on ]] && flag=--decode-linear
    timeout 60 $B/opd bench rollout --runs 2 $flag 2>&1 | grep "^opd:\|split:\|decode step" \
        | sed "s/^/$v /" >>"$OUT/rollout_ab.txt"
  done
}
# `opd bench rollout` with cuBLASLt (off), the decode linear on all four GEMMs (15), on each alone
# (1 q|k|v, 2 o, 4 gate|up, 8 down) and on o + down (10); two rounds (modes s10e, s10g).
dl_mask_ab() {
  local round mask args
  for round in 1 2; do
    for mask in off 15 1 2 4 8 10; do
      args="--no-decode-linear"; [[ $mask != off ]] && args="--decode-linear --decode-linear-gemms $mask"
      timeout 60 $B/opd bench rollout --runs 2 $args 2>&1 | grep "decode step" \
          | sed "s/^/$mask /" >>"$OUT/rollout_ab.txt"
    done
  done
}
if [[ "$what" == tests || "$what" == all ]]; then
  run cuda 300 $B/test_cuda
  # The whole model on CUDA (f32 and bf16 vs the CPU, recompute bit-identical, batch checks).
  run cuda_model 120 $B/test_cuda --gtest_filter='*CudaModel*:*CudaRows*:CudaConvert*'
  # The generation/scoring kernels' large-shape tests (W1 batch, V = 151936 against the CPU)
  # are left to the plain run; memcheck_gen covers their kernels on the small shapes.
  run memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='-*PeakScratch*:*DISABLED*:*HugeRequest*:CudaPagedAttention.*:CudaTopKLmHead.*:CudaSampler.*'
  run memcheck_gen 200 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaPagedAttention.MatchesCpuReferenceAcrossShapes:CudaPagedAttention.RawApi*:CudaPagedAttention.KvCache*:CudaPagedAttention.BadIndices*:CudaTopKLmHead.Bad*:CudaTopKLmHead.Deterministic*:CudaTopKLmHead.RowKernels*:CudaScorer.*:CudaSampler.Greedy*:CudaSampler.SanitizerSized*:CudaSampler.NonFinite*'
  # --kernel-name: only opd's kernels. The top-K row kernels are raced on given logits (no GEMM):
  # cuBLASLt's Hopper GEMMs fault under racecheck by themselves ("Internal Sanitizer Error:
  # failed to handle a hardware exception", also with PyTorch's F.linear alone), instrumented
  # or not, so no test that runs a GEMM can go under racecheck (see docs/teacher.md).
  for k in paged_attention topk_ sample_; do  # kns = kernel-name substring (sample_: both samplers)
    run "racecheck_$k" 120 compute-sanitizer --tool racecheck --error-exitcode 9 \
        --kernel-name "kns=$k" $B/test_cuda \
        --gtest_filter="CudaPagedAttention.RawApi*:$RACE_TOPK:CudaSampler.SanitizerSized*"
  done
  # Racecheck on opd's own kernels; GEMM tests are left out because racecheck reports hazards
  # inside cuBLAS's split-K kernels (nvjet_*_splitK), which are not ours.
  run racecheck 200 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='*Rmsnorm*:CudaAttention.DeterministicBitIdentical:CudaAttention.ForwardThenBackwardEndToEnd:CudaEmbedding*:CudaCrossEntropy*:CudaAdamW*:*Rope*:CudaElementwise*'
  run repro_unchecked 60 compute-sanitizer --tool memcheck $B/test_cuda --gtest_also_run_disabled_tests \
      --gtest_filter='CudaLossRepro.DISABLED_UncheckedGatherOutOfBounds'
  for t in core kernels model loss train cli dist; do
    [[ -x $B/test_$t ]] && run "$t" 90 $B/test_$t
  done
fi
if [[ "$what" == bench || "$what" == all ]]; then
  run bench_kernels 150 $B/opd bench kernels
  run torch_kernels 150 python3 tools/bench_kernels_torch.py --opd "$OUT/bench_kernels.log"
  run bench_attn 120 $B/opd bench attention --iters 30 --warmup 5
  run torch_attn 120 python3 tools/bench_attention_torch.py --iters 30 --warmup 5
  run bench_loss 120 $B/opd bench loss
  run torch_loss 120 python3 tools/bench_loss_torch.py
  # W1 student training step, opd and the PyTorch twin in one command (ratio printed), then
  # with per-layer recompute (memory vs time).
  run bench_train 300 $B/opd bench train --with-torch
  run bench_train_recompute 150 $B/opd bench train --recompute
fi
if [[ "$what" == racecheck-gen ]]; then
  for k in paged_attention topk_ sample_; do  # sample_: both sampling kernels
    run "racecheck_$k" 120 compute-sanitizer --tool racecheck --error-exitcode 9 \
        --kernel-name "kns=$k" $B/test_cuda \
        --gtest_filter="CudaPagedAttention.RawApi*:$RACE_TOPK:CudaSampler.SanitizerSized*"
  done
fi
if [[ "$what" == rollout ]]; then
  run cuda_rollout 200 $B/test_cuda --gtest_filter='*CudaRollout*:CudaDecodeFused*:CudaPagedAttention.*'
  # The decode-only paged kernel (issue 6): memcheck and racecheck on the small shapes (all head
  # dims, forced splits, bad indices through the raw API's error flag).
  run memcheck_paged 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaPagedAttention.MatchesCpuReferenceAcrossShapes:CudaPagedAttention.RawApi*:CudaPagedAttention.BadIndices*'
  run racecheck_paged 150 compute-sanitizer --tool racecheck --error-exitcode 9 \
      --kernel-name "kns=paged_attention" $B/test_cuda --gtest_filter='CudaPagedAttention.RawApi*'
  run memcheck_rollout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaRollout.GraphsGiveTheEagerPathsTokensBitForBit:CudaRollout.StopsOnEosStopTokenAndMaxTokens:CudaRollout.NonFinite*:*CudaRolloutFamilies.GreedyF32*/0'
  run bench_rollout 120 $B/opd bench rollout
  run bench_rollout_eager 90 $B/opd bench rollout --no-graphs --runs 1
  run bench_rollout_unfused 90 $B/opd bench rollout --no-fused --runs 1
  # The two kernels the decode step's time is predicted from (docs/rollout.md).
  run bench_paged_attention 60 $B/opd bench kernels --filter paged_attention
  run bench_paged_splits 60 $B/opd bench kernels --filter paged_splits
  run bench_sample 60 $B/opd bench kernels --filter sample.t1
  run torch_rollout_eager 120 python3 tools/bench_rollout_torch.py --modes eager
  run torch_rollout_compiled 200 python3 tools/bench_rollout_torch.py --modes compiled
  grep -h "^opd: \|split:\|decode step\|decode reads\|peak device" "$OUT/bench_rollout.log" "$OUT/bench_rollout_eager.log" "$OUT/bench_rollout_unfused.log" 2>/dev/null
  grep -h "^transformers generate" "$OUT"/torch_rollout_*.log 2>/dev/null
fi
if [[ "$what" == decode ]]; then
  run decode_tests 90 $B/test_cuda --gtest_filter='CudaRollout*:*CudaRolloutFamilies*:CudaDecodeFused*:*CudaLinear*:CudaModelStep*'
  run bench_rollout 45 $B/opd bench rollout
  run bench_w1 70 env OPD_LOG_LEVEL=debug $B/opd bench w1 --work-dir /tmp/opd_w1
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  # One decode step at context ~510 (launch ~75,000 of an eager 300-token rollout), each kernel
  # alone (ncu serializes), wall clock not locked (--clock-control none).
  run ncu_step 50 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
      --launch-skip 75000 --launch-count 700 $B/opd bench rollout --warmup 0 --runs 1 \
      --no-graphs --new-tokens 300
  # At most 8 files come back from a device call: keep the summary, drop the raw CSV.
  python3 tools/ncu_decode_step.py "$OUT/ncu_step.log" > "$OUT/ncu_summary.txt" 2>&1 && rm -f "$OUT/ncu_step.log"
  run bench_rollout_tuned 20 $B/opd bench rollout --warmup 1 --runs 1 --tuned-gemm
  run bench_rollout_512 20 $B/opd bench rollout --warmup 1 --runs 1 --max-step-tokens 512
  run bench_rollout_kept 20 $B/opd bench rollout --warmup 1 --runs 2 --keep-state
  grep -h "^opd: \\|split:\\|decode step\\|fixed costs\\|tuned GEMM" "$OUT"/bench_rollout*.log 2>/dev/null | head -50
  head -30 "$OUT/ncu_summary.txt"
  grep -h "rollout: \\|rollout  \\|whole step" "$OUT/bench_w1.log" | tail -8
fi
if [[ "$what" == quick-tests ]]; then
  run cuda 300 $B/test_cuda
  run memcheck_model 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='*CudaModel*:*CudaRows*:CudaConvert*'
  run memcheck_gen 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaPagedAttention.MatchesCpuReferenceAcrossShapes:CudaPagedAttention.RawApi*:CudaPagedAttention.KvCache*:CudaPagedAttention.BadIndices*:CudaTopKLmHead.Bad*:CudaTopKLmHead.Deterministic*:CudaTopKLmHead.RowKernels*:CudaScorer.*:CudaSampler.Greedy*:CudaSampler.SanitizerSized*:CudaSampler.NonFinite*'
  run memcheck_rollout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaRollout.GraphsGiveTheEagerPathsTokensBitForBit:CudaRollout.StopsOnEosStopTokenAndMaxTokens:CudaRollout.NonFinite*:*CudaRolloutFamilies.GreedyF32*/0'
fi
if [[ "$what" == quick-bench ]]; then
  run bench_train 300 $B/opd bench train --with-torch
  run bench_train_recompute 100 $B/opd bench train --recompute
  run bench_kernels 120 $B/opd bench kernels
  run torch_kernels 120 python3 tools/bench_kernels_torch.py --opd "$OUT/bench_kernels.log"
fi
if [[ "$what" == pair ]]; then
  # On a 2-GPU machine, one call: the trainer and rollout GPU tests, the trainer data parallel
  # over NCCL (2 ranks == 1 rank), and W2 against W1 (bench w2 runs W1 on one GPU first).
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  run cuda_train_roll 150 $B/test_cuda --gtest_filter='CudaTrainer*:*CudaRollout*:CudaScorer*'
  [[ -x $B/test_cli ]] && run train_dist_gpu 150 $B/test_cli --gtest_filter='TrainDist.TwoGpu*'
  run bench_w2 330 $B/opd bench w2 --nproc 2
fi
if [[ "$what" == final ]]; then
  # One call on a 2-GPU machine after kernel work: the GPU tests of the rollout, attention,
  # trainer and scorer; the NCCL trainer test; the rollout, W1 and scoring benches (GPU 0).
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  run cuda_sel 150 $B/test_cuda --gtest_filter='CudaPagedAttention.*:*CudaRollout*:CudaDecodeFused*:CudaTrainer*:CudaScorer*'
  [[ -x $B/test_cli ]] && run train_dist_gpu 150 $B/test_cli --gtest_filter='TrainDist.TwoGpu*'
  run bench_rollout 60 $B/opd bench rollout
  run bench_w1 150 $B/opd bench w1 --work-dir /tmp/opd_w1
  run bench_score 100 $B/opd bench score
fi
if [[ "$what" == anchor ]]; then
  # W1 and its HF anchor in one call (the ratio needs both on the same machine and day), then the
  # new decode kernel under memcheck and racecheck.
  run bench_w1 110 $B/opd bench w1 --work-dir /tmp/opd_w1
  run torch_w1 110 python3 tools/bench_w1_torch.py
  run memcheck_paged 60 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaPagedAttention.MatchesCpuReferenceAcrossShapes:CudaPagedAttention.RawApi*:CudaPagedAttention.BadIndices*'
  run racecheck_paged 40 compute-sanitizer --tool racecheck --error-exitcode 9 \
      --kernel-name kns=paged_attention $B/test_cuda --gtest_filter='CudaPagedAttention.RawApi*'
fi
if [[ "$what" == product ]]; then
  # One 10-minute call, most important first: the whole GPU suite (trainer, rollout, scorer and
  # every op), the W1 step through opd train and its HF anchor, then the rollout and scoring
  # benches. At most 8 logs come back from a device call: keep this list short.
  run cuda 240 $B/test_cuda
  run bench_w1 240 $B/opd bench w1 --work-dir /tmp/opd_w1
  run torch_w1 150 python3 tools/bench_w1_torch.py
  run bench_rollout 90 $B/opd bench rollout
  run bench_score 90 $B/opd bench score
fi
if [[ "$what" == final4 ]]; then
  # Session 4's closing call on nvidia-h200-x2 (~9 min): the NCCL suite (ZeRO-2 overlapped buckets
  # vs the CPU backend), the trainer over NCCL (2 ranks == 1 rank, ZeRO-2 overlap == reduce-all,
  # a sharded 2-GPU checkpoint resumed on one GPU), the whole GPU suite on GPU 0, then W2 with
  # ZeRO-2 (its first part is W1 on one GPU).
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  run dist_gpu 120 $B/opd launch --nproc-per-node 2 --master-port 0 -- $B/test_dist_gpu
  [[ -x $B/test_cli ]] && run train_dist_gpu 240 $B/test_cli --gtest_filter='TrainDist.TwoGpu*'
  run cuda 200 env CUDA_VISIBLE_DEVICES=0 $B/test_cuda
  run bench_w2 200 $B/opd bench w2 --nproc 2 --zero-stage 2
fi
if [[ "$what" == final4b ]]; then
  # After final4: the offload test with 256-byte slots, the trainer GPU tests, W2 with ZeRO-1 and
  # ZeRO-2 (each runs W1 on one GPU first), and the HF anchor of W1 on GPU 0 (~6 min).
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  run cuda_sel 120 env CUDA_VISIBLE_DEVICES=0 $B/test_cuda --gtest_filter='*CudaWeightOffload*:CudaTrainerTest.*:*CudaModelRecompute*:*CudaBackwardHooks*'
  [[ -x $B/test_cli ]] && run train_dist_gpu 120 $B/test_cli --gtest_filter='TrainDist.TwoGpu*'
  run bench_w2_z1 130 $B/opd bench w2 --nproc 2 --zero-stage 1
  run bench_w2_z2 130 $B/opd bench w2 --nproc 2 --zero-stage 2
  run torch_w1 130 env CUDA_VISIBLE_DEVICES=0 python3 tools/bench_w1_torch.py
fi
if [[ "$what" == w2probe ]]; then
  # Session 5 (issue 9): the offload test repeated; whether two concurrent rollouts (one per GPU,
  # no communication) slow each other, with all cores per process and with half; the 2-GPU
  # trainer test; W2 with ZeRO-1 and ZeRO-2 after `opd launch` split the threads (~6 min).
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  run offload_repeat 60 env CUDA_VISIBLE_DEVICES=0 $B/test_cuda --gtest_filter='*CudaWeightOffload*' --gtest_repeat=30
  run rollout_alone 60 env CUDA_VISIBLE_DEVICES=0 $B/opd bench rollout --runs 3
  for t in all half; do
    env_t=(); [[ $t == half ]] && env_t=(OPD_NUM_THREADS=$(( $(nproc) / 2 )) OPENBLAS_NUM_THREADS=$(( $(nproc) / 2 )))
    env "${env_t[@]}" CUDA_VISIBLE_DEVICES=1 $B/opd bench rollout --runs 3 >"$OUT/rollout_pair_${t}_gpu1.log" 2>&1 &
    run "rollout_pair_$t" 60 env "${env_t[@]}" CUDA_VISIBLE_DEVICES=0 $B/opd bench rollout --runs 3
    wait
  done
  grep -h "tokens/s\|tok/s" "$OUT"/rollout_*.log | head -20
  [[ -x $B/test_cli ]] && run train_dist_gpu 120 $B/test_cli --gtest_filter='TrainDist.TwoGpu*'
  run bench_w2_z1 130 $B/opd bench w2 --nproc 2 --zero-stage 1
  run bench_w2_z2 130 $B/opd bench w2 --nproc 2 --zero-stage 2
fi
if [[ "$what" == fresh ]]; then
  # Session 5 (issue 6): fresh prompts on the tensor-core attention. The rollout, paged-forward
  # and shared-prompt scorer tests, then `opd bench rollout` with it on and off, then W1 (~3 min).
  run cuda_fresh 200 $B/test_cuda --gtest_filter='*CudaRollout*:*CudaScorer*:*CudaDecodeFused*:*CudaPagedAttention*'
  run rollout_fresh 60 $B/opd bench rollout --runs 3
  run rollout_paged 60 $B/opd bench rollout --runs 3 --no-fresh-prefill
  grep -h "opd:\|split:" "$OUT"/rollout_fresh.log "$OUT"/rollout_paged.log
  run w1_fresh 180 $B/opd bench w1 --work-dir /tmp/opd_w1
  grep -h "rollout\|scoring\|train\|step" "$OUT"/w1_fresh.log | tail -8
fi
if [[ "$what" == poison ]]; then
  # The open offload test failure (docs/cuda.md): the whole suite once (the order that failed),
  # then the model/offload/trainer tests with poisoned device memory and under initcheck.
  run cuda 220 $B/test_cuda
  run cuda_poison 120 env OPD_POISON_DEVICE_MEMORY=1 $B/test_cuda \
      --gtest_filter='*CudaModel*:*CudaWeightOffload*:*CudaModelRecompute*:CudaTrainerTest.*'
  run initcheck 200 compute-sanitizer --tool initcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='*CudaWeightOffload*:*CudaModelRecompute*/0'
fi
if [[ "$what" == memory ]]; then
  # Session 4: elementwise recompute and the offloaded teacher (bit-identical tests), the scorer's
  # shared-prompt path and chunked client; W1 with default, elementwise, and elementwise +
  # offloaded-teacher settings; W1 scoring in process / one request / chunked; shared-prompt cost
  # (always vs never) at W1 with 4 generations and at a long-prompt shape (~6 min, 8 logs).
  run cuda_memory 240 $B/test_cuda --gtest_filter='CudaModelRecompute*:CudaWeightOffload*:CudaTrainerTest.*:CudaScorer*:CudaTopKLmHead.*'
  run w1_default 180 $B/opd bench w1 --work-dir /tmp/opd_w1
  grep -rh "GPU memory plan" /tmp/opd_w1/run 2>/dev/null | tail -1 | cut -c1-300
  run w1_elementwise 120 $B/opd bench w1 --work-dir /tmp/opd_w1 --recompute-granularity elementwise
  run w1_saving 120 $B/opd bench w1 --work-dir /tmp/opd_w1 --recompute-granularity elementwise --offload-teacher
  grep -rh "GPU memory plan" /tmp/opd_w1/run 2>/dev/null | tail -1 | cut -c1-300
  run bench_score 150 $B/opd bench score
  run score_shared 200 bash -c "for m in always never; do $B/opd bench score --no-server --num-generations 4 --shared-prompt \$m; \
    $B/opd bench score --no-server --prompt 2048 --completion 64 --sequences 32 --num-generations 8 --shared-prompt \$m; done"
fi
if [[ "$what" == w1 || "$what" == all ]]; then
  # The GPU training loop against the CPU backend, then the whole W1 step through `opd train`
  # (random Qwen3-0.6B student / 1.7B teacher written to $OUT-local disk) and the HF anchor.
  run cuda_trainer 200 $B/test_cuda --gtest_filter='CudaTrainer*'
  run bench_w1 400 $B/opd bench w1 --with-torch --work-dir /tmp/opd_w1
fi
if [[ "$what" == score || "$what" == all ]]; then
  # CudaScorer vs CpuScorer and the top-K kernels (plain), the row kernels under racecheck (the
  # GEMM-free tests: cuBLASLt faults under racecheck by itself), then W1 teacher scoring in
  # process and through a loopback `opd serve --device cuda`, and the HF transformers twin.
  run cuda_scorer 90 $B/test_cuda --gtest_filter='CudaScorer.*:CudaTopKLmHead.*'
  run racecheck_topk 90 compute-sanitizer --tool racecheck --error-exitcode 9 \
      --kernel-name kns=topk_ $B/test_cuda --gtest_filter="$RACE_TOPK"
  run bench_score 240 $B/opd bench score --json
  run torch_score 90 python3 tools/bench_score_torch.py
fi
if [[ "$what" == dist || "$what" == all ]]; then
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # the lent machines: NVLink multicast off
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  if (( gpus >= 2 )); then
    # One process per GPU; --master-port 0 picks a free port for the TCP store.
    run dist_gpu 300 $B/opd launch --nproc-per-node 2 --master-port 0 -- $B/test_dist_gpu
    run bench_dist 300 $B/opd launch --nproc-per-node 2 --master-port 0 -- $B/opd bench dist
    # The trainer data parallel over NCCL (2 ranks == 1 rank), then W2 vs W1 (needs test_cli in
    # the bundle: scripts/gpu_bundle.sh build/tests/test_cli ...).
    [[ -x $B/test_cli ]] && run train_dist_gpu 240 $B/test_cli --gtest_filter='TrainDist.TwoGpu*'
    run bench_w2 560 $B/opd bench w2 --nproc 2
  else
    summary+=("dist: skipped ($gpus GPU)")
  fi
fi
# Racecheck filters of the decode kernels: only tests that run the named kernel. The cluster
# sampler must not run while racecheck instruments other kernels only: the sanitizer then fails
# ("Internal Sanitizer Error: failed to handle a hardware exception", H200, 2026-11-30) where the
# instrumented run of the same test (kns=sample_cluster) has 0 hazards and plain/memcheck pass.
race_filter() {
  case $1 in
    sample_cluster) echo 'CudaSampler.SanitizerSized*' ;;
    paged_attention_decode) echo 'CudaRollout.PdlGivesThePlainLaunchesTokensBitForBit' ;;
    *) echo 'CudaDecodeFused.Pdl*' ;;
  esac
}
if [[ "$what" == last5 ]]; then
  # Session 5's last call: the fixed fresh-prefill step test (plain and memcheck), the rollout
  # with the new defaults (PDL and the cluster sampler on), W1.
  run fresh_fix 60 $B/test_cuda --gtest_filter='CudaRollout.Fresh*:CudaRollout.Pdl*:CudaSampler.*'
  run memcheck_fresh 60 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda --gtest_filter='CudaRollout.FreshPrompts*'
  run rollout_defaults 40 $B/opd bench rollout --runs 3
  grep -h "^opd:\|split:" "$OUT/rollout_defaults.log"
  run w1_defaults 120 $B/opd bench w1 --work-dir /tmp/opd_w1
  grep -h "rollout  \|scoring  \|train  \|whole step\|peak" "$OUT/w1_defaults.log" | tail -6
fi
if [[ "$what" == final5 ]]; then
  # Session 5, one nvidia-h200-x2 call (~8 min): the whole GPU suite on GPU 0 while GPU 1 runs the
  # rollout A/B (fresh prefill, PDL, cluster sampler, L2 prefetch), the attention forward variants
  # with their PyTorch twin, the sampler kernels and W1; then the sanitizers of the new decode
  # kernels on GPU 0; then the 2-GPU trainer test and W2 with ZeRO-2 (reduce once per step).
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  ( export CUDA_VISIBLE_DEVICES=1
    # (session 5 also ran "l2:--l2-prefetch"; the L2 prefetch was removed in session 7)
    for v in "base:--no-pdl --no-cluster-sampler" "nofresh:--no-fresh-prefill" \
             "pdl:--pdl" "sampler:--cluster-sampler" "all2:--pdl --cluster-sampler"; do
      timeout 60 $B/opd bench rollout --runs 3 ${v#*:} >"$OUT/rollout_${v%%:*}.log" 2>&1
    done
    timeout 120 $B/opd bench attention --fwd-only --iters 30 --warmup 5 >"$OUT/bench_attn.log" 2>&1
    timeout 120 python3 tools/bench_attention_torch.py --iters 30 --warmup 5 >"$OUT/torch_attn.log" 2>&1
    timeout 60 $B/opd bench kernels --filter sample >"$OUT/bench_sample.log" 2>&1
    timeout 150 $B/opd bench w1 --work-dir /tmp/opd_w1 >"$OUT/w1.log" 2>&1
  ) &
  run cuda 280 env CUDA_VISIBLE_DEVICES=0 $B/test_cuda
  wait
  for f in "$OUT"/rollout_*.log; do echo "$(basename "$f" .log): $(grep -h '^opd:' "$f") $(grep -h 'split:' "$f")"; done
  run memcheck_new 150 env CUDA_VISIBLE_DEVICES=0 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaRollout.PdlGivesThePlainLaunchesTokensBitForBit:CudaDecodeFused.Pdl*:CudaSampler.SanitizerSized*:CudaSampler.NonFinite*:CudaRollout.L2Prefetch*:CudaRollout.FreshPrompts*:*CudaAttentionWgmma.MatchesReferenceAndMmaKernel/mixed_g16_8'
  for k in qkv_norm_rope swiglu_packed sample_cluster; do
    run "racecheck_$k" 60 env CUDA_VISIBLE_DEVICES=0 compute-sanitizer --tool racecheck --error-exitcode 9 \
        --kernel-name "kns=$k" $B/test_cuda --gtest_filter="$(race_filter $k)"
  done
  [[ -x $B/test_cli ]] && run train_dist_gpu 120 $B/test_cli --gtest_filter='TrainDist.TwoGpu*'
  run bench_w2_z2 130 $B/opd bench w2 --nproc 2 --zero-stage 2
fi
if [[ "$what" == context ]]; then
  run context_tests 200 $B/test_cuda --gtest_filter='CudaAttentionContext.*:CudaRollout.Context*:CudaRollout.Fresh*:CudaAttention.DeterministicBitIdentical:*CudaScorerShared*'
  run memcheck_context 200 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaAttentionContext.Bf16TensorCoresMatchCpu:CudaAttentionContext.SquareContextPlanGivesTheSquareBits:CudaRollout.ContextChunksOnTensorCoresMatchThePagedKernel'
  run rollout_chunked_off 60 $B/opd bench rollout --runs 3 --max-step-tokens 128
  run rollout_chunked_on 60 $B/opd bench rollout --runs 3 --max-step-tokens 128 --context-prefill
  run rollout_default 60 $B/opd bench rollout --runs 3
  for sp in never always; do
    run "score_${sp}_off" 90 $B/opd bench score --no-server --shared-prompt $sp --num-generations 4
    run "score_${sp}_on" 90 $B/opd bench score --no-server --shared-prompt $sp --num-generations 4 --context-prefill
  done
  run score_long_always_on 90 $B/opd bench score --no-server --shared-prompt always --num-generations 8 --sequences 32 --prompt 2048 --completion 64 --context-prefill
  run score_long_always_off 90 $B/opd bench score --no-server --shared-prompt always --num-generations 8 --sequences 32 --prompt 2048 --completion 64
  run score_long_never 90 $B/opd bench score --no-server --shared-prompt never --num-generations 8 --sequences 32 --prompt 2048 --completion 64
  grep -h "^opd:\|split:\|in-process" "$OUT"/rollout_*.log "$OUT"/score_*.log
fi
if [[ "$what" == pdl ]]; then
  run pdl_tests 240 $B/test_cuda \
      --gtest_filter='*Pdl*:CudaSampler.*:CudaRollout.*:CudaDecodeFused.*:CudaPagedAttention.RawApi*:*Rmsnorm*'
  run memcheck_pdl 200 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaRollout.PdlGivesThePlainLaunchesTokensBitForBit:CudaDecodeFused.Pdl*:CudaSampler.SanitizerSized*:CudaSampler.NonFinite*'
  for k in qkv_norm_rope swiglu_packed sample_cluster; do
    run "racecheck_$k" 120 compute-sanitizer --tool racecheck --error-exitcode 9 \
        --kernel-name "kns=$k" $B/test_cuda --gtest_filter="$(race_filter $k)"
  done
  # Baseline (main before issue 6's PDL and sampler), each change alone, both: 3 runs each.
  run bench_rollout_base 120 $B/opd bench rollout --no-pdl --no-cluster-sampler
  run bench_rollout_pdl 120 $B/opd bench rollout --pdl --no-cluster-sampler
  run bench_rollout_sampler 120 $B/opd bench rollout --no-pdl --cluster-sampler
  run bench_rollout_both 120 $B/opd bench rollout --pdl --cluster-sampler
  run bench_rollout_eager_nopdl 90 $B/opd bench rollout --no-graphs --runs 1 --no-pdl
  run bench_rollout_eager_pdl 90 $B/opd bench rollout --no-graphs --runs 1 --pdl
  run bench_sample 60 $B/opd bench kernels --filter sample
fi
if [[ "$what" == next6a ]]; then
  # Session 7's first call (nvidia-h200-x2, ~9-10 min; edited since: the decode GEMMs, the
  # 5-product backward and the lm_head tile overlap it also ran were removed). GPU 0: the whole
  # suite. GPU 1 meanwhile: the rollout, scoring with shared prompts (+- context prefill). Then
  # W2 (ZeRO-2, then ZeRO-1) with the ranks' spread (time/ranks_*) and the rollout split. The
  # attention benches: `bench`; W1 with its HF anchor: s7b.
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  ( export CUDA_VISIBLE_DEVICES=1
    timeout 40 $B/opd bench rollout --runs 3 >"$OUT/rollout.log" 2>&1
    # (here session 7 also ran the rollout and the rows of opd's decode GEMM v3, since removed)
    for c in "" "--context-prefill"; do  # off (the default), then on
      timeout 60 $B/opd bench score --no-server --num-generations 4 --shared-prompt always $c >>"$OUT/score.log" 2>&1
    done
    timeout 60 $B/opd bench score --no-server --num-generations 4 --shared-prompt never >>"$OUT/score.log" 2>&1
    # (here session 7 also timed the scorer and the loss head with the lm_head overlap, since removed)
  ) &
  run cuda 330 env CUDA_VISIBLE_DEVICES=0 $B/test_cuda
  wait
  grep -h "^opd:\|decode step" "$OUT/rollout.log"
  grep -h "in process\|scored tok" "$OUT/score.log" | head -20
  # ZeRO-2 (the thinner margin of issue 9); ZeRO-1 only while the 10-minute call has room.
  run bench_w2_z2 130 $B/opd bench w2 --nproc 2 --zero-stage 2
  grep -h "rollout split" -A14 "$OUT/bench_w2_z2.log"
  if (( SECONDS < 440 )); then run bench_w2_z1 130 $B/opd bench w2 --nproc 2 --zero-stage 1; fi
fi
if [[ "$what" == next6b ]]; then
  # Planned second call of session 6 (nvidia-h200, ~7 min): the wgmma backward under the model
  # suite and memcheck (attn-bwd's steps), the PDL kernels' racecheck with per-kernel filters,
  # and the HF anchor of W1 beside `opd bench w1` (the 30x goal needs both in one call).
  run attn_bwd_model 150 env OPD_ATTENTION_BWD=wgmma-all $B/test_cuda --gtest_filter='*CudaModel*:CudaAttention.*'
  run memcheck_attn_bwd 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='*CudaAttentionWgmmaBwd.MatchesReferenceAndMmaKernel/len129_*:*CudaAttentionWgmmaBwd.MatchesReferenceAndMmaKernel/mixed_g16_8:CudaAttentionWgmmaBwd.DeterministicBitIdentical'
  for k in qkv_norm_rope swiglu_packed paged_attention_decode; do
    run "racecheck_$k" 90 compute-sanitizer --tool racecheck --error-exitcode 9 \
        --kernel-name "kns=$k" $B/test_cuda --gtest_filter="$(race_filter $k)"
  done
  run w1 150 $B/opd bench w1 --work-dir /tmp/opd_w1
  run torch_w1 150 python3 tools/bench_w1_torch.py
fi
gemm_prof() {  # limit_s [extra metrics, comma-separated]
  # Issue 6 (~3 min): why the 64-row decode GEMMs run at 0.6-1.6 TB/s. ncu (serialized, clocks
  # not locked) on the decode_linear.* cases (the cuBLASLt calls the rollout makes): DRAM and L2
  # traffic, occupancy, the main stall reasons.
  local m=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum
  m=$m,lts__t_bytes.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size
  m=$m,launch__registers_per_thread,launch__cluster_dim_x,sm__throughput.avg.pct_of_peak_sustained_elapsed
  m=$m,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
  m=$m,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
  m=$m,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio
  m=$m,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio
  if [[ -n "${2:-}" ]]; then m=$m,$2; fi  # extra metrics
  run ncu_gemm "$1" ncu --csv --page raw --clock-control none --metrics "$m" \
      $B/opd bench kernels --filter decode_linear. --iters 3 --warmup 1
  python3 tools/ncu_summary.py "$OUT/ncu_gemm.log" | tee "$OUT/ncu_gemm_summary.txt"
}
if [[ "$what" == gemm-prof ]]; then
  gemm_prof 240
fi
if [[ "$what" == attn-bwd ]]; then
  run attn_tests 200 $B/test_cuda --gtest_filter='*CudaAttention*'
  run attn_bwd_model 150 env OPD_ATTENTION_BWD=wgmma $B/test_cuda \
      --gtest_filter='*CudaModel*:CudaAttention.*'
  run attn_bwd_all_model 150 env OPD_ATTENTION_BWD=wgmma-all $B/test_cuda \
      --gtest_filter='*CudaModel*:CudaAttention.*'
  run memcheck_attn_bwd 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='*CudaAttentionWgmmaBwd.MatchesReferenceAndMmaKernel/len1_*:*CudaAttentionWgmmaBwd.MatchesReferenceAndMmaKernel/len129_*:*CudaAttentionWgmmaBwd.MatchesReferenceAndMmaKernel/mixed_g16_8:*CudaAttentionWgmmaBwd.MatchesReferenceAndMmaKernel/exact_tiles_*:CudaAttentionWgmmaBwd.DeterministicBitIdentical'
  run bench_attn 120 $B/opd bench attention --iters 30 --warmup 5
  run torch_attn 120 python3 tools/bench_attention_torch.py --iters 30 --warmup 5
  grep -h "summary" -A4 "$OUT/bench_attn.log" 2>/dev/null
fi
if [[ "$what" == s7b ]]; then
  # Session 7, one call (nvidia-h200, <= 570 s): the wgmma dK/dV + dQ backward as the new
  # default (auto = wgmma-all): the suite minus the slow forward-only sweeps (the whole suite
  # passed in next6a under the old default), memcheck and racecheck of its small cases, W1
  # with its HF anchor, then the training bench with its PyTorch twin while time is left.
  run cuda 200 $B/test_cuda --gtest_filter='-Shapes/CudaAttentionWgmma.*:CudaTopKLmHead.*:CudaPagedAttention.*'
  SMALL='*CudaAttentionWgmmaBwd.MatchesReferenceAndMmaKernel/len129_*:*CudaAttentionWgmmaBwd.MatchesReferenceAndMmaKernel/mixed_g16_8:CudaAttentionWgmmaBwd.DeterministicBitIdentical:CudaAttentionWgmmaBwd.Selection*'
  run memcheck_bwd 60 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda --gtest_filter="$SMALL"
  run racecheck_bwd 60 compute-sanitizer --tool racecheck --error-exitcode 9 \
      --kernel-name kns=attention_bwd $B/test_cuda --gtest_filter="$SMALL"
  run w1 120 $B/opd bench w1 --work-dir /tmp/opd_w1
  run torch_w1 150 python3 tools/bench_w1_torch.py
  if (( SECONDS < 400 )); then run bench_train 150 $B/opd bench train --with-torch; fi
  for k in qkv_norm_rope swiglu_packed; do
    if (( SECONDS < 520 )); then
      run "racecheck_$k" 40 compute-sanitizer --tool racecheck --error-exitcode 9 \
          --kernel-name "kns=$k" $B/test_cuda --gtest_filter="$(race_filter $k)"
    fi
  done
  grep -h "whole step\|rollout \|scoring\|train \|peak\|HF\|anchor\|MFU\|ratio" "$OUT/w1.log" "$OUT/torch_w1.log" "$OUT/bench_train.log" 2>/dev/null | grep -v '^{' | head -40
fi
if [[ "$what" == s7c ]]; then
  # Session 7 (nvidia-h200, <= 570 s): context prefill where it should pay. The scorer with
  # long shared prompts (32 x (2048 + 64), 8 per prompt): never, always on the paged kernel,
  # always with --context-prefill; W1's scoring shape with 4 per prompt again (cost fit); the
  # rollout with prompts longer than a step (--max-step-tokens 128 on W1; 16 prompts of 4096)
  # with and without it; then the context tests.
  LONG=(--sequences 32 --prompt 2048 --completion 64 --num-generations 8)
  for m in "never" "always" "always --context-prefill"; do
    timeout 75 $B/opd bench score --no-server "${LONG[@]}" --shared-prompt $m >>"$OUT/score_long.log" 2>&1
  done
  for m in "never" "always --context-prefill"; do
    timeout 75 $B/opd bench score --no-server --num-generations 4 --shared-prompt $m >>"$OUT/score_w1.log" 2>&1
  done
  for c in "" "--context-prefill"; do
    timeout 60 $B/opd bench rollout --runs 3 --max-step-tokens 128 $c >>"$OUT/rollout_ctx.log" 2>&1
    timeout 60 $B/opd bench rollout --runs 2 --prompts 16 --prompt-len 4096 --new-tokens 128 --kv-cache-gb 12 $c >>"$OUT/rollout_long.log" 2>&1
  done
  run ctx_tests 60 $B/test_cuda --gtest_filter='CudaRollout.Context*:CudaScorer*:CudaAttentionContext.*'
  grep -h "opd bench score\|in-process:" "$OUT/score_long.log" "$OUT/score_w1.log"
  grep -h "^Qwen3\|^opd:\|split:" "$OUT/rollout_ctx.log" "$OUT/rollout_long.log"
fi
if [[ "$what" == s7d ]]; then
  # Session 7 (nvidia-h200, <= 400 s): context prefill on by default (engine and scorer) and
  # Auto's new cost factor: the engine/scorer/trainer suites under the defaults, memcheck of the
  # context tests, then Auto end to end at the two measured shapes (expected: dense at W1's
  # 4 per prompt ~0.34 s; shared at 2048 + 8 x 64 ~0.09 s).
  run cuda_ctx 200 $B/test_cuda --gtest_filter='*CudaRollout*:*CudaScorer*:*CudaTrainer*:*CudaDecode*:CudaAttentionContext.*'
  run memcheck_ctx 60 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaRollout.Context*:CudaScorerShared.*'
  timeout 70 $B/opd bench score --no-server --num-generations 4 >"$OUT/score_auto.log" 2>&1
  timeout 70 $B/opd bench score --no-server --sequences 32 --prompt 2048 --completion 64 \
      --num-generations 8 >>"$OUT/score_auto.log" 2>&1
  grep -h "opd bench score\|in-process:" "$OUT/score_auto.log"
fi
if [[ "$what" == s7e ]]; then
  # Session 7's last call (nvidia-h200, <= 300 s): the suite with every new default (wgmma
  # backward, context prefill) minus the forward wgmma sweep (98 s, unchanged since call 1),
  # then memcheck of the model and attention tests under the default backward.
  run cuda 200 $B/test_cuda --gtest_filter='-Shapes/CudaAttentionWgmma.*'
  run memcheck_model 90 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='*CudaModel*:CudaAttention.*:CudaAttentionBackward.*'
fi
if [[ "$what" == s8b ]]; then
  # Session 8 (nvidia-h200, <= 400 s): the rollout suite after the split decode's revert and the
  # trainer suite (per-phase memory peaks), then W1's memory per phase against the plan for
  # each memory setting (1 measured step each).
  run rollout_trainer 200 $B/test_cuda --gtest_filter='CudaRollout.*:CudaTrainer*'
  for v in "none:" "offload:--offload-teacher" "elementwise:--recompute-granularity elementwise" \
           "elem_offload:--recompute-granularity elementwise --offload-teacher" \
           "layer_offload:--recompute-granularity layer --offload-teacher"; do
    name=${v%%:*} flags=${v#*:}
    timeout 90 $B/opd bench w1 --work-dir /tmp/opd_w1 --steps 1 $flags >"$OUT/mem_$name.log" 2>&1
    summary+=("$(printf '%-13s %s | %s' "$name" "$(grep -h 'GPU memory plan' "$OUT/mem_$name.log" | sed 's/.*peak ~//' | cut -c1-90)" \
                "$(grep -h 'peak device mem\|whole step' "$OUT/mem_$name.log" | tr -s ' ' | tr '\n' ' ')")")
  done
fi
if [[ "$what" == s8e ]]; then
  # Session 8 (nvidia-h200, <= 200 s): where the fused loss's time goes (2.9x its lm_head GEMMs
  # at N = 4096): one call of each (lm_head GEMMs alone, then the fused loss, f32 tile) under
  # ncu (duration and DRAM bytes per kernel, clocks not locked), totals per kernel family.
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  run ncu_loss 180 "$NCU" --clock-control none --csv --page raw \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
      $B/opd bench loss --rows 4096 --tile-dtype f32 --warmup 0 --iters 1
  python3 tools/ncu_summary.py --totals "$OUT/ncu_loss.log" > "$OUT/ncu_loss_totals.txt" 2>&1
  cat "$OUT/ncu_loss_totals.txt" | head -30
fi
if [[ "$what" == s8j ]]; then
  # Session 8 (nvidia-h200, <= 150 s): A/B of the RMSNorm launch shape in one call: the same
  # commit built twice (opd_block: a 256-thread block per row of 1024; opd_warp: a warp per
  # row), alternating: the norm kernels alone, then one training bench each (f32 loss tile).
  for i in 1 2 3; do
    for v in block warp; do
      timeout 20 $B/opd_$v bench kernels --filter rmsnorm 2>&1 | grep -v '^{' | grep "^rmsnorm" | sed "s/^/$v /" >>"$OUT/norm_ab.txt"
    done
  done
  for v in block warp block warp; do
    timeout 40 $B/opd_$v bench train --loss-tile f32 2>&1 | grep "^opd:" | sed "s/^/$v /" >>"$OUT/norm_ab.txt"
  done
  cat "$OUT/norm_ab.txt"
fi
# trace_run NAME LIMIT COMMAND...: COMMAND under tools/trace/opd_trace.cpp (CUPTI activity
# records: every kernel, copy and sync with its GPU start and end; bundle it with
# scripts/gpu_bundle.sh build/trace/libopd_trace.so /usr/local/cuda/lib64/libcupti.so.13),
# summarized by tools/trace_summary.py into $OUT/NAME.summary.txt; the trace comes back as
# $OUT/NAME.csv.xz. (Session 13's first call named this function `tr`, which shadowed the tr
# command that run() uses for its summary line.)
trace_run() {
  local name=$1 limit=$2; shift 2
  CUDA_INJECTION64_PATH=$PWD/$B/libopd_trace.so OPD_TRACE_OUT=/tmp/$name.csv OPD_TRACE_API_MIN_NS=5000 \
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name rc=$? $(grep -h 'opd_trace' "$OUT/$name.log")"
  python3 tools/trace_summary.py --top 10 --split-ms 3 --min-ms 50 /tmp/$name.csv >"$OUT/$name.summary.txt" 2>&1
  xz -T0 -1 -c /tmp/$name.csv >"$OUT/$name.csv.xz" 2>/dev/null || true
}
# w1_lines LOG PREFIX: an `opd bench w1` log's phase lines and the wall time from step 1's end to
# step 3's (two steps with everything between them: the metrics, the progress line).
w1_lines() {
  grep -E "rollout  |scoring  |train  |whole step|peak device" "$1" | tr -s ' ' | sed "s/^/$2: /"
  grep -E "step [13]/3" "$1" | sed -E 's/^\[opd ([0-9:.]+).*/\1/' | tr '\n' ' ' | sed "s/^/$2: step 1 and 3 end at /"
  echo
}
# prefill_profile NCU_LIMIT ROWS (modes s12g, s12i): W1's prefill alone (`opd bench rollout
# --new-tokens 1`, two calls of 3 runs, their split lines), then its kernels under ncu within
# NCU_LIMIT seconds, the ROWS largest kernel families (tools/ncu_summary.py --totals).
prefill_profile() {
  for i in 1 2; do
    timeout 60 $B/opd bench rollout --new-tokens 1 --runs 3 2>&1 | grep -E "split:" >>"$OUT/prefill.txt"
  done
  cat "$OUT/prefill.txt"
  local NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  timeout "$1" "$NCU" --clock-control none --page raw --metrics gpu__time_duration.sum --csv \
      $B/opd bench rollout --warmup 0 --runs 1 --new-tokens 1 >"$OUT/ncu.csv" 2>/dev/null
  python3 tools/ncu_summary.py --totals "$OUT/ncu.csv" | cut -c1-50,150- | head -"$2" && rm -f "$OUT/ncu.csv"
}
# alternate KIND FILE NAME_A BIN_A NAME_B BIN_B: two rounds of A then B into $OUT/FILE (then
# printed). KIND score: W1's scoring with a 2-layer teacher (`opd bench score --no-server
# --layers 2 --iters 5`, its in-process line); KIND train: `opd bench train --steps 3`; KIND w1:
# `opd bench w1` (w1_lines), none started after $W1_DEADLINE seconds of the call.
alternate() {
  local kind=$1 file=$2 i j
  local names=("$3" "$5") bins=("$4" "$6")
  for i in 1 2; do
    for j in 0 1; do
      local name=${names[$j]} bin=${bins[$j]}
      if [[ $kind == score ]]; then
        timeout 60 "$bin" bench score --no-server --layers 2 --iters 5 2>&1 | grep "in-process" \
            | sed "s/^/$name $i: /" >>"$OUT/$file"
      elif [[ $kind == train ]]; then
        timeout 60 "$bin" bench train --steps 3 2>&1 | grep "^opd:" | sed "s/^/$name $i: /" >>"$OUT/$file"
      else
        (( SECONDS > ${W1_DEADLINE:-100000} )) && break 2
        timeout 100 "$bin" bench w1 --work-dir /tmp/opd_w1 >"/tmp/w1_$name$i.log" 2>&1
        w1_lines "/tmp/w1_$name$i.log" "$name $i" >>"$OUT/$file"
      fi
    done
  done
  cat "$OUT/$file"
}
# topk_tiles BIN NAME: every topk_tile_kernel launch of one W1 scoring call with a 2-layer
# teacher under ncu (duration only), summed per vocabulary tile (16 row chunks of 2,048 rows
# each) into $OUT/NAME.txt.
topk_tiles() {
  local NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  timeout 150 "$NCU" --clock-control none --page raw --metrics gpu__time_duration.sum --csv \
      -k regex:topk_tile_kernel "$1" bench score --no-server --layers 2 --warmup 0 --iters 1 \
      >/tmp/$2.csv 2>/dev/null
  python3 - /tmp/$2.csv >"$OUT/$2.txt" <<'PY'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
h = rows[0]; t = h.index("gpu__time_duration.sum")
d = [float(r[t].replace(",", "")) for r in rows[2:] if "topk_tile_kernel" in r[h.index("Kernel Name")]]
unit = rows[1][t]
tiles = [sum(d[i:i + 16]) for i in range(0, len(d), 16)]
print(f"{len(d)} launches, total {sum(d):.0f} {unit}; per tile of 16 chunks:", " ".join(f"{x:.0f}" for x in tiles))
PY
  sed "s/^/$2: /" "$OUT/$2.txt"
}
if [[ "$what" == s14a ]]; then
  # Session 14 (nvidia-h200, <= 420 s): topk_tile_kernel gathers a tile's candidates in its LSE
  # pass once the row's kept set is full, and a row's first tile gets a floor from the threads'
  # maxima (no radix rounds over the row); cuda_memcpy no longer drains the stream after
  # host-to-device and device-to-device copies; the scorer reads its results straight into
  # its vectors. The top-K and scorer suites, the row kernels under racecheck and memcheck,
  # the top-K kernel per tile under ncu for the session's starting build (.carry/bin/opd_old)
  # and this one, then W1's scoring with a 2-layer teacher alternating.
  run topk 150 $B/test_cuda --gtest_filter='CudaTopKLmHead.*:CudaScorer*'
  grep -h "FAILED\|Failure" "$OUT/topk.log" | head -10
  run racecheck_topk 100 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test_cuda --gtest_filter="$RACE_TOPK"
  run memcheck_topk 100 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaTopKLmHead.RowKernels*:CudaTopKLmHead.Bad*:CudaTopKLmHead.GraphCapture*'
  topk_tiles $B/opd_old tiles_old
  topk_tiles $B/opd tiles_new
  alternate score topk_ab.txt old $B/opd_old new $B/opd
fi
if [[ "$what" == s14b ]]; then
  # Session 14 (nvidia-h200, <= 590 s): the GPU suite minus the forward wgmma sweep and the
  # suites s14a ran (cuda_memcpy's change touches every test), then W1 for the session's
  # starting build and this one, alternating.
  run cuda 330 $B/test_cuda --gtest_filter='-Shapes/CudaAttentionWgmma.*:CudaTopKLmHead.*:CudaScorer*'
  grep -h "FAILED\|Failure" "$OUT/cuda.log" | head -20
  W1_DEADLINE=420 alternate w1 w1_ab.txt old $B/opd_old new $B/opd
fi
if [[ "$what" == s14c ]]; then
  # Session 14 (nvidia-h200, <= 420 s): the attention backward's D = rowsum(dO * O) with 16-byte
  # loads: the attention, model and trainer suites, memcheck of the attention backward's small
  # cases, `opd bench train` for the session's starting build and this one alternating, then the
  # top-K kernel per vocabulary tile (ncu) for both (s14a's summary failed to parse).
  run attn 200 $B/test_cuda --gtest_filter='CudaAttention*:*CudaModel*:CudaTrainer*:-Shapes/CudaAttentionWgmma.*'
  grep -h "FAILED\|Failure" "$OUT/attn.log" | head -10
  run memcheck_attn 100 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaAttentionBackward.*:CudaAttention.ForwardThenBackwardEndToEnd'
  alternate train train_ab.txt old $B/opd_old new $B/opd
  topk_tiles $B/opd_old tiles_old
  topk_tiles $B/opd tiles_new
fi
if [[ "$what" == s14d ]]; then
  # Session 14 (nvidia-h200, <= 560 s): the top-K tile kernel with 8 row loads in flight per
  # thread instead of 4 (.carry/bin/opd_u8) against this build, alternating (W1's scoring with a
  # 2-layer teacher); W1 for the session's starting build and this one, alternating; then W1
  # beside its HF transformers anchor.
  alternate score unroll_ab.txt u4 $B/opd u8 $B/opd_u8
  alternate w1 w1_ab.txt old $B/opd_old new $B/opd
  run w1_anchor $(( 560 - SECONDS )) $B/opd bench w1 --with-torch --work-dir /tmp/opd_w1
  grep -h "rollout  \|scoring  \|train  \|whole step\|peak device\|anchor\|HF\|x the" "$OUT/w1_anchor.log" | head -20
fi
if [[ "$what" == s14e ]]; then
  # Session 14 (nvidia-h200, <= 560 s): the lm_head logit tile's shape for the top-K (a tile of
  # 512 x 16,384 f32 logits is 33.5 MB, under the 50 MB L2, where W1's 2,048 x 16,384 is
  # 134 MB): W1's scoring with a 2-layer teacher for row chunks 512-4,096 x vocabulary tiles
  # 8,192-32,768, the default (2,048 x 16,384) again last; then the whole GPU suite minus the
  # forward wgmma sweep on the final code.
  for rc in 512 1024 2048 4096; do
    for vt in 8192 16384 32768; do
      timeout 40 $B/opd bench score --no-server --layers 2 --iters 5 --row-chunk $rc --vocab-tile $vt 2>&1 \
          | grep "in-process:" | sed "s/^/rc $rc vt $vt: /" >>"$OUT/tiles.txt"
    done
  done
  timeout 40 $B/opd bench score --no-server --layers 2 --iters 5 2>&1 | grep "in-process:" | sed "s/^/default again: /" >>"$OUT/tiles.txt"
  cut -c1-60 "$OUT/tiles.txt"
  run cuda $(( 550 - SECONDS )) $B/test_cuda --gtest_filter='-Shapes/CudaAttentionWgmma.*'
  grep -h "FAILED\|Failure" "$OUT/cuda.log" | head -20
fi
if [[ "$what" == s14f ]]; then
  # Session 14's last call (nvidia-h200, <= 200 s): the top-K suites with the tied-rows case,
  # then W1 with the rollout's debug line (its fixed costs per step: sync wait, K/V allocation,
  # weight refresh, graph captures, teardown).
  run topk 120 $B/test_cuda --gtest_filter='CudaTopKLmHead.*:CudaScorer*'
  grep -h "FAILED\|Failure" "$OUT/topk.log" | head -10
  OPD_LOG_LEVEL=debug timeout 100 $B/opd bench w1 --work-dir /tmp/opd_w1 >/tmp/w1_debug.log 2>&1
  w1_lines /tmp/w1_debug.log debug
  grep -h "D\] rollout: " /tmp/w1_debug.log | cut -c1-400 | tail -4
fi
if [[ "$what" == s14g ]]; then
  # Session 14 (nvidia-h200, <= 330 s): the RMSNorm backward with the next row's loads issued
  # before this row's reduction (kept as bf16 until used): the norm, model and trainer suites;
  # the norm kernels alone for the starting build (opd_old), this one (opd) and this one held
  # to 64 registers (opd_lb4), alternating; `opd bench train` old / new alternating.
  run norm 150 $B/test_cuda --gtest_filter='*Rmsnorm*:*CudaModel*:CudaTrainer*'
  grep -h "FAILED\|Failure" "$OUT/norm.log" | head -10
  for i in 1 2; do
    for v in old new lb4; do
      bin=$B/opd; [[ $v == old ]] && bin=$B/opd_old; [[ $v == lb4 ]] && bin=$B/opd_lb4
      timeout 30 $bin bench kernels --filter rmsnorm 2>&1 | grep "^rmsnorm" | cut -c1-80 | sed "s/^/$v $i: /" >>"$OUT/norm_ab.txt"
    done
  done
  cat "$OUT/norm_ab.txt"
  alternate train train_ab.txt old $B/opd_old new $B/opd
fi
if [[ "$what" == s13a ]]; then
  # Session 13 (nvidia-h200, <= 400 s): where W1's phases leave the GPU idle: each bench plain,
  # then traced (trace_run above).
  run score_plain 60 $B/opd bench score --no-server --iters 3
  trace_run score_trace 90 $B/opd bench score --no-server --iters 3
  run train_plain 60 $B/opd bench train --steps 2
  trace_run train_trace 90 $B/opd bench train --steps 2
  run rollout_plain 60 $B/opd bench rollout --runs 1
  trace_run rollout_trace 120 $B/opd bench rollout --runs 1
  run w1_plain 120 $B/opd bench w1 --work-dir /tmp/opd_w1
  trace_run w1_trace 150 $B/opd bench w1 --work-dir /tmp/opd_w1b
  grep -h "^opd:\|split:\|scored\|MFU\|whole step\|rollout  \|scoring  \|train  \|opd_trace" "$OUT"/*_plain.log "$OUT"/*_trace.log | cut -c1-200
fi
if [[ "$what" == s13b ]]; then
  # Session 13 (nvidia-h200, <= 420 s): the teacher payload's check on a helper thread beside
  # the first micro-batch's forward, the widening and the entropy metric in parallel: the GPU
  # trainer and scorer suites; `opd bench w1` of the session's starting build
  # (.carry/bin/opd_old, 7c877a9's code) and of this one, alternating; then this one traced.
  run suites 200 $B/test_cuda --gtest_filter='CudaTrainer*:CudaScorer*:CudaTopKLmHead.*'
  grep -h "FAILED\|Failure" "$OUT/suites.log" | head -10
  for i in 1 2; do
    for v in old new; do
      if [[ $v == old ]]; then bin=$B/opd_old; else bin=$B/opd; fi
      timeout 100 $bin bench w1 --work-dir /tmp/opd_w1 >/tmp/w1_$v$i.log 2>&1
      w1_lines /tmp/w1_$v$i.log "$v $i" >>"$OUT/w1_ab.txt"
    done
  done
  cat "$OUT/w1_ab.txt"
  trace_run w1_trace 150 $B/opd bench w1 --work-dir /tmp/opd_w1b
  grep -h "opd_trace\|whole step" "$OUT/w1_trace.log"
  grep -E "== segment" "$OUT/w1_trace.summary.txt" | tail -4
fi
if [[ "$what" == s13c ]]; then
  # Session 13's last call (nvidia-h200, <= 580 s): the final code: the GPU suite minus the
  # forward wgmma sweep, then the sweep (not run since session 11), then memcheck of the rollout
  # engine with the decode linear on q|k|v, o and down (the default since session 12).
  run cuda 330 $B/test_cuda --gtest_filter='-Shapes/CudaAttentionWgmma.*'
  grep -h "FAILED\|Failure" "$OUT/cuda.log" | head -20
  if (( SECONDS < 400 )); then run sweep $(( 470 - SECONDS )) $B/test_cuda --gtest_filter='Shapes/CudaAttentionWgmma.*'; fi
  grep -h "FAILED\|Failure" "$OUT/sweep.log" 2>/dev/null | head -10
  if (( SECONDS < 470 )); then
    run memcheck_engine $(( 570 - SECONDS )) compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
        --gtest_filter='CudaRollout.DecodeLinearGreedyIsTheFullForwardArgmax'
  fi
fi
if [[ "$what" == s13d ]]; then
  # Session 13 (nvidia-h200, <= 400 s): after the CPU path went back to checking the payload in
  # the step (a thread per step slowed the 2-core demo): the GPU trainer suite with the check's
  # failure on the GPU (AnInProcessTeachersBadScoresStopTheRunBeforeAnyUpdate), then W1 beside
  # its HF transformers anchor (`opd bench w1 --with-torch`).
  run trainer 120 $B/test_cuda --gtest_filter='CudaTrainer*'
  grep -h "FAILED\|Failure" "$OUT/trainer.log" | head -10
  run w1_anchor 300 $B/opd bench w1 --with-torch --work-dir /tmp/opd_w1
  grep -h "rollout  \|scoring  \|train  \|whole step\|peak device\|anchor\|HF\|x the" "$OUT/w1_anchor.log" | head -20
fi
if [[ "$what" == s13e ]]; then
  # Session 13 (nvidia-h200, <= 300 s): topk_tile_kernel's merge by ranks when the tile's
  # candidates and the kept keys number <= 256 (one pass, no barrier; the radix select
  # otherwise): the top-K and scorer suites, the row kernels under racecheck, then W1's scoring
  # with a 2-layer teacher (the top-K over the full 151,936-id lm_head dominates) for the
  # previous build (.carry/bin/opd_prev) and this one, alternating.
  run topk 120 $B/test_cuda --gtest_filter='CudaTopKLmHead.*:CudaScorer*'
  grep -h "FAILED\|Failure" "$OUT/topk.log" | head -10
  run racecheck_topk 90 compute-sanitizer --tool racecheck --error-exitcode 9 $B/test_cuda --gtest_filter="$RACE_TOPK"
  for i in 1 2; do
    for v in prev new; do
      if [[ $v == prev ]]; then bin=$B/opd_prev; else bin=$B/opd; fi
      timeout 60 $bin bench score --no-server --layers 2 --iters 5 2>&1 | grep "in-process" | sed "s/^/$v $i: /" >>"$OUT/topk_ab.txt"
    done
  done
  cat "$OUT/topk_ab.txt"
fi
if [[ "$what" == s13f ]]; then
  # Session 13's last call (nvidia-h200, <= 200 s): W1 twice with the final code (the top-K
  # merge by ranks included): phases, and the wall time per step between the progress lines.
  for i in 1 2; do
    timeout 90 $B/opd bench w1 --work-dir /tmp/opd_w1 >/tmp/w1_$i.log 2>&1
    w1_lines /tmp/w1_$i.log "$i"
  done
fi
if [[ "$what" == s12i ]]; then
  # (The several-heads kernel it measures is in e7acab1 only; reverted in ae14a68.)
  # Session 12 (nvidia-h200, <= 240 s): qkv_norm_rope_store with several heads per warp at
  # prefill sizes (s12f: 35 us per call at 2048 tokens): the decode, rollout and attention suites;
  # W1's prefill alone (s12g: 0.044 s) and its kernels under ncu; `opd bench rollout`.
  run final 150 $B/test_cuda --gtest_filter='CudaDecodeFused.*:CudaRollout.*:CudaPagedAttention.*'
  grep -h "FAILED\|Failure" "$OUT/final.log" | head -10
  prefill_profile 90 12
  run rollout 40 $B/opd bench rollout --runs 3
  grep -h "^opd:\|split:" "$OUT/rollout.log"
fi
if [[ "$what" == s12h ]]; then
  # Session 12 (nvidia-h200, <= 200 s): after the review (the decode attention's two K/V load
  # sites share one lambda): the attention, decode, rows and rollout suites; `opd bench rollout`.
  run final 150 $B/test_cuda --gtest_filter='CudaPagedAttention.*:CudaDecodeFused.*:CudaRows*:CudaRollout.*:CudaDecodeLinear*'
  grep -h "FAILED\|Failure" "$OUT/final.log" | head -10
  run rollout 40 $B/opd bench rollout --runs 3
  grep -h "^opd:\|split:" "$OUT/rollout.log"
fi
if [[ "$what" == s12g ]]; then
  # Session 12's last call (nvidia-h200, <= 480 s): gather_rows and the packed SwiGLU in 16-byte
  # chunks (s12f: 10 and 32 us per prefill call): the GPU suite minus the forward wgmma sweep,
  # W1's prefill alone (s12f: 0.049 s) and its kernels under ncu, `opd bench rollout`, W1.
  run cuda 300 $B/test_cuda --gtest_filter='-Shapes/CudaAttentionWgmma.*'
  grep -h "FAILED\|Failure" "$OUT/cuda.log" | head -20
  prefill_profile 120 16
  run rollout 60 $B/opd bench rollout --runs 3
  grep -h "^opd:\|split:" "$OUT/rollout.log"
  run w1 120 $B/opd bench w1 --work-dir /tmp/opd_w1
  grep -h "whole step\|rollout  \|scoring\|train  \|peak" "$OUT/w1.log" | head -8
fi
if [[ "$what" == s12f ]]; then
  # Session 12 (nvidia-h200, <= 300 s): W1's prefill alone (`opd bench rollout --new-tokens 1`:
  # 64 prompts of 256 in steps of --max-step-tokens 2048 (default) / 4096 / 16384), then the
  # same prefill under ncu, kernel families' total time (tools/ncu_summary.py --totals).
  for mst in 2048 4096 16384 2048; do
    timeout 60 $B/opd bench rollout --new-tokens 1 --runs 3 --max-step-tokens $mst 2>&1 | \
      grep -E "^  run [0-9]|split:" | grep -v warm | sed "s/^/mst $mst: /" | cut -c1-200 >>"$OUT/prefill.txt"
  done
  cat "$OUT/prefill.txt"
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  run ncu_prefill 150 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
      $B/opd bench rollout --warmup 0 --runs 1 --new-tokens 1
  python3 tools/ncu_summary.py --totals "$OUT/ncu_prefill.log" > "$OUT/ncu_prefill_totals.txt" 2>&1 && \
    rm -f "$OUT/ncu_prefill.log"
  head -40 "$OUT/ncu_prefill_totals.txt"
fi
if [[ "$what" == s12d ]]; then
  # Session 12 (nvidia-h200, <= 420 s): the final code (the decode attention's early K/V loads,
  # q|k|v on the decode linear by default; the q|k|v prologue removed): the GPU suite minus the
  # forward wgmma sweep, and the early-launch test under memcheck.
  run cuda 300 $B/test_cuda --gtest_filter='-Shapes/CudaAttentionWgmma.*'
  run memcheck_early 90 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaDecodeFused.DecodeAttentionLaunchedEarly*'
  grep -h "FAILED\|Failure\|ERROR SUMMARY" "$OUT/cuda.log" "$OUT/memcheck_early.log" | head -20
fi
if [[ "$what" == s12e ]]; then
  # Session 12 (nvidia-h200, <= 420 s): `opd bench rollout` of the session's starting build
  # (.carry/bin/opd_old, a3a67b3) and of this one with --decode-linear-gemms 10 / 11 (default) /
  # 15, alternating; the stage attribution (--skip-stages, one stage at a time) at the defaults;
  # then `opd bench w1`.
  for i in 1 2; do
    for v in "old 10" "new 10" "new 11" "new 15"; do
      set -- $v
      if [[ $1 == old ]]; then bin=$B/opd_old; else bin=$B/opd; fi
      timeout 60 $bin bench rollout --runs 3 --decode-linear-gemms $2 2>&1 | grep -E "^  run [0-9]" | grep -v warm | \
        sed -E "s/^  run ([0-9]).*: ([0-9.]+) s, .*decode forward ([0-9.]+) s, sampling ([0-9.]+).*/$1 gemms $2: \2 fwd=\3 samp=\4/" >>"$OUT/gemms_ab.txt"
    done
  done
  sort "$OUT/gemms_ab.txt"
  for st in none qkv rope attention combine o postnorm gateup swiglu down nextnorm qkv,o,gateup,down rope,combine,postnorm,swiglu,nextnorm; do
    if [[ $st == none ]]; then arg=; else arg="--skip-stages $st"; fi
    r=$(timeout 60 $B/opd bench rollout --runs 2 $arg 2>&1 | grep -E "^  run [0-9]" | grep -v warm | \
        sed -E "s/.*: ([0-9.]+) s, .*decode forward ([0-9.]+) s.*/\2/" | tr '\n' ' ')
    echo "skip $st: decode forward $r" | tee -a "$OUT/stages.txt"
  done
  run w1 120 $B/opd bench w1 --work-dir /tmp/opd_w1
  grep -h "whole step\|rollout  \|scoring\|train  \|peak" "$OUT/w1.log" | head -8
fi
if [[ "$what" == s12c ]]; then
  # (Runs only with a build of c3f89a1: --attention-qkv and its test were removed in ad5f560.)
  # Session 12 (nvidia-h200, <= 400 s): the decode attention issues each warp's first K/V step
  # before its PDL wait (every position but this step's token): the decode, attention and
  # rollout suites, memcheck of the prologue test; then `opd bench rollout` of this build with
  # the prologue on/off x q|k|v on cuBLASLt / the decode linear, and of the session's starting
  # build (.carry/bin/opd_old, a3a67b3), alternating.
  run tests 200 $B/test_cuda --gtest_filter='CudaDecodeFused.*:CudaPagedAttention.*:CudaRollout.*:CudaDecodeLinear*'
  run memcheck_qkv 90 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaDecodeFused.AttentionQkvPrologueGivesTheSeparateKernelsBits:CudaPagedAttention.DecodeKernelW1ShapeUnequalLengths'
  grep -h "FAILED\|Failure\|ERROR SUMMARY" "$OUT/tests.log" "$OUT/memcheck_qkv.log" | head -20
  for i in 1 2; do
    for v in "old 10" "attention-qkv 10" "no-attention-qkv 10" "attention-qkv 11" "no-attention-qkv 11" "old 11"; do
      set -- $v
      if [[ $1 == old ]]; then bin=$B/opd_old; flag=; else bin=$B/opd; flag=--$1; fi
      timeout 60 $bin bench rollout --runs 3 $flag --decode-linear-gemms $2 2>&1 | grep -E "^  run [0-9]" | grep -v warm | \
        sed -E "s/^  run ([0-9]).*: ([0-9.]+) s, .*decode forward ([0-9.]+) s, sampling ([0-9.]+).*/$1 gemms $2: \2 fwd=\3 samp=\4/" >>"$OUT/qkv_ab.txt"
    done
  done
  sort "$OUT/qkv_ab.txt"
fi
if [[ "$what" == s12b ]]; then
  # (Runs only with a build of c3f89a1: --attention-qkv and its test were removed in ad5f560.)
  # Session 12 (nvidia-h200, <= 300 s): the q|k|v prologue's test after its fix (plain and
  # memcheck); `opd bench rollout` with the prologue on/off x q|k|v on cuBLASLt / on opd's
  # decode linear (--decode-linear-gemms 10 / 11: the attention's own prologue can overlap a
  # PDL-launched GEMM, not cuBLASLt's), alternating.
  run tests 60 $B/test_cuda --gtest_filter='CudaDecodeFused.*'
  run memcheck_qkv 90 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaDecodeFused.AttentionQkvPrologueGivesTheSeparateKernelsBits'
  grep -h "FAILED\|Failure\|ERROR SUMMARY" "$OUT/tests.log" "$OUT/memcheck_qkv.log" | head -20
  for i in 1 2; do
    for v in "attention-qkv 10" "no-attention-qkv 10" "attention-qkv 11" "no-attention-qkv 11"; do
      set -- $v
      timeout 60 $B/opd bench rollout --runs 3 --$1 --decode-linear-gemms $2 2>&1 | grep -E "^  run [0-9]" | grep -v warm | \
        sed -E "s/^  run ([0-9]).*: ([0-9.]+) s, .*decode forward ([0-9.]+) s, sampling ([0-9.]+).*/$1 gemms $2: \2 fwd=\3 samp=\4/" >>"$OUT/qkv_ab.txt"
    done
  done
  cat "$OUT/qkv_ab.txt"
fi
if [[ "$what" == s12a ]]; then
  # (Runs only with a build of ef98ce8: --attention-qkv and its test were removed in ad5f560.)
  # Session 12 (nvidia-h200, <= 420 s): the decode attention's q|k|v prologue (q/k norm + RoPE
  # + K/V store inside the attention, one kernel less per layer): its bit-identity test plain
  # and under memcheck, the decode/attention/rollout suites; then `opd bench rollout` with and
  # without it, alternating, and the stage attribution (--skip-stages) once.
  run tests 200 $B/test_cuda --gtest_filter='CudaDecodeFused.*:CudaPagedAttention.*:CudaRollout.*:CudaDecodeLinear*'
  run memcheck_qkv 90 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaDecodeFused.AttentionQkvPrologueGivesTheSeparateKernelsBits'
  grep -h "FAILED\|Failure\|ERROR SUMMARY" "$OUT/tests.log" "$OUT/memcheck_qkv.log" | head -20
  for i in 1 2; do
    for v in attention-qkv no-attention-qkv; do
      timeout 60 $B/opd bench rollout --runs 3 --$v 2>&1 | grep -E "^  run [0-9]" | grep -v warm | \
        sed -E "s/^  run ([0-9]).*: ([0-9.]+) s, .*decode forward ([0-9.]+) s, sampling ([0-9.]+).*/$v \2 fwd=\3 samp=\4/" >>"$OUT/qkv_ab.txt"
    done
  done
  cat "$OUT/qkv_ab.txt"
fi
if [[ "$what" == s11g ]]; then
  # Session 11's review (nvidia-h200, <= 200 s): try_decode_linear (one plan lookup per call in
  # PagedForward) and the probe's shared piece reader / checksum: the decode linear, rollout,
  # probe and partition suites, `opd bench rollout --runs 2`, the probe rows.
  run final 150 $B/test_cuda --gtest_filter='CudaDecodeLinear*:CudaRollout.*:CudaPersistentProbe.*:CudaSmPartition.*'
  run rollout 40 $B/opd bench rollout --runs 2
  run probe 40 $B/opd bench kernels --filter persistent_probe.
  grep -h "FAILED\|Failure" "$OUT/final.log" | head -10
  grep -h "^opd:\|decode step" "$OUT/rollout.log" | head -3
  grep -h "^persistent_probe.stream \|^persistent_probe.barrier_prefetch \|^persistent_probe.producer_warp_barrier " "$OUT/probe.log"
fi
if [[ "$what" == s11f ]]; then
  # Session 11 (nvidia-h200, <= 200 s): after the cluster capacity query moved to
  # cuda::max_active_clusters (decode linear plans and the probe use it): the decode linear,
  # rollout, probe and partition suites; the probe's stream row prints the capacities.
  run final 150 $B/test_cuda --gtest_filter='CudaDecodeLinear*:CudaRollout.*:CudaPersistentProbe.*:CudaSmPartition.*'
  run probe 40 $B/opd bench kernels --filter persistent_probe.stream
  grep -h "FAILED\|Failure" "$OUT/final.log" | head -10
  grep -h "^persistent" "$OUT/probe.log"
fi
if [[ "$what" == s11e ]]; then
  # Session 11's last call (nvidia-h200, <= 300 s): after the mbarrier helpers moved to
  # kernels/cuda/mbarrier.cuh (the wgmma attention kernels include them) and the probe's
  # refactor: the attention suites (wgmma forward sweep included), the probe and SM partition
  # tests, the probe rows once more.
  run attention 200 $B/test_cuda --gtest_filter='*Attention*:CudaPersistentProbe.*:CudaSmPartition.*'
  run probe 60 $B/opd bench kernels --filter persistent
  grep -h "FAILED\|Failure" "$OUT/attention.log" | head -10
  grep -h "^persistent" "$OUT/probe.log"
fi
if [[ "$what" == s11d ]]; then
  # Session 11 (nvidia-h200, <= 300 s): the GEMM-with-SM-target test after its tolerance fix;
  # then W1 scoring's batch and top-K tile sizes (`opd bench score --no-server`, in process):
  # --max-batch-tokens 16384 (the default) / 24576 / 49152, --row-chunk 2048 (default) / 4096.
  run sm_tests 60 $B/test_cuda --gtest_filter='CudaSmPartition.*'
  for cfg in "16384 2048" "49152 2048" "16384 4096" "24576 2048" "49152 4096" "16384 2048"; do
    set -- $cfg
    timeout 60 $B/opd bench score --no-server --max-batch-tokens $1 --row-chunk $2 --iters 5 2>&1 | \
      grep "in-process:" | head -1 | sed "s/^/mbt $1 rc $2: /" >>"$OUT/score_sweep.txt"
  done
  cat "$OUT/score_sweep.txt"
fi
if [[ "$what" == s11c ]]; then
  # Session 11 (nvidia-h200, <= 480 s): the GPU suite minus the forward wgmma sweep (new:
  # CudaSmPartition.*, CudaPersistentProbe.*, CudaRollout.AnotherStreamOrAnSmGroupGivesTheSameTokens),
  # the probe's test under memcheck, then `opd bench rollout` and W1 (their paths unchanged).
  run cuda 260 $B/test_cuda --gtest_filter='-Shapes/CudaAttentionWgmma.*'
  run memcheck_probe 60 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaPersistentProbe.*'
  run rollout 60 $B/opd bench rollout --runs 2
  run w1 90 $B/opd bench w1 --work-dir /tmp/opd_w1
  grep -h "FAILED\|Failure" "$OUT/cuda.log" | head -20
  grep -h "^opd:\|decode step" "$OUT/rollout.log" | head -4
  grep -h "whole step\|rollout  \|scoring\|train  \|peak" "$OUT/w1.log" | head -8
fi
if [[ "$what" == s11b ]]; then
  # Session 11 (nvidia-h200, <= 300 s): the persistent decode forward's skeleton
  # (kernels/cuda/persistent_probe.h: W1's per-layer weight bytes streamed phase by phase by one
  # resident CTA per SM, with and without grid barriers and prefetch) beside the per-layer
  # GEMMs (decode_linear.* rows, cuBLASLt as the reference) in the same call; then the rollout
  # and GEMM suites (EngineOptions::cuda_stream and the per-stream SM target are new).
  run probe 120 $B/opd bench kernels --filter persistent
  run probe_dl 120 $B/opd bench kernels --filter decode_linear
  grep -h "^persistent\|^decode_linear" "$OUT/probe.log" "$OUT/probe_dl.log"
  run suites 150 $B/test_cuda --gtest_filter='CudaRollout.*:*CudaGemm*:CudaScorer*'
  grep -h "FAILED\|Failure" "$OUT/suites.log" | head -20
fi
if [[ "$what" == s11a ]]; then
  # Session 11 (nvidia-h200, <= 300 s): can W1's teacher scoring run beside its rollout?
  # `opd bench overlap` (the SMs split by CUDA green contexts: rollout alone / with the teacher
  # scoring chunks on the other group; no split with stream priorities), then chunks of 16.
  run overlap 200 $B/opd bench overlap
  grep -v '^{' "$OUT/overlap.log" | cut -c1-300 | head -40
  if (( SECONDS < 200 )); then
    run overlap16 90 $B/opd bench overlap --teacher-sms 40 --chunk-sequences 16
    grep -v '^{' "$OUT/overlap16.log" | cut -c1-300 | tail -6
  fi
fi
if [[ "$what" == s10m ]]; then
  # Session 10 (nvidia-h200, <= 200 s): the engine with the decode linear on by default under
  # memcheck (fixture models, bf16 and f32, eager and from graphs, PDL on and off).
  run memcheck_rollout 190 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaRollout.PdlGivesThePlainLaunchesTokensBitForBit'
fi
if [[ "$what" == s10l ]]; then
  # Session 10 (nvidia-h200, <= 200 s): W1 with --loss-support full (the teacher's forward and
  # dense logits inside the training phase, no scoring phase): every phase's peak, against the
  # memory plan the trainer logs (train/doctor.h).
  run w1_full 190 $B/opd bench w1 --work-dir /tmp/opd_w1 --loss-support full
  grep -h "memory plan\|whole step\|rollout  \|scoring\|train  \|peak" "$OUT/w1_full.log" | cut -c1-400 | head -10
fi
if [[ "$what" == s10k ]]; then
  # Session 10's final code (nvidia-h200, <= 200 s): the rollout and decode linear suites after
  # the test refactor (w1_shape_model) and the gpu_check helpers.
  run final_suites 180 $B/test_cuda --gtest_filter='CudaRollout.*:CudaDecodeLinear*:CudaDecodeFused.*'
  grep -h "FAILED\|Failure" "$OUT/final_suites.log" | head -20
fi
if [[ "$what" == s10i ]]; then
  # Session 10 (nvidia-h200, <= 330 s): W1 with its HF transformers anchor in the same call
  # (the ratio goal), final binaries (decode linear on o and down).
  run w1_torch 320 $B/opd bench w1 --work-dir /tmp/opd_w1 --with-torch
  grep -h "whole step\|rollout  \|scoring\|train  \|peak\|anchor\|total\|x faster\|HF" "$OUT/w1_torch.log" | head -20
fi
if [[ "$what" == s10j ]]; then
  # Session 10 (nvidia-h200-x2, <= 300 s): W2 with the final binaries: `opd bench w2 --nproc 2
  # --zero-stage 2` (W1 on one GPU, then W1 per GPU on two, scaling efficiency).
  w2_zero2 290
fi
if [[ "$what" == s10h ]]; then
  # Session 10's last call (nvidia-h200, <= 580 s): the decode linear on o and down by default:
  # the GPU suite minus the forward wgmma sweep (unchanged); `opd bench rollout` of the
  # session's start (opd_base, b44a1a8) and the final build alternating (defaults); then W1.
  run cuda 250 $B/test_cuda --gtest_filter='-Shapes/CudaAttentionWgmma.*'
  for round in 1 2; do
    for v in base new; do
      ab_run $v rollout_ab.txt "^opd:\|decode step\|split:" 60 bench rollout --runs 2
    done
  done
  run w1 90 $B/opd bench w1 --work-dir /tmp/opd_w1
  grep -h "FAILED\|Failure" "$OUT/cuda.log" | head -20
  cat "$OUT/rollout_ab.txt"
  grep -h "whole step\|rollout  \|scoring\|train  \|peak" "$OUT/w1.log" | head -8
fi
if [[ "$what" == s10g ]]; then
  # Session 10 (nvidia-h200, <= 400 s): the decode linear with x loaded straight into registers
  # (s10f: the cp.async staging's address moves serialized its issue): tests, memcheck and
  # racecheck, its kernel rows against cuBLASLt, ncu durations, then `opd bench rollout` off /
  # all four GEMMs / each GEMM alone / o + down (two rounds, alternating).
  dl_checks
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for f in qkv_m64 o_m64 gate_up_m64 down_m64; do
    timeout 60 "$NCU" --clock-control none --metrics gpu__time_duration.sum,smsp__inst_executed.sum \
        -k 'regex:decode_linear_kernel' --launch-count 1 \
        $B/opd bench kernels --filter "decode_linear.$f" --iters 20 --warmup 1 2>&1 \
        | grep -E "gpu__time|inst_exec" | sed "s/^/$f /" >>"$OUT/ncu.txt"
  done
  dl_mask_ab
  grep -h "FAILED\|Failure" "$OUT/dl_tests.log" | head -20
  grep "^decode_linear\." "$OUT/bench_dl.log" | cut -c1-120
  cut -c1-130 "$OUT/ncu.txt"
  cat "$OUT/rollout_ab.txt"
fi
if [[ "$what" == s10f ]]; then
  # Session 10 (nvidia-h200, <= 240 s): where the decode linear's warps wait (ncu source page,
  # SASS by warp-stall samples: tools/ncu_source_top.py) on the q|k|v and gate|up shapes.
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for f in qkv_m64 gate_up_m64; do
    timeout 90 "$NCU" --clock-control none --set full --import-source yes -o "$OUT/rep_$f" -f \
        -k 'regex:decode_linear_kernel' --launch-count 1 \
        $B/opd bench kernels --filter "decode_linear.$f" --iters 20 --warmup 1 >/dev/null 2>&1
    "$NCU" -i "$OUT/rep_$f.ncu-rep" --page source --csv --print-source sass 2>&1 \
        | python3 tools/ncu_source_top.py /dev/stdin 28 > "$OUT/top_$f.txt"
    "$NCU" -i "$OUT/rep_$f.ncu-rep" --page details 2>&1 | grep -E "Duration|Warp Cycles Per Issued|Issued Warp|Registers|Theoretical Occ|Achieved Occ" >> "$OUT/top_$f.txt"
    rm -f "$OUT/rep_$f.ncu-rep"
    echo "== $f"; cut -c1-160 "$OUT/top_$f.txt"
  done
fi
if [[ "$what" == s10e ]]; then
  # Session 10 (nvidia-h200, <= 300 s): the decode linear's second version again (the third,
  # row groups sharing x, was slower in s10c-2 and is reverted) per GEMM: its tests and
  # racecheck, then `opd bench rollout` with cuBLASLt (off) and with the decode linear on each
  # subset of the per-layer GEMMs (--decode-linear-gemms: 1 q|k|v, 2 o, 4 gate|up, 8 down), two
  # rounds alternating.
  run dl_tests 150 $B/test_cuda --gtest_filter='CudaDecodeLinear*:CudaRollout.DecodeLinear*:CudaRollout.Pdl*:CudaDecodeFused.*'
  run racecheck_dl 60 compute-sanitizer --tool racecheck --error-exitcode 9 \
      --kernel-name kns=decode_linear $B/test_cuda --gtest_filter='CudaDecodeLinear.RowBits*'
  dl_mask_ab
  grep -h "FAILED\|Failure" "$OUT/dl_tests.log" | head -20
  cat "$OUT/rollout_ab.txt"
fi
if [[ "$what" == s10d ]]; then
  # Session 10 (nvidia-h200, <= 300 s): every PDL-launched decode kernel asks for the GEMMs'
  # L1/shared split (carveout 100 %, pdl.cuh prefer_max_shared), so a PDL launch can start beside
  # its predecessor: the PDL and decode linear tests; `opd bench rollout` of the previous build
  # (opd_base) and this one, each with cuBLASLt (off) and the decode linear (on), alternating;
  # then this build's decode linear without PDL.
  run pdl_tests 120 $B/test_cuda --gtest_filter='CudaDecodeLinear*:CudaRollout.DecodeLinear*:CudaRollout.Pdl*:CudaDecodeFused.*'
  for round in 1 2; do
    for v in base new; do
      for dl in off on; do
        bin=$B/opd; [[ $v == base ]] && bin=$B/opd_base
        flag=--no-decode-linear; [[ $dl == on ]] && flag=--decode-linear
        timeout 60 $bin bench rollout --runs 2 $flag 2>&1 | grep "^opd:\|decode step" \
            | sed "s/^/$v $dl /" >>"$OUT/rollout_ab.txt"
      done
    done
  done
  timeout 60 $B/opd bench rollout --runs 2 --decode-linear --no-pdl 2>&1 | grep "^opd:\|decode step" \
      | sed "s/^/new on-nopdl /" >>"$OUT/rollout_ab.txt"
  grep -h "FAILED\|Failure" "$OUT/pdl_tests.log" | head -20
  cat "$OUT/rollout_ab.txt"
fi
if [[ "$what" == s10c ]]; then
  # Session 10 (nvidia-h200, <= 420 s): decode linear v4 after s10b's profile (lane-private x
  # fragments without divisions, one cp.async group per k step, independent products
  # interleaved, plans of 16/32/48-row blocks within the device's resident clusters): s10a's
  # tests and A/B, then ncu durations and stall reasons of the four W1 shapes (ours, then
  # cuBLASLt's kernels for the same shapes).
  dl_checks
  dl_onoff_ab
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  m="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,smsp__inst_executed.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"
  for f in qkv_m64 o_m64 gate_up_m64 down_m64; do
    timeout 60 "$NCU" --clock-control none --metrics "$m" -k 'regex:decode_linear_kernel' --launch-count 1 \
        $B/opd bench kernels --filter "decode_linear.$f" --iters 20 --warmup 1 2>&1 \
        | grep -E "decode_linear_kernel<|gpu__time|dram__|lts__|inst_exec|stalled" | sed "s/^/$f /" >>"$OUT/ncu.txt"
  done
  grep "decode_linear\.\|decode_linear plan" "$OUT/bench_dl.log" "$OUT/dl_tests.log" | cut -c1-150
  grep -h "FAILED\|Failure" "$OUT/dl_tests.log" | head -20
  cat "$OUT/rollout_ab.txt"
  cut -c1-150 "$OUT/ncu.txt"
fi
if [[ "$what" == s10b ]]; then
  # Session 10 (nvidia-h200, <= 300 s): why the decode linear v4 is slower than cuBLASLt: ncu
  # (serialized, clocks not locked) on its W1 shapes and on cuBLASLt's kernels for the same
  # shapes: speed of light, memory workload, occupancy (max active clusters), launch, scheduler
  # and the stall reasons per issued instruction.
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  st=""
  for r in long_scoreboard short_scoreboard barrier membar mio_throttle lg_throttle math_pipe_throttle \
           wait not_selected selected dispatch_stall no_instruction drain imc_miss branch_resolving \
           sleeping tex_throttle misc; do
    st="$st,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
  done
  for f in qkv_m64 o_m64 gate_up_m64 down_m64; do
    run "ncu_$f" 70 "$NCU" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
        --metrics "${st:1}" -k 'regex:decode_linear_kernel|nvjet' --launch-count 3 \
        $B/opd bench kernels --filter "decode_linear.$f" --iters 20 --warmup 1
  done
  for f in qkv_m64 o_m64; do
    grep -E "^  [a-z_]*decode_linear|^  nvjet|^  [a-zA-Z_0-9]+.*\(|Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Max Active Clusters|Cluster Size|Waves Per SM|Issued Warp|No Eligible|stalled_(long|short|barrier|mio|lg|math|wait|membar|dispatch|no_inst)" \
        "$OUT/ncu_$f.log" | grep -v "^==" | cut -c1-110 | head -80
  done
fi
if [[ "$what" == s10a ]]; then
  # Session 10 (nvidia-h200, <= 420 s): opd's decode linear v4 (kernels/cuda/decode_linear.cu,
  # W streamed into registers before the PDL wait): its tests, the rollout/decode-fused/paged
  # attention suites (the PDL trigger moves), memcheck and racecheck of the kernel; its kernel
  # rows against cuBLASLt; `opd bench rollout` with --no-decode-linear / --decode-linear
  # alternating (2 runs each).
  dl_checks
  dl_onoff_ab
  grep "decode_linear\." "$OUT/bench_dl.log" | cut -c1-150
  grep -h "FAILED\|Failure\|error" "$OUT/dl_tests.log" | head -20
  cat "$OUT/rollout_ab.txt"
fi
if [[ "$what" == s9g ]]; then
  # Session 9's last call (nvidia-h200, <= 200 s): the session's final binaries: dev::for_each_float4
  # (the top-K tile kernel's and the cluster sampler's loads) and the fused loss as reverted: the
  # top-K, sampler, loss and scorer suites, then W1.
  run suites 110 $B/test_cuda --gtest_filter='CudaTopKLmHead.*:CudaSampler.*:CudaFusedLoss.*:CudaLossRepro.*:CudaScorer*'
  run w1 80 $B/opd bench w1 --work-dir /tmp/opd_w1
  grep -h "whole step\|rollout  \|scoring\|train  \|peak" "$OUT/w1.log" | head -8
fi
if [[ "$what" == s9f ]]; then
  # Session 9 (nvidia-h200-x2, <= 300 s): W2 after the session's kernel changes (RMSNorm groups,
  # cluster sampler, top-K loads): `opd bench w2 --nproc 2 --zero-stage 2` (W1 on one GPU, then
  # W1 per GPU on two, scaling efficiency; the goal's thinner margin is ZeRO-2's ~1 point).
  w2_zero2 280
fi
if [[ "$what" == s9e ]]; then
  # Session 9's last call (nvidia-h200, <= 580 s): the fused loss's LSE tile pass with 4 row
  # loads in flight per thread; the whole GPU suite minus the forward wgmma sweep (unchanged this
  # session); `opd bench loss` A/B against opd_base; W1 with its HF transformers anchor.
  run cuda 230 $B/test_cuda --gtest_filter='-Shapes/CudaAttentionWgmma.*'
  for v in base new base new; do
    ab_run $v loss_ab.txt "fused loss fwd\|  loss  " 40 bench loss --rows 4096 --tile-dtype f32 --iters 10
  done
  run w1_torch 260 $B/opd bench w1 --work-dir /tmp/opd_w1 --with-torch
  cut -c1-170 "$OUT/loss_ab.txt"
  grep -h "whole step\|rollout  \|scoring\|train  \|peak\|anchor\|total\|x faster\|HF" "$OUT/w1_torch.log" | head -20
fi
if [[ "$what" == s9d ]]; then
  # Session 9 (nvidia-h200, <= 560 s): decode-sized norms (<= 256 rows) back to a row per block,
  # the backward's grid at 512 blocks, and the cluster sampler's e / Z by reciprocals with one
  # exponential per id at T = 1: the norm, model, trainer, rollout and sampler suites, the
  # sampler under memcheck and racecheck; A/B against opd_base (alternating): the norm and
  # sampler kernels, `opd bench rollout`, `opd bench train`; then W1.
  run suites 200 $B/test_cuda --gtest_filter='*CudaRmsnorm*:*CudaModel*:CudaTrainer*:CudaRollout.*:*QkvNorm*:CudaSampler.*'
  run memcheck_sampler 60 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaSampler.SanitizerSized*:CudaSampler.Greedy*'
  run racecheck_sampler 60 compute-sanitizer --tool racecheck --error-exitcode 9 \
      --kernel-name "kns=sample_" $B/test_cuda --gtest_filter='CudaSampler.SanitizerSized*'
  for v in base new base new; do
    ab_run $v ab.txt "^rmsnorm" 40 bench kernels --filter rmsnorm
    ab_run $v ab.txt "^sample" 40 bench kernels --filter sample
    ab_run $v ab.txt "^opd: \|split:\|decode step" 60 bench rollout --runs 3
    ab_run $v ab.txt "^opd:" 40 bench train --loss-tile f32
  done
  run w1 100 $B/opd bench w1 --work-dir /tmp/opd_w1
  cut -c1-170 "$OUT/ab.txt"
  grep -h "whole step\|rollout  \|scoring\|train  \|peak" "$OUT/w1.log" | head -8
fi
if [[ "$what" == s9c ]]; then
  # Session 9 (nvidia-h200, <= 480 s): RMSNorm rows owned by power-of-two thread groups with no
  # idle lane (1024 bf16: 128 threads; q/k heads: 16) and the backward's loads issued before its
  # reduction: the norm, model, trainer and rollout suites; `opd bench kernels --filter rmsnorm`
  # and `opd bench train` A/B against opd_base (alternating); the sampler's cluster kernel and
  # the new norm backward under ncu --set full (why 92 us / why not the copy rate); W1.
  run norm_tests 170 $B/test_cuda --gtest_filter='*CudaRmsnorm*:*CudaModel*:CudaTrainer*:CudaRollout.*:*QkvNorm*'
  for v in base new base new; do
    ab_run $v norm_ab.txt "^rmsnorm" 40 bench kernels --filter rmsnorm
    ab_run $v norm_ab.txt "^opd:" 40 bench train --loss-tile f32
  done
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  run ncu_sampler 90 "$NCU" --clock-control none --set full -k regex:sample_cluster --launch-skip 3 \
      --launch-count 1 --csv --page details $B/opd bench kernels --filter sample.t1
  run ncu_normbwd 90 "$NCU" --clock-control none --set full -k regex:rms_bwd_fast --launch-skip 4 \
      --launch-count 2 --csv --page details $B/opd bench kernels --filter rmsnorm
  run w1 100 $B/opd bench w1 --work-dir /tmp/opd_w1
  cat "$OUT/norm_ab.txt" | cut -c1-160
  grep -h "whole step\|rollout  \|scoring\|train  \|peak" "$OUT/w1.log" | head -8
fi
if [[ "$what" == s9b ]]; then
  # Session 9 (nvidia-h200, <= 420 s): the top-K tile kernel's 16-byte row loads (s9a: 211 us
  # per 2048 x 16384 tile, ~0.7 TB/s): the top-K and scorer suites, memcheck and racecheck of the
  # row kernels, then `opd bench score --no-server` A/B against the previous build (opd_base,
  # carried) alternating, and W1.
  run topk 150 $B/test_cuda --gtest_filter='CudaTopKLmHead.*:CudaScorer*'
  run memcheck_topk 90 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter="$RACE_TOPK:CudaTopKLmHead.Bad*"
  run racecheck_topk 90 compute-sanitizer --tool racecheck --error-exitcode 9 \
      --kernel-name "kns=topk_" $B/test_cuda --gtest_filter="$RACE_TOPK"
  for v in base new base new; do
    ab_run $v score_ab.txt "^{" 60 bench score --no-server --work-dir /tmp/opd_score --json
  done
  run w1 100 $B/opd bench w1 --work-dir /tmp/opd_w1
  cut -c1-300 "$OUT/score_ab.txt"
  grep -h "whole step\|rollout  \|scoring\|train  \|peak" "$OUT/w1.log" | head -8
fi
if [[ "$what" == s9a ]]; then
  # Session 9's first call (nvidia-h200, <= 560 s): session 8's last refactor (offload
  # make_resident / forget_layered) under the trainer and offload suites; the memory plan's
  # shared-prompt scoring term against a run that shares (8 prompts x 8 generations of 3072 +
  # 256 tokens) and the same lengths unshared (64 prompts); then where W1's scoring and the
  # training step's memory-bound kernels go, by kernel family and launch shape, with DRAM bytes.
  run trainer 110 $B/test_cuda --gtest_filter='CudaTrainer*:*CudaWeightOffload*'
  run w1_shared 110 $B/opd bench w1 --work-dir /tmp/opd_w1s --prompts 8 --num-generations 8 \
      --prompt-len 3072 --completion-len 256 --kv-cache-gb 24 --warmup 0 --steps 1
  run w1_unshared 90 $B/opd bench w1 --work-dir /tmp/opd_w1s --prompts 64 \
      --prompt-len 3072 --completion-len 256 --kv-cache-gb 24 --warmup 0 --steps 1
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  run ncu_score 120 "$NCU" --clock-control none --csv --page raw --print-units base \
      --metrics gpu__time_duration.sum,dram__bytes.sum \
      $B/opd bench score --no-server --warmup 0 --iters 1
  python3 tools/ncu_summary.py --by-grid "$OUT/ncu_score.log" > "$OUT/ncu_score_totals.txt" 2>&1
  gzip -f "$OUT/ncu_score.log"
  if (( SECONDS < 380 )); then
    run ncu_train_mem 150 "$NCU" --clock-control none --csv --page raw --print-units base \
        --kernel-name regex:'rms|rope|swiglu|norm|add|silu|residual|copy|convert|cast' \
        --metrics gpu__time_duration.sum,dram__bytes.sum \
        $B/opd bench train --loss-tile f32 --warmup 0 --steps 1
    python3 tools/ncu_summary.py --by-grid "$OUT/ncu_train_mem.log" > "$OUT/ncu_train_mem_totals.txt" 2>&1
    gzip -f "$OUT/ncu_train_mem.log"
  fi
  grep -h "whole step\|rollout  \|scoring\|train  \|peak\|GPU memory plan" "$OUT"/w1_*.log | cut -c1-400 | head -20
  head -30 "$OUT/ncu_score_totals.txt" | cut -c1-170
  head -30 "$OUT/ncu_train_mem_totals.txt" 2>/dev/null | cut -c1-170
fi
if [[ "$what" == s8i ]]; then
  # Session 8's last call (nvidia-h200, <= 300 s): RMSNorm of bf16 rows of 1024 in training
  # batches as a warp per row: the norm, model, trainer and rollout suites, the norm kernels
  # alone, W1 (train phase, rollout unchanged).
  run norm_tests 150 $B/test_cuda --gtest_filter='*CudaRmsnorm*:*CudaModel*:CudaTrainer*:CudaRollout.*:*QkvNorm*'
  run bench_norm 40 $B/opd bench kernels --filter rmsnorm
  run w1 100 $B/opd bench w1 --work-dir /tmp/opd_w1
  grep -h "rmsnorm" "$OUT/bench_norm.log" | grep -v '^{' | head -8
  grep -h "whole step\|rollout  \|scoring\|train  \|peak" "$OUT/w1.log" | head -8
fi
if [[ "$what" == s8h ]]; then
  # Session 8 (nvidia-h200, <= 240 s): where W1's training step goes, kernel family by family:
  # one `opd bench train` step (f32 loss tile, as opd train) under ncu (durations only, clocks not
  # locked), totals per family.
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  run ncu_train 220 "$NCU" --clock-control none --csv --page raw --metrics gpu__time_duration.sum \
      $B/opd bench train --loss-tile f32 --warmup 0 --steps 1
  python3 tools/ncu_summary.py --totals "$OUT/ncu_train.log" > "$OUT/ncu_train_totals.txt" 2>&1
  head -45 "$OUT/ncu_train_totals.txt" | cut -c1-150
  gzip -f "$OUT/ncu_train.log"
fi
if [[ "$what" == s8g ]]; then
  # Session 8 (nvidia-h200, <= 300 s): the trainer's 128 MiB loss tile budget: the loss and
  # trainer suites, then `opd bench train` and W1 (defaults, and --device-memory-budget 16).
  run loss_trainer 150 $B/test_cuda --gtest_filter='CudaFusedLoss.*:CudaTrainer*:CudaLossRepro.*'
  run bench_train 60 $B/opd bench train
  run w1_default 100 $B/opd bench w1 --work-dir /tmp/opd_w1
  run w1_budget16 80 $B/opd bench w1 --work-dir /tmp/opd_w1 --device-memory-budget 16
  grep -h "MFU\|opd:" "$OUT/bench_train.log" | grep -v '^{' | head -5
  grep -h "whole step\|rollout  \|scoring\|train  \|peak\|phase peaks" "$OUT"/w1_*.log | head -20
fi
if [[ "$what" == s8f ]]; then
  # Session 8 (nvidia-h200, <= 150 s): the fused loss's tile GEMMs ran at ~63% of the whole
  # lm_head GEMMs' rate (ncu, s8e): its vocabulary tile and row chunk swept at W1's N = 4096.
  for vt in 4096 8192 16384; do
    for rc in 0 2048 4096; do
      echo "{\"sweep\": \"vocab_tile $vt row_chunk $rc\"}" >>"$OUT/loss_sweep.json"
      timeout 40 $B/opd bench loss --rows 4096 --tile-dtype f32 --vocab-tile $vt --row-chunk $rc \
          --warmup 2 --iters 10 --json >>"$OUT/loss_sweep.json" 2>>"$OUT/loss_sweep.err"
    done
  done
  python3 - "$OUT/loss_sweep.json" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    line = line.strip()
    if not line.startswith("{"):
        continue
    j = json.loads(line)
    if "sweep" in j:
        print(j["sweep"], end=": ")
        continue
    print({k: j.get(k) for k in ("vocab_tile", "fused_ms", "fused_forward_ms", "fused_backward_ms", "gemms_ms", "ratio_fused_over_gemms", "extra_peak_bytes", "loss")})
PY
fi
if [[ "$what" == s8d ]]; then
  # Session 8's last call (nvidia-h200, <= 200 s): the gradient buffers released at start-up:
  # the trainer suite, then W1 with --device-memory-budget 16 and with the defaults (every
  # step's phase peaks).
  run trainer 100 $B/test_cuda --gtest_filter='CudaTrainer*:*CudaWeightOffload*'
  run w1_budget16 100 $B/opd bench w1 --work-dir /tmp/opd_w1 --device-memory-budget 16
  run w1_default 80 $B/opd bench w1 --work-dir /tmp/opd_w1
  grep -h "whole step\|rollout  \|scoring\|train  \|peak\|phase peaks\|W1 step" "$OUT"/w1_*.log | head -40
fi
if [[ "$what" == s8c ]]; then
  # Session 8 (nvidia-h200, <= 580 s): the lm_head tile overlap's removal (its call sites are
  # serial loops again), the layered teacher upload and the memory budget: the loss, top-K,
  # scorer, offload, model and trainer suites; memcheck of the layered upload; then W1 with the
  # defaults and with --device-memory-budget 16 (every step's phase peaks), the loss and scoring
  # benches, and W1's HF anchor last while time is left.
  run suites 240 $B/test_cuda --gtest_filter='CudaTopKLmHead.*:CudaFusedLoss.*:CudaScorer*:CudaLossRepro.*:*CudaWeightOffload*:*CudaModel*:CudaTrainer*:CudaRollout.*'
  run memcheck_offload 60 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='*CudaWeightOffload.LayeredUpload*'
  run w1_default 100 $B/opd bench w1 --work-dir /tmp/opd_w1
  run w1_budget16 100 $B/opd bench w1 --work-dir /tmp/opd_w1 --device-memory-budget 16
  run w1_offload 100 $B/opd bench w1 --work-dir /tmp/opd_w1 --offload-teacher
  run bench_loss 60 $B/opd bench loss
  if (( SECONDS < 420 )); then run bench_score 80 $B/opd bench score --no-server; fi
  if (( SECONDS < 430 )); then run torch_w1 150 python3 tools/bench_w1_torch.py; fi
  grep -h "whole step\|rollout  \|scoring\|train  \|peak\|phase peaks\|chosen\|W1 step" "$OUT"/w1_*.log | head -40
  grep -h "whole step\|anchor\|total" "$OUT/torch_w1.log" 2>/dev/null | tail -5
fi
# seqkd_cuda DIR: --seq-kd on the GPU with the teacher in process and behind `opd serve --device
# cuda` (tiny random Qwen3 models with head_dim 64): the two runs' final weights, which the
# trainer's seed and stream keys make equal, and the server's log tail.
seqkd_cuda() {
  local d=$1
  mkdir -p $d
  python3 - "$d" <<'PY'
import json, sys
c = json.load(open("demo/student.config.json"))
c.update(head_dim=64, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
json.dump(c, open(sys.argv[1] + "/s.json", "w"))
c.update(hidden_size=192, num_hidden_layers=3)
json.dump(c, open(sys.argv[1] + "/t.json", "w"))
PY
  rm -rf $d/student $d/teacher
  $B/opd init --config $d/s.json --tokenizer demo/tokenizer --seed 1 --out $d/student >/dev/null 2>&1
  $B/opd init --config $d/t.json --tokenizer demo/tokenizer --seed 2 --out $d/teacher >/dev/null 2>&1
  $B/opd serve --model $d/teacher --device cuda --port 0 >$d/serve.log 2>&1 &
  local spid=$! port=""
  for i in $(seq 1 300); do port=$(grep -o "opd serve: port [0-9]*" $d/serve.log | grep -o "[0-9]*$"); [[ -n $port ]] && break; sleep 0.1; done
  local common="--student $d/student --data demo/data/train.jsonl --max-steps 3 --batch-size 16
      --micro-batch-size 8 --lmbda 0 --seq-kd --max-completion-length 6 --learning-rate 1e-3
      --device cuda --dtype bf16 --no-tensorboard --save-minutes 0"
  timeout 120 $B/opd train $common --teacher $d/teacher --out $d/local >$d/local.log 2>&1; echo "local rc=$?"
  timeout 120 $B/opd train $common --teacher-url http://127.0.0.1:$port --out $d/remote >$d/remote.log 2>&1; echo "remote rc=$?"
  kill $spid; wait $spid; echo "serve rc=$?"
  sha256sum $d/local/checkpoints/step-*/model.safetensors $d/remote/checkpoints/step-*/model.safetensors | cut -c1-16,65-
  grep -h '"source"' $d/remote/metrics.jsonl | grep -o '"source":"[a-z]*"' | sort | uniq -c
  tail -n 2 $d/local.log $d/remote.log $d/serve.log | cut -c1-200
}
if [[ "$what" == s15a ]]; then
  # Session 15 (nvidia-h200, <= 560 s): the trainer suite (new: the rollout's memory kept or
  # released gives the same weights with fewer cudaMalloc calls; a plan past the device stops
  # at start-up); --seq-kd with an `opd serve --device cuda` teacher against the in-process
  # one; `opd doctor --device cuda` against the device; W1 with the rollout's blocks released
  # (OPD_ROLLOUT_KEEP_MEMORY=0, the old behaviour) and kept (1), alternating; W1's scoring with
  # a 2-layer teacher at logit tiles 2,048 x 16,384 (default) and 4,096 x 32,768, alternating.
  run trainer 200 $B/test_cuda --gtest_filter='CudaTrainer*'
  grep -h "FAILED\|Failure" "$OUT/trainer.log" | head -10
  seqkd_cuda /tmp/seqkd 2>&1 | tee "$OUT/seqkd.txt"
  rm -rf /tmp/p06; timeout 60 $B/opd init --preset qwen3-0.6b --out /tmp/p06 >/dev/null 2>&1
  timeout 60 $B/opd doctor --student /tmp/p06 --teacher /tmp/p06 --device cuda 2>&1 | grep -i "memory" | cut -c1-220 | tee "$OUT/doctor.txt"
  for i in 1 2; do
    for keep in 0 1; do
      OPD_ROLLOUT_KEEP_MEMORY=$keep timeout 100 $B/opd bench w1 --work-dir /tmp/opd_w1 >/tmp/w1_k$keep$i.log 2>&1
      w1_lines /tmp/w1_k$keep$i.log "keep $keep $i" >>"$OUT/w1_keep.txt"
    done
  done
  cat "$OUT/w1_keep.txt"
  for i in 1 2; do
    for t in "2048 16384" "4096 32768"; do
      set -- $t
      timeout 40 $B/opd bench score --no-server --layers 2 --iters 5 --row-chunk $1 --vocab-tile $2 2>&1 \
          | grep "in-process:" | sed "s/^/rc $1 vt $2 ($i): /" >>"$OUT/tiles.txt"
    done
  done
  cut -c1-90 "$OUT/tiles.txt"
fi
if [[ "$what" == s15b ]]; then
  # Session 15 (nvidia-h200, <= 560 s): the whole GPU suite minus the forward wgmma sweep on the
  # session's code (seq-kd through a served teacher, the device memory budget, the kept rollout
  # blocks, the probe's fixes); then W1 with the rollout's prefill admitted 2,048 tokens per
  # engine step (the trainer's setting) and all 16,384 prompt tokens in one step
  # (OPD_ROLLOUT_STEP_TOKENS), alternating, while time is left.
  run cuda 380 $B/test_cuda --gtest_filter='-Shapes/CudaAttentionWgmma.*'
  grep -h "FAILED\|Failure" "$OUT/cuda.log" | head -20
  for i in 1 2; do
    for t in 2048 16384; do
      (( SECONDS > 500 )) && break 2
      OPD_ROLLOUT_STEP_TOKENS=$t timeout 100 $B/opd bench w1 --work-dir /tmp/opd_w1 >/tmp/w1_t$t$i.log 2>&1
      w1_lines /tmp/w1_t$t$i.log "tokens $t $i" >>"$OUT/w1_tokens.txt"
    done
  done
  cat "$OUT/w1_tokens.txt"
fi
if [[ "$what" == s15c ]]; then
  # Session 15's last call (nvidia-h200, <= 400 s): the trainer suite and the generation-on-GPU
  # check again on the final code, then W1 beside its HF transformers anchor.
  run trainer 200 $B/test_cuda --gtest_filter='CudaTrainer*'
  grep -h "FAILED\|Failure" "$OUT/trainer.log" | head -10
  seqkd_cuda /tmp/seqkd 2>&1 | head -8 | tee "$OUT/seqkd.txt"
  run w1_anchor $(( 560 - SECONDS )) $B/opd bench w1 --with-torch --work-dir /tmp/opd_w1
  grep -h "rollout  \|scoring  \|train  \|whole step\|peak device\|anchor\|HF\|x the" "$OUT/w1_anchor.log" | head -20
fi
if [[ "$what" == s15d ]]; then
  # Session 15, after the last host-side changes (nvidia-h200, <= 200 s): the trainer and
  # rollout suites and --seq-kd through `opd serve --device cuda` on the final binaries, and the
  # served generation's decoded text on the GPU.
  run suites 150 $B/test_cuda --gtest_filter='CudaTrainer*:CudaRollout.*:CudaScorer*'
  grep -h "FAILED\|Failure" "$OUT/suites.log" | head -10
  seqkd_cuda /tmp/seqkd 2>&1 | head -8 | tee "$OUT/seqkd.txt"
  $B/opd serve --model demo/teacher --device cuda --port 0 >/tmp/serve_text.log 2>&1 &
  spid=$!
  for i in $(seq 1 300); do port=$(grep -o "opd serve: port [0-9]*" /tmp/serve_text.log | grep -o "[0-9]*$"); [[ -n $port ]] && break; sleep 0.1; done
  curl -s localhost:$port/v1/completions -H 'Content-Type: application/json' \
      -d '{"prompt":[49,50,43,51,52,61],"max_tokens":5,"temperature":0}' | cut -c1-300 | tee "$OUT/text.txt"
  echo
  kill $spid; wait $spid
fi
if [[ "$what" == s16a ]]; then
  # Session 16 (nvidia-h200-x2, <= 560 s): the NCCL suite, the trainer over NCCL (2 GPU ranks ==
  # 1 GPU), then W2 with ZeRO-2 on the session's starting code (W1 on one GPU, then per GPU on
  # two: scaling efficiency), and W1 with ZeRO-2's 2-GPU run repeated while time is left.
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  run dist_gpu 120 $B/opd launch --nproc-per-node 2 --master-port 0 -- $B/test_dist_gpu
  run train_dist_gpu 150 $B/test_cli --gtest_filter='TrainDist.TwoGpu*'
  w2_zero2 $(( 550 - SECONDS ))
fi
if [[ "$what" == s16b ]]; then
  # Session 16 (nvidia-h200, <= 300 s): W1's training phase by kernel family (traced, then its
  # summary's families), to choose the next lever there; `opd bench train` plain beside it.
  run train_plain 60 $B/opd bench train --steps 2
  trace_run train_trace 120 $B/opd bench train --steps 2
  grep -h "MFU\|train" "$OUT/train_plain.log" | tail -4
  head -c 6000 "$OUT/train_trace.summary.txt"
fi
if [[ "$what" == s16c ]]; then
  # Session 16 (nvidia-h200, <= 300 s): the warp-per-row LSE tile kernel of the fused loss: the
  # loss suites (CPU reference, odd shapes, determinism, guards), then `opd bench loss --rows
  # 4096` and `opd bench train` of the session's starting build (opd_base) and this one,
  # alternating.
  run loss 120 $B/test_cuda --gtest_filter='CudaFusedLoss*:CudaLossRepro*:CudaTrainer*'
  grep -h "FAILED\|Failure" "$OUT/loss.log" | head -10
  for i in 1 2; do
    for v in base new; do
      bin=$B/opd; [[ $v == base ]] && bin=$B/opd_base
      timeout 40 $bin bench loss --rows 4096 --tile-dtype bf16 2>&1 | grep -i "fused\|lm_head" | head -4 | sed "s/^/$v $i: /" >>"$OUT/loss_ab.txt"
    done
  done
  cat "$OUT/loss_ab.txt"
  alternate train train_ab.txt base $B/opd_base new $B/opd
  cat "$OUT/train_ab.txt"
fi
if [[ "$what" == s16d ]]; then
  # Session 16 (nvidia-h200, <= 560 s): the fused q/k head norm + RoPE (forward and backward)
  # and the LSE tile kernel: their suites and the model/trainer/scorer/rollout suites that run
  # them; then the session's starting build (opd_base) against this one, alternating:
  # `opd bench train` (this one with the LSE tile's 4 and 8 vectors per lane), `opd bench score
  # --no-server`, and `opd bench w1` while time is left.
  run suites 240 $B/test_cuda --gtest_filter='*CudaRmsnormRope*:*CudaRope*:CudaModel*:CudaTrainer*:CudaFusedLoss*:CudaLossRepro*:CudaScorer*:*CudaRollout*:CudaDecodeFused*:CudaRmsnorm*'
  grep -h "FAILED\|Failure\|differ\|max |" "$OUT/suites.log" | head -20
  for i in 1 2; do
    for v in base new new8; do
      bin=$B/opd; [[ $v == base ]] && bin=$B/opd_base
      u=4; [[ $v == new8 ]] && u=8
      OPD_LSE_UNROLL=$u timeout 60 $bin bench train --steps 3 2>&1 | grep "^opd:" | sed "s/^/$v $i: /" >>"$OUT/ab.txt"
    done
    for v in base new; do
      bin=$B/opd; [[ $v == base ]] && bin=$B/opd_base
      timeout 60 $bin bench score --no-server 2>&1 | grep "in-process" | sed "s/^/score $v $i: /" >>"$OUT/ab.txt"
    done
  done
  cat "$OUT/ab.txt"
  for i in 1 2; do
    for v in base new; do
      (( SECONDS > 480 )) && break 2
      bin=$B/opd; [[ $v == base ]] && bin=$B/opd_base
      timeout 100 $bin bench w1 --work-dir /tmp/opd_w1 >/tmp/w1_$v$i.log 2>&1
      w1_lines /tmp/w1_$v$i.log "$v $i" >>"$OUT/w1_ab.txt"
    done
  done
  cat "$OUT/w1_ab.txt"
fi
if [[ "$what" == s16e ]]; then
  # Session 16 (nvidia-h200, <= 300 s): which of the session's changes moves W1's training:
  # the starting build (opd_base), the first LSE tile kernel (opd_lse1), the second (opd_lse2,
  # unroll 4 and 8), and the second with the fused q/k norm + RoPE (opd), alternating:
  # `opd bench loss` forward times, then `opd bench train`.
  for i in 1 2; do
    for v in base lse1 lse2 lse2u8; do
      bin=$B/opd_$v; u=4; [[ $v == lse2u8 ]] && bin=$B/opd_lse2 && u=8
      OPD_LSE_UNROLL=$u timeout 40 $bin bench loss --rows 4096 --tile-dtype bf16 --iters 30 2>&1 | grep "fused loss fwd" | sed "s/^/$v $i: /" >>"$OUT/loss_ab.txt"
    done
  done
  cat "$OUT/loss_ab.txt"
  for i in 1 2 3; do
    for v in base lse1 lse2 full; do
      bin=$B/opd_$v; [[ $v == full ]] && bin=$B/opd
      timeout 60 $bin bench train --steps 4 2>&1 | grep "^opd:" | sed "s/^/$v $i: /" >>"$OUT/train_ab.txt"
    done
  done
  cat "$OUT/train_ab.txt"
fi
if [[ "$what" == s16f ]]; then
  # Session 16 (nvidia-h200, <= 560 s): the whole GPU suite minus the forward wgmma sweep
  # (unchanged kernels) on the session's final code (the LSE tile kernel, the write seam, the
  # merged probes' fixes).
  run cuda 540 $B/test_cuda --gtest_filter='-Shapes/CudaAttentionWgmma.*'
  grep -h "FAILED\|Failure" "$OUT/cuda.log" | head -20
fi
if [[ "$what" == s16g ]]; then
  # Session 16's last call (nvidia-h200, <= 560 s): W1 beside its HF transformers anchor on the
  # final code, then --device-memory-budget 16 (the peak goal's setting) while time is left.
  run w1_anchor 400 $B/opd bench w1 --with-torch --work-dir /tmp/opd_w1
  grep -h "rollout  \|scoring  \|train  \|whole step\|peak device\|anchor\|HF\|x the" "$OUT/w1_anchor.log" | head -20
  if (( SECONDS < 470 )); then
    timeout $(( 550 - SECONDS )) $B/opd bench w1 --work-dir /tmp/opd_w1b --device-memory-budget 16 >/tmp/w1_b16.log 2>&1
    w1_lines /tmp/w1_b16.log "budget 16" | tee "$OUT/w1_budget16.txt"
  fi
fi
if [[ "$what" == s16h ]]; then
  # Session 16 (nvidia-h200, <= 330 s): the teacher's layered upload with the embedding copied
  # last and the first forward's lookup in its pinned host copy: the offload, model, scorer,
  # trainer and embedding suites; then `opd bench w1 --device-memory-budget 16` (offload +
  # elementwise recompute) of the previous build (opd_prev) and this one, alternating.
  run suites 120 $B/test_cuda --gtest_filter='*CudaWeightOffload*:CudaTrainer*:CudaScorer*:CudaModel*:*CudaEmbedding*:*Embedding*'
  grep -h "FAILED\|Failure" "$OUT/suites.log" | head -10
  for i in 1 2; do
    for v in prev new; do
      (( SECONDS > 290 )) && break 2
      bin=$B/opd; [[ $v == prev ]] && bin=$B/opd_prev
      timeout 60 $bin bench w1 --work-dir /tmp/opd_w1 --device-memory-budget 16 >/tmp/w1_$v$i.log 2>&1
      w1_lines /tmp/w1_$v$i.log "$v $i" >>"$OUT/w1_ab.txt"
    done
  done
  grep -v "step 1 and" "$OUT/w1_ab.txt"
fi
if [[ "$what" == s16i ]]; then
  # Session 16's last call (nvidia-h200, <= 330 s): the final binaries (the offload change, the
  # server's connection policy): the GPU suite minus the forward wgmma sweep, then --seq-kd
  # through `opd serve --device cuda` against the in-process teacher.
  run cuda 260 $B/test_cuda --gtest_filter='-Shapes/CudaAttentionWgmma.*'
  grep -h "FAILED\|Failure" "$OUT/cuda.log" | head -10
  (( SECONDS < 280 )) && seqkd_cuda /tmp/seqkd 2>&1 | head -8 | tee "$OUT/seqkd.txt"
fi
if [[ "$what" == s17a ]]; then
  # Session 17 (nvidia-h200, <= 480 s): what session 16 did not run: the forward wgmma sweep,
  # the fused loss (its warp-per-row LSE tile kernel) under memcheck and racecheck; and the GPU
  # halves of the new CLI tests (`opd generate` / `opd eval --device cuda` against the CPU;
  # bundle: scripts/gpu_bundle.sh build/tests/test_rollout build/tests/test_cli).
  run cli_cuda 120 bash -c "$B/test_rollout --gtest_filter='GenerateCli.DeviceCuda*' && $B/test_cli --gtest_filter='CliEval.DeviceCuda*'"
  grep -h "FAILED\|Failure\|SKIPPED\|OK \]" "$OUT/cli_cuda.log" | head -10
  run memcheck_loss 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_cuda \
      --gtest_filter='CudaFusedLoss.*:CudaLossRepro.*:-*PeakScratch*'
  run racecheck_loss 120 compute-sanitizer --tool racecheck --error-exitcode 9 \
      --kernel-name kns=lse_tile $B/test_cuda --gtest_filter='CudaFusedLoss.OddShapes:CudaFusedLoss.MatchesCpuBf16Bf16Tile'
  run wgmma_sweep 200 $B/test_cuda --gtest_filter='Shapes/CudaAttentionWgmma.*'
  grep -h "FAILED\|Failure" "$OUT/wgmma_sweep.log" | head -10
fi
if [[ "$what" == s17b ]]; then
  # Session 17's final binaries (nvidia-h200, <= 480 s): the GPU suite minus the forward wgmma
  # sweep (run in s17a), the GPU halves of the CLI tests (`opd generate` / `opd eval --device
  # cuda`), then --seq-kd through `opd serve --device cuda` against the in-process teacher.
  # Bundle: scripts/gpu_bundle.sh build/tests/test_rollout build/tests/test_cli.
  run cuda 300 $B/test_cuda --gtest_filter='-Shapes/CudaAttentionWgmma.*'
  grep -h "FAILED\|Failure" "$OUT/cuda.log" | head -10
  run cli_cuda 120 bash -c "$B/test_rollout --gtest_filter='GenerateCli.DeviceCuda*' && $B/test_cli --gtest_filter='CliEval.DeviceCuda*'"
  grep -h "FAILED\|Failure\|SKIPPED\|OK \]" "$OUT/cli_cuda.log" | head -10
  (( SECONDS < 400 )) && seqkd_cuda /tmp/seqkd 2>&1 | head -8 | tee "$OUT/seqkd.txt"
fi
if [[ "$what" == s17c ]]; then
  # Session 17's last call (nvidia-h200, <= 560 s): W1 beside its HF transformers anchor on the
  # final code, then --device-memory-budget 16 while time is left.
  run w1_anchor 400 $B/opd bench w1 --with-torch --work-dir /tmp/opd_w1
  grep -h "rollout  \|scoring  \|train  \|whole step\|peak device\|anchor\|HF\|x the" "$OUT/w1_anchor.log" | head -20
  if (( SECONDS < 470 )); then
    timeout $(( 550 - SECONDS )) $B/opd bench w1 --work-dir /tmp/opd_w1b --device-memory-budget 16 >/tmp/w1_b16.log 2>&1
    w1_lines /tmp/w1_b16.log "budget 16" | tee "$OUT/w1_budget16.txt"
  fi
fi
grep -h "device 0" "$OUT/cuda.log" 2>/dev/null | head -1
# The device tool brings back at most 8 files from $OUT: with more, every log goes into one
# archive (logs.tgz; unpack it where the files land) and only gpu.txt stays beside it.
if (( $(find "$OUT" -maxdepth 1 -type f | wc -l) > 8 )); then
  (cd "$OUT" && tar -czf logs.tgz --exclude=logs.tgz --exclude=gpu.txt -- * && \
     find . -maxdepth 1 -type f ! -name logs.tgz ! -name gpu.txt -delete)
  echo "logs packed into \$OUT/logs.tgz"
fi
echo "==== summary"
printf '%s\n' "${summary[@]}"
