#!/usr/bin/env bash
# The embedded default job: installs dependencies, builds opd, then describes the tiny
# Qwen3-family model shipped in tests/fixtures/models/qwen3 and runs its forward pass on the
# CPU, printing next-token predictions and a greedy continuation for three token sequences.
# (Becomes the on-policy distillation demo once `opd train` exists.)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
scripts/build.sh --target opd
model=tests/fixtures/models/qwen3
echo
echo "== opd info $model"
build/opd info "$model"
echo
echo "== opd predict --model $model --generate 8"
build/opd predict --model "$model" --generate 8
