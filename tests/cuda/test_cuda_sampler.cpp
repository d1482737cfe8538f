// CUDA sampler (rollout/sampler_cuda.cu) against the CPU sampler (rollout/sampler.cpp) on the
// same f32 logits and the same Philox streams: greedy equals the CPU's first argmax (ties
// included); every setting's GPU pick equals the CPU's pick for the same u except where u lies
// within rounding of a CDF boundary (counted, must be rare); sampling and model logprobs match;
// chi-square of GPU frequencies against the CPU's filtered probabilities at several settings;
// non-finite logits rejected; both kernels (a row split over a cluster of CTAs, one CTA per row)
// and rows independent of the batch. GPU only: every test skips cleanly without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "common/chi_square.h"  // chi2_pvalue, chi2_test
#include "core/philox.h"
#include "cuda/cuda_test_util.h"
#include "rollout/sampler.h"
#include "rollout/sampler_cuda.h"  // cuda::sample_rows with a forced cluster

namespace opd::test {
namespace {

double model_lse(const float* z, int64_t V) {
  double m = -INFINITY, s = 0;
  for (int64_t v = 0; v < V; ++v) m = std::max(m, static_cast<double>(z[v]));
  for (int64_t v = 0; v < V; ++v) s += std::exp(z[v] - m);
  return m + std::log(s);
}

std::string describe(const SamplingParams& p) {
  return cat("T=", p.temperature, " top_k=", p.top_k, " top_p=", p.top_p, " min_p=", p.min_p);
}

std::vector<SamplingParams> settings() {
  std::vector<SamplingParams> s(7);
  s[0].temperature = 1.0;
  s[1].temperature = 0.7;
  s[1].top_k = 50;
  s[2].top_p = 0.9;
  s[3].min_p = 0.05;
  s[4].temperature = 1.3;
  s[4].top_k = 100;
  s[4].top_p = 0.95;
  s[4].min_p = 0.02;
  s[5].temperature = 1.5;
  s[5].top_p = 0.5;
  s[6].temperature = 0.25;
  s[6].top_k = 1;
  for (size_t i = 0; i < s.size(); ++i) s[i].seed = 1000 + i;
  return s;
}

// Rows of logits with a realistic spread (a few dominant ids, a long tail).
Tensor make_logits(int64_t B, int64_t V, uint64_t seed) {
  Tensor z = random_uniform({B, V}, DType::F32, seed, -4, 4);
  float* p = z.data<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int j = 0; j < 8; ++j) p[b * V + philox_u32(seed, b, j) % V] += 6.0f + j;  // peaks
  return z;
}

// sample_tokens_cuda through the raw cuda::sample_rows with a forced cluster (CTAs per row: 0 =
// auto, -1 = the one-CTA-per-row kernel, 1/2/4/8 = the cluster kernel split that many ways).
std::vector<SampledToken> sample_with_cluster(const Tensor& zd, const std::vector<SamplingParams>& params,
                                              const std::vector<SampleStream>& streams, int cluster) {
  const int64_t B = zd.dim(0), V = zd.dim(1);
  std::vector<cuda::SampleRowParams> rows(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    cuda::SampleRowParams& r = rows[static_cast<size_t>(b)];
    r.temperature = params[b].temperature;
    r.top_p = params[b].top_p;
    r.min_p = params[b].min_p;
    r.top_k = params[b].top_k;
    r.seed = params[b].seed;
    r.stream_key = streams[b].stream_key;
    r.sample_index = streams[b].sample_index;
    r.step = streams[b].step;
  }
  static_assert(sizeof(cuda::SampleRowParams) % 8 == 0);
  const int64_t words = B * static_cast<int64_t>(sizeof(cuda::SampleRowParams)) / 8;
  Tensor ph = Tensor::empty({words}, DType::I64);
  std::memcpy(ph.raw(), rows.data(), rows.size() * sizeof(cuda::SampleRowParams));
  Tensor pd = ph.to(Device::CUDA);
  Tensor ids = Tensor::from_vector(std::vector<int32_t>(static_cast<size_t>(B), -7), {B}).to(Device::CUDA);
  Tensor slp = dev_poison({B}, DType::F32), mlp = dev_poison({B}, DType::F32);
  Tensor flag = Tensor::from_vector(std::vector<int32_t>{-1}, {1}).to(Device::CUDA);
  cuda::sample_rows(zd.data<float>(), B, V, static_cast<const cuda::SampleRowParams*>(pd.raw()),
                    ids.data<int32_t>(), slp.data<float>(), mlp.data<float>(),
                    reinterpret_cast<unsigned*>(flag.raw()), nullptr, nullptr, cluster);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(flag.to(Device::CPU).data<int32_t>()[0], -1);
  Tensor hi = ids.to(Device::CPU), hs = slp.to(Device::CPU), hm = mlp.to(Device::CPU);
  std::vector<SampledToken> out(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b)
    out[b] = SampledToken{hi.data<int32_t>()[b], hs.data<float>()[b], hm.data<float>()[b]};
  return out;
}

TEST(CudaSampler, GreedyEqualsCpuFirstArgmax) {
  REQUIRE_GPU();
  for (int64_t V : {1, 7, 1000, 151936}) {
    const int64_t B = 64;
    Tensor z = make_logits(B, V, 3 + V);
    float* p = z.data<float>();
    for (int64_t b = 0; b < B; b += 3) {  // exact ties for the max: the first id must win
      const int64_t a = (b * 7919) % V, c = (b * 104729 + 5) % V;
      p[b * V + a] = p[b * V + c] = 100.0f;
    }
    std::vector<SamplingParams> params(B);
    std::vector<SampleStream> streams(B);
    for (auto& q : params) q.temperature = 0;
    std::vector<SampledToken> got = sample_tokens_cuda(z.to(Device::CUDA), params, streams);
    std::vector<double> scratch;
    for (int64_t b = 0; b < B; ++b) {
      SampledToken want = sample_token(p + b * V, V, params[b], 0.5, scratch);
      EXPECT_EQ(got[b].id, want.id) << "V " << V << " row " << b;
      EXPECT_EQ(got[b].sampling_logprob, 0.0);
      EXPECT_NEAR(got[b].model_logprob, want.model_logprob, 1e-5 + 1e-6 * std::fabs(want.model_logprob));
    }
  }
}

// Same u, same pick (unless u is within 1e-5 of the CPU's CDF value at the smaller id: f32 exp
// on the GPU vs f64 on the CPU moves CDF boundaries by ~1e-7, and a tail token at the top-p
// threshold (mass ~1e-6) can fall on either side); same logprobs. The CPU pick is sample_token's
// inverse CDF over sampling_distribution (computed once per row and setting, reused per step).
// Every kernel shape: the automatic one (cluster kernel, 1 CTA per row at V <= 4096, 8 at W1's
// V), the one-CTA-per-row kernel (-1), and rows split over 2 and 8 CTAs (slices of 25 ids at
// V = 50 leave some CTAs of a cluster empty; at V = 151936 the radix selects, scans and argmax
// ties cross CTA boundaries).
TEST(CudaSampler, PicksAndLogprobsMatchCpuForTheSameUniform) {
  REQUIRE_GPU();
  int64_t draws = 0, boundary = 0;
  for (int64_t V : {50, 1000, 151936}) {
    const int64_t B = 64;
    Tensor z = make_logits(B, V, 77 + V);
    Tensor zd = z.to(Device::CUDA);
    const float* p = z.data<float>();
    std::vector<double> lse(B);
    for (int64_t b = 0; b < B; ++b) lse[b] = model_lse(p + b * V, V);
    for (const SamplingParams& base : settings()) {
      std::vector<std::vector<double>> probs(B);
      for (int64_t b = 0; b < B; ++b) sampling_distribution(p + b * V, V, base, probs[b]);
      for (int cluster : {0, -1, 2, 8}) {
        const uint32_t steps = cluster != 0 ? 2u : V > 10000 ? 3u : 16u;
        for (uint32_t step = 0; step < steps; ++step) {
          std::vector<SamplingParams> params(B, base);
          std::vector<SampleStream> streams(B);
          for (int64_t b = 0; b < B; ++b)
            streams[b] = {0x9e3779b97f4a7c15ull * (b + 1), static_cast<uint32_t>(b % 3), step};
          std::vector<SampledToken> got = cluster == 0 ? sample_tokens_cuda(zd, params, streams)
                                                       : sample_with_cluster(zd, params, streams, cluster);
          for (int64_t b = 0; b < B; ++b) {
            SCOPED_TRACE(cat("V ", V, " ", describe(base), " cluster ", cluster, " step ", step, " row ", b));
            const std::vector<double>& pr = probs[b];
            const double u = sampling_uniform(base.seed, streams[b].stream_key,
                                              streams[b].sample_index, step);
            int32_t want = -1;  // sample_token's draw
            double cum = 0;
            for (int64_t v = 0; v < V; ++v) {
              if (pr[v] <= 0) continue;
              want = static_cast<int32_t>(v);
              cum += pr[v];
              if (u < cum) break;
            }
            ++draws;
            ASSERT_TRUE(got[b].id >= 0 && got[b].id < V) << got[b].id;
            EXPECT_GT(pr[got[b].id], 0.0) << "GPU picked a filtered-out id " << got[b].id;
            if (got[b].id != want) {
              const int32_t a = std::min(got[b].id, want);
              double cdf = 0;
              for (int32_t v = 0; v <= a; ++v) cdf += pr[v];
              EXPECT_LE(std::fabs(u - cdf), 1e-5) << "pick " << got[b].id << " vs cpu " << want
                                                 << ": u " << u << " is not at a CDF boundary (" << cdf << ")";
              ++boundary;
            }
            if (pr[got[b].id] > 0) {
              const double want_slp = std::log(pr[got[b].id]);
              EXPECT_NEAR(got[b].sampling_logprob, want_slp, 1e-5 + 1e-6 * std::fabs(want_slp));
            }
            const double want_mlp = p[b * V + got[b].id] - lse[b];
            EXPECT_NEAR(got[b].model_logprob, want_mlp, 1e-5 + 1e-6 * std::fabs(want_mlp));
          }
        }
      }
    }
  }
  std::printf("[ boundary ] %lld of %lld draws differ from the CPU at a CDF boundary\n",
              static_cast<long long>(boundary), static_cast<long long>(draws));
  EXPECT_LE(boundary * 1000, draws) << "boundary cases must be rare";
}

// Small enough for compute-sanitizer (memcheck, racecheck of the shared and distributed shared
// memory): 3 rows of V = 2000, every filter setting, every kernel shape; each pick is kept by the
// CPU's distribution and equals the CPU's pick unless u is at a CDF boundary.
TEST(CudaSampler, SanitizerSizedRowsEverySplit) {
  REQUIRE_GPU();
  const int64_t B = 3, V = 2000;
  Tensor z = make_logits(B, V, 31);
  Tensor zd = z.to(Device::CUDA);
  for (const SamplingParams& base : settings()) {
    std::vector<std::vector<double>> probs(B);
    for (int64_t b = 0; b < B; ++b) sampling_distribution(z.data<float>() + b * V, V, base, probs[b]);
    std::vector<SamplingParams> params(B, base);
    std::vector<SampleStream> streams(B);
    for (int64_t b = 0; b < B; ++b) streams[b] = {0x1234567ull * (b + 1), 0, 5};
    for (int cluster : {-1, 1, 2, 8}) {
      std::vector<SampledToken> got = sample_with_cluster(zd, params, streams, cluster);
      for (int64_t b = 0; b < B; ++b) {
        SCOPED_TRACE(cat(describe(base), " cluster ", cluster, " row ", b));
        ASSERT_TRUE(got[b].id >= 0 && got[b].id < V) << got[b].id;
        EXPECT_GT(probs[b][got[b].id], 0.0);
        const double u = sampling_uniform(base.seed, streams[b].stream_key, 0, 5);
        double cum = 0;
        int32_t want = -1;
        for (int64_t v = 0; v < V; ++v) {
          if (probs[b][v] <= 0) continue;
          want = static_cast<int32_t>(v);
          cum += probs[b][v];
          if (u < cum) break;
        }
        if (got[b].id != want) {
          double cdf = 0;
          for (int32_t v = 0; v <= std::min(got[b].id, want); ++v) cdf += probs[b][v];
          EXPECT_LE(std::fabs(u - cdf), 1e-5) << "pick " << got[b].id << " vs cpu " << want;
        }
      }
    }
  }
}

// A row's draw does not depend on the rows beside it: rows sampled in a batch of 64 and again
// alone (a 1-row batch) or among 3 give the same ids and log-probabilities bit for bit, for the
// cluster kernel (auto, 8 CTAs at this V) and the one-CTA kernel; greedy with exact ties for the
// max in different CTAs' slices picks the first.
TEST(CudaSampler, RowsDoNotDependOnTheBatch) {
  REQUIRE_GPU();
  const int64_t B = 64, V = 151936;
  Tensor z = make_logits(B, V, 4242);
  float* hp = z.data<float>();
  // Row 9: a tie for the max at ids 30,000 (CTA 1 of 8) and 120,000 (CTA 6); greedy below.
  hp[9 * V + 30000] = hp[9 * V + 120000] = 99.0f;
  Tensor zd = z.to(Device::CUDA);
  std::vector<SamplingParams> params(B);
  std::vector<SampleStream> streams(B);
  const std::vector<SamplingParams> s = settings();
  for (int64_t b = 0; b < B; ++b) {
    params[b] = s[b % s.size()];
    streams[b] = {0x51ed27ull * (b + 3), static_cast<uint32_t>(b % 4), static_cast<uint32_t>(b)};
  }
  params[9].temperature = 0;
  for (int cluster : {0, -1}) {
    std::vector<SampledToken> all = sample_with_cluster(zd, params, streams, cluster);
    EXPECT_EQ(all[9].id, 30000) << "cluster " << cluster;
    for (const std::vector<int64_t>& pick : {std::vector<int64_t>{9}, std::vector<int64_t>{0, 37, 63}}) {
      const int64_t n = static_cast<int64_t>(pick.size());
      Tensor sub = Tensor::empty({n, V}, DType::F32);
      std::vector<SamplingParams> sp;
      std::vector<SampleStream> ss;
      for (int64_t i = 0; i < n; ++i) {
        std::copy(hp + pick[i] * V, hp + (pick[i] + 1) * V, sub.data<float>() + i * V);
        sp.push_back(params[pick[i]]);
        ss.push_back(streams[pick[i]]);
      }
      std::vector<SampledToken> got = sample_with_cluster(sub.to(Device::CUDA), sp, ss, cluster);
      for (int64_t i = 0; i < n; ++i) {
        const SampledToken &a = got[i], &w = all[pick[i]];
        EXPECT_EQ(a.id, w.id) << "cluster " << cluster << " row " << pick[i];
        EXPECT_EQ(a.sampling_logprob, w.sampling_logprob) << "cluster " << cluster << " row " << pick[i];
        EXPECT_EQ(a.model_logprob, w.model_logprob) << "cluster " << cluster << " row " << pick[i];
      }
    }
  }
}

// 20,000 GPU draws of one row per setting (steps 0..19999 as rows of a batch) against the CPU's
// filtered probabilities: fail when p < 1e-4 (as tests/rollout/test_sampler.cpp).
TEST(CudaSampler, ChiSquareAgainstFilteredProbabilities) {
  REQUIRE_GPU();
  const int64_t V = 40, N = 20000;
  Tensor row = make_logits(1, V, 5);
  Tensor z = Tensor::empty({N, V}, DType::F32);
  for (int64_t i = 0; i < N; ++i) std::copy(row.data<float>(), row.data<float>() + V, z.data<float>() + i * V);
  Tensor zd = z.to(Device::CUDA);
  // Auto (one CTA per row at this V) and 8 CTAs per row (slices of 8 ids, 3 CTAs empty).
  for (int cluster : {0, 8})
  for (const SamplingParams& base : settings()) {
    SCOPED_TRACE(cat("cluster ", cluster));
    std::vector<SamplingParams> params(N, base);
    std::vector<SampleStream> streams(N);
    for (int64_t i = 0; i < N; ++i) streams[i] = {42, 0, static_cast<uint32_t>(i)};
    std::vector<SampledToken> got = cluster == 0 ? sample_tokens_cuda(zd, params, streams)
                                                 : sample_with_cluster(zd, params, streams, cluster);
    std::vector<int64_t> counts(V, 0);
    for (const SampledToken& t : got) {
      ASSERT_TRUE(t.id >= 0 && t.id < V);
      ++counts[t.id];
    }
    std::vector<double> probs;
    sampling_distribution(row.data<float>(), V, base, probs);
    const double pv = chi2_test(counts, probs);
    EXPECT_GE(pv, 1e-4) << describe(base) << ": chi-square p-value " << pv;
    for (int64_t v = 0; v < V; ++v)
      if (probs[v] == 0) EXPECT_EQ(counts[v], 0) << describe(base) << ": filtered id " << v << " drawn";
  }
}

TEST(CudaSampler, NonFiniteLogitsRejected) {
  REQUIRE_GPU();
  const int64_t B = 4, V = 300;
  Tensor z = make_logits(B, V, 9);
  z.data<float>()[2 * V + 17] = std::nanf("");
  z.data<float>()[3 * V + 1] = INFINITY;
  std::vector<SamplingParams> params(B);
  std::vector<SampleStream> streams(B);
  const std::string msg = error_message([&] { sample_tokens_cuda(z.to(Device::CUDA), params, streams); },
                                        ErrorKind::InvalidData);
  EXPECT_NE(msg.find("row 2"), std::string::npos) << msg;
  // The device is healthy afterwards.
  z.data<float>()[2 * V + 17] = 0;
  z.data<float>()[3 * V + 1] = 0;
  EXPECT_EQ(sample_tokens_cuda(z.to(Device::CUDA), params, streams).size(), static_cast<size_t>(B));
}

}  // namespace
}  // namespace opd::test
