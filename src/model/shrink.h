// Builds a smaller student from a Hugging Face model directory by keeping a subset of its
// decoder layers (the "every other layer removed" initialisation of layer-dropping distillation,
// e.g. DistilBERT / Sanh et al. 2019): kept layer keep[j] becomes layer j, embeddings, final norm
// and lm_head are copied, config.json is the original with num_hidden_layers (and a per-layer
// list such as layer_types) updated, and tokenizer / generation files are copied unchanged.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace opd {

// "0,2,4" (any order, no repeats), "even" (0,2,...) or "odd" (1,3,...) -> sorted layer
// indices, each checked against num_layers; `flag` names the option in errors.
std::vector<int64_t> parse_layer_selection(const std::string& spec, int64_t num_layers,
                                           const std::string& flag);
// The complement of parse_layer_selection(spec) (what --drop-layers means).
std::vector<int64_t> complement_layers(const std::vector<int64_t>& layers, int64_t num_layers);

// Writes out_dir (must not exist or be empty; written through a temporary sibling directory).
// Tensors keep their stored dtype. Returns the new config.
ModelConfig shrink_model_dir(const std::string& in_dir, const std::string& out_dir,
                             const std::vector<int64_t>& keep_layers);

}  // namespace opd
