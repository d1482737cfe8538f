// The CPU reference of attention over cached context (kernels/cpu/attention_context.cpp):
// with cu_q == cu_k it is attention_forward; with context, every query row equals the same row
// of the square causal attention over the whole sequence (keys = context + new rows); f32 vs
// f64; len_k < len_q and malformed cu_seqlens are rejected naming the sequence.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernel_test_util.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

std::vector<int32_t> prefix(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu = {0};
  for (int32_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

struct CtxOut {
  Tensor out, lse;
};

template <typename T>
CtxOut run_context(const Tensor& q, const Tensor& k, const Tensor& v,
                   const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k,
                   double scale) {
  const int64_t hq = q.dim(1), d = q.dim(2), hkv = k.dim(1);
  CtxOut r{Tensor::poisoned({q.dim(0), hq, d}, q.dtype()), Tensor::poisoned({q.dim(0), hq}, q.dtype())};
  cpu::attention_forward_context(q.data<T>(), k.data<T>(), v.data<T>(), cu_q.data(), cu_k.data(),
                                 static_cast<int64_t>(cu_q.size()) - 1, q.dim(0), k.dim(0), hq,
                                 hkv, d, scale, r.out.data<T>(), r.lse.data<T>());
  return r;
}

TEST(AttentionContext, SquareIsAttentionForward) {
  const std::vector<int32_t> cu = prefix({5, 0, 17, 1, 40});
  const int64_t n = cu.back(), hq = 4, hkv = 2, d = 24;
  Tensor q = rand64({n, hq, d}, 1, -2, 2), k = rand64({n, hkv, d}, 2, -2, 2), v = rand64({n, hkv, d}, 3);
  const double scale = 0.3;
  CtxOut got = run_context<double>(q, k, v, cu, cu, scale);
  Tensor out = Tensor::poisoned({n, hq, d}, DType::F64), lse = Tensor::poisoned({n, hq}, DType::F64);
  ops::attention_forward(q, k, v, Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())}),
                         scale, out, lse);
  EXPECT_TRUE(close(got.out, out, 1e-13, 1e-14, 1e-13));
  EXPECT_TRUE(close(got.lse, lse, 1e-13, 1e-14, 1e-13));
}

// Sequences (len_q, len_k): odd lengths, len_q from 1 to len_k, empty sequences, GQA 6/2.
TEST(AttentionContext, RowsEqualTheSquareAttentionOverTheWholeSequence) {
  const std::vector<int32_t> lq = {1, 3, 0, 33, 1, 0, 9, 64};
  const std::vector<int32_t> lk = {1, 7, 0, 33, 70, 5, 200, 65};
  const std::vector<int32_t> cu_q = prefix(lq), cu_k = prefix(lk);
  const int64_t nq = cu_q.back(), nk = cu_k.back(), hq = 6, hkv = 2, d = 16;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Tensor k = rand64({nk, hkv, d}, 11, -2, 2), v = rand64({nk, hkv, d}, 12);
  Tensor q_full = rand64({nk, hq, d}, 13, -2, 2);  // a query for every key row
  Tensor q = Tensor::empty({nq, hq, d}, DType::F64);
  const int64_t row = hq * d;
  for (size_t b = 0; b < lq.size(); ++b) {  // the last len_q query rows of each sequence
    for (int64_t i = 0; i < lq[b]; ++i) {
      const int64_t src = cu_k[b] + lk[b] - lq[b] + i, dst = cu_q[b] + i;
      for (int64_t c = 0; c < row; ++c) q.data<double>()[dst * row + c] = q_full.data<double>()[src * row + c];
    }
  }
  CtxOut got = run_context<double>(q, k, v, cu_q, cu_k, scale);
  Tensor out = Tensor::poisoned({nk, hq, d}, DType::F64), lse = Tensor::poisoned({nk, hq}, DType::F64);
  ops::attention_forward(q_full, k, v, Tensor::from_vector(cu_k, {static_cast<int64_t>(cu_k.size())}),
                         scale, out, lse);
  Tensor want_out = Tensor::empty({nq, hq, d}, DType::F64), want_lse = Tensor::empty({nq, hq}, DType::F64);
  for (size_t b = 0; b < lq.size(); ++b) {
    for (int64_t i = 0; i < lq[b]; ++i) {
      const int64_t src = cu_k[b] + lk[b] - lq[b] + i, dst = cu_q[b] + i;
      for (int64_t c = 0; c < row; ++c) want_out.data<double>()[dst * row + c] = out.data<double>()[src * row + c];
      for (int64_t h = 0; h < hq; ++h) want_lse.data<double>()[dst * hq + h] = lse.data<double>()[src * hq + h];
    }
  }
  EXPECT_TRUE(close(got.out, want_out, 1e-12, 1e-13, 1e-12));
  EXPECT_TRUE(close(got.lse, want_lse, 1e-12, 1e-13, 1e-12));

  // f32 storage (f64 accumulation inside): within f32 rounding of the f64 result.
  CtxOut got32 = run_context<float>(q.to_dtype(DType::F32), k.to_dtype(DType::F32),
                                    v.to_dtype(DType::F32), cu_q, cu_k, scale);
  Tensor ref32 = run_context<double>(q.to_dtype(DType::F32).to_dtype(DType::F64),
                                     k.to_dtype(DType::F32).to_dtype(DType::F64),
                                     v.to_dtype(DType::F32).to_dtype(DType::F64), cu_q, cu_k, scale)
                     .out;
  EXPECT_TRUE(f32_close(got32.out, ref32));
}

TEST(AttentionContext, RejectsMoreQueriesThanKeysAndBadCuSeqlens) {
  const int64_t hq = 2, hkv = 1, d = 8;
  Tensor q = rand64({5, hq, d}, 1), k = rand64({6, hkv, d}, 2), v = rand64({6, hkv, d}, 3);
  EXPECT_TRUE(throws([&] { run_context<double>(q, k, v, {0, 2, 5}, {0, 4, 6}, 1.0); },
                     ErrorKind::InvalidData, {"sequence 1", "3 query rows", "2 keys"}));
  EXPECT_TRUE(throws([&] { run_context<double>(q, k, v, {0, 2, 5}, {0, 4, 7}, 1.0); },
                     ErrorKind::InvalidData, {"cu_seqlens[2] = 7"}));
  EXPECT_TRUE(throws([&] { run_context<double>(q, k, v, {0, 3, 2}, {0, 4, 6}, 1.0); },
                     ErrorKind::InvalidData, {"non-decreasing"}));
}

}  // namespace
}  // namespace opd::test
