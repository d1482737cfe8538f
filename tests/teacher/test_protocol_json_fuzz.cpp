// Structural mutation fuzzing of the teacher's JSON boundaries (protocol.cpp), complementing the
// hand-written cases in test_protocol.cpp (binary byte flips, truncations, lying counts): opd's
// JSON score request and response and vLLM's /v1/completions prompt_logprobs and generation
// replies, each mutated
// by random structural edits (wrong types, missing keys, huge/negative numbers, deep nesting,
// duplicated elements) and by byte edits of their text. Every case must end in a value that
// re-encodes, or an opd::Error; never another exception type or a sanitizer report.
#include <gtest/gtest.h>

#include <fstream>
#include <iostream>
#include <sstream>

#include "common/fuzz_util.h"
#include "common/test_util.h"
#include "teacher/protocol_samples.h"
#include "teacher/protocol.h"

namespace opd {
namespace {


ScoreRequest request() {
  ScoreRequest q;
  q.k = 2;
  q.temperature = 1.0;
  q.sequences.push_back({{5, 17, 3, 42}, 1, 4});
  q.sequences.push_back({{7, 7, 90}, 1, 3});
  return q;
}

// Mutates `base` (a JSON text) structurally or bytewise and hands the parsed result to `use`.
template <typename Use>
int fuzz_json(const std::string& base, uint32_t seed, int iters, Use use) {
  const std::vector<std::string> dict = {"{", "}", "[", "]", ",", ":", "\"", "null", "-1", "1e999", "1e308",
                                         "99999999999999999999", "-9223372036854775809", "\\ud800", "[[[[[[[["};
  int ok = 0;
  for (int c = 0; c < iters; ++c) {
    test::FuzzRng rng(seed + static_cast<uint64_t>(c));
    std::string log = "case " + std::to_string(c) + ": ";
    std::string text = base;
    if (rng.chance(75)) {
      nlohmann::json j = nlohmann::json::parse(base);
      for (size_t k = 0, n = 1 + rng.below(3); k < n; ++k) test::mutate_json(j, rng, &log);
      text = test::dump_raw(j);
    } else {
      for (size_t k = 0, n = 1 + rng.below(3); k < n; ++k) test::mutate_bytes(text, rng, dict, &log);
    }
    if (test::accepts(log, [&] { use(parse_json(text, "fuzz")); })) ++ok;
  }
  return ok;
}

TEST(ProtocolJsonFuzz, ScoreRequest) {
  const std::string base = score_request_to_json(request()).dump();
  const int iters = test::fuzz_iters(2000);
  const int ok = fuzz_json(base, 0x5c0e0000u, iters, [](const nlohmann::json& j) {
    const ScoreRequest q = score_request_from_json(j);
    (void)decode_score_request(encode_score_request(q));  // what was accepted must re-encode
  });
  std::cout << "[ fuzz     ] " << iters << " score requests: " << ok << " accepted\n";
  EXPECT_GT(ok, iters / 20);
}

TEST(ProtocolJsonFuzz, ScoreResponse) {
  const std::string base = score_response_to_json(test::sample_response()).dump();
  const int iters = test::fuzz_iters(2000);
  const int ok = fuzz_json(base, 0x5c0f0000u, iters, [](const nlohmann::json& j) {
    const ScoreResponse r = score_response_from_json(j);
    (void)decode_score_response(encode_score_response(r));
  });
  std::cout << "[ fuzz     ] " << iters << " score responses: " << ok << " accepted\n";
  EXPECT_GT(ok, iters / 20);
}

TEST(ProtocolJsonFuzz, VllmPromptLogprobs) {
  const std::string base =
      test::read_file(test::fixture_path("teacher/vllm_completions_prompt_logprobs.json"));
  const int iters = test::fuzz_iters(2000);
  const int ok = fuzz_json(base, 0x5c100000u, iters, [](const nlohmann::json& j) {
    const ScoreResponse r = parse_vllm_prompt_logprobs(j, request(), 96);
    for (int32_t id : r.ids) ASSERT_TRUE(id >= 0 && id < 96);
    (void)decode_score_response(encode_score_response(r));
  });
  std::cout << "[ fuzz     ] " << iters << " vLLM replies: " << ok << " accepted\n";
  EXPECT_GT(ok, iters / 50);
}

TEST(ProtocolJsonFuzz, VllmGeneration) {
  const std::string base =
      test::read_file(test::fixture_path("teacher/vllm_completions_generation.json"));
  GenerateRequest g;
  g.prompts = {{5, 17, 3, 42}, {7, 7, 90}};
  g.max_tokens = 4;
  const int iters = test::fuzz_iters(2000);
  const int ok = fuzz_json(base, 0x5c110000u, iters, [&](const nlohmann::json& j) {
    const std::vector<GeneratedCompletion> out = parse_generation_response(j, g, 96);
    ASSERT_EQ(out.size(), 2u);
    for (const auto& c : out) {
      ASSERT_TRUE(!c.ids.empty() && c.ids.size() <= 4);
      for (int32_t id : c.ids) ASSERT_TRUE(id >= 0 && id < 96);
      ASSERT_TRUE(c.stopped || c.ids.size() == 4);
    }
  });
  std::cout << "[ fuzz     ] " << iters << " vLLM generation replies: " << ok << " accepted\n";
  EXPECT_GT(ok, iters / 50);
}

}  // namespace
}  // namespace opd
