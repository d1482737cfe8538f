// `opd eval` as a process with the teacher metrics (train/eval.h) on the committed demo teacher:
// the teacher evaluated against itself gives reverse KL 0 and 100% agreement in one --json
// object beside exact match; a teacher metric without --teacher and an unknown metric are
// named errors.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "common/test_util.h"

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
