// Named model shapes (see presets.h); values from the families' published config.json files.
#include "model/presets.h"

#include <cstdint>

#include "core/error.h"

namespace opd {

namespace {

struct Preset {
  const char* name;
  int64_t hidden, layers, heads, intermediate;
  bool tied;
};

constexpr Preset kPresets[] = {
    {"qwen3-0.6b", 1024, 28, 16, 3072, true},  {"qwen3-1.7b", 2048, 28, 16, 6144, true},
    {"qwen3-4b", 2560, 36, 32, 9728, true},    {"qwen3-8b", 4096, 36, 32, 12288, false},
    {"qwen3-32b", 5120, 64, 64, 25600, false},
};

}  // namespace

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const Preset& p : kPresets) names.push_back(p.name);
  return names;
}

ModelConfig model_preset(const std::string& name) {
  for (const Preset& p : kPresets) {
    if (name != p.name) continue;
    ModelConfig c;
    c.arch = Architecture::Qwen3;
    c.model_type = "qwen3";
    c.vocab_size = 151936;
    c.hidden_size = p.hidden;
    c.intermediate_size = p.intermediate;
    c.num_hidden_layers = p.layers;
    c.num_attention_heads = p.heads;
    c.num_key_value_heads = 8;
    c.head_dim = 128;
    c.rms_norm_eps = 1e-6;
    c.rope_theta = 1e6;
    c.max_position_embeddings = 40960;
    c.tie_word_embeddings = p.tied;
    c.qk_norm = true;
    c.torch_dtype = "bfloat16";
    return c;
  }
  std::string known;
  for (const auto& n : model_preset_names()) known += (known.empty() ? "" : ", ") + n;
  OPD_FAIL(InvalidArgument, "unknown model preset '", name, "' (known: ", known, ")");
}

}  // namespace opd
