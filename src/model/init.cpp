// Random initialization (N(0, std) weights, unit norms, zero biases; Philox + Box-Muller) and
// writing a Hugging Face model directory.
#include "model/init.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include "core/error.h"
#include "core/philox.h"
#include "core/thread_pool.h"
#include "model/safetensors.h"

namespace opd {

namespace {

bool is_norm(const std::string& name) {
  return name.find("norm.weight") != std::string::npos;  // *_layernorm, q_norm, k_norm, model.norm
}
bool is_bias(const std::string& name) { return name.size() > 5 && name.ends_with(".bias"); }

}  // namespace

ModelWeights init_weights(const ModelConfig& config, uint64_t seed, double std) {
  if (!(std > 0)) std = 0.02;
  ModelWeights w = zeros_weights(config, DType::F32);
  uint64_t index = 0;
  w.for_each([&](const std::string& name, Tensor& t) {
    const uint64_t stream = index++;
    float* p = t.data<float>();
    const int64_t n = t.numel();
    if (is_norm(name)) {
      for (int64_t i = 0; i < n; ++i) p[i] = 1.0f;
      return;
    }
    if (is_bias(name)) return;  // zeros
    // Element pairs (2j, 2j+1) are independent draws keyed by their index: split across threads
    // (a 1.7e9-parameter teacher takes seconds instead of a minute), same values at any count.
    parallel_for(
        (n + 1) / 2,
        [&](int64_t j0, int64_t j1) {
          for (int64_t i = 2 * j0; i < std::min(n, 2 * j1); i += 2) {
            // Box-Muller on two uniforms in (0, 1]: u1 = 1 - U keeps log() finite.
            const double u1 = 1.0 - philox_uniform(seed, stream, static_cast<uint64_t>(i));
            const double u2 = philox_uniform(seed, stream, static_cast<uint64_t>(i + 1));
            const double r = std::sqrt(-2.0 * std::log(u1));
            p[i] = static_cast<float>(std * r * std::cos(2 * M_PI * u2));
            if (i + 1 < n) p[i + 1] = static_cast<float>(std * r * std::sin(2 * M_PI * u2));
          }
        },
        1 << 15);
  });
  return w;
}

void save_model_dir(const std::string& dir, const ModelConfig& config, const ModelWeights& weights,
                    const std::string& tokenizer_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  OPD_CHECK(!ec, Io, "cannot create ", dir, ": ", ec.message());
  std::map<std::string, Tensor> tensors;
  weights.for_each([&](const std::string& name, const Tensor& t) { tensors[name] = t; });
  save_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
  {
    const std::string tmp = dir + "/config.json.tmp";
    std::ofstream f(tmp, std::ios::binary);
    f << model_config_to_json(config) << "\n";
    f.close();
    OPD_CHECK(f.good(), Io, "cannot write ", tmp);
    fs::rename(tmp, dir + "/config.json", ec);
    OPD_CHECK(!ec, Io, "cannot rename ", tmp, ": ", ec.message());
  }
  if (!tokenizer_dir.empty()) {
    for (const char* file : {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                             "special_tokens_map.json", "chat_template.jinja"}) {
      const fs::path src = fs::path(tokenizer_dir) / file;
      if (!fs::exists(src)) continue;
      fs::copy_file(src, fs::path(dir) / file, fs::copy_options::overwrite_existing, ec);
      OPD_CHECK(!ec, Io, "cannot copy ", src.string(), " to ", dir, ": ", ec.message());
    }
  }
}

}  // namespace opd
