// AdamW + global grad-norm clipping on the CPU against torch.optim.AdamW and
// torch.nn.utils.clip_grad_norm_ (tests/fixtures/train/adamw.safetensors, written by
// tools/make_adamw_fixture.py), plus validation, exact resume and the model copy.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/test_util.h"
#include "kernels/fixture_reader.h"
#include "kernels/kernel_test_util.h"
#include "train/optimizer.h"

namespace opd {
namespace {

constexpr int kParams = 5, kSteps = 5;

struct FixtureRun {
  std::vector<Tensor> master, grad, model;
  AdamW opt;
};

AdamWConfig fixture_config(const test::Fixture& f) {
  const double* h = f["hyper"].data<double>();
  AdamWConfig c;
  c.beta1 = h[0], c.beta2 = h[1], c.eps = h[2], c.weight_decay = h[3];
  return c;
}

std::string key(const char* what, int s, int i) { return cat(what, "_", s, "_", i); }

TEST(AdamW, MatchesTorchAdamWWithClippingOverSeveralSteps) {
  test::Fixture f(test::fixture_path("train/adamw.safetensors"));
  std::vector<Tensor> master, grad, model;
  std::vector<OptimParam> params;
  for (int i = 0; i < kParams; ++i) {
    master.push_back(f[cat("p0_", i)].clone());
    grad.push_back(Tensor::zeros(master.back().shape(), DType::F32));
    model.push_back(Tensor::poisoned(master.back().shape(), DType::BF16));
    params.push_back({master[i], grad[i], model[i]});
  }
  AdamW opt(params, fixture_config(f));
  const double* lr = f["lr"].data<double>();
  const double* max_norm = f["max_norm"].data<double>();
  const double* norm = f["norm"].data<double>();
  for (int s = 0; s < kSteps; ++s) {
    SCOPED_TRACE(cat("step ", s));
    for (int i = 0; i < kParams; ++i) grad[i].copy_from(f[key("g", s, i)]);
    StepReport r = opt.step(lr[s], max_norm[s]);
    EXPECT_EQ(r.norm_computed, max_norm[s] > 0);
    if (max_norm[s] > 0) {
      EXPECT_NEAR(r.grad_norm, norm[s], 2e-6 * norm[s]);
      EXPECT_EQ(r.clip_coef < 1.0, norm[s] > max_norm[s]) << "coef " << r.clip_coef;
    }
    EXPECT_EQ(opt.steps(), s + 1);
    for (int i = 0; i < kParams; ++i) {
      SCOPED_TRACE(cat("param ", i));
      // f32 arithmetic in torch's operation order: a few ulp at most (FMA contraction).
      EXPECT_TRUE(test::close(master[i], f[key("p", s, i)], 1e-6, 1e-7, 1e-6));
      EXPECT_TRUE(test::close(opt.exp_avg()[i], f[key("m", s, i)], 1e-6, 1e-9, 1e-6));
      EXPECT_TRUE(test::close(opt.exp_avg_sq()[i], f[key("v", s, i)], 1e-6, 1e-12, 1e-6));
      // The bf16 copy is the rounding of the master weights (one bf16 ulp where the f32
      // values straddle a rounding boundary).
      EXPECT_TRUE(test::close(model[i].to_dtype(DType::F32), f[key("bf16", s, i)], 8e-3, 0, 1e-3));
    }
  }
}

TEST(AdamW, GradientsAreLeftUntouchedByClipping) {
  Tensor p = test::random_uniform({100}, DType::F32, 1);
  Tensor g = test::random_uniform({100}, DType::F32, 2, -10, 10);
  Tensor g0 = g.clone();
  AdamW opt({{p, g, Tensor()}}, AdamWConfig{});
  StepReport r = opt.step(1e-3, 1.0);
  EXPECT_TRUE(r.norm_computed);
  EXPECT_GT(r.grad_norm, 1.0);
  EXPECT_NEAR(r.clip_coef, 1.0 / (r.grad_norm + 1e-6), 1e-6);
  EXPECT_TRUE(test::same_bits(g, g0));
  EXPECT_NEAR(opt.grad_norm(), r.grad_norm, 1e-12);
}

TEST(AdamW, ClippedStepEqualsAStepOnPrescaledGradients) {
  Tensor p1 = test::random_uniform({333}, DType::F32, 3), p2 = p1.clone();
  Tensor g = test::random_uniform({333}, DType::F32, 4, -5, 5);
  AdamW a({{p1, g, Tensor()}}, AdamWConfig{});
  StepReport r = a.step(1e-2, 0.25);
  Tensor gs = g.clone();
  const float coef = static_cast<float>(r.clip_coef);
  for (int64_t i = 0; i < gs.numel(); ++i) gs.data<float>()[i] *= coef;
  AdamW b({{p2, gs, Tensor()}}, AdamWConfig{});
  b.step(1e-2);
  EXPECT_TRUE(test::same_bits(p1, p2));
}

TEST(AdamW, ResumeFromSavedStateIsBitExact) {
  const AdamWConfig cfg{0.9, 0.95, 1e-8, 0.1};
  Tensor pa = test::random_uniform({7, 13}, DType::F32, 5), pb = pa.clone();
  Tensor ga = Tensor::zeros({7, 13}, DType::F32), gb = ga.clone();
  AdamW a({{pa, ga, Tensor()}}, cfg);
  AdamW b({{pb, gb, Tensor()}}, cfg);
  for (int s = 0; s < 4; ++s) {
    Tensor g = test::random_uniform({7, 13}, DType::F32, 100 + s);
    ga.copy_from(g);
    a.step(1e-3 * (s + 1), s % 2 ? 0.5 : 0.0);
    if (s == 1) {  // "checkpoint" b after two steps and continue in a fresh optimizer
      gb.copy_from(g);
      b.step(1e-3 * (s + 1), 0.5);
    } else if (s == 0) {
      gb.copy_from(g);
      b.step(1e-3, 0.0);
    }
  }
  Tensor pc = pb.clone(), gc = Tensor::zeros({7, 13}, DType::F32);
  AdamW c({{pc, gc, Tensor()}}, cfg);
  c.exp_avg()[0].copy_from(b.exp_avg()[0]);
  c.exp_avg_sq()[0].copy_from(b.exp_avg_sq()[0]);
  c.set_steps(b.steps());
  for (int s = 2; s < 4; ++s) {
    gc.copy_from(test::random_uniform({7, 13}, DType::F32, 100 + s));
    c.step(1e-3 * (s + 1), s % 2 ? 0.5 : 0.0);
  }
  EXPECT_TRUE(test::same_bits(pa, pc));
  EXPECT_TRUE(test::same_bits(a.exp_avg()[0], c.exp_avg()[0]));
  EXPECT_TRUE(test::same_bits(a.exp_avg_sq()[0], c.exp_avg_sq()[0]));
}

// step_if_finite is grad_norm() + step() with one norm pass: same bits, clipping or not; a
// non-finite gradient leaves everything (weights, moments, step count) as it was.
TEST(AdamW, StepIfFiniteEqualsNormThenStepAndSkipsNonFinite) {
  const AdamWConfig cfg{0.9, 0.95, 1e-8, 0.1};
  Tensor pa = test::random_uniform({9, 11}, DType::F32, 7), pb = pa.clone();
  Tensor ga = Tensor::zeros({9, 11}, DType::F32), gb = ga.clone();
  Tensor ma = Tensor::zeros({9, 11}, DType::BF16), mb = ma.clone();
  AdamW a({{pa, ga, ma}}, cfg);
  AdamW b({{pb, gb, mb}}, cfg);
  for (int s = 0; s < 4; ++s) {
    const Tensor g = test::random_uniform({9, 11}, DType::F32, 300 + s, -4, 4);
    ga.copy_from(g);
    gb.copy_from(g);
    const double max_norm = s % 2 ? 0.5 : 0.0;  // clipping active, then off
    const double norm = a.grad_norm();
    const StepReport ra = a.step(1e-2, max_norm);
    StepReport rb;
    ASSERT_TRUE(b.step_if_finite(1e-2, max_norm, &rb));
    EXPECT_EQ(rb.grad_norm, norm);
    if (max_norm > 0) EXPECT_EQ(rb.clip_coef, ra.clip_coef);
    EXPECT_LT(rb.clip_coef, max_norm > 0 ? 1.0 : 1.5);
  }
  EXPECT_TRUE(test::same_bits(pa, pb));
  EXPECT_TRUE(test::same_bits(ma, mb));
  EXPECT_TRUE(test::same_bits(a.exp_avg_sq()[0], b.exp_avg_sq()[0]));
  EXPECT_EQ(b.steps(), 4);
  // A NaN gradient: no update, no step counted, the norm reported.
  const Tensor before = pb.clone(), m_before = b.exp_avg()[0].clone();
  gb.data<float>()[5] = std::nanf("");
  StepReport r;
  EXPECT_FALSE(b.step_if_finite(1e-2, 1.0, &r));
  EXPECT_TRUE(std::isnan(r.grad_norm));
  EXPECT_TRUE(test::same_bits(pb, before));
  EXPECT_TRUE(test::same_bits(b.exp_avg()[0], m_before));
  EXPECT_EQ(b.steps(), 4);
}

// Gradient buffers can be released between steps and new ones bound: the step reads the new
// buffers; using the optimizer while released is an error, and bad buffers are refused.
TEST(AdamW, ReleasedGradientsMustBeBoundAgain) {
  const AdamWConfig cfg{0.9, 0.95, 1e-8, 0.0};
  Tensor pa = test::random_uniform({5, 6}, DType::F32, 3), pb = pa.clone();
  Tensor ga = test::random_uniform({5, 6}, DType::F32, 4), gb_old = Tensor::zeros({5, 6}, DType::F32);
  AdamW a({{pa, ga, Tensor()}}, cfg);
  AdamW b({{pb, gb_old, Tensor()}}, cfg);
  a.step(1e-2);
  b.release_grads();
  EXPECT_FALSE(b.grads_bound());
  EXPECT_THROW(b.step(1e-2), Error);
  EXPECT_THROW(b.grad_norm(), Error);
  EXPECT_THROW(b.bind_grads({Tensor::zeros({6, 5}, DType::F32)}), Error);  // wrong shape
  EXPECT_THROW(b.bind_grads({}), Error);                                   // wrong count
  b.bind_grads({ga.clone()});
  EXPECT_TRUE(b.grads_bound());
  b.step(1e-2);
  EXPECT_TRUE(test::same_bits(pa, pb));
}

TEST(AdamW, ZeroLearningRateAndNoDecayLeaveWeightsButMoveMoments) {
  Tensor p = test::random_uniform({50}, DType::F32, 6), p0 = p.clone();
  Tensor g = test::random_uniform({50}, DType::F32, 7);
  AdamW opt({{p, g, Tensor()}}, AdamWConfig{0.9, 0.999, 1e-8, 0.0});
  opt.step(0.0);
  EXPECT_TRUE(test::same_bits(p, p0));
  for (int64_t i = 0; i < 50; ++i)
    EXPECT_FLOAT_EQ(opt.exp_avg()[0].data<float>()[i], 0.1f * g.data<float>()[i]);
}

TEST(AdamW, RejectsBadParametersAndHyperparameters) {
  Tensor p = test::random_uniform({4}, DType::F32, 1);
  Tensor g5 = test::random_uniform({5}, DType::F32, 2);
  Tensor g64 = test::random_uniform({4}, DType::F64, 2);
  EXPECT_TRUE(test::throws([&] { AdamW({{p, g5, Tensor()}}, AdamWConfig{}); },
                           ErrorKind::InvalidArgument, {"grad", "does not match"}));
  EXPECT_TRUE(test::throws([&] { AdamW({{p, g64, Tensor()}}, AdamWConfig{}); },
                           ErrorKind::InvalidArgument, {"must be f32"}));
  Tensor g = test::random_uniform({4}, DType::F32, 3);
  EXPECT_TRUE(test::throws([&] { AdamW({{p, g, Tensor()}}, AdamWConfig{1.0, 0.9, 1e-8, 0}); },
                           ErrorKind::InvalidArgument, {"betas"}));
  EXPECT_TRUE(test::throws([&] { AdamW({{p, g, Tensor()}}, AdamWConfig{0.9, 0.9, 0, 0}); },
                           ErrorKind::InvalidArgument, {"eps"}));
  Tensor bad_model = Tensor::zeros({4}, DType::F64);
  EXPECT_TRUE(test::throws([&] { AdamW({{p, g, bad_model}}, AdamWConfig{}); },
                           ErrorKind::InvalidArgument, {"model copy"}));
  AdamW ok({{p, g, Tensor()}}, AdamWConfig{});
  EXPECT_TRUE(test::throws([&] { ok.step(std::nan("")); }, ErrorKind::InvalidArgument, {"lr"}));
}

}  // namespace
}  // namespace opd
