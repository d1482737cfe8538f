// CudaScorer (teacher/cuda_scorer.h) against CpuScorer (teacher/scorer.h) on the fixture models
// of tests/fixtures/models (as tests/cuda/test_cuda_model.cpp uses them), with a request that
// exercises the shared forward plan: different lengths, an exact duplicate, a prefix of another
// sequence, one prompt with two completions, an empty scored range, a range ending early.
// - f32 CUDA model vs the CPU scorer of the same directory: ids equal except at near-ties
//   (both sides compute f32 logits up to summation order; a swap is accepted only when the dense
//   CPU logprobs of the two ids are within 2e-4), logprobs within 1e-4.
// - bf16 CUDA model vs the CPU scorer of the bf16-rounded weights (written to a per-process
//   temp dir, so weight rounding is not counted): per-row logprob bound 0.08 x max|z| / T + 1e-3
//   (the bf16 logit bound of test_cuda_model.cpp, max_rel 4e-2 of the row's logit scale, twice:
//   z and LSE), top-K set overlap >= 80% on average.
// - prefix sharing: duplicated / prefix rows bit-identical to their carrier's inside a request,
//   and every sequence scored alone equal to it within f32 tolerance.
// - a bad request is refused with the CPU scorer's message; the shared-model constructor and
//   make_local_scorer(dir, CUDA) give the same scores as the directory constructor.
// Fast (tiny models). GPU only: skips cleanly without a device.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <set>
#include <tuple>

#include "common/mixed_score_request.h"
#include "core/philox.h"
#include "cuda/cuda_test_util.h"
#include "model/init.h"
#include "model/transformer.h"
#include "teacher/cuda_scorer.h"
#include "teacher/scorer.h"

namespace opd::test {
namespace {

namespace fs = std::filesystem;

// The mixed batch of common/mixed_score_request.h, with the actual tokens' ranks.
ScoreRequest make_request(int64_t V, int64_t k, double T) {
  return mixed_score_request(V, k, T, /*with_ranks=*/true);
}

// Dense CPU logprobs log p_T(. | ids[0..p-1]) of every scored row, in response row order.
std::vector<std::vector<double>> dense_logprobs(const Transformer& cpu_model, const ScoreRequest& q,
                                                std::vector<double>* row_zmax = nullptr) {
  const int64_t V = cpu_model.config().vocab_size;
  std::vector<std::vector<double>> rows;
  for (const ScoreSequence& s : q.sequences) {
    if (s.end == s.begin) continue;
    Tensor logits = cpu_model.forward(make_batch({s.ids}, V));
    for (int64_t p = s.begin; p < s.end; ++p) {
      const float* z = logits.data<float>() + (p - 1) * V;
      double m = -INFINITY, zmax = 0;
      for (int64_t v = 0; v < V; ++v) {
        m = std::max(m, z[v] / q.temperature);
        zmax = std::max(zmax, std::fabs(static_cast<double>(z[v])));
      }
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] / q.temperature - m);
      std::vector<double> lp(static_cast<size_t>(V));
      for (int64_t v = 0; v < V; ++v) lp[static_cast<size_t>(v)] = z[v] / q.temperature - m - std::log(sum);
      rows.push_back(std::move(lp));
      if (row_zmax) row_zmax->push_back(zmax);
    }
  }
  return rows;
}

void expect_same_layout(const ScoreResponse& g, const ScoreResponse& c) {
  EXPECT_EQ(g.k, c.k);
  EXPECT_EQ(g.vocab_size, c.vocab_size);
  EXPECT_EQ(g.seq_begin, c.seq_begin);
  EXPECT_EQ(g.row_offsets, c.row_offsets);
  EXPECT_EQ(g.ids.size(), c.ids.size());
  EXPECT_EQ(g.logprobs.size(), c.logprobs.size());
  EXPECT_EQ(g.actual_logprobs.size(), c.actual_logprobs.size());
  EXPECT_EQ(g.actual_ranks.size(), c.actual_ranks.size());
}

