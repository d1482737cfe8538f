// CUDA kernels against the CPU reference (GPU only; every test skips cleanly without a device).
// Sweeps odd shapes, poisons outputs, compares f32 tightly and bf16 at bf16 tolerance.
#include <gtest/gtest.h>

#include <cmath>

#include "common/test_util.h"
#include "core/cuda/stream.h"
#include "core/philox.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"

namespace opd {
namespace {

#define REQUIRE_GPU()                                                   \
  do {                                                                  \
    if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";    \
  } while (0)

Tensor to_bf16_roundtrip(const Tensor& t) { return t.to_dtype(DType::BF16).to_dtype(DType::F32); }

// Host f32 tensor whose values are exactly representable in `dt` (rounded through it).
Tensor random_input(const Shape& s, DType dt, uint64_t seed, double lo = -2, double hi = 2) {
  Tensor t = test::random_uniform(s, DType::F32, seed, lo, hi);
  return dt == DType::BF16 ? to_bf16_roundtrip(t) : t;
}
Tensor to_device(const Tensor& host_f32, DType dt) { return host_f32.to_dtype(dt).to(Device::CUDA); }
Tensor poisoned_device(const Shape& s, DType dt) { return Tensor::poisoned(s, dt).to(Device::CUDA); }
Tensor from_device(const Tensor& d) { return d.to(Device::CPU).to_dtype(DType::F32); }

TEST(CudaDevice, DescribesTheDevice) {
  REQUIRE_GPU();
  std::string d = cuda::device_description(0);
  EXPECT_NE(d.find("sm_"), std::string::npos) << d;
  std::printf("device 0: %s\n", d.c_str());
}

TEST(CudaPhilox, SameStreamAsCpu) {
  REQUIRE_GPU();
  const int64_t n = 100003;  // not a multiple of the block or of 4
  Tensor dev = Tensor::empty({n}, DType::F32, Device::CUDA);
  cuda::philox_uniform_fill(dev.data<float>(), n, 0x1234abcd5678ull, 77, nullptr);
  Tensor host = dev.to(Device::CPU);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(host.data<float>()[i], philox_uniform(0x1234abcd5678ull, 77, static_cast<uint64_t>(i)))
        << "element " << i;
}

struct NormCase {
  int64_t n, h;
};

class CudaRmsnorm : public ::testing::TestWithParam<NormCase> {};

TEST_P(CudaRmsnorm, ForwardAndBackwardMatchCpu) {
  REQUIRE_GPU();
  const auto [n, h] = GetParam();
  // At H = 1 the dx formula cancels almost exactly (y = w*sign(x) when eps << x^2), so the
  // true dx is ~eps-sized and both sides are rounding noise; a large eps makes it well-posed.
  const double eps = h == 1 ? 0.5 : 1e-6;
  for (DType dt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dt));
    // Inputs representable in the storage dtype, so CPU and GPU see identical values.
    Tensor x = random_input({n, h}, dt, 1), w = random_input({h}, dt, 2, 0.5, 1.5);
    Tensor dy = random_input({n, h}, dt, 3);

    Tensor y_ref = Tensor::poisoned({n, h}, DType::F32), rstd_ref = Tensor::poisoned({n}, DType::F32);
    ops::rmsnorm_forward(x, w, eps, y_ref, rstd_ref);
    Tensor dx_ref = Tensor::poisoned({n, h}, DType::F32);
    Tensor dw_ref = test::random_uniform({h}, DType::F32, 9);  // accumulate onto non-zero
    Tensor dw0 = dw_ref.clone();
    ops::rmsnorm_backward(dy, x, w, rstd_ref, dx_ref, dw_ref);

    Tensor xd = to_device(x, dt), wd = to_device(w, dt), dyd = to_device(dy, dt);
    Tensor yd = poisoned_device({n, h}, dt), rstdd = poisoned_device({n}, DType::F32);
    cuda::rmsnorm_forward(xd.raw(), wd.raw(), eps, n, h, dt, yd.raw(), rstdd.data<float>(), nullptr);
    Tensor dxd = poisoned_device({n, h}, dt);
    Tensor dwd = dw0.to(Device::CUDA);
    cuda::rmsnorm_backward(dyd.raw(), xd.raw(), wd.raw(), rstdd.data<float>(), n, h, dt, dxd.raw(),
                           dwd.data<float>(), nullptr);

    const double rtol = dt == DType::F32 ? 1e-5 : 8e-3;
    const double atol = dt == DType::F32 ? 1e-6 : 1e-2;
    EXPECT_TRUE(test::close(from_device(rstdd), rstd_ref, 1e-5, 1e-6));
    EXPECT_TRUE(test::close(from_device(yd), y_ref, rtol, atol, dt == DType::F32 ? 1e-6 : 8e-3));
    EXPECT_TRUE(test::close(from_device(dxd), dx_ref, rtol, atol, dt == DType::F32 ? 1e-5 : 8e-3));
    EXPECT_TRUE(test::close(from_device(dwd), dw_ref, 1e-4, 1e-4 * std::sqrt(double(n)), 1e-4));
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaRmsnorm,
                         ::testing::Values(NormCase{1, 1}, NormCase{1, 7}, NormCase{3, 255},
                                           NormCase{17, 256}, NormCase{33, 1000},
                                           NormCase{257, 1024}, NormCase{1000, 4096},
                                           NormCase{4097, 128}),
                         [](const auto& info) {
                           return "n" + std::to_string(info.param.n) + "_h" + std::to_string(info.param.h);
                         });

}  // namespace
}  // namespace opd
