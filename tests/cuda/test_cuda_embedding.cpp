// CUDA embedding forward/backward against the CPU reference: odd and real shapes, heavily
// repeated ids (the sorted-segment backward), bit-identical gradients run to run, and bad ids
// reported through the device error flag as InvalidData with the CPU's message, nothing written.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

struct EmbCase {
  int64_t n, vocab, hidden;
  int32_t id_range;  // ids drawn from [0, id_range): small ranges repeat ids often
};

class CudaEmbedding : public ::testing::TestWithParam<EmbCase> {};

TEST_P(CudaEmbedding, ForwardAndBackwardMatchCpu) {
  REQUIRE_GPU();
  const auto [n, vocab, hidden, range] = GetParam();
  Tensor ids = random_ints({n}, 11, 0, range);
  if (n > 1) {
    ids.data<int32_t>()[0] = static_cast<int32_t>(vocab - 1);  // both ends of the range
    ids.data<int32_t>()[1] = 0;
  }
  for (DType dt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_label(dt));
    Tensor table = rand_in({vocab, hidden}, dt, 1);
    Tensor dout = rand_in({n, hidden}, dt, 2);
    Tensor dt0 = random_uniform({vocab, hidden}, DType::F32, 3);

    Tensor out_ref = Tensor::poisoned({n, hidden}, DType::F32);
    ops::embedding_forward(ids, table, out_ref);
    Tensor dtable_ref = dt0.clone();
    ops::embedding_backward(ids, dout, dtable_ref);

    Tensor idsd = dev_i32(ids), outd = dev_poison({n, hidden}, dt);
    ops::embedding_forward(idsd, dev(table, dt), outd);
    EXPECT_TRUE(close(host(outd), out_ref, 0, 0, 0)) << "a gather is exact";
    Tensor doutd = dev(dout, dt);
    Tensor dtable1 = dt0.to(Device::CUDA), dtable2 = dt0.to(Device::CUDA);
    ops::embedding_backward(idsd, doutd, dtable1);
    ops::embedding_backward(idsd, doutd, dtable2);
    // Sums of f32 values in a different grouping than the CPU's running sum: f32 tolerance
    // scaled by the number of repeats.
    EXPECT_TRUE(close(host(dtable1), dtable_ref, 1e-5, 1e-5 * std::sqrt(double(n) / range + 1), 1e-6));
    EXPECT_TRUE(same_bits(dtable1.to(Device::CPU), dtable2.to(Device::CPU)))
        << "the backward is deterministic";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaEmbedding,
    ::testing::Values(EmbCase{1, 1, 1, 1}, EmbCase{13, 10, 6, 10}, EmbCase{257, 1000, 7, 1000},
                      EmbCase{255, 100, 1024, 3}, EmbCase{1000, 32000, 1024, 32000},
                      EmbCase{4096, 151936, 256, 151936}, EmbCase{6144, 5000, 1024, 50},
                      EmbCase{0, 10, 8, 10}),
    [](const auto& info) {
      const EmbCase& c = info.param;
      return "n" + std::to_string(c.n) + "_v" + std::to_string(c.vocab) + "_h" +
             std::to_string(c.hidden) + "_r" + std::to_string(c.id_range);
    });

TEST(CudaEmbeddingErrors, BadIdsAreInvalidDataWithTheCpuMessageAndNothingIsWritten) {
  REQUIRE_GPU();
  const int64_t n = 1000, vocab = 50, hidden = 16;
  for (int32_t bad : {50, -1, 1 << 30}) {
    SCOPED_TRACE(bad);
    Tensor ids = random_ints({n}, 5, 0, vocab);
    ids.data<int32_t>()[617] = bad;
    ids.data<int32_t>()[900] = bad;  // the first bad row is reported
    Tensor table = rand_in({vocab, hidden}, DType::F32, 1);
    Tensor out = Tensor::poisoned({n, hidden}, DType::F32);
    std::string cpu = error_message([&] { ops::embedding_forward(ids, table, out); },
                                    ErrorKind::InvalidData);
    Tensor outd = dev_poison({n, hidden}, DType::F32);
    std::string gpu = error_message(
        [&] { ops::embedding_forward(dev_i32(ids), dev(table, DType::F32), outd); },
        ErrorKind::InvalidData);
    EXPECT_EQ(message_head(gpu), message_head(cpu));
    EXPECT_NE(gpu.find("at row 617"), std::string::npos) << gpu;
    EXPECT_TRUE(all_nan(host(outd))) << "nothing written";

    Tensor dtable = Tensor::zeros({vocab, hidden}, DType::F32, Device::CUDA);
    Tensor dout = dev(rand_in({n, hidden}, DType::F32, 2), DType::F32);
    std::string gpu_b = error_message(
        [&] { ops::embedding_backward(dev_i32(ids), dout, dtable); }, ErrorKind::InvalidData);
    EXPECT_NE(gpu_b.find("embedding_backward: token id"), std::string::npos) << gpu_b;
    Tensor zero = Tensor::zeros({vocab, hidden}, DType::F32);
    EXPECT_TRUE(same_bits(dtable.to(Device::CPU), zero)) << "no partial accumulation";
  }
  // The device is still healthy after the rejected calls.
  Tensor ok = Tensor::zeros({4}, DType::F32, Device::CUDA);
  EXPECT_EQ(ok.to(Device::CPU).data<float>()[0], 0.0f);
}

TEST(CudaEmbeddingErrors, DtableMustBeF32MasterGradients) {
  REQUIRE_GPU();
  Tensor ids = dev_i32(random_ints({4}, 1, 0, 8));
  Tensor dout = dev(rand_in({4, 8}, DType::BF16, 2), DType::BF16);
  Tensor dtable = dev(rand_in({8, 8}, DType::BF16, 3), DType::BF16);
  EXPECT_TRUE(throws([&] { ops::embedding_backward(ids, dout, dtable); },
                     ErrorKind::InvalidArgument, {"dtable must be f32"}));
}

}  // namespace
}  // namespace opd::test
