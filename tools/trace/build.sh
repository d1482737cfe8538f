#!/usr/bin/env bash
# Builds tools/trace/opd_trace.cpp into build/trace/libopd_trace.so (a CUDA injection library
# for GPU timelines; see the file's header). Needs CUPTI's headers and library: CUDA_HOME
# (default /usr/local/cuda) with include/cupti.h and lib/ or lib64/ or extras/CUPTI/.
set -euo pipefail
cd "$(dirname "$0")/../.."
cuda=${CUDA_HOME:-/usr/local/cuda}
inc="" lib=""
for d in "$cuda/include" "$cuda/extras/CUPTI/include"; do [[ -f "$d/cupti.h" ]] && inc=$d && break; done
for d in "$cuda/lib64" "$cuda/lib" "$cuda/extras/CUPTI/lib64" /usr/lib/x86_64-linux-gnu; do
  compgen -G "$d/libcupti.so*" > /dev/null && lib=$d && break
done
[[ -n "$inc" && -n "$lib" ]] || { echo "CUPTI not found under $cuda (set CUDA_HOME)" >&2; exit 1; }
mkdir -p build/trace
g++ -std=c++17 -O2 -shared -fPIC -I"$inc" tools/trace/opd_trace.cpp -o build/trace/libopd_trace.so \
  -L"$lib" -Wl,-rpath,'$ORIGIN' -lcupti
echo "build/trace/libopd_trace.so (CUPTI from $lib)"
