// The fused head norm + RoPE (cuda::rmsnorm_rope_forward / cuda::rope_rmsnorm_backward,
// kernels/cuda/rmsnorm.cu) against the two kernels it replaces (rmsnorm_forward then rope;
// rope(inverse) then rmsnorm_backward), bit for bit: y, rstd, dx and the accumulated dw, in f32
// and bf16, over head sizes whose rows take the fused kernels (8, 16 and 32 lanes per head, a
// rotate-half partner 1 to 16 lanes away, a head of 96 = 12 vectors in a 16-lane group, few
// rows and many, one head per token so a block's rows span 16-32 tokens) and shapes that fall
// back to the two kernels (odd half). Each of the two paths is itself checked against the CPU
// (test_cuda_rope.cpp, test_cuda_ops.cpp); here only their equality is at stake.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/cuda/allocator.h"
#include "cuda/cuda_test_util.h"
#include "kernels/cuda/cuda_ops.h"

namespace opd::test {
namespace {

struct NormRopeCase {
  int64_t tokens, heads, head_dim;
  int32_t max_pos;
};

Tensor inv_freq_dev(int64_t head_dim, double theta) {
  std::vector<float> f(static_cast<size_t>(head_dim / 2));
  for (size_t i = 0; i < f.size(); ++i)
    f[i] = static_cast<float>(1.0 / std::pow(theta, 2.0 * double(i) / double(head_dim)));
  return Tensor::from_vector(f, {head_dim / 2}).to(Device::CUDA);
}

class CudaRmsnormRope : public ::testing::TestWithParam<NormRopeCase> {};

TEST_P(CudaRmsnormRope, FusedEqualsNormThenRopeBitForBit) {
  REQUIRE_GPU();
  const auto [tokens, heads, d, max_pos] = GetParam();
  const int64_t n = tokens * heads;
  Tensor pos = random_ints({tokens}, 11, 0, max_pos);
  if (tokens > 0) pos.data<int32_t>()[tokens - 1] = max_pos - 1;
  Tensor pos_d = dev_i32(pos);
  Tensor freq = inv_freq_dev(d, 1e6);
  const int32_t* p = pos_d.data<int32_t>();
  const float* f = freq.data<float>();
  cudaStream_t s = cuda::current_stream();
  for (DType dt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_label(dt));
    const Tensor x = dev(rand_in({n, d}, dt, 21, -3, 3), dt);
    const Tensor w = dev(rand_in({d}, dt, 22, 0.5, 1.5), dt);
    // Forward: the two kernels, then the fused one.
    Tensor y_ref = dev_poison({n, d}, dt), y = dev_poison({n, d}, dt);
    Tensor r_ref = dev_poison({std::max<int64_t>(n, 1)}, DType::F32);
    Tensor r = dev_poison({std::max<int64_t>(n, 1)}, DType::F32);
    cuda::rmsnorm_forward(x.raw(), w.raw(), 1e-6, n, d, dt, y_ref.raw(), r_ref.data<float>(), s);
    cuda::rope(y_ref.raw(), p, f, tokens, heads, d, dt, false, s);
    cuda::rmsnorm_rope_forward(x.raw(), w.raw(), 1e-6, n, d, dt, y.raw(), r.data<float>(), p, f,
                               heads, s);
    if (n > 0) {
      EXPECT_TRUE(same_bits(host(y), host(y_ref))) << "y: " << diff_summary(y, y_ref);
      EXPECT_TRUE(same_bits(host(r), host(r_ref))) << "rstd: " << diff_summary(r, r_ref);
    }
    // Backward onto a non-zero dw: rope(inverse) in place then the norm's backward, and fused.
    const Tensor dy = dev(rand_in({n, d}, dt, 23), dt);
    const Tensor dw0 = rand_in({d}, DType::F32, 24);
    Tensor dy_ref = dy.clone(), dy_f = dy.clone();
    Tensor dx_ref = dev_poison({n, d}, dt), dx = dev_poison({n, d}, dt);
    Tensor dw_ref = dw0.to(Device::CUDA), dw = dw0.to(Device::CUDA);
    cuda::rope(dy_ref.raw(), p, f, tokens, heads, d, dt, true, s);
    cuda::rmsnorm_backward(dy_ref.raw(), x.raw(), w.raw(), r_ref.data<float>(), n, d, dt,
                           dx_ref.raw(), dw_ref.data<float>(), s);
    cuda::rope_rmsnorm_backward(dy_f.raw(), x.raw(), w.raw(), r_ref.data<float>(), n, d, dt,
                                dx.raw(), dw.data<float>(), p, f, heads, s);
    if (n > 0) EXPECT_TRUE(same_bits(host(dx), host(dx_ref))) << "dx: " << diff_summary(dx, dx_ref);
    EXPECT_TRUE(same_bits(host(dw), host(dw_ref))) << "dw: " << diff_summary(dw, dw_ref);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaRmsnormRope,
    ::testing::Values(
        NormRopeCase{6144, 16, 128, 768},   // W1's q heads (16 lanes per head)
        NormRopeCase{6144, 8, 128, 768},    // W1's k heads
        NormRopeCase{257, 16, 128, 40000},  // a partial last block, long positions
        NormRopeCase{4, 16, 128, 512},      // 64 rows: the few-rows group of 32
        NormRopeCase{300, 5, 64, 1000},     // 8 lanes per head, blocks across tokens
        NormRopeCase{100, 3, 256, 4096},    // 32 lanes per head
        NormRopeCase{90, 4, 96, 300},       // 12 vectors in a 16-lane group
        NormRopeCase{2000, 1, 128, 2000},   // one head per token: 16 tokens per block
        NormRopeCase{70, 2, 8, 64},         // a head of one vector: the W = 1 kernels
        NormRopeCase{50, 3, 12, 64},        // half 6: not a whole vector (W = 1)
        NormRopeCase{0, 4, 128, 1}),
    [](const auto& info) {
      const NormRopeCase& c = info.param;
      return "t" + std::to_string(c.tokens) + "_h" + std::to_string(c.heads) + "_d" +
             std::to_string(c.head_dim);
    });

}  // namespace
}  // namespace opd::test
