// Named model shapes (config.json values of public model families) for benchmarks, memory plans
// and `opd init --preset`: the W1-W3 workloads of BENCHMARKS.md are stated on Qwen3 shapes.
// Only shapes: the weights come from model/init.h (random) or a real model directory.
#pragma once

#include <string>
#include <vector>

#include "model/config.h"

namespace opd {

// "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-32b" (Qwen3 configs: vocab 151936,
// head_dim 128, 8 KV heads, q/k norm, rope_theta 1e6, eps 1e-6; the small ones tie embeddings).
// InvalidArgument naming the known presets otherwise.
ModelConfig model_preset(const std::string& name);
std::vector<std::string> model_preset_names();

}  // namespace opd
