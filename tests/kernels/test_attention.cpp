// Causal GQA attention over packed sequences: gradient check over q, k, v for many layouts,
// packing/GQA/single-token properties, f32/f64, poison, cu_seqlens validation.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernel_test_util.h"
#include "kernels/ops.h"

namespace opd::test {
namespace {

struct AttnCase {
  std::vector<int32_t> cu;  // cu_seqlens
  int64_t hq, hkv, d;
};

int64_t rows(const AttnCase& c) { return c.cu.back(); }
Tensor cu_tensor(const std::vector<int32_t>& cu) {
  return Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())});
}

struct AttnOut {
  Tensor out, lse;
};

AttnOut run_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu,
                    double scale) {
  AttnOut r{Tensor::poisoned({q.dim(0), q.dim(1), q.dim(2)}, q.dtype()),
            Tensor::poisoned({q.dim(0), q.dim(1)}, q.dtype())};
  ops::attention_forward(q, k, v, cu, scale, r.out, r.lse);
  return r;
}

class AttentionCases : public ::testing::TestWithParam<AttnCase> {};

TEST_P(AttentionCases, GradientMatchesFiniteDifferences) {
  const AttnCase& c = GetParam();
  int64_t n = rows(c);
  double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  Tensor cu = cu_tensor(c.cu);
  Tensor q = rand64({n, c.hq, c.d}, 1, -2, 2);  // wide enough that softmax is far from uniform
  Tensor k = rand64({n, c.hkv, c.d}, 2, -2, 2);
  Tensor v = rand64({n, c.hkv, c.d}, 3);
  Tensor r = rand64({n, c.hq, c.d}, 4);
  auto loss = [&] { return dot(run_forward(q, k, v, cu, scale).out, r); };
  Tensor num_q = numeric_grad(q, loss), num_k = numeric_grad(k, loss), num_v = numeric_grad(v, loss);
  AttnOut f = run_forward(q, k, v, cu, scale);
  Tensor dq = Tensor::poisoned(q.shape(), DType::F64);
  Tensor dk = Tensor::poisoned(k.shape(), DType::F64);
  Tensor dv = Tensor::poisoned(v.shape(), DType::F64);
  ops::attention_backward(r, q, k, v, f.out, f.lse, cu, scale, dq, dk, dv);
  EXPECT_TRUE(grad_close(dq, num_q));
  EXPECT_TRUE(grad_close(dk, num_k));
  EXPECT_TRUE(grad_close(dv, num_v));
}

TEST_P(AttentionCases, PackedEqualsEachSequenceAlone) {
  // No attention across sequence boundaries: running each sequence by itself gives the same rows.
  const AttnCase& c = GetParam();
  int64_t n = rows(c);
  Tensor q = rand64({n, c.hq, c.d}, 5), k = rand64({n, c.hkv, c.d}, 6), v = rand64({n, c.hkv, c.d}, 7);
  AttnOut packed = run_forward(q, k, v, cu_tensor(c.cu), 0.7);
  for (size_t b = 0; b + 1 < c.cu.size(); ++b) {
    int64_t s0 = c.cu[b], s1 = c.cu[b + 1];
    AttnOut alone = run_forward(q.slice_rows(s0, s1).clone(), k.slice_rows(s0, s1).clone(),
                                v.slice_rows(s0, s1).clone(),
                                cu_tensor({0, static_cast<int32_t>(s1 - s0)}), 0.7);
    EXPECT_TRUE(close(packed.out.slice_rows(s0, s1).clone(), alone.out, 0, 0)) << "sequence " << b;
    EXPECT_TRUE(close(packed.lse.slice_rows(s0, s1).clone(), alone.lse, 0, 0)) << "sequence " << b;
  }
}

