// Held-out evaluation against a teacher (train/eval.h) on tiny random models: a teacher equal to
// the student gives reverse KL 0 and 100% greedy agreement; with a different teacher every
// per-token log q / log p equals log_softmax(z / T) of a dense forward of each model, the
// estimate lies within its standard error of the exact per-position KL computed densely, and the
// agreement counts are consistent; bad options are named.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "common/run_dir_test.h"
#include "common/test_util.h"
#include "core/error.h"
#include "data/dataset.h"
#include "model/init.h"
#include "model/safetensors.h"
#include "model/transformer.h"
#include "rollout/engine.h"
#include "teacher/scorer.h"
#include "tokenizer/tokenizer.h"
#include "train/eval.h"
#include "train/text_adapters.h"

namespace opd {
namespace {

namespace fs = std::filesystem;

constexpr int32_t kEos = 256;  // the demo tokenizer's EOS (test_util.h)

class EvalTeacherTest : public test::RunDirTest {
 protected:
  EvalTeacherTest() : RunDirTest("opd_eval_") {}
  void SetUp() override {
    RunDirTest::SetUp();
    const std::string tok = test::source_dir() + "/demo/tokenizer";
    // std 0.1 (not 0.02) so the distributions are far from uniform and differ between models.
    save_model_dir(path("student"), test::tiny_demo_config(32, 1),
                   init_weights(test::tiny_demo_config(32, 1), 1, 0.1), tok);
    save_model_dir(path("teacher"), test::tiny_demo_config(48, 2),
                   init_weights(test::tiny_demo_config(48, 2), 2, 0.1), tok);
    std::ofstream f(path("prompts.jsonl"));
    for (int i = 0; i < 8; ++i) {  // prompt-only, pre-tokenized, lengths 3..10, ids below EOS
      f << "{\"prompt_ids\": [";
      for (int j = 0; j < 3 + i; ++j) f << (j ? "," : "") << (i * 41 + j * 17 + 5) % 256;
      f << "]}\n";
    }
  }

