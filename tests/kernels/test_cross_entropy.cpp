// Cross-entropy with ignored rows: gradient check, count of valid rows, log-sum-exp stability,
// f32/f64, poison, target validation.
#include <gtest/gtest.h>

#include <cmath>

#include "kernel_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

struct CeCase {
  int64_t n, vocab;
  double logit_range;
  int64_t ignored_every;  // 0: none ignored; k: rows k-1, 2k-1, ... ignored (1: all)
};

Tensor make_targets(const CeCase& c, uint64_t seed) {
  Tensor t = random_ints({c.n}, seed, 0, static_cast<int32_t>(c.vocab));
  if (c.ignored_every)
    for (int64_t i = c.ignored_every - 1; i < c.n; i += c.ignored_every) t.data<int32_t>()[i] = -100;
  return t;
}

class CrossEntropyCases : public ::testing::TestWithParam<CeCase> {};

TEST_P(CrossEntropyCases, ForwardMatchesDefinitionAndGradientMatchesFiniteDifferences) {
  const CeCase& c = GetParam();
  Tensor logits = rand64({c.n, c.vocab}, 1, -c.logit_range, c.logit_range);
  Tensor targets = make_targets(c, 2);
  const double scale = 0.37;  // e.g. 1 / number of valid tokens of the step
  Tensor losses = Tensor::poisoned({c.n}, DType::F64), lse = Tensor::poisoned({c.n}, DType::F64);
  int64_t valid = -1;
  auto loss = [&] {
    valid = ops::cross_entropy_forward(logits, targets, losses, lse);
    double s = 0;
    for (int64_t i = 0; i < c.n; ++i) s += losses.data<double>()[i];
    return scale * s;
  };
  loss();
  int64_t want_valid = 0;
  for (int64_t i = 0; i < c.n; ++i) {
    int32_t y = targets.data<int32_t>()[i];
    long double sum = 0;  // the definition, summed in long double without any shift
    for (int64_t v = 0; v < c.vocab; ++v) sum += std::exp(static_cast<long double>(logits.data<double>()[i * c.vocab + v]));
    double want_lse = static_cast<double>(std::log(sum));
    EXPECT_NEAR(lse.data<double>()[i], want_lse, 1e-13 * std::max(1.0, std::fabs(want_lse)));
    double want_loss = y == -100 ? 0.0 : want_lse - logits.data<double>()[i * c.vocab + y];
    EXPECT_NEAR(losses.data<double>()[i], want_loss, 1e-12 * std::max(1.0, std::fabs(want_lse)));
    want_valid += y != -100;
  }
  EXPECT_EQ(valid, want_valid);
  Tensor numeric = numeric_grad(logits, loss);
  loss();
  Tensor dlogits = Tensor::poisoned({c.n, c.vocab}, DType::F64);
  ops::cross_entropy_backward(logits, targets, lse, scale, dlogits);
  EXPECT_TRUE(grad_close(dlogits, numeric));
}

TEST_P(CrossEntropyCases, Float32MatchesFloat64) {
  const CeCase& c = GetParam();
  Tensor logits = random_uniform({c.n, c.vocab}, DType::F32, 3, -c.logit_range, c.logit_range);
  Tensor targets = make_targets(c, 4);
  Tensor res[2][3];
  for (int i = 0; i < 2; ++i) {
    DType dt = i ? DType::F64 : DType::F32;
    Tensor z = logits.to_dtype(dt);
    Tensor losses = Tensor::poisoned({c.n}, dt), lse = Tensor::poisoned({c.n}, dt);
    Tensor dz = Tensor::poisoned({c.n, c.vocab}, dt);
    ops::cross_entropy_forward(z, targets, losses, lse);
    ops::cross_entropy_backward(z, targets, lse, 0.5, dz);
    res[i][0] = losses, res[i][1] = lse, res[i][2] = dz;
  }
  // Losses are differences lse - z of values up to logit_range: f32 rounding of those.
  double atol = 1e-6 * std::max(1.0, c.logit_range);
  for (int j = 0; j < 3; ++j) EXPECT_TRUE(f32_close(res[0][j], res[1][j], 1e-5, atol)) << "output " << j;
}