// f32: entry-by-entry logprobs within 1e-4, ids equal except near-ties (dense CPU logprobs of
// the two ids within 2e-4); returns the number of swapped entries.
int64_t expect_f32_match(const ScoreResponse& g, const ScoreResponse& c,
                         const std::vector<std::vector<double>>& dense) {
  expect_same_layout(g, c);
  if (g.ids.size() != c.ids.size() || g.actual_logprobs.size() != c.actual_logprobs.size()) return 0;
  int64_t swaps = 0;
  const int64_t K = g.k;
  for (int64_t row = 0; row < g.num_rows(); ++row) {
    const auto& lp = dense[static_cast<size_t>(row)];
    for (int64_t j = 0; j < K; ++j) {
      const size_t e = static_cast<size_t>(row * K + j);
      EXPECT_LE(std::fabs(g.logprobs[e] - c.logprobs[e]), 1e-4) << "row " << row << " entry " << j;
      if (g.ids[e] != c.ids[e]) {
        ++swaps;
        if (!(g.ids[e] >= 0 && g.ids[e] < g.vocab_size)) {
          ADD_FAILURE() << "row " << row << " entry " << j << ": id " << g.ids[e];
          return swaps;
        }
        EXPECT_LE(std::fabs(lp[static_cast<size_t>(g.ids[e])] - lp[static_cast<size_t>(c.ids[e])]), 2e-4)
            << "row " << row << " entry " << j << ": id " << g.ids[e] << " vs cpu " << c.ids[e];
      }
    }
    EXPECT_LE(std::fabs(g.actual_logprobs[static_cast<size_t>(row)] - c.actual_logprobs[static_cast<size_t>(row)]),
              1e-4)
        << "row " << row;
    if (!c.actual_ranks.empty())
      EXPECT_LE(std::llabs(g.actual_ranks[static_cast<size_t>(row)] - c.actual_ranks[static_cast<size_t>(row)]), 1)
          << "row " << row;
  }
  return swaps;
}

CudaScorer::Options small_tiles(DType dt) {
  CudaScorer::Options o;
  o.dtype = dt;
  o.vocab_tile = 40;        // 96 ids: three tiles, the last one partial
  o.row_chunk = 16;         // several row chunks
  o.max_batch_tokens = 50;  // several forward batches
  return o;
}

TEST(CudaScorer, F32MatchesCpuScorerAllFamilies) {
  REQUIRE_GPU();
  for (const char* m : {"qwen3", "qwen2", "llama", "llama_bias"}) {
    SCOPED_TRACE(m);
    const std::string dir = fixture_path(std::string("models/") + m);
    const Transformer cpu_model = Transformer::load(dir);
    const int64_t V = cpu_model.config().vocab_size;
    CpuScorer cpu(dir);
    CudaScorer gpu(dir, small_tiles(DType::F32));
    EXPECT_EQ(gpu.info().vocab_size, cpu.info().vocab_size);
    EXPECT_EQ(gpu.info().fingerprint, cpu.info().fingerprint);
    for (auto [k, t] : {std::pair<int64_t, double>{5, 1.0}, {1, 0.7}, {96, 1.3}, {0, 1.0}}) {
      SCOPED_TRACE("k=" + std::to_string(k) + " T=" + std::to_string(t));
      const ScoreRequest q = make_request(V, k, t);
      const ScoreResponse c = cpu.score(q), g = gpu.score(q);
      ASSERT_NO_THROW(check_response_matches(g, q));
      const int64_t swaps = expect_f32_match(g, c, dense_logprobs(cpu_model, q));
      EXPECT_LE(swaps * 100, std::max<int64_t>(1, g.num_rows() * k)) << "near-tie swaps must be rare";
    }
  }
}

