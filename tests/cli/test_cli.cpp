// The `opd` binary end to end: `opd info` and `opd predict` on the committed fixture models,
// and clear errors (non-zero exit, message naming the problem) for bad input.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "common/test_util.h"

namespace opd {
namespace {

using Result = test::OpdResult;
Result run(const std::string& args) { return test::run_opd(args, test::Stderr::Merge); }

std::string model(const char* family) { return test::fixture_path(std::string("models/") + family); }

TEST(CliInfo, JsonMatchesTheFixtureConfig) {
  for (const char* fam : {"qwen3", "qwen2", "llama"}) {
    Result r = run("info " + model(fam) + " --json");
    ASSERT_EQ(r.code, 0) << r.out;
    auto j = nlohmann::json::parse(r.out);
    auto cfg = nlohmann::json::parse(std::ifstream(model(fam) + "/config.json"));
    EXPECT_EQ(j["architecture"], cfg["architectures"][0]) << fam;
    EXPECT_EQ(j["vocab_size"], cfg["vocab_size"]);
    EXPECT_EQ(j["num_hidden_layers"], cfg["num_hidden_layers"]);
    EXPECT_EQ(j["tie_word_embeddings"], cfg["tie_word_embeddings"]);
    EXPECT_EQ(j["tokenizer_fingerprint"].get<std::string>().size(), 64u);
    EXPECT_GT(j["num_parameters"].get<int64_t>(), j["num_non_embedding_parameters"].get<int64_t>());
  }
}

TEST(CliInfo, ParameterCountsMatchTheStoredTensors) {
  // Fixture parameter counts printed by tools/make_fixtures.py from transformers.
  const std::pair<const char*, int64_t> expected[] = {{"qwen3", 46384}, {"qwen2", 42640}, {"llama", 63808}};
  for (auto [fam, n] : expected) {
    Result r = run("info " + model(fam) + " --json");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(nlohmann::json::parse(r.out)["num_parameters"].get<int64_t>(), n) << fam;
  }
}

TEST(CliInfo, TableOutputNamesTheArchitecture) {
  Result r = run("info " + model("llama"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("LlamaForCausalLM"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("llama3 scaling"), std::string::npos) << r.out;
}

// Stored tensors the config does not read (here llama_bias with attention_bias edited to false)
// are named by `opd info` as by every command that loads the weights (session 16; it said
// nothing); the fixtures as committed list none.
TEST(CliInfo, StoredTensorsTheConfigDoesNotReadAreNamed) {
  namespace fs = std::filesystem;
  Result r = run("info " + model("llama_bias") + " --json");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(nlohmann::json::parse(r.out)["unused_tensors"].empty()) << r.out;
  const fs::path dir = fs::temp_directory_path() / ("opd_cli_unused_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::copy(model("llama_bias"), dir, fs::copy_options::recursive);
  auto cfg = nlohmann::json::parse(std::ifstream((dir / "config.json").string()));
  cfg["attention_bias"] = false;
  std::ofstream((dir / "config.json").string()) << cfg.dump();
  r = run("info " + dir.string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("not used by its config.json"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("unused         "), std::string::npos) << r.out;
  r = test::run_opd("info " + dir.string() + " --json", test::Stderr::Discard);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto unused = nlohmann::json::parse(r.out)["unused_tensors"];
  EXPECT_FALSE(unused.empty());
  EXPECT_NE(unused.dump().find("model.layers.0.self_attn.k_proj.bias"), std::string::npos) << r.out;
  fs::remove_all(dir);
}

TEST(CliInfo, BadDirectoriesGiveNamedErrors) {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("opd_cli_test_" + std::to_string(getpid()));
  fs::create_directories(dir);
  Result r = run("info " + dir.string());
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("config.json"), std::string::npos) << r.out;

  // A config without weights: the error names the missing safetensors.
  fs::copy_file(model("qwen3") + "/config.json", dir / "config.json");
  r = run("info " + dir.string());
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("safetensors"), std::string::npos) << r.out;

  // Weights of another model: a named shape or missing-tensor error, never a crash.
  fs::copy_file(model("qwen2") + "/model.safetensors", dir / "model.safetensors");
  r = run("info " + dir.string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("model."), std::string::npos) << r.out;
  fs::remove_all(dir);

  r = run("info /nonexistent/path");
  EXPECT_NE(r.code, 0);
}

TEST(CliPredict, PrintsPredictionsForEverySequence) {
  Result r = run("predict --model " + model("qwen3") + " --ids 1,2,3,4 --ids 5 --top 3 --generate 2 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[0]["top"].size(), 3u);
  EXPECT_EQ(j[1]["greedy"].size(), 2u);
  double total = 0;
  for (const auto& t : j[0]["top"]) total += t["prob"].get<double>();
  EXPECT_GT(total, 0.0);
  EXPECT_LE(total, 1.0 + 1e-9);
  // Probabilities are sorted, descending.
  EXPECT_GE(j[0]["top"][0]["prob"].get<double>(), j[0]["top"][1]["prob"].get<double>());
}

TEST(CliPredict, BatchingDoesNotChangeResults) {
  // The same sequence alone and inside a packed batch gives the same predictions.
  Result alone = run("predict --model " + model("llama") + " --ids 7,8,9,10,11 --json");
  Result batched = run("predict --model " + model("llama") + " --ids 1,2 --ids 7,8,9,10,11 --ids 3 --json");
  ASSERT_EQ(alone.code, 0) << alone.out;
  ASSERT_EQ(batched.code, 0) << batched.out;
  auto a = nlohmann::json::parse(alone.out)[0], b = nlohmann::json::parse(batched.out)[1];
  EXPECT_EQ(a["top"][0]["id"], b["top"][0]["id"]);
  EXPECT_NEAR(a["next_token_loss"].get<double>(), b["next_token_loss"].get<double>(), 1e-5);
}

TEST(CliPredict, OutOfVocabularyIdIsANamedError) {
  Result r = run("predict --model " + model("qwen3") + " --ids 1,2,96");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("token id 96 at sequence 0 position 2"), std::string::npos) << r.out;
  r = run("predict --model " + model("qwen3") + " --ids 1,x");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("'x' is not an integer"), std::string::npos) << r.out;
  r = run("predict --model " + model("qwen3") + " --ids -1");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("token id -1"), std::string::npos) << r.out;
}

// `opd doctor --device-memory-budget` reports what `opd train` would choose, so it follows the
// trainer's rule: with --loss-support full the dense teacher runs in the training phase and is
// never offloaded (the plan runs on any machine: no GPU needed).
TEST(CliDoctor, MemoryBudgetOffloadsTheTeacherOnlyWhereTheTrainerMay) {
  const std::string teacher = test::source_dir() + "/demo/teacher";
  const std::string base = "doctor --student " + teacher + " --teacher " + teacher +
                           " --device cuda --device-memory-budget 0.001";
  Result r = run(base);
  EXPECT_EQ(r.code, 1) << r.out;  // nothing fits 1 MiB: an error
  EXPECT_NE(r.out.find("nothing fits; the smallest plan is recompute"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("teacher offloaded, planned peak"), std::string::npos) << r.out;
  r = run(base + " --loss-support full");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("nothing fits; the smallest plan is recompute"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("teacher offloaded"), std::string::npos) << r.out;
  r = run(base + " --loss-support full --offload-teacher");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--offload-teacher cannot be used with --loss-support full"),
            std::string::npos) << r.out;
}

}  // namespace
}  // namespace opd
