// add / add_inplace: exact sums, f32, poison, in-place aliasing, shape and dtype errors.
#include <gtest/gtest.h>

#include "kernel_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

class AddShapes : public ::testing::TestWithParam<Shape> {};

TEST_P(AddShapes, SumsElementwise) {
  Shape shape = GetParam();
  for (DType dt : {DType::F32, DType::F64}) {
    Tensor a = random_uniform(shape, dt, 1), b = random_uniform(shape, dt, 2, -3, 3);
    Tensor out = Tensor::poisoned(shape, dt);
    ops::add(a, b, out);
    Tensor acc = a.clone();
    ops::add_inplace(acc, b);
    for (int64_t i = 0; i < a.numel(); ++i) {
      double want = dt == DType::F32 ? static_cast<double>(a.data<float>()[i] + b.data<float>()[i])
                                     : a.data<double>()[i] + b.data<double>()[i];
      ASSERT_EQ(element(out, i), want) << "element " << i;
      ASSERT_EQ(element(acc, i), want) << "element " << i;
    }
  }
}

// Includes a size above the parallel chunk (1 << 14) so the threaded split is exercised.
INSTANTIATE_TEST_SUITE_P(Shapes, AddShapes,
                         ::testing::Values(Shape{1}, Shape{3, 7}, Shape{2, 3, 5}, Shape{40001}));

TEST(Add, OutputMayAliasAnInput) {
  Tensor a = rand64({5, 3}, 3), b = rand64({5, 3}, 4);
  Tensor want = Tensor::poisoned({5, 3}, DType::F64);
  ops::add(a, b, want);
  ops::add(a, b, a);  // out == a
  EXPECT_TRUE(close(a, want, 0, 0));
}

TEST(Add, ShapeAndDtypeErrors) {
  Tensor a = rand64({3, 4}, 5), b = rand64({4, 3}, 6), out = Tensor::poisoned({3, 4}, DType::F64);
  EXPECT_TRUE(throws([&] { ops::add(a, b, out); }, ErrorKind::InvalidArgument,
                     {"add", "b must have shape [3, 4]", "[4, 3]"}));
  Tensor b32 = random_uniform({3, 4}, DType::F32, 7);
  EXPECT_TRUE(throws([&] { ops::add_inplace(a, b32); }, ErrorKind::InvalidArgument,
                     {"add_inplace", "x is f32"}));
  EXPECT_TRUE(all_nan(out));
}

}  // namespace
}  // namespace opd::test