  Dataset prompts() const {
    Tokenizer tok = Tokenizer::load(test::source_dir() + "/demo/tokenizer");
    TokenizerTextEncoder enc(tok);
    DatasetOptions o;
    o.require_completion = false;
    return Dataset::load({path("prompts.jsonl")}, enc, nullptr, o);
  }
};

// log_softmax(z / T)[id] at every position of `seq` (dense: the test's reference).
std::vector<std::vector<double>> dense_logprobs(const Transformer& m, const std::vector<int32_t>& seq,
                                                double temperature) {
  const Tensor logits = m.forward(make_batch({seq}, m.config().vocab_size));
  const int64_t v = m.config().vocab_size;
  std::vector<std::vector<double>> out(seq.size(), std::vector<double>(static_cast<size_t>(v)));
  const float* z = logits.data<float>();
  for (size_t p = 0; p < seq.size(); ++p) {
    double mx = -INFINITY;
    for (int64_t i = 0; i < v; ++i) mx = std::max(mx, z[p * v + i] / temperature);
    double s = 0;
    for (int64_t i = 0; i < v; ++i) s += std::exp(z[p * v + i] / temperature - mx);
    const double lse = mx + std::log(s);
    for (int64_t i = 0; i < v; ++i) out[p][static_cast<size_t>(i)] = z[p * v + i] / temperature - lse;
  }
  return out;
}

// A training run's stop signal abandons an evaluation (EvalOptions::should_cancel, polled per
// generation step; the trainer logs the evaluation as abandoned): a Cancelled error, not the
// whole evaluation first (session 16: with a real model it could hold the exit past 60 s).
TEST_F(EvalTeacherTest, ExactMatchStopsWhenCancelled) {
  std::ofstream f(path("ref.jsonl"));
  for (int i = 0; i < 4; ++i) f << "{\"prompt_ids\": [5, 6, 7], \"completion_ids\": [8, 9, 10, 11]}\n";
  f.close();
  Tokenizer tok = Tokenizer::load(test::source_dir() + "/demo/tokenizer");
  TokenizerTextEncoder enc(tok);
  const Dataset data = Dataset::load({path("ref.jsonl")}, enc, nullptr, DatasetOptions{});
  const Transformer m = Transformer::load(path("student"));
  EvalOptions o;
  o.max_new_tokens = 8;
  EXPECT_EQ(evaluate_exact_match(m, {kEos}, data, o).total, 4);
  int polls = 0;
  o.should_cancel = [&] { return ++polls > 1; };
  try {
    (void)evaluate_exact_match(m, {kEos}, data, o);
    ADD_FAILURE() << "a cancelled evaluation completed";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Cancelled) << e.what();
  }
  EXPECT_EQ(polls, 2);
}

TEST_F(EvalTeacherTest, ReverseKlIsZeroWhenTheTeacherIsTheStudent) {
  const Dataset data = prompts();
  const Transformer student = Transformer::load(path("student"));
  CpuScorer teacher(path("student"));
  ReverseKlOptions o;
  o.max_new_tokens = 12;
  o.samples_per_prompt = 3;
  o.seed = 7;
  o.keep_samples = true;
  const ReverseKlResult r = evaluate_reverse_kl(student, teacher, {kEos}, data, o);
  EXPECT_EQ(r.prompts, 8);
  EXPECT_EQ(r.samples, 24);
  ASSERT_GT(r.tokens, 24);
  ASSERT_EQ(static_cast<int64_t>(r.kept.size()), r.samples);
  int64_t tokens = 0;
  for (const auto& s : r.kept) {
    ASSERT_EQ(s.ids.size(), s.student_logprobs.size());
    ASSERT_EQ(s.ids.size(), s.teacher_logprobs.size());
    tokens += static_cast<int64_t>(s.ids.size());
    for (size_t t = 0; t < s.ids.size(); ++t) {
      ASSERT_TRUE(std::isfinite(s.student_logprobs[t]));
      // Paged rollout forward vs the scorer's packed forward: f32 rounding only.
      EXPECT_NEAR(s.student_logprobs[t], s.teacher_logprobs[t], 1e-4 + 1e-5 * std::abs(s.teacher_logprobs[t]));
    }
  }
  EXPECT_EQ(tokens, r.tokens);
  EXPECT_NEAR(r.mean, 0.0, 1e-5);
  EXPECT_NEAR(r.student_logprob, r.teacher_logprob, 1e-5);
  EXPECT_LT(r.student_logprob, -0.1);  // a real distribution, not a point mass
}

TEST_F(EvalTeacherTest, ReverseKlMatchesADenseReference) {
  const Dataset data = prompts();
  const Transformer student = Transformer::load(path("student"));
  const Transformer teacher_model = Transformer::load(path("teacher"));
  CpuScorer teacher(path("teacher"));
  for (double temperature : {1.0, 0.7}) {
    SCOPED_TRACE("T = " + std::to_string(temperature));
    ReverseKlOptions o;
    o.max_new_tokens = 10;
    o.samples_per_prompt = 4;
    o.temperature = temperature;
    o.seed = 3;
    o.keep_samples = true;
    const ReverseKlResult r = evaluate_reverse_kl(student, teacher, {kEos}, data, o);
    ASSERT_EQ(r.samples, 32);
    double sum = 0, exact_sum = 0;
    int64_t tokens = 0;
    for (const auto& s : r.kept) {
      std::vector<int32_t> seq = data[static_cast<size_t>(s.prompt_index)].prompt_ids;
      const size_t p0 = seq.size();
      seq.insert(seq.end(), s.ids.begin(), s.ids.end());
      const auto lq = dense_logprobs(student, seq, temperature);
      const auto lp = dense_logprobs(teacher_model, seq, temperature);
      for (size_t t = 0; t < s.ids.size(); ++t) {
        const auto& q = lq[p0 + t - 1];  // position p is predicted from row p - 1
        const auto& p = lp[p0 + t - 1];
        const auto y = static_cast<size_t>(s.ids[t]);
        EXPECT_NEAR(s.student_logprobs[t], q[y], 1e-4 + 1e-5 * std::abs(q[y]));
        EXPECT_NEAR(s.teacher_logprobs[t], p[y], 1e-4 + 1e-5 * std::abs(p[y]));
        sum += s.student_logprobs[t] - s.teacher_logprobs[t];
        double kl = 0;  // exact KL(q || p) at this position
        for (size_t i = 0; i < q.size(); ++i) kl += std::exp(q[i]) * (q[i] - p[i]);
        exact_sum += kl;
        ++tokens;
      }
    }
    ASSERT_EQ(tokens, r.tokens);
    EXPECT_NEAR(r.mean, sum / static_cast<double>(tokens), 1e-9 * std::abs(r.mean) + 1e-12);
    const double exact = exact_sum / static_cast<double>(tokens);
    EXPECT_GT(exact, 0.05);  // the models really differ
    EXPECT_GT(r.std_error, 0.0);
    // Seeded, so deterministic; an unbiased estimate lies within a few standard errors.
    EXPECT_NEAR(r.mean, exact, 4 * r.std_error) << "exact " << exact << " se " << r.std_error;
  }
}

TEST_F(EvalTeacherTest, AgreementIsFullWhenTheTeacherIsTheStudent) {
  const Dataset data = prompts();
  const Transformer student = Transformer::load(path("student"));
  AgreementOptions o;
  o.tokens = 9;
  const AgreementResult r = evaluate_agreement(student, {kEos}, student, {kEos}, data, o);
  EXPECT_EQ(r.prompts, 8);
  EXPECT_EQ(r.exact, 8);
  EXPECT_DOUBLE_EQ(r.exact_rate(), 1.0);
  EXPECT_DOUBLE_EQ(r.token_agreement(), 1.0);
  EXPECT_EQ(r.prefix_tokens, r.compared_tokens);
  EXPECT_GT(r.compared_tokens, 8);
  EXPECT_TRUE(r.examples.empty());
}

TEST_F(EvalTeacherTest, AgreementCountsAgainstADifferentTeacher) {
  const Dataset data = prompts();
  const Transformer student = Transformer::load(path("student"));
  const Transformer teacher = Transformer::load(path("teacher"));
  // Reference: each model's greedy answers from the engine, compared here by hand.
  std::vector<GenerationRequest> reqs(data.size());
  for (size_t i = 0; i < data.size(); ++i) {
    reqs[i].prompt = data[i].prompt_ids;
    reqs[i].sampling.temperature = 0;
    reqs[i].max_new_tokens = 9;
  }
  auto s_out = RolloutEngine(student, EngineOptions{}, {kEos}).generate(reqs);
  auto t_out = RolloutEngine(teacher, EngineOptions{}, {kEos}).generate(reqs);
  int64_t exact = 0, agree = 0, compared = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    const auto& a = s_out[i].samples[0].ids;
    const auto& b = t_out[i].samples[0].ids;
    exact += a == b;
    compared += static_cast<int64_t>(std::max(a.size(), b.size()));
    for (size_t t = 0; t < std::min(a.size(), b.size()); ++t) agree += a[t] == b[t];
  }
  AgreementOptions o;
  o.tokens = 9;
  o.max_examples = 2;
  Tokenizer tok = Tokenizer::load(test::source_dir() + "/demo/tokenizer");
  const AgreementResult r = evaluate_agreement(student, {kEos}, teacher, {kEos}, data, o, &tok);
  EXPECT_EQ(r.exact, exact);
  EXPECT_EQ(r.agreeing_tokens, agree);
  EXPECT_EQ(r.compared_tokens, compared);
  EXPECT_LT(r.exact, 8);  // random models of different shapes disagree somewhere
  EXPECT_LE(r.prefix_tokens, r.agreeing_tokens);
  ASSERT_EQ(r.examples.size(), 2u);
  EXPECT_NE(r.examples[0].find("teacher \""), std::string::npos) << r.examples[0];

  // N = 1: exact match and token agreement are the same count.
  o.tokens = 1;
  const AgreementResult one = evaluate_agreement(student, {kEos}, teacher, {kEos}, data, o);
  EXPECT_EQ(one.compared_tokens, 8);
  EXPECT_EQ(one.exact, one.agreeing_tokens);
}

TEST_F(EvalTeacherTest, BadOptionsAreNamed) {
  const Dataset data = prompts();
  const Transformer student = Transformer::load(path("student"));
  CpuScorer teacher(path("teacher"));
  auto expect_error = [&](ReverseKlOptions o, const std::string& what) {
    try {
      evaluate_reverse_kl(student, teacher, {kEos}, data, o);
      ADD_FAILURE() << "no error for " << what;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  ReverseKlOptions o;
  o.samples_per_prompt = 0;
  expect_error(o, "samples per prompt 0");
  o = {};
  o.temperature = 0;
  expect_error(o, "temperature 0");
  o = {};
  o.max_new_tokens = 0;
  expect_error(o, "max_new_tokens 0");
  AgreementOptions a;
  a.tokens = 0;
  EXPECT_THROW(evaluate_agreement(student, {kEos}, student, {kEos}, data, a), Error);
}

}  // namespace
}  // namespace opd
