// SwiGLU: gradient check over gate and up, saturated inputs, f32/f64, poison, shape errors.
#include <gtest/gtest.h>

#include <cmath>

#include "kernel_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

class SwigluShapes : public ::testing::TestWithParam<Shape> {};

TEST_P(SwigluShapes, ForwardMatchesDefinitionAndGradientMatchesFiniteDifferences) {
  Shape shape = GetParam();
  Tensor gate = rand64(shape, 1, -6, 6);  // both signs, into the sigmoid's tails
  Tensor up = rand64(shape, 2);
  Tensor r = rand64(shape, 3);
  Tensor out = Tensor::poisoned(shape, DType::F64);
  auto loss = [&] {
    ops::swiglu_forward(gate, up, out);
    return dot(out, r);
  };
  loss();
  for (int64_t i = 0; i < gate.numel(); ++i) {
    double g = gate.data<double>()[i];
    EXPECT_NEAR(out.data<double>()[i], g / (1 + std::exp(-g)) * up.data<double>()[i], 1e-15);
  }
  Tensor num_gate = numeric_grad(gate, loss), num_up = numeric_grad(up, loss);
  Tensor dgate = Tensor::poisoned(shape, DType::F64), dup = Tensor::poisoned(shape, DType::F64);
  ops::swiglu_backward(r, gate, up, dgate, dup);
  EXPECT_TRUE(grad_close(dgate, num_gate));
  EXPECT_TRUE(grad_close(dup, num_up));
}

TEST_P(SwigluShapes, Float32MatchesFloat64) {
  Shape shape = GetParam();
  Tensor gate = random_uniform(shape, DType::F32, 4, -6, 6);
  Tensor up = random_uniform(shape, DType::F32, 5);
  Tensor dout = random_uniform(shape, DType::F32, 6);
  Tensor res[2][3];
  for (int i = 0; i < 2; ++i) {
    DType dt = i ? DType::F64 : DType::F32;
    Tensor out = Tensor::poisoned(shape, dt), dg = Tensor::poisoned(shape, dt),
           du = Tensor::poisoned(shape, dt);
    ops::swiglu_forward(gate.to_dtype(dt), up.to_dtype(dt), out);
    ops::swiglu_backward(dout.to_dtype(dt), gate.to_dtype(dt), up.to_dtype(dt), dg, du);
    res[i][0] = out, res[i][1] = dg, res[i][2] = du;
  }
  for (int j = 0; j < 3; ++j) EXPECT_TRUE(f32_close(res[0][j], res[1][j])) << "output " << j;
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwigluShapes,
                         ::testing::Values(Shape{1, 1}, Shape{3, 7}, Shape{2, 5, 3}, Shape{1, 16}, Shape{0, 3}));

TEST(Swiglu, SaturatedGatesStayFinite) {
  // exp(-g) overflows for g < -709 in double (-88 in float): sigmoid must be taken from the
  // safe side. silu(g) -> g for g >> 0 and -> 0 for g << 0; d silu -> 1 and 0.
  for (DType dt : {DType::F32, DType::F64}) {
    Tensor gate = Tensor::from_vector<double>({-1000, -100, 100, 1000}, {4}).to_dtype(dt);
    Tensor up = Tensor::from_vector<double>({0.5, -0.25, 0.75, -1.5}, {4}).to_dtype(dt);
    Tensor ones = Tensor::from_vector<double>({1, 1, 1, 1}, {4}).to_dtype(dt);
    Tensor out = Tensor::poisoned({4}, dt), dg = Tensor::poisoned({4}, dt), du = Tensor::poisoned({4}, dt);
    ops::swiglu_forward(gate, up, out);
    ops::swiglu_backward(ones, gate, up, dg, du);
    Tensor want_out = Tensor::from_vector<double>({0, 0, 75, -1500}, {4});
    Tensor want_dg = Tensor::from_vector<double>({0, 0, 0.75, -1.5}, {4});
    Tensor want_du = Tensor::from_vector<double>({0, 0, 100, 1000}, {4});
    EXPECT_TRUE(close(out, want_out, 1e-6, 1e-30));
    EXPECT_TRUE(close(dg, want_dg, 1e-6, 1e-30));
    EXPECT_TRUE(close(du, want_du, 1e-6, 1e-30));
  }
}

TEST(Swiglu, ShapeErrors) {
  Tensor gate = rand64({3, 4}, 7), up = rand64({4, 3}, 8);
  Tensor out = Tensor::poisoned({3, 4}, DType::F64);
  EXPECT_TRUE(throws([&] { ops::swiglu_forward(gate, up, out); }, ErrorKind::InvalidArgument,
                     {"swiglu_forward", "up must have shape [3, 4]", "[4, 3]"}));
  Tensor dg = Tensor::poisoned({3, 4}, DType::F64), du = Tensor::poisoned({3, 5}, DType::F64);
  EXPECT_TRUE(throws([&] { ops::swiglu_backward(rand64({3, 4}, 9), gate, rand64({3, 4}, 10), dg, du); },
                     ErrorKind::InvalidArgument, {"swiglu_backward", "dup", "[3, 5]"}));
}

}  // namespace
}  // namespace opd::test
