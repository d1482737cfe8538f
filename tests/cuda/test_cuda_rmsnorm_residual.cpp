// CUDA RMSNorm, plain and fused with the residual add, against the CPU reference over every
// kernel path: warp-per-row (short rows such as per-head q/k norm), block-per-row with 1..4
// register vectors, the scalar fallback (sizes that are not a multiple of the vector), and the
// long-row path; dw deterministic run to run; ds computed in place over dres.
#include <gtest/gtest.h>

#include <cmath>

#include "cuda/cuda_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

struct NormCase {
  int64_t n, h;
};

class CudaRmsnormPaths : public ::testing::TestWithParam<NormCase> {};

// dw sums n products: f32 accumulation-order differences grow like sqrt(n).
Tol dw_tol(int64_t n) { return {1e-4, 1e-4 * std::sqrt(double(n) + 1), 1e-4}; }

TEST_P(CudaRmsnormPaths, FusedResidualMatchesCpu) {
  REQUIRE_GPU();
  const auto [n, h] = GetParam();
  const double eps = 1e-6;
  for (DType dt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_label(dt));
    Tensor x = rand_in({n, h}, dt, 1), r = rand_in({n, h}, dt, 2);
    Tensor w = rand_in({h}, dt, 3, 0.5, 1.5), dy = rand_in({n, h}, dt, 4);
    Tensor dres = rand_in({n, h}, dt, 5);
    Tensor dw0 = random_uniform({h}, DType::F32, 6);

    // Reference: the CPU op on the sum as the GPU stores it (rounded to dt), so both norms see
    // the same s; for f32 the rounding is the identity.
    Tensor sum_ref = Tensor::poisoned({n, h}, DType::F32);
    ops::add(x, r, sum_ref);
    sum_ref = round_through(sum_ref, dt);
    Tensor y_ref = Tensor::poisoned({n, h}, DType::F32), rstd_ref = Tensor::poisoned({n}, DType::F32);
    ops::rmsnorm_forward(sum_ref, w, eps, y_ref, rstd_ref);
    Tensor ds_ref = Tensor::poisoned({n, h}, DType::F32), dw_ref = dw0.clone();
    ops::rmsnorm_residual_backward(dy, sum_ref, w, rstd_ref, dres, ds_ref, dw_ref);

    Tensor xd = dev(x, dt), rd = dev(r, dt), wd = dev(w, dt);
    Tensor sumd = dev_poison({n, h}, dt), yd = dev_poison({n, h}, dt);
    Tensor rstdd = dev_poison({n}, DType::F32);
    ops::rmsnorm_residual_forward(xd, rd, wd, eps, sumd, yd, rstdd);
    EXPECT_TRUE(close(host(sumd), sum_ref, dt == DType::F32 ? 0 : 4e-3, 0, 4e-3)) << "sum";
    EXPECT_TRUE(close(host(rstdd), rstd_ref, 1e-5, 1e-6, 1e-5)) << "rstd";
    EXPECT_TRUE(close_as(host(yd), y_ref, dt)) << "y";

    Tensor dyd = dev(dy, dt), dsd = dev(dres, dt);  // in place: ds over dres
    Tensor dwd = dw0.to(Device::CUDA);
    ops::rmsnorm_residual_backward(dyd, sumd, wd, rstdd, dsd, dsd, dwd);
    EXPECT_TRUE(close_as(host(dsd), ds_ref, dt)) << "ds";
    Tol t = dw_tol(n);
    EXPECT_TRUE(close(host(dwd), dw_ref, t.rtol, t.atol, t.rel_l2)) << "dw";

    Tensor dwd2 = dw0.to(Device::CUDA), dsd2 = dev_poison({n, h}, dt);
    ops::rmsnorm_residual_backward(dyd, sumd, wd, rstdd, dev(dres, dt), dsd2, dwd2);
    EXPECT_TRUE(same_bits(dwd.to(Device::CPU), dwd2.to(Device::CPU))) << "dw deterministic";
    EXPECT_TRUE(same_bits(dsd.to(Device::CPU), dsd2.to(Device::CPU))) << "in place == out of place";
  }
}

