// Helpers for the rollout tests: fixture models and generation fixtures
// (tools/make_generate_fixtures.py), seeded prompts, and an engine run with defaults.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/philox_ids.h"
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
  return philox_ids(seed, 99, len, vocab);
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

// The stop tests' free run `ids`: the first position k >= 3 whose token does not occur before
// it, so that token as EOS or a stop token ends the run right after step k; ids.size() when no
// such position exists.
inline size_t first_fresh_token(const std::vector<int32_t>& ids) {
  size_t k = 3;
  while (k < ids.size() && std::find(ids.begin(), ids.begin() + static_cast<long>(k), ids[k]) !=
                               ids.begin() + static_cast<long>(k))
    ++k;
  return k;
}

// A stop token id and max_new_tokens on `engine` (no EOS), whose free run of `base` gave `ids`:
// stop_token_ids = {ids[k]} (k from first_fresh_token) ends with ids[0..k] and reason Stop;
// max_new_tokens 5 and 1 end with the first 5 and 1 tokens and reason Length.
inline void expect_stop_token_and_max_tokens(RolloutEngine& engine, const GenerationRequest& base,
                                             const std::vector<int32_t>& ids, size_t k) {
  ASSERT_LT(k, ids.size());
  const std::vector<int32_t> prefix(ids.begin(), ids.begin() + static_cast<long>(k) + 1);
  GenerationRequest r = base;
  r.stop_token_ids = {ids[k]};
  SampleOutput s = engine.generate({r})[0].samples[0];
  EXPECT_EQ(s.ids, prefix);
  EXPECT_EQ(s.finish_reason, FinishReason::Stop);

  r = base;
  r.max_new_tokens = 5;
  s = engine.generate({r})[0].samples[0];
  EXPECT_EQ(s.ids, std::vector<int32_t>(ids.begin(), ids.begin() + 5));
  EXPECT_EQ(s.finish_reason, FinishReason::Length);
  r.max_new_tokens = 1;
  s = engine.generate({r})[0].samples[0];
  EXPECT_EQ(s.ids, std::vector<int32_t>(ids.begin(), ids.begin() + 1));
}

}  // namespace opd::test
