#!/usr/bin/env bash
# Runs on the lent GPU machine: the test binaries built on a CPU machine (carried in
# .carry/bin with the OpenBLAS runtime in .carry/lib, since that machine has no OpenBLAS),
# the GPU suite plain and under compute-sanitizer memcheck/racecheck, then the CPU suites.
# Prints a short summary last; full logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
# The bundle holds bin/ and lib/ (compressed: the working tree that travels is capped).
if [[ -f .carry/bundle.tgz ]]; then tar -C .carry -xzf .carry/bundle.tgz; fi
export LD_LIBRARY_PATH="$PWD/.carry/lib:${LD_LIBRARY_PATH:-}"
export OPD_SOURCE_DIR="$PWD" OPD_BINARY="$PWD/.carry/bin/opd"
OUT="${OUT:-/tmp/opd_out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
summary=()
run() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s%N)
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local secs=$(( ($(date +%s%N) - t0) / 1000000 ))e-3
  local tail=$(grep -E "PASSED|FAILED|ERROR SUMMARY|SKIPPED \]" "$OUT/$name.log" | head -3 | tr '\n' ' ')
  summary+=("$(printf '%-22s rc=%d %6.1fs  %s' "$name" "$rc" "$secs" "$tail")")
}
run cuda .carry/bin/test_cuda
run cuda_memcheck compute-sanitizer --tool memcheck --error-exitcode 9 .carry/bin/test_cuda
run cuda_racecheck compute-sanitizer --tool racecheck --error-exitcode 9 .carry/bin/test_cuda
for t in core kernels model cli; do
  [[ -x .carry/bin/test_$t ]] && run "$t" .carry/bin/test_$t
done
grep -h "device 0" "$OUT/cuda.log" || true
echo "==== summary"
printf '%s\n' "${summary[@]}"
