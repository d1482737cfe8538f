#!/usr/bin/env bash
# The embedded default job (BENCHMARKS.md W0): on-policy distillation on the CPU.
# Installs dependencies, builds opd, then distills the teacher shipped in demo/teacher (a
# 0.8M-parameter Qwen3-family model trained with `opd sft` on two-number addition; regenerate
# it with scripts/make_demo_teacher.sh) into a 7x smaller, randomly initialized student with
# `opd train`, and prints held-out exact-match accuracy of the teacher, the student before and
# the student after. Everything goes to runs/demo/ (train.log, metrics.jsonl, tensorboard/,
# checkpoints/step-*/ which are Hugging Face model directories). ~2-3 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh --target opd
opd=build/opd
out=runs/demo
steps="${OPD_DEMO_STEPS:-3000}"
rm -rf "$out"
mkdir -p "$out"
start=$(date +%s)
echo
echo "== the student: a random init of demo/student.config.json"
$opd init --config demo/student.config.json --tokenizer demo/tokenizer --seed "${OPD_DEMO_SEED:-0}" --out "$out/student-init"
echo
echo "== on-policy distillation: $steps steps of 64 prompts (opd train --help explains every flag)"
$opd train --student "$out/student-init" --teacher demo/teacher \
  --data demo/data/train.jsonl --eval-data demo/data/eval.jsonl --out "$out" \
  --max-steps "$steps" --batch-size 64 --micro-batch-size 64 --learning-rate 2e-3 \
  --warmup-steps 30 --weight-decay 0.1 --lmbda 0.5 --beta 0 --teacher-top-k 16 \
  --max-completion-length 5 \
  --save-steps 500 --eval-steps 500
echo
echo "== held-out exact match (demo/data/eval.jsonl: 500 additions never seen in training)"
acc() { $opd eval --model "$1" --data demo/data/eval.jsonl --max-new-tokens 5 --json |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["exact_match"])'; }
teacher=$(acc demo/teacher)
before=$(acc "$out/student-init")
after=$(acc "$out/checkpoints/$(head -1 "$out/checkpoints/LATEST")")
python3 - "$teacher" "$before" "$after" "$(( $(date +%s) - start ))" <<'PY'
import sys
t, b, a, secs = map(float, sys.argv[1:])
print(f"teacher          {100*t:5.1f}%  (demo/teacher, 822,656 parameters)")
print(f"student before   {100*b:5.1f}%  (random init, 116,096 parameters)")
print(f"student after    {100*a:5.1f}%  = {100*a/t:.0f}% of the teacher (goal >= 90%: {'met' if a >= 0.9*t else 'MISSED'})")
print(f"distillation + evaluation took {secs:.0f} s; run directory runs/demo/")
PY
