#!/usr/bin/env bash
# Regenerates the demo's teacher (demo/teacher/) from scratch: the demo inputs
# (tools/make_demo.py: tokenizer, data, configs), a randomly initialized teacher (`opd init`),
# then supervised training on the task (`opd sft`). Deterministic on a given machine and thread
# count. Takes ~10-20 minutes on 2 CPU cores. The committed teacher was made with this script.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh --target opd >/dev/null
opd=build/opd
python3 tools/make_demo.py
work=runs/make-demo-teacher
rm -rf "$work"
$opd init --config demo/teacher.config.json --tokenizer demo/tokenizer --seed 1 --out "$work/init"
$opd sft --student "$work/init" --data demo/data/train.jsonl --eval-data demo/data/eval.jsonl \
  --out "$work/sft" --max-steps "${STEPS:-3000}" --batch-size 64 --micro-batch-size 64 \
  --learning-rate 2e-3 --warmup-steps 50 --weight-decay 0.01 --eval-steps 500 --eval-limit 200
ckpt="$(ls -d "$work"/sft/checkpoints/step-* | tail -1)"
rm -rf demo/teacher
mkdir -p demo/teacher
cp "$ckpt"/{config.json,model.safetensors,tokenizer.json,tokenizer_config.json} demo/teacher/
$opd eval --model demo/teacher --data demo/data/eval.jsonl
