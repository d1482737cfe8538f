// Teacher scorer against a dense reference: full logits from Transformer::forward of each
// sequence alone, log_softmax(z / T) in double and a full sort, computed here in the test (the
// transformer forward itself is checked against transformers in tests/model). Also: the tiled
// top-K kernel's memory bound, Gumbel-max sampling, request validation and payload validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/mixed_score_request.h"
#include "common/test_util.h"
#include "core/philox.h"
#include "loss/teacher_payload.h"
#include "model/transformer.h"
#include "teacher/scorer.h"
#include "teacher/topk_lm_head.h"

namespace opd {
namespace {

struct RefRow {
  std::vector<int32_t> ids;
  std::vector<double> logprobs;
  double actual = 0;
};

// Dense reference of one row of logits.
RefRow dense_row(const float* z, int64_t V, int64_t k, double T, int32_t actual) {
  double m = -INFINITY;
  for (int64_t v = 0; v < V; ++v) m = std::max(m, z[v] / T);
  double s = 0;
  for (int64_t v = 0; v < V; ++v) s += std::exp(z[v] / T - m);
  const double lse = m + std::log(s);
  std::vector<int32_t> idx(static_cast<size_t>(V));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return z[a] > z[b]; });
  RefRow r;
  for (int64_t j = 0; j < k; ++j) {
    r.ids.push_back(idx[static_cast<size_t>(j)]);
    r.logprobs.push_back(z[idx[static_cast<size_t>(j)]] / T - lse);
  }
  r.actual = z[actual] / T - lse;
  return r;
}

// The mixed batch of common/mixed_score_request.h (duplicates, prefixes, empty ranges).
ScoreRequest make_request(int64_t V, int64_t k, double T) {
  return test::mixed_score_request(V, k, T, /*with_ranks=*/false);
}

void expect_matches_dense(const std::string& model_name, int64_t k, double T) {
  SCOPED_TRACE(model_name + " k=" + std::to_string(k) + " T=" + std::to_string(T));
  const std::string dir = test::fixture_path("models/" + model_name);
  Transformer model = Transformer::load(dir);
  const int64_t V = model.config().vocab_size;
  CpuScorer::Options opts;
  opts.vocab_tile = 7;        // many tiles, the last one partial
  opts.row_chunk = 5;
  opts.max_batch_tokens = 50;  // several forward batches
  CpuScorer scorer(dir, opts);
  ScoreRequest q = make_request(V, k, T);
  ScoreResponse r = scorer.score(q);
  ASSERT_NO_THROW(check_response_matches(r, q));
  EXPECT_EQ(r.vocab_size, V);
  EXPECT_EQ(r.k, k);

  int64_t checked = 0;
  for (size_t s = 0; s < q.sequences.size(); ++s) {
    const ScoreSequence& sq = q.sequences[s];
    if (sq.end == sq.begin) continue;
    Tensor logits = model.forward(make_batch({sq.ids}, V));
    for (int64_t p = sq.begin; p < sq.end; ++p) {
      const int64_t row = r.row_offsets[s] + (p - sq.begin);
      RefRow ref = dense_row(logits.data<float>() + (p - 1) * V, V, k, T, sq.ids[p]);
      for (int64_t j = 0; j < k; ++j) {
        ASSERT_EQ(r.ids[row * k + j], ref.ids[j]) << "sequence " << s << " position " << p
                                                  << " entry " << j;
        const double got = r.logprobs[row * k + j], want = ref.logprobs[j];
        ASSERT_LE(std::fabs(got - want), 1e-6 + 1e-6 * std::fabs(want))
            << "sequence " << s << " position " << p << " entry " << j;
      }
      const double got = r.actual_logprobs[row];
      ASSERT_LE(std::fabs(got - ref.actual), 1e-6 + 1e-6 * std::fabs(ref.actual))
          << "sequence " << s << " position " << p << " actual";
      ++checked;
    }
  }
  EXPECT_EQ(checked, r.num_rows());
}

TEST(Scorer, MatchesDenseReferenceAllFamilies) {
  for (const char* m : {"qwen3", "qwen2", "llama", "llama_bias"}) expect_matches_dense(m, 5, 1.0);
}

TEST(Scorer, MatchesDenseReferenceTemperatureAndK) {
  expect_matches_dense("qwen3", 1, 0.7);
  expect_matches_dense("qwen3", 16, 2.0);
  expect_matches_dense("qwen3", 96, 1.3);  // K = V: the whole distribution, sums to 1
  expect_matches_dense("qwen3", 0, 1.0);   // actual token only
}

