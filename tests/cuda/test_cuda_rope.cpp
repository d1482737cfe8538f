// CUDA RoPE against the CPU reference (f32 angle = position * inv_freq as in transformers):
// vector and scalar paths, head counts that do not fill a thread's head group, long positions,
// forward then backward returns the input, host or device inv_freq, and negative positions
// reported as InvalidData with the CPU's message, x untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

struct RopeCase {
  int64_t n, heads, head_dim;
  int32_t max_pos;
};

Tensor inv_freq_for(int64_t head_dim, double theta) {
  std::vector<float> f(static_cast<size_t>(head_dim / 2));
  for (size_t i = 0; i < f.size(); ++i)
    f[i] = static_cast<float>(1.0 / std::pow(theta, 2.0 * double(i) / double(head_dim)));
  return Tensor::from_vector(f, {head_dim / 2});
}

class CudaRope : public ::testing::TestWithParam<RopeCase> {};

TEST_P(CudaRope, ForwardAndBackwardMatchCpu) {
  REQUIRE_GPU();
  const auto [n, heads, d, max_pos] = GetParam();
  Tensor pos = random_ints({n}, 3, 0, max_pos);
  if (n > 0) pos.data<int32_t>()[n - 1] = max_pos - 1;
  Tensor freq = inv_freq_for(d, 1e6);
  for (DType dt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_label(dt));
    Tensor x = rand_in({n, heads, d}, dt, 1);
    Tensor ref = x.clone();
    ops::rope_forward(ref, pos, freq);
    Tensor xd = dev(x, dt);
    ops::rope_forward(xd, dev_i32(pos), freq.to(Device::CUDA));
    // cos/sin of a large f32 angle in f32 vs in double: |error| ~ 1e-7 * |x|.
    EXPECT_TRUE(close_as(host(xd), ref, dt)) << "forward";

    Tensor back = ref.clone();
    ops::rope_backward(back, pos, freq);
    Tensor bd = dev(round_through(ref, dt), dt);
    ops::rope_backward(bd, dev_i32(pos), freq);  // host inv_freq: uploaded by the op
    Tensor back_ref = round_through(ref, dt);
    ops::rope_backward(back_ref, pos, freq);
    EXPECT_TRUE(close_as(host(bd), back_ref, dt)) << "backward";
    EXPECT_TRUE(close(back, x, 1e-5, 1e-5, 1e-5)) << "the CPU backward inverts the forward";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaRope,
    ::testing::Values(RopeCase{1, 1, 2, 1}, RopeCase{7, 3, 6, 100}, RopeCase{5, 5, 8, 1000},
                      RopeCase{257, 16, 128, 4096}, RopeCase{1000, 8, 128, 40000},
                      RopeCase{6144, 16, 128, 768}, RopeCase{33, 2, 64, 131072},
                      RopeCase{0, 4, 16, 1}),
    [](const auto& info) {
      const RopeCase& c = info.param;
      return "n" + std::to_string(c.n) + "_h" + std::to_string(c.heads) + "_d" +
             std::to_string(c.head_dim) + "_p" + std::to_string(c.max_pos);
    });

TEST(CudaRopeErrors, NegativePositionIsInvalidDataAndXIsUntouched) {
  REQUIRE_GPU();
  const int64_t n = 300, heads = 4, d = 16;
  Tensor pos = random_ints({n}, 4, 0, 50);
  pos.data<int32_t>()[123] = -7;
  Tensor x = rand_in({n, heads, d}, DType::F32, 5);
  Tensor freq = inv_freq_for(d, 1e4);
  Tensor xc = x.clone();
  std::string cpu = error_message([&] { ops::rope_forward(xc, pos, freq); }, ErrorKind::InvalidData);
  Tensor xd = dev(x, DType::F32);
  std::string gpu = error_message(
      [&] { ops::rope_forward(xd, dev_i32(pos), freq.to(Device::CUDA)); }, ErrorKind::InvalidData);
  EXPECT_EQ(message_head(gpu), message_head(cpu));
  EXPECT_TRUE(same_bits(host(xd), x));
}

}  // namespace
}  // namespace opd::test
