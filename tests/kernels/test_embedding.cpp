// Embedding lookup and scatter-add backward: gradient check, f32/f64, poison, id validation.
#include <gtest/gtest.h>

#include "kernel_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

struct EmbShape {
  int64_t n, vocab, hidden;
};

class EmbeddingShapes : public ::testing::TestWithParam<EmbShape> {};

TEST_P(EmbeddingShapes, GradientMatchesFiniteDifferences) {
  auto [n, vocab, hidden] = GetParam();
  Tensor ids = random_ints({n}, 1, 0, static_cast<int32_t>(vocab));
  Tensor table = rand64({vocab, hidden}, 2);
  Tensor r = rand64({n, hidden}, 3);
  Tensor out = Tensor::poisoned({n, hidden}, DType::F64);
  auto loss = [&] {
    ops::embedding_forward(ids, table, out);
    return dot(out, r);
  };
  loss();
  for (int64_t t = 0; t < n; ++t)  // the definition, element by element
    for (int64_t c = 0; c < hidden; ++c)
      ASSERT_EQ(out.data<double>()[t * hidden + c],
                table.data<double>()[ids.data<int32_t>()[t] * hidden + c]);
  Tensor numeric = numeric_grad(table, loss);
  Tensor dtable0 = rand64({vocab, hidden}, 4);  // accumulated into, so start from non-zero
  Tensor dtable = dtable0.clone();
  ops::embedding_backward(ids, r, dtable);
  EXPECT_TRUE(grad_close(minus(dtable, dtable0), numeric));
}

TEST_P(EmbeddingShapes, Float32MatchesFloat64) {
  auto [n, vocab, hidden] = GetParam();
  Tensor ids = random_ints({n}, 5, 0, static_cast<int32_t>(vocab));
  Tensor table32 = random_uniform({vocab, hidden}, DType::F32, 6);
  Tensor dout32 = random_uniform({n, hidden}, DType::F32, 7);
  Tensor out32 = Tensor::poisoned({n, hidden}, DType::F32);
  Tensor out64 = Tensor::poisoned({n, hidden}, DType::F64);
  ops::embedding_forward(ids, table32, out32);
  ops::embedding_forward(ids, table32.to_dtype(DType::F64), out64);
  EXPECT_TRUE(f32_close(out32, out64, 0, 0));  // a copy: exact
  Tensor d0 = random_uniform({vocab, hidden}, DType::F32, 8);
  Tensor d32 = d0.clone(), d64 = d0.to_dtype(DType::F64);
  ops::embedding_backward(ids, dout32, d32);
  ops::embedding_backward(ids, dout32.to_dtype(DType::F64), d64);
  EXPECT_TRUE(f32_close(d32, d64));
}

// Size 1 everywhere; more rows than vocabulary entries (repeated ids accumulate); odd sizes;
// no rows; a hidden size above the 64-column chunk of the threaded backward.
INSTANTIATE_TEST_SUITE_P(Shapes, EmbeddingShapes,
                         ::testing::Values(EmbShape{1, 1, 1}, EmbShape{7, 3, 5},
                                           EmbShape{13, 10, 6}, EmbShape{4, 9, 1},
                                           EmbShape{0, 3, 2}, EmbShape{6, 4, 150}));

TEST(Embedding, OutOfVocabularyIdsAreRejectedBeforeAnyWrite) {
  const int64_t vocab = 10, hidden = 3;
  Tensor table = rand64({vocab, hidden}, 9);
  for (int32_t bad : {10, -1, 2147483647, -2147483647 - 1}) {
    Tensor ids = Tensor::from_vector<int32_t>({1, 9, 0, bad, 4}, {5});
    Tensor out = Tensor::poisoned({5, hidden}, DType::F64);
    std::string value = "token id " + std::to_string(bad);
    EXPECT_TRUE(throws([&] { ops::embedding_forward(ids, table, out); }, ErrorKind::InvalidData,
                       {"embedding_forward", value, "at row 3", "[0, 10)"}));
    EXPECT_TRUE(all_nan(out)) << "rows before the bad id were written";
    Tensor dtable = rand64({vocab, hidden}, 10);
    Tensor before = dtable.clone();
    EXPECT_TRUE(throws([&] { ops::embedding_backward(ids, rand64({5, hidden}, 11), dtable); },
                       ErrorKind::InvalidData, {"embedding_backward", value, "at row 3", "[0, 10)"}));
    EXPECT_TRUE(same_bits(dtable, before)) << "dtable changed although an id was invalid";
  }
}

TEST(Embedding, ShapeAndDtypeMismatchesAreInvalidArguments) {
  Tensor ids = random_ints({4}, 12, 0, 5);
  Tensor table = rand64({5, 3}, 13);
  Tensor out = Tensor::poisoned({4, 2}, DType::F64);
  EXPECT_TRUE(throws([&] { ops::embedding_forward(ids, table, out); }, ErrorKind::InvalidArgument,
                     {"embedding_forward", "[4, 3]", "[4, 2]"}));
  Tensor out32 = Tensor::poisoned({4, 3}, DType::F32);
  EXPECT_TRUE(throws([&] { ops::embedding_forward(ids, table, out32); },
                     ErrorKind::InvalidArgument, {"embedding_forward", "out is f32", "table is f64"}));
  Tensor ids64 = Tensor::from_vector<int64_t>({0, 1, 2, 3}, {4});
  Tensor out64 = Tensor::poisoned({4, 3}, DType::F64);
  EXPECT_TRUE(throws([&] { ops::embedding_forward(ids64, table, out64); },
                     ErrorKind::InvalidArgument, {"embedding_forward", "ids must be i32"}));
  Tensor dtable = rand64({5, 3}, 14);
  EXPECT_TRUE(throws([&] { ops::embedding_backward(ids, rand64({3, 3}, 15), dtable); },
                     ErrorKind::InvalidArgument, {"embedding_backward", "[3, 3]"}));
}

}  // namespace
}  // namespace opd::test
