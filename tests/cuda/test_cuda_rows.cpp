// CUDA gather_rows / convert against the CPU: every in/out dtype pair (f32, bf16), -1 rows,
// row widths on and off the 256-thread block and the 16-byte chunks, more rows than one grid
// row, poisoned outputs,
// f32 -> bf16 rounding identical to the host's, bad maps rejected with nothing written.
#include <gtest/gtest.h>

#include <vector>

#include "cuda/cuda_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

class CudaRows : public ::testing::TestWithParam<std::pair<int64_t, int64_t>> {};

TEST_P(CudaRows, GatherMatchesCpuForEveryDtypePair) {
  REQUIRE_GPU();
  const auto [n_in, h] = GetParam();
  const int64_t n_out = n_in + 3;
  std::vector<int32_t> map(static_cast<size_t>(n_out));
  for (int64_t i = 0; i < n_out; ++i)
    map[i] = i % 5 == 2 ? -1 : static_cast<int32_t>((i * 7 + 3) % n_in);
  Tensor rows = Tensor::from_vector(map, {n_out});
  for (DType in_dt : {DType::F32, DType::BF16}) {
    for (DType out_dt : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(dtype_label(in_dt) + " -> " + dtype_label(out_dt));
      Tensor in = rand_in({n_in, h}, in_dt, 11);
      Tensor ref = Tensor::poisoned({n_out, h}, DType::F32);
      ops::gather_rows(in, rows, ref);
      Tensor out = dev_poison({n_out, h}, out_dt);
      ops::gather_rows(dev(in, in_dt), dev_i32(rows), out);
      // One rounding of exact values: bit-equal to the host conversion.
      Tensor want = out_dt == DType::BF16 ? round_through(ref, DType::BF16) : ref;
      EXPECT_TRUE(close(host(out), want, 0, 0, 0));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaRows,
                         ::testing::Values(std::pair<int64_t, int64_t>{1, 1},
                                           std::pair<int64_t, int64_t>{7, 255},
                                           std::pair<int64_t, int64_t>{33, 1024},
                                           std::pair<int64_t, int64_t>{70000, 16},
                                           std::pair<int64_t, int64_t>{70000, 3}));

TEST(CudaRowsErrors, BadMapRejectedNothingWritten) {
  REQUIRE_GPU();
  Tensor in = dev(rand_in({4, 8}, DType::F32, 1), DType::F32);
  Tensor out = dev_poison({3, 8}, DType::BF16);
  for (int32_t bad : {4, -2}) {
    Tensor rows = dev_i32(Tensor::from_vector<int32_t>({0, 1, bad}, {3}));
    std::string m = error_message([&] { ops::gather_rows(in, rows, out); }, ErrorKind::InvalidData);
    EXPECT_NE(m.find("source row " + std::to_string(bad) + " at row 2"), std::string::npos) << m;
    EXPECT_TRUE(all_nan(host(out)));
  }
}

TEST(CudaConvert, RoundsLikeTheHostBothWays) {
  REQUIRE_GPU();
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{3} << 20}) {
    Tensor x = random_uniform({n}, DType::F32, 5, -300, 300);  // not bf16-representable
    Tensor b = dev_poison({n}, DType::BF16);
    ops::convert(x.to(Device::CUDA), b);
    EXPECT_TRUE(close(host(b), round_through(x, DType::BF16), 0, 0, 0)) << n;
    Tensor f = dev_poison({n}, DType::F32);
    ops::convert(b, f);
    EXPECT_TRUE(close(host(f), round_through(x, DType::BF16), 0, 0, 0)) << n;
  }
}

}  // namespace
}  // namespace opd::test
