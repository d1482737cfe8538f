// Structural mutation fuzzing of config.json parsing (config.cpp): the committed real configs
// (Qwen3, Qwen2.5, Llama-3.2, tiny ones) mutated by wrong types, missing keys, zero/negative/huge
// sizes and bytewise edits. Every case must end in a config whose sizes are positive, whose
// products fit int64 (parameter counts, q/kv widths, vocab x hidden) and which writes back and
// re-parses to itself, or in an opd::Error.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "common/fuzz_util.h"
#include "common/test_util.h"
#include "model/config.h"
#include "model/weights.h"

namespace opd {
namespace {

std::vector<std::string> base_configs() {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(test::fixture_path("configs"))) {
    if (!std::filesystem::exists(e.path() / "config.json")) continue;
    out.push_back(test::read_file((e.path() / "config.json").string()));
  }
  std::sort(out.begin(), out.end());
  return out;
}

void check_config(const ModelConfig& c, const std::string& log) {
  for (int64_t v : {c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                    c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.max_position_embeddings}) {
    ASSERT_GT(v, 0) << log;
    ASSERT_LE(v, INT32_MAX) << log;
  }
  ASSERT_EQ(c.num_attention_heads % c.num_key_value_heads, 0) << log;
  ASSERT_EQ(c.head_dim % 2, 0) << log;
  for (int64_t id : c.eos_token_ids) ASSERT_TRUE(id >= 0 && id < c.vocab_size) << log;
  ASSERT_LT(c.bos_token_id, c.vocab_size) << log;
  (void)c.num_parameters();
  (void)c.num_embedding_parameters();
  for (const auto& [name, shape] : parameter_shapes(c)) (void)shape_numel(shape);
  const ModelConfig again = parse_model_config(model_config_to_json(c), "round trip");
  ASSERT_EQ(model_config_to_json(again), model_config_to_json(c)) << log;
}

TEST(ConfigFuzz, RandomMutations) {
  const auto bases = base_configs();
  ASSERT_GE(bases.size(), 5u);
  for (const auto& b : bases) ASSERT_NO_THROW(check_config(parse_model_config(b, "base"), "base"));
  const std::vector<std::string> dict = {"{", "}", "[", "]", ",", ":", "\"", "null", "-1", "0", "1e999",
                                         "2147483648", "9223372036854775808", "\xff", "true"};
  const int iters = test::fuzz_iters(2000);
  int ok = 0;
  for (int c = 0; c < iters; ++c) {
    test::FuzzRng rng(0xc0f90000u + static_cast<uint64_t>(c));
    std::string log = "case " + std::to_string(c) + ": ";
    std::string text = bases[rng.below(bases.size())];
    if (rng.chance(80)) {
      nlohmann::json j = nlohmann::json::parse(text);
      for (size_t k = 0, n = 1 + rng.below(3); k < n; ++k) test::mutate_json(j, rng, &log);
      text = test::dump_raw(j);
    } else {
      test::mutate_bytes(text, rng, dict, &log);
    }
    std::optional<ModelConfig> cfg;
    if (!test::accepts(log, [&] { cfg = parse_model_config(text, "fuzz/config.json"); })) continue;
    ++ok;
    ASSERT_TRUE(test::accepts(log + " (use)", [&] { check_config(*cfg, log); })) << log;
  }
  std::cout << "[ fuzz     ] " << iters << " config.json files: " << ok << " accepted\n";
  EXPECT_GT(ok, iters / 10);
}

// num_hidden_layers = 2^31 - 1 passed the size check (<= 2^31) and parameter_shapes() then built
// ~2*10^10 (name, shape) entries: the deep ASan campaign sat at 4 GB and growing.
TEST(ConfigFuzz, Regressions) {
  const std::string text = test::read_file(test::fixture_path("configs/qwen3_0_6b/config.json"));
  nlohmann::json j = nlohmann::json::parse(text);
  j["num_hidden_layers"] = 2147483647;
  const std::string err = test::error_of([&] { parse_model_config(j.dump(), "layers.json"); });
  EXPECT_NE(err.find("num_hidden_layers' = 2147483647 is over opd's limit of 4096 layers"), std::string::npos) << err;
  j["num_hidden_layers"] = 4096;
  j.erase("layer_types");
  EXPECT_EQ(parse_model_config(j.dump(), "layers.json").num_hidden_layers, 4096);
}

}  // namespace
}  // namespace opd