TEST(Scorer, FullVocabularySumsToOne) {
  CpuScorer scorer(test::fixture_path("models/llama"));
  ScoreRequest q = make_request(96, 96, 0.9);
  ScoreResponse r = scorer.score(q);
  for (int64_t row = 0; row < r.num_rows(); ++row) {
    double s = 0;
    for (int64_t j = 0; j < 96; ++j) s += std::exp(static_cast<double>(r.logprobs[row * 96 + j]));
    ASSERT_NEAR(s, 1.0, 1e-5) << "row " << row;
  }
}

TEST(Scorer, ResponsePassesPayloadValidation) {
  CpuScorer scorer(test::fixture_path("models/qwen3"));
  ScoreRequest q = make_request(96, 8, 1.0);
  ScoreResponse r = scorer.score(q);
  LossConfig cfg;
  cfg.temperature = 1.0;
  TeacherTopK t = validate_teacher_payload(to_teacher_payload(r), completion_layout(q), 96, cfg,
                                           DType::F32);
  EXPECT_EQ(t.rows, r.num_rows());
  EXPECT_EQ(t.k, 8);
  // The same response checked against a student with a smaller vocabulary is refused.
  EXPECT_THROW(validate_teacher_payload(to_teacher_payload(r), completion_layout(q), 50, cfg,
                                        DType::F32),
               Error);
}

TEST(Scorer, RejectsBadRequestsNamingTheProblem) {
  CpuScorer scorer(test::fixture_path("models/qwen3"));
  auto expect_error = [&](ScoreRequest q, const std::string& needle) {
    try {
      scorer.score(q);
      ADD_FAILURE() << "accepted a request that should fail with: " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  ScoreRequest ok = make_request(96, 4, 1.0);
  ScoreRequest q = ok;
  q.sequences[1].ids[3] = 96;
  expect_error(q, "sequence 1, position 3: token id 96 is outside the vocabulary [0, 96)");
  q = ok;
  q.sequences[0].ids[0] = -5;
  expect_error(q, "token id -5");
  q = ok;
  q.sequences[2].begin = 0;
  expect_error(q, "sequence 2: scored positions [0, 40)");
  q = ok;
  q.sequences[1].end = 18;
  expect_error(q, "end <= length 17");
  q = ok;
  q.k = 97;
  expect_error(q, "k = 97");
  q = ok;
  q.k = -1;
  expect_error(q, "k = -1");
  q = ok;
  q.temperature = std::nan("");
  expect_error(q, "temperature nan");
  q = ok;
  q.temperature = 0;
  expect_error(q, "temperature 0");
  q = ok;
  q.model_fingerprint = "deadbeef";
  expect_error(q, "expects teacher fingerprint 'deadbeef'");
  q = ok;
  q.model_fingerprint = scorer.info().fingerprint;
  EXPECT_NO_THROW(scorer.score(q));
}

TEST(Scorer, LimitsBoundTheRequest) {
  CpuScorer::Options opts;
  opts.limits.max_tokens = 100;
  opts.limits.max_output_entries = 50;
  CpuScorer scorer(test::fixture_path("models/qwen3"), opts);
  ScoreRequest q;
  q.k = 2;
  q.sequences.push_back({test::philox_ids(9, 7, 60, 96), 1, 60});
  q.sequences.push_back({test::philox_ids(8, 7, 60, 96), 1, 2});
  try {
    scorer.score(q);
    ADD_FAILURE() << "over the token limit";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("over the limit of 100"), std::string::npos) << e.what();
  }
  q.sequences.pop_back();
  try {
    scorer.score(q);
    ADD_FAILURE() << "over the output limit";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("limit of 50 output entries"), std::string::npos)
        << e.what();
  }
}