TEST(CudaScorer, Bf16WithinBf16ToleranceOfTheCpuOnTheSameWeights) {
  REQUIRE_GPU();
  const std::string src = fixture_path("models/qwen3");
  const Transformer loaded = Transformer::load(src);
  // The CPU reference scores the bf16-rounded weights (written as an f32 model directory).
  const Transformer rounded = loaded.to(Device::CPU, DType::BF16).to(Device::CPU, DType::F32);
  const std::string dir =
      (fs::temp_directory_path() / ("opd_cuda_scorer_" + std::to_string(::getpid()))).string();
  fs::remove_all(dir);
  save_model_dir(dir, rounded.config(), rounded.weights());
  CpuScorer cpu(dir);
  CudaScorer gpu(dir, small_tiles(DType::BF16));
  const int64_t V = loaded.config().vocab_size, K = 8;
  const double T = 0.8;
  const ScoreRequest q = make_request(V, K, T);
  const ScoreResponse c = cpu.score(q), g = gpu.score(q);
  fs::remove_all(dir);
  expect_same_layout(g, c);
  ASSERT_EQ(g.ids.size(), c.ids.size());
  std::vector<double> zmax;
  const auto dense = dense_logprobs(rounded, q, &zmax);
  double overlap = 0;
  for (int64_t row = 0; row < g.num_rows(); ++row) {
    const double tol = 0.08 * zmax[static_cast<size_t>(row)] / T + 1e-3;
    std::set<int32_t> cs, gs;
    for (int64_t j = 0; j < K; ++j) {
      const size_t e = static_cast<size_t>(row * K + j);
      ASSERT_TRUE(g.ids[e] >= 0 && g.ids[e] < V) << "row " << row << " id " << g.ids[e];
      EXPECT_LE(std::fabs(g.logprobs[e] - c.logprobs[e]), tol) << "row " << row << " entry " << j;
      // The GPU's logprob of its id is the CPU's logprob of that id, within the same bound.
      EXPECT_LE(std::fabs(g.logprobs[e] - dense[static_cast<size_t>(row)][static_cast<size_t>(g.ids[e])]), tol)
          << "row " << row << " entry " << j << " id " << g.ids[e];
      cs.insert(c.ids[e]);
      gs.insert(g.ids[e]);
    }
    int common = 0;
    for (int32_t id : gs) common += cs.count(id) ? 1 : 0;
    overlap += static_cast<double>(common) / K;
    EXPECT_LE(std::fabs(g.actual_logprobs[static_cast<size_t>(row)] - c.actual_logprobs[static_cast<size_t>(row)]),
              tol)
        << "row " << row;
  }
  overlap /= static_cast<double>(g.num_rows());
  std::printf("[ bf16 ] top-%lld set overlap with the CPU: %.3f over %lld rows\n",
              static_cast<long long>(K), overlap, static_cast<long long>(g.num_rows()));
  EXPECT_GE(overlap, 0.8);
}

TEST(CudaScorer, PrefixSharingGivesTheSameScoresAsScoringAlone) {
  REQUIRE_GPU();
  const std::string dir = fixture_path("models/qwen3");
  CudaScorer gpu(dir, small_tiles(DType::F32));
  const ScoreRequest q = make_request(96, 6, 1.0);
  const ScoreResponse all = gpu.score(q);
  const int64_t K = q.k;
  auto rows_of = [&](const ScoreResponse& r, size_t s) {
    const int64_t b = r.row_offsets[s], e = r.row_offsets[s + 1];
    return std::make_tuple(std::vector<int32_t>(r.ids.begin() + b * K, r.ids.begin() + e * K),
                           std::vector<float>(r.logprobs.begin() + b * K, r.logprobs.begin() + e * K),
                           std::vector<float>(r.actual_logprobs.begin() + b, r.actual_logprobs.begin() + e));
  };
  // Sequence 2 duplicates 0: bit-identical rows (taken from the same carrier rows).
  EXPECT_TRUE(rows_of(all, 0) == rows_of(all, 2));
  // Sequence 3 (a prefix of 0, scored from position 5) shares rows 10..24 with sequence 0.
  {
    const auto [ids0, lp0, a0] = rows_of(all, 0);
    const auto [ids3, lp3, a3] = rows_of(all, 3);
    for (int64_t p = 10; p < 25; ++p) {
      for (int64_t j = 0; j < K; ++j) {
        EXPECT_EQ(ids3[static_cast<size_t>((p - 5) * K + j)], ids0[static_cast<size_t>((p - 10) * K + j)]);
        EXPECT_EQ(lp3[static_cast<size_t>((p - 5) * K + j)], lp0[static_cast<size_t>((p - 10) * K + j)]);
      }
      EXPECT_EQ(a3[static_cast<size_t>(p - 5)], a0[static_cast<size_t>(p - 10)]);
    }
  }
  // Each sequence alone (nothing to share) agrees within f32 tolerance.
  const Transformer cpu_model = Transformer::load(dir);
  for (size_t s = 0; s < q.sequences.size(); ++s) {
    SCOPED_TRACE("sequence " + std::to_string(s));
    ScoreRequest one = q;
    one.sequences = {q.sequences[s]};
    const ScoreResponse alone = gpu.score(one);
    ScoreResponse part = alone;
    const int64_t b = all.row_offsets[s], e = all.row_offsets[s + 1];
    part.ids.assign(all.ids.begin() + b * K, all.ids.begin() + e * K);
    part.logprobs.assign(all.logprobs.begin() + b * K, all.logprobs.begin() + e * K);
    part.actual_logprobs.assign(all.actual_logprobs.begin() + b, all.actual_logprobs.begin() + e);
    part.actual_ranks.assign(all.actual_ranks.begin() + b, all.actual_ranks.begin() + e);
    (void)expect_f32_match(alone, part, dense_logprobs(cpu_model, one));
  }
}

