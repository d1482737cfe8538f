// Shared prompts in the CUDA teacher scorer (teacher/score_plan.h, teacher/cuda_scorer.h): the
// completions of one prompt run over the prompt's K/V (PagedForward::step_hidden on the device,
// paged prefill attention) and must give the dense path's scores:
// - f32 CUDA, shared vs dense (mode Always vs Never), on every fixture family, blocks of 4 and
//   16, prompts prefilled in chunks and completions in several steps: logprobs within 1e-4,
//   ids equal except near-ties (the two ids' dense CPU logprobs within 2e-4); and the f32 CUDA
//   shared path against the CPU scorer's shared path within the same bounds;
// - bf16 CUDA, shared vs dense: per-row bound 0.08 x max|z| / T + 1e-3 (the bf16 logit bound of
//   test_cuda_scorer.cpp) and top-K set overlap >= 80% on average.
// The plan is asserted to share (the test cannot pass on the dense path alone). Fast (tiny
// fixture models). GPU only: skips cleanly without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "cuda/cuda_test_util.h"
#include "common/shared_prompt_request.h"
#include "model/transformer.h"
#include "teacher/cuda_scorer.h"
#include "teacher/score_plan.h"
#include "teacher/scorer.h"

namespace opd::test {
namespace {

ScoreRequest make_request(int64_t V, int64_t k, double T) {
  return shared_prompt_request(V, k, T, true);
}

CudaScorer::Options gpu_options(DType dt, SharedPromptMode mode, int64_t block) {
  CudaScorer::Options o;
  o.dtype = dt;
  o.vocab_tile = 40;
  o.row_chunk = 16;
  o.max_batch_tokens = 20;  // prompt B in chunks, several suffix steps
  o.shared_prompt.mode = mode;
  o.shared_prompt.min_prompt_tokens = 8;
  o.shared_prompt.block_size = block;
  return o;
}

// Dense CPU logprobs of every scored row (response row order) and each row's max |logit|.
std::vector<std::vector<double>> dense_logprobs(const Transformer& m, const ScoreRequest& q,
                                                std::vector<double>* zmax_out) {
  const int64_t V = m.config().vocab_size;
  std::vector<std::vector<double>> rows;
  for (const ScoreSequence& s : q.sequences) {
    if (s.end == s.begin) continue;
    Tensor logits = m.forward(make_batch({s.ids}, V));
    for (int64_t p = s.begin; p < s.end; ++p) {
      const float* z = logits.data<float>() + (p - 1) * V;
      double mx = -INFINITY, zmax = 0;
      for (int64_t v = 0; v < V; ++v) {
        mx = std::max(mx, z[v] / q.temperature);
        zmax = std::max(zmax, std::fabs(static_cast<double>(z[v])));
      }
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] / q.temperature - mx);
      std::vector<double> lp(static_cast<size_t>(V));
      for (int64_t v = 0; v < V; ++v)
        lp[static_cast<size_t>(v)] = z[v] / q.temperature - mx - std::log(sum);
      rows.push_back(std::move(lp));
      if (zmax_out) zmax_out->push_back(zmax);
    }
  }
  return rows;
}

// f32 bounds: logprobs within 1e-4, ids equal or a near-tie (dense logprobs within 2e-4).
void expect_f32_close(const ScoreResponse& a, const ScoreResponse& b,
                      const std::vector<std::vector<double>>& dense) {
  ASSERT_EQ(a.row_offsets, b.row_offsets);
  ASSERT_EQ(a.ids.size(), b.ids.size());
  ASSERT_EQ(a.actual_logprobs.size(), b.actual_logprobs.size());
  const int64_t K = a.k;
  int64_t swaps = 0;
  for (int64_t row = 0; row < a.num_rows(); ++row) {
    for (int64_t j = 0; j < K; ++j) {
      const size_t e = static_cast<size_t>(row * K + j);
      ASSERT_TRUE(std::isfinite(a.logprobs[e])) << "row " << row << " entry " << j;
      EXPECT_LE(std::fabs(a.logprobs[e] - b.logprobs[e]), 1e-4) << "row " << row << " entry " << j;
      if (a.ids[e] != b.ids[e]) {
        ++swaps;
        ASSERT_TRUE(a.ids[e] >= 0 && a.ids[e] < a.vocab_size) << "row " << row << " id " << a.ids[e];
        const auto& lp = dense[static_cast<size_t>(row)];
        EXPECT_LE(std::fabs(lp[static_cast<size_t>(a.ids[e])] - lp[static_cast<size_t>(b.ids[e])]), 2e-4)
            << "row " << row << " entry " << j;
      }
    }
    const size_t r = static_cast<size_t>(row);
    ASSERT_TRUE(std::isfinite(a.actual_logprobs[r])) << "row " << row;
    EXPECT_LE(std::fabs(a.actual_logprobs[r] - b.actual_logprobs[r]), 1e-4) << "row " << row;
  }
  EXPECT_LE(swaps * 100, std::max<int64_t>(1, a.num_rows() * K)) << "near-tie swaps must be rare";
}