// The vocabulary pass never holds more than one [row_chunk x tile] logit tile: with V = 50,000
// a dense [N x V] buffer would be 6.6 MB; the tile is 16 x 1000 x 4 = 64 KB.
TEST(TopKLmHead, MemoryIsOneTileAndMatchesDense) {
  const int64_t N = 33, H = 8, V = 50000, K = 40;
  TopKLmHeadArgs a;
  a.hidden = test::random_uniform({N, H}, DType::F32, 11, -2, 2);
  a.lm_head = test::random_uniform({V, H}, DType::F32, 12, -1, 1);
  for (int64_t r = 0; r < N; ++r) a.actual.push_back(static_cast<int32_t>((r * 7919) % V));
  a.actual[3] = -1;  // a row without an actual token
  a.k = K;
  a.temperature = 0.8;
  a.vocab_tile = 1000;
  a.row_chunk = 16;
  const MemoryStats before = memory_stats(Device::CPU);
  reset_peak_memory(Device::CPU);
  TopKLmHeadResult res = topk_lm_head(a);
  const int64_t extra = memory_stats(Device::CPU).peak - before.in_use;
  EXPECT_LE(extra, topk_lm_head_scratch_bytes(N, V, 1000, 16));
  EXPECT_EQ(topk_lm_head_scratch_bytes(N, V, 1000, 16), 16 * 1000 * 4);
  EXPECT_LT(extra, N * V * 4 / 50);

  Tensor logits = Tensor::empty({N, V}, DType::F32);
  // Dense reference logits in double.
  {
    const float* h = a.hidden.data<float>();
    const float* w = a.lm_head.data<float>();
    for (int64_t r = 0; r < N; ++r)
      for (int64_t v = 0; v < V; ++v) {
        double acc = 0;
        for (int64_t j = 0; j < H; ++j) acc += static_cast<double>(h[r * H + j]) * w[v * H + j];
        logits.data<float>()[r * V + v] = static_cast<float>(acc);
      }
  }
  for (int64_t r = 0; r < N; ++r) {
    RefRow ref = dense_row(logits.data<float>() + r * V, V, K, 0.8, std::max(a.actual[r], 0));
    for (int64_t j = 0; j < K; ++j) {
      // Logits of a tiny H can sit within rounding of each other: compare values, and ids
      // wherever the reference's neighbours are separated by more than the rounding.
      const double want = ref.logprobs[j];
      ASSERT_LE(std::fabs(res.logprobs[r * K + j] - want), 2e-5) << "row " << r << " entry " << j;
    }
    ASSERT_EQ(res.ids[r * K], ref.ids[0]) << "row " << r;
    if (a.actual[r] < 0) {
      EXPECT_TRUE(std::isnan(res.actual_logprobs[r]));
    } else {
      EXPECT_LE(std::fabs(res.actual_logprobs[r] - ref.actual), 2e-5) << "row " << r;
    }
  }
}

TEST(TopKLmHead, RejectsActualIdOutsideVocabulary) {
  TopKLmHeadArgs a;
  a.hidden = test::random_uniform({2, 4}, DType::F32, 1);
  a.lm_head = test::random_uniform({10, 4}, DType::F32, 2);
  a.actual = {3, 10};
  a.k = 2;
  try {
    topk_lm_head(a);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData);
    EXPECT_NE(std::string(e.what()).find("row 1: actual token id 10"), std::string::npos);
  }
}

// Gumbel-max over tiles samples softmax(z / Ts): frequencies over 40,000 Philox streams of one
// row with V = 6 match the probabilities within 5 standard errors; Ts = 0 is the argmax.
TEST(TopKLmHead, GumbelMaxSamplesTheSoftmax) {
  const int64_t N = 40000, H = 3, V = 6;
  Tensor h1 = test::random_uniform({1, H}, DType::F32, 5, -1, 1);
  TopKLmHeadArgs a;
  a.hidden = Tensor::empty({N, H}, DType::F32);
  for (int64_t r = 0; r < N; ++r)
    std::copy(h1.data<float>(), h1.data<float>() + H, a.hidden.data<float>() + r * H);
  a.lm_head = test::random_uniform({V, H}, DType::F32, 6, -1.5, 1.5);
  a.k = 1;
  a.vocab_tile = 4;
  a.row_chunk = 1000;
  a.sample = true;
  a.sample_temperature = 1.5;
  a.seed = 1234;
  for (int64_t r = 0; r < N; ++r) a.streams.push_back(static_cast<uint64_t>(r));
  TopKLmHeadResult r = topk_lm_head(a);
  std::vector<double> z(V);
  for (int64_t v = 0; v < V; ++v) {
    double acc = 0;
    for (int64_t j = 0; j < H; ++j) acc += h1.data<float>()[j] * a.lm_head.data<float>()[v * H + j];
    z[v] = acc / 1.5;
  }
  const double m = *std::max_element(z.begin(), z.end());
  double s = 0;
  for (double x : z) s += std::exp(x - m);
  std::vector<int64_t> count(V, 0);
  for (int32_t id : r.sampled) {
    ASSERT_GE(id, 0);
    ASSERT_LT(id, V);
    ++count[id];
  }
  for (int64_t v = 0; v < V; ++v) {
    const double p = std::exp(z[v] - m) / s;
    const double se = std::sqrt(p * (1 - p) / N);
    EXPECT_NEAR(static_cast<double>(count[v]) / N, p, 5 * se + 1e-9) << "id " << v;
  }
  a.sample_temperature = 0;
  TopKLmHeadResult g = topk_lm_head(a);
  for (int64_t i = 0; i < N; i += 997) EXPECT_EQ(g.sampled[i], g.ids[i]);  // argmax = top-1
}

}  // namespace
}  // namespace opd
