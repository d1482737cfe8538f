#!/usr/bin/env bash
# Configures and builds opd into build/ (Release, ccache). The CUDA backend is built when
# nvcc is found (on PATH or in /usr/local/cuda/bin). Extra arguments go to `cmake --build`
# (e.g. --target opd).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
jobs="${OPD_BUILD_JOBS:-$(nproc)}"
# ccache keys on relative paths below the repository, so a fresh clone elsewhere reuses the cache.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-true}"
if [[ ! -f build/build.ninja ]]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
cmake --build build -j "$jobs" "$@"