TEST_P(CudaRmsnormPaths, PlainMatchesCpu) {
  REQUIRE_GPU();
  const auto [n, h] = GetParam();
  // At H = 1 dx is pure cancellation (see test_cuda_ops.cpp); a large eps makes it well-posed.
  const double eps = h == 1 ? 0.5 : 1e-5;
  for (DType dt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_label(dt));
    Tensor x = rand_in({n, h}, dt, 11), w = rand_in({h}, dt, 12, 0.5, 1.5);
    Tensor dy = rand_in({n, h}, dt, 13);
    Tensor dw0 = random_uniform({h}, DType::F32, 14);
    Tensor y_ref = Tensor::poisoned({n, h}, DType::F32), rstd_ref = Tensor::poisoned({n}, DType::F32);
    ops::rmsnorm_forward(x, w, eps, y_ref, rstd_ref);
    Tensor dx_ref = Tensor::poisoned({n, h}, DType::F32), dw_ref = dw0.clone();
    ops::rmsnorm_backward(dy, x, w, rstd_ref, dx_ref, dw_ref);

    Tensor xd = dev(x, dt), wd = dev(w, dt);
    Tensor yd = dev_poison({n, h}, dt), rstdd = dev_poison({n}, DType::F32);
    ops::rmsnorm_forward(xd, wd, eps, yd, rstdd);
    Tensor dxd = dev_poison({n, h}, dt), dwd = dw0.to(Device::CUDA);
    ops::rmsnorm_backward(dev(dy, dt), xd, wd, rstdd, dxd, dwd);
    EXPECT_TRUE(close(host(rstdd), rstd_ref, 1e-5, 1e-6, 1e-5));
    EXPECT_TRUE(close_as(host(yd), y_ref, dt)) << "y";
    EXPECT_TRUE(close_as(host(dxd), dx_ref, dt)) << "dx";
    Tol t = dw_tol(n);
    EXPECT_TRUE(close(host(dwd), dw_ref, t.rtol, t.atol, t.rel_l2)) << "dw";
  }
}

// h = 128 with many rows: q/k norm (warp per row); 1024: the W1 hidden size (block, one
// vector per thread in bf16; 768 rows and a training batch's 6,145); 2048/4096: two and four vectors; 8192 f32 and 10000: long rows;
// 1, 7, 255, 1000 + 3: scalar paths; n = 0: nothing to do.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaRmsnormPaths,
    ::testing::Values(NormCase{1, 1}, NormCase{3, 7}, NormCase{17, 255}, NormCase{98304, 128},
                      NormCase{257, 256}, NormCase{4097, 128}, NormCase{33, 1003},
                      NormCase{768, 1024}, NormCase{6145, 1024}, NormCase{100, 2048},
                      NormCase{1000, 4096},
                      NormCase{64, 8192}, NormCase{9, 10000}, NormCase{0, 64},
                      // Groups of 8 and 64 threads per bf16 row, rows left over in the last block.
                      NormCase{1001, 64}, NormCase{515, 512},
                      // Decode-sized batches (<= 256 rows): a row per block or per warp.
                      NormCase{64, 1024}, NormCase{200, 128}),
    [](const auto& info) {
      return "n" + std::to_string(info.param.n) + "_h" + std::to_string(info.param.h);
    });

TEST(CudaRmsnormResidualErrors, StatisticsAndWeightGradientsAreF32) {
  REQUIRE_GPU();
  Tensor x = dev(rand_in({4, 8}, DType::BF16, 1), DType::BF16);
  Tensor w = dev(rand_in({8}, DType::BF16, 2), DType::BF16);
  Tensor sum = dev_poison({4, 8}, DType::BF16), y = dev_poison({4, 8}, DType::BF16);
  Tensor rstd16 = dev_poison({4}, DType::BF16);
  EXPECT_TRUE(throws([&] { ops::rmsnorm_residual_forward(x, x, w, 1e-6, sum, y, rstd16); },
                     ErrorKind::InvalidArgument, {"rstd must be f32"}));
}

}  // namespace
}  // namespace opd::test
