// `opd generate` end to end on the fixture models: greedy ids from --prompt-ids equal
// transformers' generate (fixture), JSON fields (ids, text, finish_reason, both logprob lists),
// seeds and n, a JSONL prompts file with ids and text, stop strings, and clear errors (exit 1,
// message naming the problem).
#include <gtest/gtest.h>
#include <unistd.h>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "rollout_test_util.h"

namespace opd {
namespace {

using Result = test::OpdResult;
Result run(const std::string& args, bool merge_stderr = false) {
  return test::run_opd("generate " + args, merge_stderr ? test::Stderr::Merge : test::Stderr::Discard);
}

std::string ids_arg(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += cat(s.empty() ? "" : ",", id);
  return s;
}

TEST(GenerateCli, GreedyPromptIdsMatchTransformers) {
  for (const char* family : {"qwen3", "llama"}) {
    nlohmann::json fx = test::generate_fixture(family);
    const auto& c = fx["greedy"][2];  // the model's own EOS ids
    ASSERT_EQ(c["eos_token_ids"], fx["eos_token_ids"]);
    Result r = run("--model " + test::model_dir(family) + " --prompt-ids " +
                   ids_arg(c["prompt"].get<std::vector<int32_t>>()) +
                   " --temperature 0 --max-new-tokens 24 --json");
    ASSERT_EQ(r.code, 0) << r.out;
    auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["eos_token_ids"], fx["eos_token_ids"]);
    ASSERT_EQ(j["results"].size(), 1u);
    const auto& s = j["results"][0]["samples"][0];
    EXPECT_EQ(s["ids"], c["expected"]) << family;
    EXPECT_EQ(s["finish_reason"], "length");
    EXPECT_TRUE(s["text"].is_null());  // no tokenizer in the fixture directory
    ASSERT_EQ(s["model_logprobs"].size(), s["ids"].size());
    for (const auto& lp : s["model_logprobs"]) EXPECT_LT(lp.get<double>(), 0.0);
    for (const auto& lp : s["sampling_logprobs"]) EXPECT_EQ(lp.get<double>(), 0.0);  // greedy
  }
}

TEST(GenerateCli, SeedAndNSelectTheSamples) {
  const std::string base = "--model " + test::model_dir("qwen2") +
                           " --prompt-ids 4,8,15,16 --max-new-tokens 10 --top-p 0.9 --top-k 50 --json";
  Result a = run(base + " --n 3 --seed 5"), b = run(base + " --n 3 --seed 5"),
         c = run(base + " --n 1 --seed 5"), d = run(base + " --n 3 --seed 6");
  ASSERT_EQ(a.code, 0) << a.out;
  auto ja = nlohmann::json::parse(a.out), jb = nlohmann::json::parse(b.out),
       jc = nlohmann::json::parse(c.out), jd = nlohmann::json::parse(d.out);
  const auto& sa = ja["results"][0]["samples"];
  ASSERT_EQ(sa.size(), 3u);
  EXPECT_EQ(sa, jb["results"][0]["samples"]);  // deterministic
  EXPECT_EQ(sa[0]["ids"], jc["results"][0]["samples"][0]["ids"]);  // sample 0 independent of n
  EXPECT_NE(sa[0]["ids"], sa[1]["ids"]);
  EXPECT_NE(sa[0]["ids"], jd["results"][0]["samples"][0]["ids"]);
  for (const auto& s : sa) {
    for (size_t k = 0; k < s["ids"].size(); ++k) {
      // Filtering and renormalizing raises a kept token's probability: log p_sampling >= log p_model.
      EXPECT_GE(s["sampling_logprobs"][k].get<double>(), s["model_logprobs"][k].get<double>() - 1e-9);
    }
  }
}

TEST(GenerateCli, PromptsFileWithIdsAndTextAndStopStrings) {
  const std::string path = ::testing::TempDir() + "opd_generate_prompts_" + std::to_string(::getpid()) + ".jsonl";
  {
    std::ofstream f(path);
    // Qwen3 pre-tokenization splits digits one by one: "12" -> ids 16, 17 (bytes '1', '2').
    f << "{\"prompt_ids\": [3, 1, 4]}\n\n{\"prompt\": \"12\"}\n";
  }
  const std::string common = "--model " + test::model_dir("qwen3") + " --tokenizer " +
                             test::fixture_path("tokenizers/qwen3") + " --prompts " + path +
                             " --max-new-tokens 20 --seed 1 --json";
  Result r = run(common);
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["results"].size(), 2u);
  EXPECT_EQ(j["results"][0]["prompt_ids"], nlohmann::json({3, 1, 4}));
  EXPECT_EQ(j["results"][1]["prompt_ids"], nlohmann::json({16, 17}));
  EXPECT_EQ(j["results"][1]["prompt"], "12");
  const auto& s = j["results"][1]["samples"][0];
  ASSERT_TRUE(s["text"].is_string());
  const std::string text = s["text"].get<std::string>();
  ASSERT_GE(text.size(), 6u);
  // Stop at the 2 characters found at offset 3 of that text: the new text ends before them.
  const std::string stop = text.substr(3, 2);
  ASSERT_EQ(stop.find_first_of("\"\\' $`"), std::string::npos) << "pick another seed: '" << stop << "'";
  Result rs = run(common + " --stop '" + stop + "'");
  ASSERT_EQ(rs.code, 0) << rs.out;
  auto js = nlohmann::json::parse(rs.out);
  const auto& ss = js["results"][1]["samples"][0];
  EXPECT_EQ(ss["finish_reason"], "stop");
  EXPECT_EQ(ss["stop"], stop);
  EXPECT_EQ(ss["text"], text.substr(0, text.find(stop)));
  EXPECT_LT(ss["ids"].size(), s["ids"].size());
  // Human-readable output runs too.
  Result h = run("--model " + test::model_dir("qwen3") + " --prompt-ids 1,2 --max-new-tokens 3");
  EXPECT_EQ(h.code, 0);
  EXPECT_NE(h.out.find("sample 0 [length, 3 tokens"), std::string::npos) << h.out;
}

TEST(GenerateCli, ErrorsNameTheProblem) {
  const std::string m = "--model " + test::model_dir("qwen3");
  const std::string jsonl = ::testing::TempDir() + "opd_generate_bad_" + std::to_string(::getpid()) + ".jsonl";
  {
    std::ofstream f(jsonl);
    f << "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n";
  }
  const std::pair<std::string, std::string> cases[] = {
      {m + " --prompt hello", "a text prompt needs a tokenizer"},
      {m + " --prompt-ids 1,96", "request 0: prompt token id 96 at position 1 is outside the vocabulary [0, 96)"},
      {m + " --prompt-ids 1,x", "'x' is not an integer"},
      {m + " --prompt-ids 1,2,", "'1,2,' ends with a comma (an empty id)"},
      {m + " --prompt-ids 1,,2", "'' is not an integer"},
      {m, "no prompt"},
      {m + " --prompts " + jsonl, "line 1: chat \"messages\" need a chat template"},
      {m + " --prompt-ids 1,2 --stop ab", "stop strings need a tokenizer"},
      {m + " --prompt-ids 1,2 --top-p 0", "top_p must be in (0, 1]"},
      {m + " --prompt-ids 1,2 --max-new-tokens 1000 --kv-cache-gb 0.00001", "holds only"},
  };
  for (const auto& [args, part] : cases) {
    Result r = run(args, true);
    EXPECT_EQ(r.code, 1) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(part), std::string::npos) << args << "\n" << r.out;
  }
}

}  // namespace
}  // namespace opd
