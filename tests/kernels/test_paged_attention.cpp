// Paged KV cache ops against the dense reference: K/V scattered through shuffled block tables
// (block sizes 1, 3, 16), queried in chunks (chunked prefill) and one row at a time (decode),
// must give the rows of attention_forward over the whole sequences; GQA and MHA; f32 and f64;
// cache slots outside the slot mapping untouched; every index validated.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/philox.h"
#include "kernel_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

struct PagedCase {
  std::vector<int32_t> lens;  // sequence lengths
  int64_t hq, hkv, d, block_size, chunk;  // chunk: query rows per step (1 = decode only)
};

Tensor i32(const std::vector<int32_t>& v, const Shape& shape) { return Tensor::from_vector(v, shape); }

Tensor rows_of(const Tensor& t, int64_t begin, int64_t end) { return t.slice_rows(begin, end).clone(); }

class PagedAttention : public ::testing::TestWithParam<std::tuple<PagedCase, DType>> {};

TEST_P(PagedAttention, ChunkedQueriesEqualDenseRows) {
  const auto& [c, dtype] = GetParam();
  const int64_t B = static_cast<int64_t>(c.lens.size());
  std::vector<int32_t> cu = {0};
  for (int32_t l : c.lens) cu.push_back(cu.back() + l);
  const int64_t T = cu.back();
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  Tensor q = random_uniform({T, c.hq, c.d}, dtype, 11, -2, 2);
  Tensor k = random_uniform({T, c.hkv, c.d}, dtype, 12, -2, 2);
  Tensor v = random_uniform({T, c.hkv, c.d}, dtype, 13);
  Tensor dense = Tensor::poisoned({T, c.hq, c.d}, dtype), lse = Tensor::poisoned({T, c.hq}, dtype);
  ops::attention_forward(q, k, v, i32(cu, {B + 1}), scale, dense, lse);

  // Blocks handed out in a shuffled order, with spare blocks, so a sequence's blocks are neither
  // contiguous nor ordered; unused table entries hold -1 (must never be read).
  int64_t max_blocks = 0, needed = 0;
  for (int32_t l : c.lens) {
    max_blocks = std::max<int64_t>(max_blocks, (l + c.block_size - 1) / c.block_size);
    needed += (l + c.block_size - 1) / c.block_size;
  }
  const int64_t num_blocks = needed + 3;
  std::vector<int32_t> perm(static_cast<size_t>(num_blocks));
  std::iota(perm.begin(), perm.end(), 0);
  for (size_t i = perm.size(); i > 1; --i)
    std::swap(perm[i - 1], perm[philox_u32(5, 0, i) % i]);
  std::vector<int32_t> table(static_cast<size_t>(std::max<int64_t>(B * max_blocks, 1)), -1);
  size_t next = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < (c.lens[b] + c.block_size - 1) / c.block_size; ++j)
      table[b * max_blocks + j] = perm[next++];
  Tensor tables = i32(table, {B, max_blocks});
  Tensor k_cache = random_uniform({num_blocks, c.block_size, c.hkv, c.d}, dtype, 14);
  Tensor v_cache = random_uniform({num_blocks, c.block_size, c.hkv, c.d}, dtype, 15);

  // Steps: each sequence stores and queries its next `chunk` rows (sequences progress together
  // and finish at different steps, like continuous batching).
  int64_t max_len = *std::max_element(c.lens.begin(), c.lens.end());
  int64_t compared = 0;
  for (int64_t done = 0; done < max_len; done += c.chunk) {
    std::vector<int32_t> rows, slot, cu_q = {0}, seq_lens;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t end = std::min<int64_t>(done + c.chunk, c.lens[b]);
      for (int64_t p = done; p < end; ++p) {
        rows.push_back(static_cast<int32_t>(cu[b] + p));
        slot.push_back(table[b * max_blocks + p / c.block_size] * static_cast<int32_t>(c.block_size) +
                       static_cast<int32_t>(p % c.block_size));
      }
      cu_q.push_back(static_cast<int32_t>(rows.size()));
      seq_lens.push_back(static_cast<int32_t>(std::max<int64_t>(end, 0)));
    }
    const int64_t n = static_cast<int64_t>(rows.size());
    Tensor ks = Tensor::empty({n, c.hkv, c.d}, dtype), vs = Tensor::empty({n, c.hkv, c.d}, dtype);
    Tensor qs = Tensor::empty({n, c.hq, c.d}, dtype), want = Tensor::empty({n, c.hq, c.d}, dtype);
    for (int64_t r = 0; r < n; ++r) {
      ks.slice_rows(r, r + 1).copy_from(k.slice_rows(rows[r], rows[r] + 1));
      vs.slice_rows(r, r + 1).copy_from(v.slice_rows(rows[r], rows[r] + 1));
      qs.slice_rows(r, r + 1).copy_from(q.slice_rows(rows[r], rows[r] + 1));
      want.slice_rows(r, r + 1).copy_from(dense.slice_rows(rows[r], rows[r] + 1));
    }
    ops::kv_cache_store(ks, vs, i32(slot, {n}), k_cache, v_cache);
    Tensor out = Tensor::poisoned({n, c.hq, c.d}, dtype);
    ops::paged_attention(qs, k_cache, v_cache, i32(cu_q, {B + 1}), i32(seq_lens, {B}), tables,
                         scale, out);
    if (n == 0) continue;
    const double rtol = dtype == DType::F64 ? 1e-12 : 1e-5;
    EXPECT_TRUE(close(out, want, rtol, rtol * 1e-2)) << "step starting at position " << done;
    compared += n;
  }
  EXPECT_EQ(compared, T);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PagedAttention,
    ::testing::Combine(
        ::testing::Values(PagedCase{{7, 1, 12}, 4, 2, 8, 3, 1},     // decode, GQA, bs 3
                          PagedCase{{7, 1, 12}, 4, 2, 8, 3, 4},     // chunks of 4
                          PagedCase{{5, 9}, 2, 2, 6, 1, 2},         // MHA, one-token blocks
                          PagedCase{{33, 16, 17}, 6, 2, 16, 16, 5}, // block boundaries at 16
                          PagedCase{{20}, 4, 1, 4, 16, 20},         // one chunk = whole prefill
                          PagedCase{{0, 6}, 2, 1, 4, 4, 3}),        // an empty sequence
        ::testing::Values(DType::F64, DType::F32)));

