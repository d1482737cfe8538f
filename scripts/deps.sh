#!/usr/bin/env bash
# Installs what opd needs to build and test on Debian/Ubuntu (run as root): compilers, CMake,
# Ninja, ccache, OpenBLAS, nlohmann-json, CLI11, GoogleTest, and python3 for test oracles.
# Packages already present are not reinstalled (no network needed then).
# Usage: scripts/deps.sh [--oracles]   (--oracles also pip-installs safetensors + numpy)
set -euo pipefail

pkgs=(build-essential cmake ninja-build ccache pkg-config libopenblas-dev nlohmann-json3-dev
      libcli11-dev libgtest-dev libpcre2-dev python3 python3-pip)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[deps] apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [[ "${1:-}" == "--oracles" ]]; then
  # Python oracles for tests only (never used by the engine): the reference safetensors reader.
  if ! python3 -c "import safetensors, numpy" >/dev/null 2>&1; then
    echo "[deps] pip install safetensors numpy (test oracles)"
    python3 -m pip install -q safetensors numpy 2>/dev/null ||
      python3 -m pip install -q --break-system-packages safetensors numpy
  fi
fi