TEST(CudaScorer, BadRequestsAreRefusedWithTheCpuMessage) {
  REQUIRE_GPU();
  const std::string dir = fixture_path("models/qwen3");
  CpuScorer cpu(dir);
  CudaScorer gpu(dir, small_tiles(DType::BF16));
  const ScoreRequest ok = make_request(96, 4, 1.0);
  std::vector<ScoreRequest> bad(7, ok);
  bad[0].sequences[1].ids[3] = 96;
  bad[1].sequences[0].ids[0] = -5;
  bad[2].sequences[2].begin = 0;
  bad[3].sequences[1].end = 18;
  bad[4].k = 97;
  bad[5].temperature = std::nan("");
  bad[6].model_fingerprint = "deadbeef";
  for (size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE("bad request " + std::to_string(i));
    const std::string want = error_message([&] { cpu.score(bad[i]); }, ErrorKind::InvalidArgument);
    const std::string got = error_message([&] { gpu.score(bad[i]); }, ErrorKind::InvalidArgument);
    EXPECT_FALSE(want.empty());
    EXPECT_EQ(message_head(got), message_head(want));
  }
  // Limits are the scorer's options, as on the CPU.
  CudaScorer::Options o = small_tiles(DType::BF16);
  o.limits.max_tokens = 100;
  CudaScorer limited(dir, o);
  EXPECT_NE(error_message([&] { limited.score(ok); }, ErrorKind::InvalidArgument).find("over the limit of 100"),
            std::string::npos);
  // The scorer still works after the refusals.
  EXPECT_EQ(gpu.score(ok).num_rows(), ok.num_rows());
}

TEST(CudaScorer, SharedModelAndFactoryGiveTheSameScores) {
  REQUIRE_GPU();
  const std::string dir = fixture_path("models/llama");
  const Transformer host = Transformer::load(dir);
  CudaScorer::Options o;  // defaults: bf16, large tiles
  CudaScorer from_dir(dir, o);
  auto shared = std::make_shared<const Transformer>(host.to(Device::CUDA, DType::BF16));
  CudaScorer reuse(shared, TeacherInfo{}, o);
  EXPECT_EQ(reuse.info().vocab_size, host.config().vocab_size);
  std::unique_ptr<Scorer> factory = make_local_scorer(dir, Device::CUDA);
  const ScoreRequest q = make_request(96, 7, 1.1);
  const ScoreResponse a = from_dir.score(q), b = reuse.score(q), c = factory->score(q);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.logprobs, b.logprobs);
  EXPECT_EQ(a.actual_logprobs, b.actual_logprobs);
  EXPECT_EQ(a.ids, c.ids);
  EXPECT_EQ(a.logprobs, c.logprobs);
  // A teacher description that disagrees with the model is refused; so is a host model.
  TeacherInfo wrong;
  wrong.vocab_size = 95;
  EXPECT_NE(error_message([&] { (void)CudaScorer(shared, wrong, o); }, ErrorKind::InvalidArgument).find("vocabulary 95"),
            std::string::npos);
  auto on_host = std::make_shared<const Transformer>(host);
  EXPECT_NE(error_message([&] { (void)CudaScorer(on_host, TeacherInfo{}, o); }, ErrorKind::InvalidArgument).find("CUDA weights"),
            std::string::npos);
  // next_tokens is not offered on CUDA.
  NextTokenRequest nt;
  nt.prompts = {{1, 2, 3}};
  EXPECT_THROW(from_dir.next_tokens(nt), Error);
}

}  // namespace
}  // namespace opd::test
