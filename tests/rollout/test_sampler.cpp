// Sampling against transformers: opd's sampling distribution equals the softmax of HF's warped
// scores (temperature, top-k, top-p, min-p in generate's order) element-wise, and the
// frequencies of tokens sampled by the engine (n = 4000 samples of one prompt, fixed seed) pass
// a chi-square goodness-of-fit test against HF's probabilities at every fixture configuration.
// Threshold: p-value >= 1e-4 per test (64 tests: a correct sampler fails any of them with
// probability ~0.6%; the seeds are fixed, so the outcome is deterministic). The same counts must
// be rejected (p < 1e-4) against every other configuration's distribution that is at least 0.1
// away in total variation, so the test has the power to fail. Also: the per-token logprobs,
// greedy, the Philox stream, and parameter validation.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "common/chi_square.h"
#include "rollout/sampler.h"
#include "rollout_test_util.h"

namespace opd {
namespace {

using test::chi2_pvalue;
using test::chi2_test;

TEST(ChiSquare, PValuesMatchTables) {
  // Critical values from the standard chi-square table (upper 5% and 0.1% points).
  EXPECT_NEAR(chi2_pvalue(3.841, 1), 0.05, 1e-4);
  EXPECT_NEAR(chi2_pvalue(5.991, 2), 0.05, 1e-4);
  EXPECT_NEAR(chi2_pvalue(18.307, 10), 0.05, 1e-4);
  EXPECT_NEAR(chi2_pvalue(124.342, 100), 0.05, 1e-4);
  EXPECT_NEAR(chi2_pvalue(29.588, 10), 0.001, 1e-5);
  EXPECT_NEAR(chi2_pvalue(0.0, 3), 1.0, 1e-12);
}

SamplingParams params_of(const nlohmann::json& c, uint64_t seed = 0) {
  SamplingParams p;
  p.temperature = c["temperature"].get<double>();
  p.top_k = c["top_k"].get<int64_t>();
  p.top_p = c["top_p"].get<double>();
  p.min_p = c["min_p"].get<double>();
  p.seed = seed;
  return p;
}

std::string describe(const SamplingParams& p) {
  return cat("T=", p.temperature, " top_k=", p.top_k, " top_p=", p.top_p, " min_p=", p.min_p);
}

class SamplerFamilies : public ::testing::TestWithParam<const char*> {};

TEST_P(SamplerFamilies, DistributionEqualsTransformersWarpers) {
  nlohmann::json fx = test::generate_fixture(GetParam());
  int checked = 0;
  for (const auto& e : fx["sampling"]) {
    std::vector<float> logits = e["logits"].get<std::vector<float>>();
    for (const auto& c : e["configs"]) {
      SamplingParams p = params_of(c);
      std::vector<double> want = c["probs"].get<std::vector<double>>(), got;
      sampling_distribution(logits.data(), static_cast<int64_t>(logits.size()), p, got);
      ASSERT_EQ(got.size(), want.size());
      for (size_t v = 0; v < want.size(); ++v) {
        EXPECT_EQ(got[v] > 0, want[v] > 0) << describe(p) << " token " << v << " kept-set differs";
        EXPECT_NEAR(got[v], want[v], 1e-6) << describe(p) << " token " << v;
      }
      ++checked;
    }
  }
  EXPECT_GE(checked, 14);
}

TEST_P(SamplerFamilies, SampledFrequenciesPassChiSquareAgainstTransformers) {
  const std::string family = GetParam();
  nlohmann::json fx = test::generate_fixture(family);
  Transformer model = Transformer::load(test::model_dir(family));
  RolloutEngine engine(model, EngineOptions{}, {});
  constexpr int64_t kSamples = 4000;
  int tested = 0, power_checks = 0;
  for (const auto& e : fx["sampling"]) {
    const std::vector<int32_t> prompt = e["prompt"].get<std::vector<int32_t>>();
    const std::vector<double> model_lp = e["model_logprobs"].get<std::vector<double>>();
    const auto& configs = e["configs"];
    for (size_t ci = 0; ci < configs.size(); ++ci) {
      SamplingParams p = params_of(configs[ci], 1000 + ci);
      std::vector<double> want = configs[ci]["probs"].get<std::vector<double>>();
      GenerationRequest r = test::request(prompt, 1, p.temperature, p.seed, kSamples);
      r.sampling = p;
      auto out = engine.generate({r});
      ASSERT_EQ(out[0].samples.size(), static_cast<size_t>(kSamples));
      std::vector<int64_t> counts(want.size(), 0);
      for (const SampleOutput& s : out[0].samples) {
        ASSERT_EQ(s.ids.size(), 1u);
        const int32_t t = s.ids[0];
        ASSERT_GT(want[t], 0) << describe(p) << ": sampled token " << t << " outside the kept set";
        counts[t] += 1;
        EXPECT_NEAR(s.sampling_logprobs[0], std::log(want[t]), 1e-5) << describe(p);
        EXPECT_NEAR(s.model_logprobs[0], model_lp[t], 2e-5) << describe(p);
      }
      const double pv = chi2_test(counts, want);
      EXPECT_GE(pv, 1e-4) << family << " " << describe(p) << ": chi-square p-value " << pv;
      ++tested;
      // Power: the same counts must be rejected against clearly different distributions.
      for (size_t other = 0; other < configs.size(); ++other) {
        std::vector<double> alt = configs[other]["probs"].get<std::vector<double>>();
        double tv = 0;
        for (size_t v = 0; v < alt.size(); ++v) tv += 0.5 * std::fabs(alt[v] - want[v]);
        if (tv < 0.1) continue;
        EXPECT_LT(chi2_test(counts, alt), 1e-4)
            << family << " " << describe(p) << " not told apart from "
            << describe(params_of(configs[other])) << " (TV " << tv << ")";
        ++power_checks;
      }
    }
  }
  EXPECT_GE(tested, 14);
  EXPECT_GE(power_checks, 10);
  std::printf("%s: %d chi-square tests of %lld samples, %d power checks\n", family.c_str(),
              tested, (long long)kSamples, power_checks);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SamplerFamilies,
                         ::testing::Values("qwen3", "qwen2", "llama", "llama_bias"));

TEST(Sampler, GreedyIsTheFirstArgmaxWithProbabilityOne) {
  std::vector<float> z = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f};
  SamplingParams p;
  p.temperature = 0;
  std::vector<double> scratch;
  for (double u : {0.0, 0.3, 0.999}) {
    SampledToken t = sample_token(z.data(), 5, p, u, scratch);
    EXPECT_EQ(t.id, 1);  // ties go to the lower id, like torch.argmax
    EXPECT_EQ(t.sampling_logprob, 0.0);
    double lse = std::log(std::exp(0.5) + 2 * std::exp(2.0) + std::exp(-1.0) + std::exp(1.0));
    EXPECT_NEAR(t.model_logprob, 2.0 - lse, 1e-12);
  }
}

TEST(Sampler, InverseCdfFollowsTokenOrder) {
  // p = softmax(log[0.1, 0.2, 0.3, 0.4]): u partitions [0, 1) in id order.
  std::vector<float> z = {std::log(0.1f), std::log(0.2f), std::log(0.3f), std::log(0.4f)};
  SamplingParams p;
  std::vector<double> scratch;
  const std::vector<std::pair<double, int32_t>> cases = {
      {0.0, 0}, {0.0999, 0}, {0.1001, 1}, {0.2999, 1}, {0.3001, 2}, {0.5999, 2}, {0.6001, 3}, {0.99999, 3}};
  for (auto [u, id] : cases) {
    SampledToken t = sample_token(z.data(), 4, p, u, scratch);
    EXPECT_EQ(t.id, id) << "u = " << u;
    EXPECT_NEAR(t.sampling_logprob, std::log(0.1 * (id + 1)), 1e-6);
  }
  // With top_k = 2 only ids 2 and 3 remain (3/7, 4/7); the sampling logprob is renormalized
  // while the model logprob is not.
  p.top_k = 2;
  SampledToken t = sample_token(z.data(), 4, p, 0.0, scratch);
  EXPECT_EQ(t.id, 2);
  EXPECT_NEAR(t.sampling_logprob, std::log(3.0 / 7.0), 1e-6);
  EXPECT_NEAR(t.model_logprob, std::log(0.3), 1e-6);
}

TEST(Sampler, PhiloxStreamIsUniformAndKeyedByEveryCoordinate) {
  std::map<std::vector<double>, int> seen;
  double sum = 0;
  int n = 0;
  for (uint32_t step = 0; step < 50; ++step) {
    for (uint32_t sample = 0; sample < 50; ++sample) {
      double u = sampling_uniform(7, 12345, sample, step);
      ASSERT_GE(u, 0.0);
      ASSERT_LT(u, 1.0);
      sum += u;
      ++n;
    }
  }
  EXPECT_NEAR(sum / n, 0.5, 0.02);  // 2500 uniforms: sd of the mean 0.0058
  const double base = sampling_uniform(7, 12345, 3, 4);
  EXPECT_EQ(base, sampling_uniform(7, 12345, 3, 4));  // pure function
  EXPECT_NE(base, sampling_uniform(8, 12345, 3, 4));
  EXPECT_NE(base, sampling_uniform(7, 12346, 3, 4));
  EXPECT_NE(base, sampling_uniform(7, 12345, 4, 4));
  EXPECT_NE(base, sampling_uniform(7, 12345, 3, 5));
  EXPECT_NE(base, sampling_uniform(7, 12345ull | (1ull << 40), 3, 4));  // high key bits count
  const std::vector<int32_t> a = {1, 2, 3}, b = {1, 2, 4}, c = {1, 2, 3, 0};
  EXPECT_NE(prompt_stream_key(a), prompt_stream_key(b));
  EXPECT_NE(prompt_stream_key(a), prompt_stream_key(c));
  EXPECT_EQ(prompt_stream_key(a), prompt_stream_key(std::vector<int32_t>{1, 2, 3}));
}

TEST(Sampler, ValidatesParametersAndLogits) {
  auto fails = [](SamplingParams p, const std::string& part) {
    try {
      p.validate();
      return ::testing::AssertionFailure() << "no error for " << part;
    } catch (const Error& e) {
      if (std::string(e.what()).find(part) == std::string::npos)
        return ::testing::AssertionFailure() << e.what();
      return ::testing::AssertionSuccess();
    }
  };
  SamplingParams p;
  p.temperature = -1;
  EXPECT_TRUE(fails(p, "temperature must be a finite number >= 0 (0 = greedy), got -1"));
  p = {};
  p.top_p = 0;
  EXPECT_TRUE(fails(p, "top_p must be in (0, 1], got 0"));
  p = {};
  p.top_p = 1.5;
  EXPECT_TRUE(fails(p, "top_p must be in (0, 1], got 1.5"));
  p = {};
  p.top_k = -3;
  EXPECT_TRUE(fails(p, "top_k must be >= 0"));
  p = {};
  p.min_p = 2;
  EXPECT_TRUE(fails(p, "min_p must be in [0, 1], got 2"));
  std::vector<float> z = {0.f, NAN, 1.f};
  std::vector<double> scratch;
  try {
    sample_token(z.data(), 3, SamplingParams{}, 0.5, scratch);
    ADD_FAILURE() << "NaN logit accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData);
    EXPECT_NE(std::string(e.what()).find("of token 1 is not finite"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace opd