// V = 1 (loss 0); every row ignored; one ignored row; larger logits; odd vocabulary sizes; no rows.
INSTANTIATE_TEST_SUITE_P(Cases, CrossEntropyCases,
                         ::testing::Values(CeCase{1, 1, 1, 0}, CeCase{3, 5, 2, 1}, CeCase{4, 7, 3, 3},
                                           CeCase{5, 33, 10, 0}, CeCase{1, 2, 1, 0},
                                           CeCase{0, 5, 1, 0}));

TEST(CrossEntropy, HugeLogitsStayFiniteAndShiftInvariant) {
  // log-sum-exp must shift by the row max: logits ~ 1e3 overflow exp() without it.
  Tensor z = rand64({3, 6}, 5, -3, 3);
  Tensor shifted = z.clone();
  for (int64_t i = 0; i < shifted.numel(); ++i) shifted.data<double>()[i] += 1000.0;
  Tensor targets = Tensor::from_vector<int32_t>({0, 5, 2}, {3});
  Tensor l0 = Tensor::poisoned({3}, DType::F64), l1 = l0.clone(), s0 = l0.clone(), s1 = l0.clone();
  ops::cross_entropy_forward(z, targets, l0, s0);
  ops::cross_entropy_forward(shifted, targets, l1, s1);
  EXPECT_TRUE(close(l1, l0, 1e-10, 1e-12));
  Tensor d0 = Tensor::poisoned({3, 6}, DType::F64), d1 = d0.clone();
  ops::cross_entropy_backward(z, targets, s0, 1.0, d0);
  ops::cross_entropy_backward(shifted, targets, s1, 1.0, d1);
  EXPECT_TRUE(close(d1, d0, 1e-9, 1e-12));
}

TEST(CrossEntropy, OutOfVocabularyTargetsAreRejected) {
  const int64_t vocab = 7;
  Tensor logits = rand64({4, vocab}, 6);
  for (int32_t bad : {7, -5, -1, -101, 1 << 30}) {
    Tensor targets = Tensor::from_vector<int32_t>({3, -100, bad, 6}, {4});
    std::string value = "target " + std::to_string(bad);
    Tensor losses = Tensor::poisoned({4}, DType::F64), lse = Tensor::poisoned({4}, DType::F64);
    EXPECT_TRUE(throws([&] { ops::cross_entropy_forward(logits, targets, losses, lse); },
                       ErrorKind::InvalidData, {"cross_entropy_forward", value, "at row 2", "[0, 7)"}));
    EXPECT_TRUE(all_nan(losses) && all_nan(lse)) << "rows before the bad target were written";
    Tensor dlogits = Tensor::poisoned({4, vocab}, DType::F64);
    EXPECT_TRUE(throws([&] { ops::cross_entropy_backward(logits, targets, rand64({4}, 7), 1.0, dlogits); },
                       ErrorKind::InvalidData, {"cross_entropy_backward", value, "at row 2"}));
    EXPECT_TRUE(all_nan(dlogits));
  }
}

TEST(CrossEntropy, ShapeErrors) {
  Tensor logits = rand64({4, 7}, 8);
  Tensor losses = Tensor::poisoned({4}, DType::F64), lse = Tensor::poisoned({3}, DType::F64);
  EXPECT_TRUE(throws([&] { ops::cross_entropy_forward(logits, random_ints({4}, 9, 0, 7), losses, lse); },
                     ErrorKind::InvalidArgument, {"cross_entropy_forward", "lse must have shape [4]", "[3]"}));
  Tensor lse4 = Tensor::poisoned({4}, DType::F64);
  EXPECT_TRUE(throws([&] { ops::cross_entropy_forward(logits, random_ints({5}, 10, 0, 7), losses, lse4); },
                     ErrorKind::InvalidArgument, {"cross_entropy_forward", "targets must have shape [4]"}));
  Tensor dz = Tensor::poisoned({4, 6}, DType::F64);
  EXPECT_TRUE(throws([&] { ops::cross_entropy_backward(logits, random_ints({4}, 11, 0, 7), rand64({4}, 12), 1.0, dz); },
                     ErrorKind::InvalidArgument, {"cross_entropy_backward", "dlogits", "[4, 6]"}));
}

}  // namespace
}  // namespace opd::test
