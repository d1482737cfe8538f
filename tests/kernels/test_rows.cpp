// gather_rows / convert on the CPU: rows copied exactly, -1 rows zero, every output row written
// (poisoned first), bad maps rejected before anything is written, f32 <-> f64 conversion.
#include <gtest/gtest.h>

#include "kernel_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

TEST(GatherRows, CopiesRowsAndZeroesMinusOne) {
  for (DType dt : {DType::F32, DType::F64}) {
    Tensor in = random_uniform({5, 7}, dt, 1);
    Tensor rows = Tensor::from_vector<int32_t>({4, -1, 0, 4, 2, -1}, {6});
    Tensor out = Tensor::poisoned({6, 7}, dt);
    ops::gather_rows(in, rows, out);
    for (int64_t i = 0; i < 6; ++i) {
      const int32_t r = rows.data<int32_t>()[i];
      for (int64_t c = 0; c < 7; ++c)
        ASSERT_EQ(element(out, i * 7 + c), r < 0 ? 0.0 : element(in, r * 7 + c)) << i << "," << c;
    }
  }
}

TEST(GatherRows, BadMapIsRejectedBeforeWriting) {
  Tensor in = random_uniform({5, 3}, DType::F32, 2);
  Tensor out = Tensor::poisoned({3, 3}, DType::F32);
  for (int32_t bad : {5, -2, 1 << 30}) {
    Tensor rows = Tensor::from_vector<int32_t>({0, bad, 1}, {3});
    EXPECT_TRUE(throws([&] { ops::gather_rows(in, rows, out); }, ErrorKind::InvalidData,
                       {"gather_rows", "source row " + std::to_string(bad), "at row 1",
                        "[-1, 5)"}));
    EXPECT_TRUE(all_nan(out));
  }
  Tensor rows = Tensor::from_vector<int32_t>({0, 1}, {2});
  EXPECT_TRUE(throws([&] { ops::gather_rows(in, rows, out); }, ErrorKind::InvalidArgument,
                     {"gather_rows", "out must have shape [2, 3]"}));
}

TEST(Convert, F32AndF64BothWays) {
  Tensor a = random_uniform({4, 9}, DType::F32, 3);
  Tensor b = Tensor::poisoned({4, 9}, DType::F64);
  ops::convert(a, b);
  Tensor back = Tensor::poisoned({4, 9}, DType::F32);
  ops::convert(b, back);
  for (int64_t i = 0; i < a.numel(); ++i) {
    ASSERT_EQ(element(b, i), element(a, i));
    ASSERT_EQ(element(back, i), element(a, i));
  }
  Tensor wrong = Tensor::poisoned({9, 4}, DType::F64);
  EXPECT_TRUE(throws([&] { ops::convert(a, wrong); }, ErrorKind::InvalidArgument, {"convert"}));
}

}  // namespace
}  // namespace opd::test