TEST_P(AttentionCases, GroupedQueryEqualsRepeatedKeysAndValues) {
  // Query head h reads kv head h / (Hq / Hkv): same as multi-head attention on repeated k, v.
  const AttnCase& c = GetParam();
  int64_t n = rows(c), group = c.hq / c.hkv;
  Tensor q = rand64({n, c.hq, c.d}, 8), k = rand64({n, c.hkv, c.d}, 9), v = rand64({n, c.hkv, c.d}, 10);
  Tensor k_rep = Tensor::empty({n, c.hq, c.d}, DType::F64), v_rep = k_rep.clone();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < c.hq; ++h)
      for (int64_t i = 0; i < c.d; ++i) {
        k_rep.data<double>()[(t * c.hq + h) * c.d + i] = k.data<double>()[(t * c.hkv + h / group) * c.d + i];
        v_rep.data<double>()[(t * c.hq + h) * c.d + i] = v.data<double>()[(t * c.hkv + h / group) * c.d + i];
      }
  Tensor cu = cu_tensor(c.cu);
  AttnOut gqa = run_forward(q, k, v, cu, 0.5), mha = run_forward(q, k_rep, v_rep, cu, 0.5);
  EXPECT_TRUE(close(gqa.out, mha.out, 1e-14, 1e-15));
  EXPECT_TRUE(close(gqa.lse, mha.lse, 1e-14, 1e-15));
}

TEST_P(AttentionCases, Float32MatchesFloat64) {
  const AttnCase& c = GetParam();
  int64_t n = rows(c);
  Tensor cu = cu_tensor(c.cu);
  Tensor q = random_uniform({n, c.hq, c.d}, DType::F32, 11, -2, 2);
  Tensor k = random_uniform({n, c.hkv, c.d}, DType::F32, 12, -2, 2);
  Tensor v = random_uniform({n, c.hkv, c.d}, DType::F32, 13);
  Tensor dout = random_uniform({n, c.hq, c.d}, DType::F32, 14);
  Tensor res[2][5];
  for (int i = 0; i < 2; ++i) {
    DType dt = i ? DType::F64 : DType::F32;
    Tensor qi = q.to_dtype(dt), ki = k.to_dtype(dt), vi = v.to_dtype(dt);
    AttnOut f = run_forward(qi, ki, vi, cu, 0.4);
    Tensor dq = Tensor::poisoned(q.shape(), dt), dk = Tensor::poisoned(k.shape(), dt),
           dv = Tensor::poisoned(v.shape(), dt);
    ops::attention_backward(dout.to_dtype(dt), qi, ki, vi, f.out, f.lse, cu, 0.4, dq, dk, dv);
    res[i][0] = f.out, res[i][1] = f.lse, res[i][2] = dq, res[i][3] = dk, res[i][4] = dv;
  }
  for (int j = 0; j < 5; ++j) EXPECT_TRUE(f32_close(res[0][j], res[1][j])) << "output " << j;
}

// T = 1; zero-length sequences first, in the middle and last; single-token sequences;
// GQA ratios 1, 2, 4 (and 3); head_dim 2, 6, 16; an empty batch (B = 0) and only empty sequences.
INSTANTIATE_TEST_SUITE_P(
    Layouts, AttentionCases,
    ::testing::Values(AttnCase{{0, 1}, 1, 1, 2}, AttnCase{{0, 3, 3, 7}, 2, 1, 6},
                      AttnCase{{0, 0, 5, 6}, 4, 1, 16}, AttnCase{{0, 4, 5, 9}, 3, 3, 6},
                      AttnCase{{0, 1, 2, 3}, 2, 2, 2}, AttnCase{{0, 6, 6}, 4, 2, 2},
                      AttnCase{{0, 2, 7}, 6, 2, 6}, AttnCase{{0}, 2, 1, 4},
                      AttnCase{{0, 0, 0}, 1, 1, 2}));

TEST(Attention, SingleTokenAttendsOnlyToItself) {
  // softmax over one key is 1: out = v, lse = scale * q.k, exactly from the definition.
  Tensor q = rand64({1, 2, 6}, 15), k = rand64({1, 1, 6}, 16), v = rand64({1, 1, 6}, 17);
  AttnOut f = run_forward(q, k, v, cu_tensor({0, 1}), 0.3);
  for (int64_t h = 0; h < 2; ++h) {
    double s = 0;
    for (int64_t i = 0; i < 6; ++i) {
      EXPECT_NEAR(f.out.data<double>()[h * 6 + i], v.data<double>()[i], 1e-15);
      s += q.data<double>()[h * 6 + i] * k.data<double>()[i];
    }
    EXPECT_NEAR(f.lse.data<double>()[h], 0.3 * s, 1e-15);
  }
}

