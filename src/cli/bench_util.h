// What the `opd bench` subcommands share: the median of timed runs, the Qwen3-0.6B shape at a
// chosen depth, a seeded xorshift64 for synthetic inputs, and running a PyTorch/transformers
// twin script (tools/bench_*_torch.py) whose last JSON line on stdout carries its results.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/weights.h"

namespace opd::cli {

// The median of `v` (the mean of the middle two for an even count); 0 for no samples.
double median(std::vector<double> v);

// The Qwen3-0.6B shape (model/presets.h) with `layers` decoder layers.
ModelConfig qwen3_06b(int64_t layers);

// The benches' random model: bf16 weights on the current CUDA device, matrices normal(0, 0.02)
// and norms 1, each tensor seeded from `seed` in the weights' order (synchronized on return).
// Throws Unsupported in a build without CUDA.
ModelWeights random_bf16_cuda_weights(const ModelConfig& config, uint64_t seed);

// xorshift64: reproducible host data (prompt ids, token ids, teacher payload) from the seed.
struct Rng {
  uint64_t x;
  explicit Rng(uint64_t seed) : x(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  }
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1), 53 bits
};

// One run of a twin: `python script args 2>&1`, where a relative script path resolves under
// $OPD_SOURCE_DIR when that is set (the benches run from any directory).
struct TwinRun {
  std::string python;
  std::string script;
  std::string args;             // appended as is: starts with a space
  std::string name;             // in the messages: "PyTorch twin", "transformers twin"
  bool quiet = false;           // --json: neither the command nor the twin's output is echoed
  bool require_success = true;  // a non-zero exit status fails even when a JSON line came
};

// Runs the twin, echoing its output unless quiet, and returns its last line that starts with
// '{' parsed as JSON; null when it could not start, failed, or printed no parsable JSON line.
nlohmann::json run_twin(const TwinRun& twin);

}  // namespace opd::cli
