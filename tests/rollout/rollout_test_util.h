// Helpers for the rollout tests: fixture models and generation fixtures
// (tools/make_generate_fixtures.py), seeded prompts, and an engine run with defaults.
#pragma once

#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "core/philox.h"
#include "model/transformer.h"
#include "rollout/engine.h"

namespace opd::test {

inline const std::vector<const char*>& families() {
  static const std::vector<const char*> f = {"qwen3", "qwen2", "llama", "llama_bias"};
  return f;
}

inline std::string model_dir(const std::string& family) { return fixture_path("models/" + family); }

inline nlohmann::json generate_fixture(const std::string& family) {
  std::ifstream in(fixture_path("generate/" + family + ".json"));
  EXPECT_TRUE(in.good()) << "missing fixture generate/" << family << ".json";
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str());
}

inline std::vector<int32_t> seeded_prompt(uint64_t seed, int64_t len, int64_t vocab) {
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < len; ++i) ids.push_back(static_cast<int32_t>(philox_u32(seed, 99, i) % vocab));
  return ids;
}

inline GenerationRequest request(std::vector<int32_t> prompt, int64_t max_new, double temperature,
                                 uint64_t seed = 0, int64_t n = 1) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new;
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  r.n = n;
  return r;
}

}  // namespace opd::test
