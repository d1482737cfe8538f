#!/usr/bin/env bash
# The whole test suite: installs dependencies (and the python test oracles), builds
# everything (CUDA code too when nvcc exists), runs every CTest test. GPU tests skip
# (reported as skipped) where no GPU exists. The last lines are CTest's summary.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh --oracles
scripts/build.sh
cd build
ctest --output-on-failure -j "${OPD_TEST_JOBS:-$(nproc)}"
