// CUDA cross-entropy (online log-sum-exp) against the CPU reference: vocabularies from 1 to
// 151936 (vector and scalar paths), ignored rows, large logits (stability), the count of
// non-ignored rows, and bad targets reported through the device error flag as InvalidData.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

struct CeCase {
  int64_t n, vocab;
};

class CudaCrossEntropy : public ::testing::TestWithParam<CeCase> {};

TEST_P(CudaCrossEntropy, ForwardAndBackwardMatchCpu) {
  REQUIRE_GPU();
  const auto [n, vocab] = GetParam();
  Tensor targets = random_ints({n}, 7, 0, static_cast<int32_t>(vocab));
  for (int64_t i = 0; i < n; i += 5) targets.data<int32_t>()[i] = -100;  // ignored rows
  if (n > 1) targets.data<int32_t>()[1] = static_cast<int32_t>(vocab - 1);
  for (DType dt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_label(dt));
    Tensor logits = rand_in({n, vocab}, dt, 1, -6, 6);
    if (n > 3 && vocab > 2) {  // a dominant logit: exp would overflow without the max shift
      logits.data<float>()[3 * vocab + 1] = 120.0f;
      logits.data<float>()[2 * vocab] = -120.0f;
    }
    Tensor losses_ref = Tensor::poisoned({n}, DType::F32), lse_ref = Tensor::poisoned({n}, DType::F32);
    int64_t count_ref = ops::cross_entropy_forward(logits, targets, losses_ref, lse_ref);
    Tensor dz_ref = Tensor::poisoned({n, vocab}, DType::F32);
    const double scale = 1.0 / std::max<int64_t>(count_ref, 1);
    ops::cross_entropy_backward(logits, targets, lse_ref, scale, dz_ref);

    Tensor zd = dev(logits, dt), td = dev_i32(targets);
    Tensor lossd = dev_poison({n}, DType::F32), lsed = dev_poison({n}, DType::F32);
    int64_t count = ops::cross_entropy_forward(zd, td, lossd, lsed);
    EXPECT_EQ(count, count_ref);
    EXPECT_TRUE(close(host(lsed), lse_ref, 1e-6, 1e-5, 1e-6)) << "lse";
    EXPECT_TRUE(close(host(lossd), losses_ref, 1e-5, 1e-5, 1e-5)) << "losses";
    Tensor dzd = dev_poison({n, vocab}, dt);
    ops::cross_entropy_backward(zd, td, lsed, scale, dzd);
    Tol t = tol_for(dt);
    EXPECT_TRUE(close(host(dzd), dz_ref, t.rtol, t.atol * scale, t.rel_l2)) << "dlogits";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaCrossEntropy,
    ::testing::Values(CeCase{1, 1}, CeCase{7, 13}, CeCase{33, 1000}, CeCase{4, 151936},
                      CeCase{257, 4096}, CeCase{64, 32001}, CeCase{5, 7}, CeCase{0, 10}),
    [](const auto& info) {
      return "n" + std::to_string(info.param.n) + "_v" + std::to_string(info.param.vocab);
    });

TEST(CudaCrossEntropyErrors, BadTargetIsInvalidDataWithTheCpuMessage) {
  REQUIRE_GPU();
  const int64_t n = 40, vocab = 30;
  for (int32_t bad : {30, -1, -101}) {
    SCOPED_TRACE(bad);
    Tensor targets = random_ints({n}, 8, 0, vocab);
    targets.data<int32_t>()[21] = bad;
    Tensor logits = rand_in({n, vocab}, DType::F32, 2);
    Tensor l = Tensor::poisoned({n}, DType::F32), s = Tensor::poisoned({n}, DType::F32);
    std::string cpu = error_message([&] { ops::cross_entropy_forward(logits, targets, l, s); },
                                    ErrorKind::InvalidData);
    Tensor ld = dev_poison({n}, DType::F32), sd = dev_poison({n}, DType::F32);
    Tensor zd = dev(logits, DType::F32), td = dev_i32(targets);
    std::string gpu = error_message([&] { ops::cross_entropy_forward(zd, td, ld, sd); },
                                    ErrorKind::InvalidData);
    EXPECT_EQ(message_head(gpu), message_head(cpu));
    EXPECT_TRUE(all_nan(host(ld)));
    Tensor dz = dev_poison({n, vocab}, DType::F32);
    std::string gpu_b = error_message(
        [&] { ops::cross_entropy_backward(zd, td, sd, 1.0, dz); }, ErrorKind::InvalidData);
    EXPECT_NE(gpu_b.find("cross_entropy_backward: target"), std::string::npos) << gpu_b;
    EXPECT_TRUE(all_nan(host(dz)));
  }
}

}  // namespace
}  // namespace opd::test
