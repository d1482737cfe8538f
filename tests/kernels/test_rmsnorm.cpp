// RMSNorm forward/backward: gradient check over x and w, f32/f64, poison, shape errors.
#include <gtest/gtest.h>

#include <cmath>

#include "kernel_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

struct NormShape {
  int64_t n, h;
  double eps;  // h = 1 needs a large eps: dx = w dy eps / (x^2 + eps)^1.5 is all cancellation
};

class RmsnormShapes : public ::testing::TestWithParam<NormShape> {};

TEST_P(RmsnormShapes, ForwardMatchesDefinitionAndGradientMatchesFiniteDifferences) {
  auto [n, h, eps] = GetParam();
  Tensor x = rand64({n, h}, 1);
  Tensor w = rand64({h}, 2, 0.5, 1.5);
  Tensor r = rand64({n, h}, 3);
  Tensor y = Tensor::poisoned({n, h}, DType::F64);
  Tensor rstd = Tensor::poisoned({n}, DType::F64);
  auto loss = [&] {
    ops::rmsnorm_forward(x, w, eps, y, rstd);
    return dot(y, r);
  };
  loss();
  for (int64_t i = 0; i < n; ++i) {  // rstd from its definition, computed here independently
    double ss = 0;
    for (int64_t c = 0; c < h; ++c) ss += std::pow(x.data<double>()[i * h + c], 2);
    EXPECT_NEAR(rstd.data<double>()[i], 1 / std::sqrt(ss / h + eps), 1e-12 * rstd.data<double>()[i]);
  }
  Tensor num_x = numeric_grad(x, loss);
  Tensor num_w = numeric_grad(w, loss);
  loss();  // restore y/rstd for the unperturbed inputs
  Tensor dx = Tensor::poisoned({n, h}, DType::F64);
  Tensor dw0 = rand64({h}, 4);
  Tensor dw = dw0.clone();
  ops::rmsnorm_backward(r, x, w, rstd, dx, dw);
  EXPECT_TRUE(grad_close(dx, num_x));
  EXPECT_TRUE(grad_close(minus(dw, dw0), num_w));
}

TEST_P(RmsnormShapes, Float32MatchesFloat64) {
  auto [n, h, eps] = GetParam();
  Tensor x32 = random_uniform({n, h}, DType::F32, 5);
  Tensor w32 = random_uniform({h}, DType::F32, 6, 0.5, 1.5);
  Tensor dy32 = random_uniform({n, h}, DType::F32, 7);
  Tensor dw0 = random_uniform({h}, DType::F32, 8);
  Tensor outs[2][5];  // y, rstd, dx, dw per dtype
  for (int k = 0; k < 2; ++k) {
    DType dt = k ? DType::F64 : DType::F32;
    Tensor x = x32.to_dtype(dt), w = w32.to_dtype(dt), dy = dy32.to_dtype(dt);
    Tensor y = Tensor::poisoned({n, h}, dt), rstd = Tensor::poisoned({n}, dt);
    Tensor dx = Tensor::poisoned({n, h}, dt), dw = dw0.to_dtype(dt);
    ops::rmsnorm_forward(x, w, eps, y, rstd);
    ops::rmsnorm_backward(dy, x, w, rstd, dx, dw);
    outs[k][0] = y, outs[k][1] = rstd, outs[k][2] = dx, outs[k][3] = dw;
  }
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(f32_close(outs[0][i], outs[1][i])) << "output " << i;
}

// h = 1 (x / |x| up to eps), single rows, odd sizes, a typical head_dim, no rows, and h above
// the 64-column chunk of the threaded dw reduction.
INSTANTIATE_TEST_SUITE_P(Shapes, RmsnormShapes,
                         ::testing::Values(NormShape{1, 1, 0.5}, NormShape{3, 1, 0.1},
                                           NormShape{1, 7, 1e-6}, NormShape{5, 12, 1e-5},
                                           NormShape{4, 33, 1e-6}, NormShape{0, 4, 1e-6},
                                           NormShape{3, 200, 1e-6}));

TEST(Rmsnorm, ShapeDtypeAndArgumentErrors) {
  Tensor x = rand64({3, 4}, 9), w = rand64({5}, 10);
  Tensor y = Tensor::poisoned({3, 4}, DType::F64), rstd = Tensor::poisoned({3}, DType::F64);
  EXPECT_TRUE(throws([&] { ops::rmsnorm_forward(x, w, 1e-6, y, rstd); },
                     ErrorKind::InvalidArgument, {"rmsnorm_forward", "w must have shape [4]", "[5]"}));
  Tensor w4 = rand64({4}, 11);
  Tensor rstd32 = Tensor::poisoned({3}, DType::F32);
  EXPECT_TRUE(throws([&] { ops::rmsnorm_forward(x, w4, 1e-6, y, rstd32); },
                     ErrorKind::InvalidArgument, {"rmsnorm_forward", "rstd", "f32"}));
  EXPECT_TRUE(throws([&] { ops::rmsnorm_forward(x, w4, -1.0, y, rstd); },
                     ErrorKind::InvalidArgument, {"rmsnorm_forward", "eps"}));
  Tensor xb = Tensor::empty({3, 4}, DType::BF16), wb = Tensor::empty({4}, DType::BF16);
  Tensor yb = Tensor::empty({3, 4}, DType::BF16), rb = Tensor::empty({3}, DType::BF16);
  EXPECT_TRUE(throws([&] { ops::rmsnorm_forward(xb, wb, 1e-6, yb, rb); },
                     ErrorKind::Unsupported, {"rmsnorm_forward", "bf16"}));
  Tensor dx = Tensor::poisoned({3, 4}, DType::F64), dw = rand64({4}, 12);
  EXPECT_TRUE(throws([&] { ops::rmsnorm_backward(rand64({4, 3}, 13), x, w4, rand64({3}, 14), dx, dw); },
                     ErrorKind::InvalidArgument, {"rmsnorm_backward", "dy", "[4, 3]"}));
  Tensor undefined;
  EXPECT_TRUE(throws([&] { ops::rmsnorm_forward(x, undefined, 1e-6, y, rstd); },
                     ErrorKind::InvalidArgument, {"rmsnorm_forward", "w is undefined"}));
}

TEST(Rmsnorm, ReadOnlyOutputIsRefused) {
  // A read-only mapping (e.g. weights straight from a safetensors mmap) must never be written.
  Tensor x = rand64({2, 3}, 15), w = rand64({3}, 16);
  Tensor backing = Tensor::poisoned({2, 3}, DType::F64);
  auto ro = borrowed_storage(backing.raw(), backing.nbytes(), nullptr, /*writable=*/false);
  Tensor y(ro, 0, {2, 3}, DType::F64);
  Tensor rstd = Tensor::poisoned({2}, DType::F64);
  EXPECT_TRUE(throws([&] { ops::rmsnorm_forward(x, w, 1e-6, y, rstd); },
                     ErrorKind::InvalidArgument, {"rmsnorm_forward", "y is read-only"}));
  EXPECT_TRUE(all_nan(backing));
}

}  // namespace
}  // namespace opd::test