TEST(PagedAttentionOps, StoreWritesOnlyTheMappedSlots) {
  Tensor kc = random_uniform({3, 2, 1, 4}, DType::F64, 1), vc = random_uniform({3, 2, 1, 4}, DType::F64, 2);
  Tensor kc0 = kc.clone(), vc0 = vc.clone();
  Tensor k = random_uniform({2, 1, 4}, DType::F64, 3), v = random_uniform({2, 1, 4}, DType::F64, 4);
  ops::kv_cache_store(k, v, i32({5, 2}, {2}), kc, vc);
  const double* kp = kc.data<double>();
  for (int64_t slot = 0; slot < 6; ++slot) {
    for (int64_t c = 0; c < 4; ++c) {
      double want = slot == 5 ? k.data<double>()[c] : slot == 2 ? k.data<double>()[4 + c]
                                                              : kc0.data<double>()[slot * 4 + c];
      EXPECT_EQ(kp[slot * 4 + c], want) << "slot " << slot;
    }
  }
  EXPECT_EQ(vc.data<double>()[5 * 4], v.data<double>()[0]);
  EXPECT_EQ(vc.data<double>()[0], vc0.data<double>()[0]);
}

TEST(PagedAttentionOps, RejectsBadIndices) {
  Tensor kc = random_uniform({2, 4, 1, 4}, DType::F32, 1), vc = random_uniform({2, 4, 1, 4}, DType::F32, 2);
  Tensor k = random_uniform({1, 1, 4}, DType::F32, 3), v = random_uniform({1, 1, 4}, DType::F32, 4);
  EXPECT_TRUE(throws([&] { ops::kv_cache_store(k, v, i32({8}, {1}), kc, vc); }, ErrorKind::InvalidData,
               {"slot 8 at row 0", "[0, 8)"}));
  EXPECT_TRUE(throws([&] { ops::kv_cache_store(k, v, i32({-1}, {1}), kc, vc); }, ErrorKind::InvalidData,
               {"slot -1"}));
  Tensor q = random_uniform({1, 2, 4}, DType::F32, 5), out = Tensor::poisoned({1, 2, 4}, DType::F32);
  Tensor cu = i32({0, 1}, {2});
  EXPECT_TRUE(throws([&] { ops::paged_attention(q, kc, vc, cu, i32({5}, {1}), i32({0, 2}, {1, 2}), 0.5, out); },
               ErrorKind::InvalidData, {"block_tables[0, 1] = 2", "[0, 2)"}));
  EXPECT_TRUE(throws([&] { ops::paged_attention(q, kc, vc, cu, i32({9}, {1}), i32({0, 1}, {1, 2}), 0.5, out); },
               ErrorKind::InvalidData, {"seq_len 9", "at most 2 x 4 = 8"}));
  EXPECT_TRUE(throws([&] { ops::paged_attention(q, kc, vc, cu, i32({0}, {1}), i32({0, 1}, {1, 2}), 0.5, out); },
               ErrorKind::InvalidData, {"seq_len 0 but 1 query rows"}));
  Tensor q64 = random_uniform({1, 2, 4}, DType::F64, 5);
  EXPECT_TRUE(throws([&] { ops::paged_attention(q64, kc, vc, cu, i32({1}, {1}), i32({0, 1}, {1, 2}), 0.5, out); },
               ErrorKind::InvalidArgument, {"share one dtype"}));
  Tensor q3 = random_uniform({1, 3, 4}, DType::F32, 5), out3 = Tensor::poisoned({1, 3, 4}, DType::F32);
  Tensor kc2 = random_uniform({2, 4, 2, 4}, DType::F32, 1), vc2 = random_uniform({2, 4, 2, 4}, DType::F32, 2);
  EXPECT_TRUE(throws([&] { ops::paged_attention(q3, kc2, vc2, cu, i32({1}, {1}), i32({0, 1}, {1, 2}), 0.5, out3); },
               ErrorKind::InvalidArgument, {"multiple of kv heads"}));
}

}  // namespace
}  // namespace opd::test
