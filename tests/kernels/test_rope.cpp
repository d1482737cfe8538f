// Rotary embedding in place: gradient check (backward = transpose), the rotation definition,
// the relative-position property, f32/f64, position validation.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernel_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

// inv_freq[i] = 1 / theta^(2i/d), the Hugging Face default, as the model passes it (f32).
Tensor default_inv_freq(int64_t head_dim, DType dtype = DType::F32, double theta = 10000.0) {
  std::vector<double> f(static_cast<size_t>(head_dim / 2));
  for (size_t i = 0; i < f.size(); ++i) f[i] = 1.0 / std::pow(theta, 2.0 * i / head_dim);
  return Tensor::from_vector(f, {head_dim / 2}).to_dtype(dtype);
}

struct RopeShape {
  int64_t n, heads, head_dim;
};

class RopeShapes : public ::testing::TestWithParam<RopeShape> {};

TEST_P(RopeShapes, BackwardMatchesFiniteDifferences) {
  auto [n, heads, d] = GetParam();
  Tensor positions = random_ints({n}, 1, 0, 4096);
  positions.data<int32_t>()[0] = 0;
  Tensor inv_freq = default_inv_freq(d);
  Tensor x = rand64({n, heads, d}, 2);
  Tensor r = rand64({n, heads, d}, 3);
  auto loss = [&] {
    Tensor y = x.clone();
    ops::rope_forward(y, positions, inv_freq);
    return dot(y, r);
  };
  Tensor numeric = numeric_grad(x, loss);
  Tensor dx = r.clone();
  ops::rope_backward(dx, positions, inv_freq);
  EXPECT_TRUE(grad_close(dx, numeric));
}

TEST_P(RopeShapes, ForwardIsTheRotateHalfRotation) {
  auto [n, heads, d] = GetParam();
  Tensor positions = random_ints({n}, 4, 0, 100000);
  Tensor inv_freq = default_inv_freq(d, DType::F64);
  Tensor x = rand64({n, heads, d}, 5);
  Tensor y = x.clone();
  ops::rope_forward(y, positions, inv_freq);
  const double* xs = x.data<double>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < d / 2; ++i) {
        double a = positions.data<int32_t>()[t] * inv_freq.data<double>()[i];
        int64_t base = (t * heads + h) * d;
        double x1 = xs[base + i], x2 = xs[base + i + d / 2];
        EXPECT_NEAR(y.data<double>()[base + i], x1 * std::cos(a) - x2 * std::sin(a), 1e-14);
        EXPECT_NEAR(y.data<double>()[base + i + d / 2], x2 * std::cos(a) + x1 * std::sin(a), 1e-14);
      }
}

// The f32 path forms the angle as the f32 product position * inv_freq (what transformers does;
// at position 2048 it differs from the double angle by ~1e-4 rad), then rotates in double.
TEST_P(RopeShapes, Float32UsesTheFloat32AngleLikeTransformers) {
  auto [n, heads, d] = GetParam();
  Tensor positions = random_ints({n}, 6, 0, 2048);
  Tensor inv_freq = default_inv_freq(d);
  Tensor x32 = random_uniform({n, heads, d}, DType::F32, 7);
  Tensor orig = x32.clone();
  ops::rope_forward(x32, positions, inv_freq);
  Tensor expect = Tensor::poisoned({n, heads, d}, DType::F32);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < d / 2; ++i) {
        float a32 = static_cast<float>(positions.data<int32_t>()[t]) *
                    inv_freq.data<float>()[i];
        double a = a32;
        int64_t base = (t * heads + h) * d;
        double x1 = orig.data<float>()[base + i], x2 = orig.data<float>()[base + i + d / 2];
        expect.data<float>()[base + i] = static_cast<float>(x1 * std::cos(a) - x2 * std::sin(a));
        expect.data<float>()[base + i + d / 2] = static_cast<float>(x2 * std::cos(a) + x1 * std::sin(a));
      }
  EXPECT_TRUE(f32_close(x32, expect));
  ops::rope_backward(x32, positions, inv_freq);  // the exact inverse rotation
  EXPECT_TRUE(f32_close(x32, orig));
}

// head_dim 2 (one pair), 6 (odd half), 16; one row; one head; no rows.
INSTANTIATE_TEST_SUITE_P(Shapes, RopeShapes,
                         ::testing::Values(RopeShape{1, 1, 2}, RopeShape{5, 3, 6},
                                           RopeShape{4, 2, 16}, RopeShape{3, 1, 6},
                                           RopeShape{0, 2, 4}));

TEST(Rope, ScoresDependOnlyOnRelativePosition) {
  // <R(m) q, R(n) k> = <R(m - n) q, k>: what makes RoPE a relative position encoding.
  const int64_t d = 8;
  Tensor inv_freq = default_inv_freq(d, DType::F64);
  Tensor q = rand64({1, 1, d}, 8), k = rand64({1, 1, d}, 9);
  auto score = [&](int32_t m, int32_t n) {
    Tensor qr = q.clone(), kr = k.clone();
    ops::rope_forward(qr, Tensor::from_vector<int32_t>({m}, {1}), inv_freq);
    ops::rope_forward(kr, Tensor::from_vector<int32_t>({n}, {1}), inv_freq);
    return dot(qr, kr);
  };
  EXPECT_NEAR(score(7, 3), score(4, 0), 1e-12);
  EXPECT_NEAR(score(1003, 1000), score(3, 0), 1e-10);
  EXPECT_GT(std::fabs(score(7, 3) - score(7, 4)), 1e-6);  // and it does depend on it
}

TEST(Rope, NegativePositionIsRejectedBeforeAnyWrite) {
  Tensor positions = Tensor::from_vector<int32_t>({0, 1, -3, 2}, {4});
  Tensor inv_freq = default_inv_freq(4);
  Tensor x = rand64({4, 2, 4}, 10);
  Tensor before = x.clone();
  EXPECT_TRUE(throws([&] { ops::rope_forward(x, positions, inv_freq); }, ErrorKind::InvalidData,
                     {"rope_forward", "position -3", "at row 2"}));
  EXPECT_TRUE(throws([&] { ops::rope_backward(x, positions, inv_freq); }, ErrorKind::InvalidData,
                     {"rope_backward", "position -3", "at row 2"}));
  EXPECT_TRUE(same_bits(x, before));
}

TEST(Rope, ShapeErrors) {
  Tensor x = rand64({4, 2, 5}, 11);
  EXPECT_TRUE(throws([&] { ops::rope_forward(x, random_ints({4}, 12, 0, 9), default_inv_freq(4)); },
                     ErrorKind::InvalidArgument, {"rope_forward", "head_dim must be even", "[4, 2, 5]"}));
  Tensor x4 = rand64({4, 2, 4}, 13);
  EXPECT_TRUE(throws([&] { ops::rope_forward(x4, random_ints({4}, 14, 0, 9), default_inv_freq(6)); },
                     ErrorKind::InvalidArgument, {"rope_forward", "inv_freq must have shape [2]", "[3]"}));
  EXPECT_TRUE(throws([&] { ops::rope_forward(x4, random_ints({3}, 15, 0, 9), default_inv_freq(4)); },
                     ErrorKind::InvalidArgument, {"rope_forward", "positions must have shape [4]"}));
}

}  // namespace
}  // namespace opd::test