TEST(CudaScorerShared, F32SharedEqualsDenseAllFamiliesAndTheCpu) {
  REQUIRE_GPU();
  for (const char* m : {"qwen3", "qwen2", "llama", "llama_bias"}) {
    for (int64_t block : {int64_t{4}, int64_t{16}}) {
      SCOPED_TRACE(std::string(m) + " block " + std::to_string(block));
      const std::string dir = fixture_path(std::string("models/") + m);
      const Transformer cpu_model = Transformer::load(dir);
      const ScoreRequest q = make_request(cpu_model.config().vocab_size, 6, 0.8);
      const CudaScorer::Options so = gpu_options(DType::F32, SharedPromptMode::Always, block);
      const ScorePlan plan = plan_score_request(q, so.max_batch_tokens, cpu_model.config(), so.shared_prompt);
      ASSERT_EQ(plan.shared.size(), 2u);
      CudaScorer shared(dir, so);
      CudaScorer dense(dir, gpu_options(DType::F32, SharedPromptMode::Never, block));
      CpuScorer::Options co;
      co.max_batch_tokens = so.max_batch_tokens;
      co.shared_prompt = so.shared_prompt;
      CpuScorer cpu(dir, co);
      const auto ref = dense_logprobs(cpu_model, q, nullptr);
      const ScoreResponse s = shared.score(q);
      expect_f32_close(s, dense.score(q), ref);
      expect_f32_close(s, cpu.score(q), ref);
    }
  }
}

TEST(CudaScorerShared, Bf16SharedWithinBf16ToleranceOfDense) {
  REQUIRE_GPU();
  const std::string dir = fixture_path("models/qwen3");
  const Transformer cpu_model = Transformer::load(dir);
  const double T = 0.8;
  const int64_t K = 8, V = cpu_model.config().vocab_size;
  const ScoreRequest q = make_request(V, K, T);
  CudaScorer shared(dir, gpu_options(DType::BF16, SharedPromptMode::Always, 16));
  CudaScorer dense(dir, gpu_options(DType::BF16, SharedPromptMode::Never, 16));
  const ScoreResponse s = shared.score(q), d = dense.score(q);
  ASSERT_EQ(s.row_offsets, d.row_offsets);
  ASSERT_EQ(s.ids.size(), d.ids.size());
  std::vector<double> zmax;
  (void)dense_logprobs(cpu_model, q, &zmax);
  double overlap = 0;
  for (int64_t row = 0; row < s.num_rows(); ++row) {
    const double tol = 0.08 * zmax[static_cast<size_t>(row)] / T + 1e-3;
    std::set<int32_t> a, b;
    for (int64_t j = 0; j < K; ++j) {
      const size_t e = static_cast<size_t>(row * K + j);
      ASSERT_TRUE(s.ids[e] >= 0 && s.ids[e] < V) << "row " << row << " id " << s.ids[e];
      ASSERT_TRUE(std::isfinite(s.logprobs[e])) << "row " << row;
      EXPECT_LE(std::fabs(s.logprobs[e] - d.logprobs[e]), tol) << "row " << row << " entry " << j;
      a.insert(s.ids[e]);
      b.insert(d.ids[e]);
    }
    int common = 0;
    for (int32_t id : a) common += b.count(id) ? 1 : 0;
    overlap += static_cast<double>(common) / K;
    EXPECT_LE(std::fabs(s.actual_logprobs[static_cast<size_t>(row)] - d.actual_logprobs[static_cast<size_t>(row)]), tol)
        << "row " << row;
  }
  overlap /= static_cast<double>(s.num_rows());
  std::printf("[ bf16 shared ] top-%lld set overlap with the dense path: %.3f over %lld rows\n",
              static_cast<long long>(K), overlap, static_cast<long long>(s.num_rows()));
  EXPECT_GE(overlap, 0.8);
}

}  // namespace
}  // namespace opd::test
