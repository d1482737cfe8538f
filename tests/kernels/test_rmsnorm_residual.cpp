// RMSNorm fused with the residual add (CPU reference): equals add + rmsnorm exactly, gradient
// check of x, r, w against finite differences (f64), f32 vs f64, in-place ds == dres, errors.
#include <gtest/gtest.h>

#include "kernel_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

struct Case {
  int64_t n, h;
  double eps;
};

class RmsnormResidual : public ::testing::TestWithParam<Case> {};

TEST_P(RmsnormResidual, EqualsAddThenRmsnorm) {
  auto [n, h, eps] = GetParam();
  for (DType dt : {DType::F32, DType::F64}) {
    Tensor x = random_uniform({n, h}, dt, 1), r = random_uniform({n, h}, dt, 2);
    Tensor w = random_uniform({h}, dt, 3, 0.5, 1.5);
    Tensor sum = Tensor::poisoned({n, h}, dt), y = Tensor::poisoned({n, h}, dt);
    Tensor rstd = Tensor::poisoned({n}, dt);
    ops::rmsnorm_residual_forward(x, r, w, eps, sum, y, rstd);
    Tensor sum2 = Tensor::poisoned({n, h}, dt), y2 = Tensor::poisoned({n, h}, dt);
    Tensor rstd2 = Tensor::poisoned({n}, dt);
    ops::add(x, r, sum2);
    ops::rmsnorm_forward(sum2, w, eps, y2, rstd2);
    EXPECT_TRUE(same_bits(sum, sum2));
    EXPECT_TRUE(same_bits(y, y2));
    EXPECT_TRUE(same_bits(rstd, rstd2));

    Tensor dy = random_uniform({n, h}, dt, 4), dres = random_uniform({n, h}, dt, 5);
    Tensor dw0 = random_uniform({h}, dt, 6);
    Tensor ds = Tensor::poisoned({n, h}, dt), dw = dw0.clone();
    ops::rmsnorm_residual_backward(dy, sum, w, rstd, dres, ds, dw);
    Tensor dx2 = Tensor::poisoned({n, h}, dt), dw2 = dw0.clone();
    ops::rmsnorm_backward(dy, sum2, w, rstd2, dx2, dw2);
    ops::add_inplace(dx2, dres);
    EXPECT_TRUE(same_bits(ds, dx2));
    EXPECT_TRUE(same_bits(dw, dw2));

    // In place: the residual gradient buffer receives the result.
    Tensor inplace = dres.clone(), dw3 = dw0.clone();
    ops::rmsnorm_residual_backward(dy, sum, w, rstd, inplace, inplace, dw3);
    EXPECT_TRUE(same_bits(inplace, ds));
    EXPECT_TRUE(same_bits(dw3, dw));
  }
}

TEST_P(RmsnormResidual, GradientsMatchFiniteDifferences) {
  auto [n, h, eps] = GetParam();
  Tensor x = rand64({n, h}, 11), r = rand64({n, h}, 12), w = rand64({h}, 13, 0.5, 1.5);
  Tensor ry = rand64({n, h}, 14), rs = rand64({n, h}, 15);  // L = sum(y*ry) + sum(sum*rs)
  Tensor sum = Tensor::poisoned({n, h}, DType::F64), y = Tensor::poisoned({n, h}, DType::F64);
  Tensor rstd = Tensor::poisoned({n}, DType::F64);
  auto loss = [&] {
    ops::rmsnorm_residual_forward(x, r, w, eps, sum, y, rstd);
    return dot(y, ry) + dot(sum, rs);
  };
  Tensor num_x = numeric_grad(x, loss), num_r = numeric_grad(r, loss), num_w = numeric_grad(w, loss);
  loss();
  Tensor ds = Tensor::poisoned({n, h}, DType::F64), dw0 = rand64({h}, 16), dw = dw0.clone();
  ops::rmsnorm_residual_backward(ry, sum, w, rstd, rs, ds, dw);
  EXPECT_TRUE(grad_close(ds, num_x));
  EXPECT_TRUE(grad_close(ds, num_r));
  EXPECT_TRUE(grad_close(minus(dw, dw0), num_w));
}

TEST_P(RmsnormResidual, Float32MatchesFloat64) {
  auto [n, h, eps] = GetParam();
  Tensor outs[2][5];
  for (int k = 0; k < 2; ++k) {
    DType dt = k ? DType::F64 : DType::F32;
    Tensor x = random_uniform({n, h}, DType::F32, 21).to_dtype(dt);
    Tensor r = random_uniform({n, h}, DType::F32, 22).to_dtype(dt);
    Tensor w = random_uniform({h}, DType::F32, 23, 0.5, 1.5).to_dtype(dt);
    Tensor dy = random_uniform({n, h}, DType::F32, 24).to_dtype(dt);
    Tensor dres = random_uniform({n, h}, DType::F32, 25).to_dtype(dt);
    Tensor sum = Tensor::poisoned({n, h}, dt), y = Tensor::poisoned({n, h}, dt);
    Tensor rstd = Tensor::poisoned({n}, dt), ds = Tensor::poisoned({n, h}, dt);
    Tensor dw = random_uniform({h}, DType::F32, 26).to_dtype(dt);
    ops::rmsnorm_residual_forward(x, r, w, eps, sum, y, rstd);
    ops::rmsnorm_residual_backward(dy, sum, w, rstd, dres, ds, dw);
    outs[k][0] = sum, outs[k][1] = y, outs[k][2] = rstd, outs[k][3] = ds, outs[k][4] = dw;
  }
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(f32_close(outs[0][i], outs[1][i])) << "output " << i;
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsnormResidual,
                         ::testing::Values(Case{1, 1, 0.5}, Case{1, 7, 1e-6}, Case{5, 12, 1e-5},
                                           Case{4, 33, 1e-6}, Case{0, 4, 1e-6},
                                           Case{3, 200, 1e-6}));

TEST(RmsnormResidualErrors, ShapesAndDtypes) {
  Tensor x = rand64({3, 4}, 1), r = rand64({3, 5}, 2), w = rand64({4}, 3);
  Tensor sum = Tensor::poisoned({3, 4}, DType::F64), y = Tensor::poisoned({3, 4}, DType::F64);
  Tensor rstd = Tensor::poisoned({3}, DType::F64);
  EXPECT_TRUE(throws([&] { ops::rmsnorm_residual_forward(x, r, w, 1e-6, sum, y, rstd); },
                     ErrorKind::InvalidArgument,
                     {"rmsnorm_residual_forward", "r must have shape [3, 4]"}));
  Tensor r32 = random_uniform({3, 4}, DType::F32, 4);
  EXPECT_TRUE(throws([&] { ops::rmsnorm_residual_forward(x, r32, w, 1e-6, sum, y, rstd); },
                     ErrorKind::InvalidArgument, {"share one dtype"}));
  Tensor r4 = rand64({3, 4}, 5);
  EXPECT_TRUE(throws([&] { ops::rmsnorm_residual_forward(x, r4, w, -1, sum, y, rstd); },
                     ErrorKind::InvalidArgument, {"eps"}));
  Tensor dres = rand64({2, 4}, 6), ds = Tensor::poisoned({3, 4}, DType::F64), dw = rand64({4}, 7);
  EXPECT_TRUE(throws([&] { ops::rmsnorm_residual_backward(x, x, w, rstd, dres, ds, dw); },
                     ErrorKind::InvalidArgument, {"dres must have shape [3, 4]"}));
}

}  // namespace
}  // namespace opd::test
