// `opd eval` as a process with the teacher metrics (train/eval.h) on the committed demo teacher:
// the teacher evaluated against itself gives reverse KL 0 and 100% agreement in one --json
// object beside exact match; --device cuda gives the CPU's numbers (f32) on a GPU and a named
// error without one; a teacher metric without --teacher and an unknown metric are named errors.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "common/test_util.h"
#include "core/tensor.h"  // device_hooks::cuda_device_count

namespace opd {
namespace {

using Result = test::OpdResult;  // stdout only: the JSON parses; the log goes to the test log
Result run(const std::string& args) { return test::run_opd(args); }

std::string demo(const std::string& rel) { return test::source_dir() + "/demo/" + rel; }

TEST(CliEval, TeacherAgainstItselfHasZeroReverseKlAndFullAgreement) {
  Result r = run("eval --model " + demo("teacher") + " --teacher " + demo("teacher") + " --data " +
                 demo("data/eval.jsonl") + " --metric exact-match reverse-kl agreement --limit 24" +
                 " --max-new-tokens 5 --samples 2 --seed 3 --agreement-tokens 4 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_GE(j["exact_match"].get<double>(), 0.9) << r.out;
  const auto& kl = j["reverse_kl"];
  EXPECT_EQ(kl["samples"].get<int64_t>(), 48);
  EXPECT_GT(kl["tokens"].get<int64_t>(), 48);
  EXPECT_NEAR(kl["per_token"].get<double>(), 0.0, 1e-4) << r.out;
  EXPECT_LT(kl["student_logprob"].get<double>(), 0.0);
  const auto& ag = j["agreement"];
  EXPECT_EQ(ag["prompts"].get<int64_t>(), 24);
  EXPECT_DOUBLE_EQ(ag["exact_rate"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(ag["token_agreement"].get<double>(), 1.0);
}

// The same metrics with the model and the teacher on the GPU (f32: exact match and agreement
// equal the CPU's, reverse KL within rounding; bf16 runs). Without a GPU: the named error.
TEST(CliEval, DeviceCudaGivesTheCpuNumbers) {
  const std::string base = "eval --model " + demo("teacher") + " --teacher " + demo("teacher") +
                           " --data " + demo("data/eval.jsonl") +
                           " --metric exact-match reverse-kl agreement --limit 16 --max-new-tokens 5" +
                           " --samples 2 --seed 3 --agreement-tokens 4 --json";
  if (device_hooks::cuda_device_count() == 0) {
    Result r = run(base + " --device cuda 2>&1");
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.out.find("opd eval --device cuda: no usable CUDA device here"), std::string::npos)
        << r.out;
    GTEST_SKIP() << "no CUDA device: only the error without one was checked";
  }
  Result cpu = run(base), gpu = run(base + " --device cuda --dtype f32"),
         bf16 = run(base + " --device cuda");
  ASSERT_EQ(cpu.code, 0) << cpu.out;
  ASSERT_EQ(gpu.code, 0) << gpu.out;
  ASSERT_EQ(bf16.code, 0) << bf16.out;
  const auto c = nlohmann::json::parse(cpu.out), g = nlohmann::json::parse(gpu.out),
             b = nlohmann::json::parse(bf16.out);
  EXPECT_EQ(g["correct"], c["correct"]);
  EXPECT_EQ(g["reverse_kl"]["tokens"], c["reverse_kl"]["tokens"]);
  EXPECT_NEAR(g["reverse_kl"]["student_logprob"].get<double>(),
              c["reverse_kl"]["student_logprob"].get<double>(), 1e-4);
  EXPECT_NEAR(g["reverse_kl"]["per_token"].get<double>(), 0.0, 1e-4);
  EXPECT_EQ(g["agreement"]["exact"], c["agreement"]["exact"]);
  EXPECT_GE(b["exact_match"].get<double>(), 0.8) << bf16.out;
  EXPECT_EQ(b["samples"], c["samples"]);
}

// A long evaluation shows progress: without a terminal, log lines counting finished samples.
TEST(CliEval, ProgressIsLogged) {
  Result r = run("eval --model " + demo("teacher") + " --data " + demo("data/eval.jsonl") +
                 " --limit 12 --max-new-tokens 4 2>&1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("samples 12/12 (100.0%)  exact-match finished"), std::string::npos) << r.out;
}

TEST(CliEval, TeacherMetricsNeedATeacher) {
  Result r = run("eval --model " + demo("teacher") + " --data " + demo("data/eval.jsonl") +
                 " --metric reverse-kl 2>&1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("need --teacher"), std::string::npos) << r.out;
  r = run("eval --model " + demo("teacher") + " --data " + demo("data/eval.jsonl") +
          " --metric forward-kl 2>&1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("forward-kl"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace opd
