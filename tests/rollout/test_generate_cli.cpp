// `opd generate` end to end on the fixture models: greedy ids from --prompt-ids equal
// transformers' generate (fixture), JSON fields (ids, text, finish_reason, both logprob lists),
// seeds and n, a JSONL prompts file with ids, text and chat messages, stop strings, --device cuda
// (the CPU's tokens on a GPU in f32; a named error without one), and clear errors (exit 1,
// message naming the problem).
#include <gtest/gtest.h>
#include <unistd.h>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/tensor.h"  // device_hooks::cuda_device_count
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

// A "messages" line (and, with --chat, a text prompt as one user message) is rendered with the
// model directory's chat template (add_generation_prompt) and generates what the rendered text
// given as --prompt generates.
TEST(GenerateCli, MessagesLinesAreRenderedWithTheChatTemplate) {
  namespace fs = std::filesystem;
  const std::string dir = ::testing::TempDir() + "opd_generate_chat_" + std::to_string(::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"})
    fs::copy_file(test::source_dir() + "/demo/teacher/" + f, dir + "/" + f);
  {
    // The generation prompt ("=") only appears when asked for: a template that ignored
    // add_generation_prompt would give "12+34" and another answer.
    std::ofstream t(dir + "/chat_template.jinja");
    t << "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}";
  }
  const std::string jsonl = dir + "/prompts.jsonl";
  {
    std::ofstream f(jsonl);
    f << "{\"messages\": [{\"role\": \"user\", \"content\": \"12+\"}, {\"role\": \"user\", \"content\": \"34\"}]}\n";
  }
  const std::string common = "--model " + dir + " --temperature 0 --max-new-tokens 6 --json";
  Result chat = run(common + " --prompts " + jsonl);
  Result text = run(common + " --prompt '12+34='");
  ASSERT_EQ(chat.code, 0) << chat.out;
  ASSERT_EQ(text.code, 0) << text.out;
  const auto jc = nlohmann::json::parse(chat.out), jt = nlohmann::json::parse(text.out);
  EXPECT_EQ(jc["results"][0]["prompt"], "12+34=");
  EXPECT_EQ(jc["results"][0]["prompt_ids"], jt["results"][0]["prompt_ids"]);
  EXPECT_EQ(jc["results"][0]["samples"][0]["ids"], jt["results"][0]["samples"][0]["ids"]);
  // The demo teacher adds: the greedy answer starts with 46.
  EXPECT_EQ(jt["results"][0]["samples"][0]["text"].get<std::string>().rfind("46", 0), 0u) << text.out;
  // --chat: a text prompt (flag or file line) is one user message through the same template.
  {
    std::ofstream f(jsonl);
    f << "{\"prompt\": \"12+34\"}\n";
  }
  for (const std::string& how : {std::string(" --prompt '12+34'"), " --prompts " + jsonl}) {
    Result c = run(common + " --chat" + how);
    ASSERT_EQ(c.code, 0) << c.out;
    const auto jx = nlohmann::json::parse(c.out);
    EXPECT_EQ(jx["results"][0]["prompt"], "12+34=") << how;
    EXPECT_EQ(jx["results"][0]["samples"][0]["ids"], jt["results"][0]["samples"][0]["ids"]) << how;
  }
  {
    std::ofstream f(jsonl);
    f << "{\"messages\": [{\"role\": \"user\", \"content\": \"12+\"}, {\"role\": \"user\", \"content\": \"34\"}]}\n";
  }
  // A template that fails names the line.
  {
    std::ofstream t(dir + "/chat_template.jinja");
    t << "{{ raise_exception('no system role here') }}";
  }
  Result bad = run(common + " --prompts " + jsonl, true);
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.out.find("line 1: the chat template failed"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("no system role here"), std::string::npos) << bad.out;
  fs::remove_all(dir);
}

// --device cuda runs the same engine on the GPU: in f32 it gives the CPU's greedy tokens on every
// fixture family (the engine-level tests, tests/cuda/test_cuda_rollout.cpp, show why: same
// sampling, f32 logits within ~1e-6); bf16 runs and gives as many tokens. Without a GPU the
// flag is a named error (and the GPU half skips).
TEST(GenerateCli, DeviceCudaGivesTheCpuTokens) {
  const std::string prompt = " --prompt-ids 3,1,4,1,5 --temperature 0 --max-new-tokens 12 --json";
  if (device_hooks::cuda_device_count() == 0) {
    Result r = run("--model " + test::model_dir("qwen3") + prompt + " --device cuda", true);
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.out.find("opd generate --device cuda: no usable CUDA device here"), std::string::npos)
        << r.out;
    GTEST_SKIP() << "no CUDA device: only the error without one was checked";
  }
  for (const char* family : test::families()) {
    const std::string base = "--model " + test::model_dir(family) + prompt;
    Result cpu = run(base), gpu = run(base + " --device cuda --dtype f32"),
           bf16 = run(base + " --device cuda");
    ASSERT_EQ(cpu.code, 0) << cpu.out;
    ASSERT_EQ(gpu.code, 0) << gpu.out;
    ASSERT_EQ(bf16.code, 0) << bf16.out;
    const auto jc = nlohmann::json::parse(cpu.out), jg = nlohmann::json::parse(gpu.out),
               jb = nlohmann::json::parse(bf16.out);
    EXPECT_EQ(jg["results"][0]["samples"][0]["ids"], jc["results"][0]["samples"][0]["ids"]) << family;
    const auto& lc = jc["results"][0]["samples"][0]["model_logprobs"];
    const auto& lg = jg["results"][0]["samples"][0]["model_logprobs"];
    ASSERT_EQ(lg.size(), lc.size());
    for (size_t i = 0; i < lc.size(); ++i)
      EXPECT_NEAR(lg[i].get<double>(), lc[i].get<double>(), 1e-4) << family << " token " << i;
    EXPECT_EQ(jb["results"][0]["samples"][0]["ids"].size(), 12u) << family;
  }
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
      {m + " --prompts " + jsonl, "line 1: a text prompt needs a tokenizer"},
      {"--model " + test::source_dir() + "/demo/teacher --prompts " + jsonl,
       "line 1: a chat prompt needs a chat template"},
      {"--model " + test::source_dir() + "/demo/teacher --chat --prompt 1+1",
       "--prompt: a chat prompt needs a chat template"},
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
