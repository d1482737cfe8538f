// Linear (OpenBLAS GEMM): gradient check over x, w, bias with and without bias / dx,
// accumulation into dw and dbias, f32/f64, poison (beta = 0 must not read y), empty sizes.
#include <gtest/gtest.h>

#include "kernel_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

struct LinShape {
  int64_t n, in, out;
  bool bias, want_dx;
};

class LinearShapes : public ::testing::TestWithParam<LinShape> {};

TEST_P(LinearShapes, ForwardMatchesDefinitionAndGradientMatchesFiniteDifferences) {
  auto [n, in, out, has_bias, want_dx] = GetParam();
  Tensor x = rand64({n, in}, 1), w = rand64({out, in}, 2);
  Tensor bias = has_bias ? rand64({out}, 3) : Tensor();
  Tensor r = rand64({n, out}, 4);
  Tensor y = Tensor::poisoned({n, out}, DType::F64);
  auto loss = [&] {
    ops::linear_forward(x, w, bias, y);
    return dot(y, r);
  };
  loss();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t o = 0; o < out; ++o) {
      double s = has_bias ? bias.data<double>()[o] : 0.0;
      for (int64_t c = 0; c < in; ++c) s += x.data<double>()[i * in + c] * w.data<double>()[o * in + c];
      EXPECT_NEAR(y.data<double>()[i * out + o], s, 1e-14);
    }
  Tensor num_x = numeric_grad(x, loss), num_w = numeric_grad(w, loss);
  Tensor num_b = has_bias ? numeric_grad(bias, loss) : Tensor();
  Tensor dx = want_dx ? Tensor::poisoned({n, in}, DType::F64) : Tensor();
  Tensor dw0 = rand64({out, in}, 5), dw = dw0.clone();
  Tensor db0 = rand64({out}, 6), db = has_bias ? db0.clone() : Tensor();
  ops::linear_backward(r, x, w, dx, dw, db);
  if (want_dx) EXPECT_TRUE(grad_close(dx, num_x));
  EXPECT_TRUE(grad_close(minus(dw, dw0), num_w));
  if (has_bias) EXPECT_TRUE(grad_close(minus(db, db0), num_b));
}

TEST_P(LinearShapes, Float32MatchesFloat64) {
  auto [n, in, out, has_bias, want_dx] = GetParam();
  Tensor x = random_uniform({n, in}, DType::F32, 7), w = random_uniform({out, in}, DType::F32, 8);
  Tensor bias = random_uniform({out}, DType::F32, 9), dy = random_uniform({n, out}, DType::F32, 10);
  Tensor dw0 = random_uniform({out, in}, DType::F32, 11), db0 = random_uniform({out}, DType::F32, 12);
  Tensor res[2][4];
  for (int i = 0; i < 2; ++i) {
    DType dt = i ? DType::F64 : DType::F32;
    Tensor b = has_bias ? bias.to_dtype(dt) : Tensor();
    Tensor y = Tensor::poisoned({n, out}, dt), dx = Tensor::poisoned({n, in}, dt);
    Tensor dw = dw0.to_dtype(dt), db = db0.to_dtype(dt);
    ops::linear_forward(x.to_dtype(dt), w.to_dtype(dt), b, y);
    ops::linear_backward(dy.to_dtype(dt), x.to_dtype(dt), w.to_dtype(dt), dx, dw, db);
    res[i][0] = y, res[i][1] = dx, res[i][2] = dw, res[i][3] = db;
  }
  for (int j = 0; j < 4; ++j) EXPECT_TRUE(f32_close(res[0][j], res[1][j])) << "output " << j;
}

// 1x1x1; odd sizes; a bias-less layer; dx skipped (first layer: no input gradient wanted).
INSTANTIATE_TEST_SUITE_P(Shapes, LinearShapes,
                         ::testing::Values(LinShape{1, 1, 1, true, true}, LinShape{3, 5, 4, true, true},
                                           LinShape{7, 16, 9, false, true},
                                           LinShape{5, 3, 6, true, false},
                                           LinShape{2, 33, 1, false, false}));

TEST(Linear, EmptySizes) {
  // in = 0: y = bias (an empty sum); n = 0 or out = 0: nothing to do, and no BLAS error.
  Tensor x = Tensor::empty({3, 0}, DType::F64), w = Tensor::empty({4, 0}, DType::F64);
  Tensor bias = rand64({4}, 13), y = Tensor::poisoned({3, 4}, DType::F64);
  ops::linear_forward(x, w, bias, y);
  for (int64_t i = 0; i < 3; ++i)
    EXPECT_TRUE(close(y.slice_rows(i, i + 1).reshape({4}), bias, 0, 0));
  Tensor y2 = Tensor::poisoned({3, 4}, DType::F64);
  ops::linear_forward(x, w, Tensor(), y2);
  EXPECT_TRUE(close(y2, Tensor::zeros({3, 4}, DType::F64), 0, 0));
  Tensor dx = Tensor::poisoned({0, 5}, DType::F64), dw0 = rand64({2, 5}, 14), dw = dw0.clone();
  Tensor db0 = rand64({2}, 15), db = db0.clone();
  ops::linear_backward(Tensor::empty({0, 2}, DType::F64), Tensor::empty({0, 5}, DType::F64),
                       rand64({2, 5}, 16), dx, dw, db);
  EXPECT_TRUE(same_bits(dw, dw0));
  EXPECT_TRUE(same_bits(db, db0));
  // out = 0: dx = dy @ w is an empty sum, so 0.
  Tensor dx2 = Tensor::poisoned({3, 5}, DType::F64), dw2 = Tensor::empty({0, 5}, DType::F64);
  Tensor none;
  ops::linear_backward(Tensor::empty({3, 0}, DType::F64), rand64({3, 5}, 17), dw2, dx2, dw2, none);
  EXPECT_TRUE(close(dx2, Tensor::zeros({3, 5}, DType::F64), 0, 0));
}

TEST(Linear, ShapeErrors) {
  Tensor x = rand64({3, 5}, 18), w = rand64({4, 6}, 19);
  Tensor y = Tensor::poisoned({3, 4}, DType::F64);
  EXPECT_TRUE(throws([&] { ops::linear_forward(x, w, Tensor(), y); }, ErrorKind::InvalidArgument,
                     {"linear_forward", "w must have shape [4, 5]", "[4, 6]"}));
  Tensor w5 = rand64({4, 5}, 20);
  EXPECT_TRUE(throws([&] { ops::linear_forward(x, w5, rand64({3}, 21), y); },
                     ErrorKind::InvalidArgument, {"linear_forward", "bias must have shape [4]"}));
  Tensor dx = Tensor::poisoned({3, 5}, DType::F64), dw = rand64({4, 5}, 22), db = rand64({4}, 23);
  EXPECT_TRUE(throws([&] { ops::linear_backward(rand64({3, 5}, 24), x, w5, dx, dw, db); },
                     ErrorKind::InvalidArgument, {"linear_backward", "dy must have shape [3, 4]"}));
  Tensor dw32 = random_uniform({4, 5}, DType::F32, 25);
  EXPECT_TRUE(throws([&] { ops::linear_backward(rand64({3, 4}, 26), x, w5, dx, dw32, db); },
                     ErrorKind::InvalidArgument, {"linear_backward", "dw is f32"}));
}

}  // namespace
}  // namespace opd::test
