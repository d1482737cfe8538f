// Random initialization of a model from its config, as transformers' _init_weights does for
// Llama/Qwen: every linear and embedding weight ~ N(0, initializer_range), biases 0, every
// RMSNorm weight 1. The normals come from Philox (core/philox.h) keyed by (seed, parameter
// index), via Box-Muller, so a (config, seed) pair gives the same weights on every machine.
#pragma once

#include <cstdint>
#include <string>

#include "model/config.h"
#include "model/weights.h"

namespace opd {

// f32 weights of the config's shapes. std <= 0 uses 0.02.
ModelWeights init_weights(const ModelConfig& config, uint64_t seed, double std = 0.02);

// Writes a complete Hugging Face model directory: config.json, model.safetensors (f32, the
// Hugging Face names), and copies tokenizer.json / tokenizer_config.json /
// generation_config.json / special_tokens_map.json from `tokenizer_dir` when given. Atomic per
// file. Used by `opd init` and by checkpoint export.
void save_model_dir(const std::string& dir, const ModelConfig& config, const ModelWeights& weights,
                    const std::string& tokenizer_dir = "");

}  // namespace opd