TEST(Attention, LargeScoresStayFinite) {
  // Scores of several hundred: the log-sum-exp must shift by the row max.
  Tensor q = rand64({5, 2, 4}, 18, 10, 20), k = rand64({5, 1, 4}, 19, 10, 20), v = rand64({5, 1, 4}, 20);
  AttnOut f = run_forward(q, k, v, cu_tensor({0, 5}), 1.0);
  EXPECT_TRUE(close(f.out, f.out, 0, 0));  // no NaN/inf
  EXPECT_TRUE(close(f.lse, f.lse, 0, 0));
}

TEST(Attention, BadCuSeqlensAreRejected) {
  Tensor q = rand64({5, 2, 4}, 21), k = rand64({5, 1, 4}, 22), v = rand64({5, 1, 4}, 23);
  struct Bad {
    std::vector<int32_t> cu;
    std::vector<std::string> parts;
  };
  for (const Bad& bad : {Bad{{1, 3, 5}, {"cu_seqlens[0] = 1", "must be 0"}},
                         Bad{{0, 4, 2, 5}, {"cu_seqlens[2] = 2", "cu_seqlens[1] = 4", "non-decreasing"}},
                         Bad{{0, 2, 4}, {"cu_seqlens[2] = 4", "T = 5"}},
                         Bad{{0, 3, 7, 5}, {"cu_seqlens[2] = 7", "T = 5"}},
                         Bad{{0, -1, 5}, {"cu_seqlens[1] = -1"}}}) {
    Tensor cu = cu_tensor(bad.cu);
    Tensor out = Tensor::poisoned({5, 2, 4}, DType::F64), lse = Tensor::poisoned({5, 2}, DType::F64);
    auto check = [&](const char* op, const std::function<void()>& fn) {
      try {
        fn();
        ADD_FAILURE() << op << " accepted invalid cu_seqlens (expected: " << bad.parts[0] << ")";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::InvalidData) << e.what();
        for (const std::string& p : bad.parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(op), std::string::npos) << e.what();
      }
    };
    check("attention_forward", [&] { ops::attention_forward(q, k, v, cu, 0.5, out, lse); });
    EXPECT_TRUE(all_nan(out));
    Tensor dq = Tensor::poisoned(q.shape(), DType::F64), dk = Tensor::poisoned(k.shape(), DType::F64),
           dv = Tensor::poisoned(v.shape(), DType::F64);
    check("attention_backward", [&] {
      ops::attention_backward(rand64({5, 2, 4}, 24), q, k, v, rand64({5, 2, 4}, 25),
                              rand64({5, 2}, 26), cu, 0.5, dq, dk, dv);
    });
    EXPECT_TRUE(all_nan(dq) && all_nan(dk) && all_nan(dv));
  }
}

TEST(Attention, ShapeErrors) {
  Tensor q = rand64({5, 3, 4}, 27), k = rand64({5, 2, 4}, 28), v = rand64({5, 2, 4}, 29);
  Tensor out = Tensor::poisoned({5, 3, 4}, DType::F64), lse = Tensor::poisoned({5, 3}, DType::F64);
  EXPECT_TRUE(throws([&] { ops::attention_forward(q, k, v, cu_tensor({0, 5}), 0.5, out, lse); },
                     ErrorKind::InvalidArgument, {"attention_forward", "multiple of kv heads", "[5, 3, 4]"}));
  Tensor q2 = rand64({5, 2, 4}, 30), v3 = rand64({5, 2, 3}, 31);
  Tensor out2 = Tensor::poisoned({5, 2, 4}, DType::F64), lse2 = Tensor::poisoned({5, 2}, DType::F64);
  EXPECT_TRUE(throws([&] { ops::attention_forward(q2, k, v3, cu_tensor({0, 5}), 0.5, out2, lse2); },
                     ErrorKind::InvalidArgument, {"attention_forward", "v must have shape [5, 2, 4]"}));
  Tensor cu64 = Tensor::from_vector<int64_t>({0, 5}, {2});
  EXPECT_TRUE(throws([&] { ops::attention_forward(q2, k, v, cu64, 0.5, out2, lse2); },
                     ErrorKind::InvalidArgument, {"attention_forward", "cu_seqlens must be i32"}));
}

}  // namespace
}  // namespace opd::test
