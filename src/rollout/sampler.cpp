// Sampling distribution, Philox stream and inverse-CDF draw (definitions in sampler.h).
#include "rollout/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"
#include "core/philox.h"

namespace opd {

void SamplingParams::validate() const {
  OPD_CHECK(std::isfinite(temperature) && temperature >= 0, InvalidArgument,
            "temperature must be a finite number >= 0 (0 = greedy), got ", temperature);
  OPD_CHECK(top_p > 0 && top_p <= 1, InvalidArgument, "top_p must be in (0, 1], got ", top_p);
  OPD_CHECK(top_k >= 0, InvalidArgument, "top_k must be >= 0 (0 = off), got ", top_k);
  OPD_CHECK(min_p >= 0 && min_p <= 1, InvalidArgument, "min_p must be in [0, 1], got ", min_p);
}

uint64_t prompt_stream_key(std::span<const int32_t> prompt) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t id : prompt) {
    uint32_t u = static_cast<uint32_t>(id);
    for (int byte = 0; byte < 4; ++byte) {
      h ^= (u >> (8 * byte)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

double sampling_uniform(uint64_t seed, uint64_t stream_key, uint32_t sample_index, uint32_t step) {
  Philox4 ctr{{step, sample_index, static_cast<uint32_t>(stream_key),
               static_cast<uint32_t>(stream_key >> 32)}};
  Philox4 r = philox4x32(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint64_t bits = ((static_cast<uint64_t>(r.v[0]) << 32) | r.v[1]) >> 11;
  return static_cast<double>(bits) * 0x1.0p-53;
}

namespace {

int32_t first_argmax(const float* z, int64_t vocab) {
  int64_t best = 0;
  for (int64_t v = 1; v < vocab; ++v)
    if (z[v] > z[best]) best = v;
  return static_cast<int32_t>(best);
}

void renormalize(std::vector<double>& p) {
  double sum = 0;
  for (double x : p) sum += x;
  for (double& x : p) x /= sum;
}

}  // namespace

void sampling_distribution(const float* z, int64_t vocab, const SamplingParams& params,
                           std::vector<double>& p) {
  OPD_CHECK(vocab >= 1, InvalidArgument, "sampling: empty vocabulary");
  p.assign(static_cast<size_t>(vocab), 0.0);
  for (int64_t v = 0; v < vocab; ++v) {
    if (!std::isfinite(z[v]))
      OPD_FAIL(InvalidData, "sampling: logit ", z[v], " of token ", v, " is not finite");
  }
  if (params.greedy()) {
    p[static_cast<size_t>(first_argmax(z, vocab))] = 1.0;
    return;
  }
  const double inv_t = 1.0 / params.temperature;
  // top-k: the k-th largest scaled logit is the threshold (ties with it are kept).
  double floor = -std::numeric_limits<double>::infinity();
  if (params.top_k > 0 && params.top_k < vocab) {
    std::vector<float> sorted(z, z + vocab);
    std::nth_element(sorted.begin(), sorted.begin() + (params.top_k - 1), sorted.end(),
                     std::greater<float>());
    floor = sorted[static_cast<size_t>(params.top_k - 1)];
  }
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t v = 0; v < vocab; ++v)
    if (z[v] >= floor) m = std::max(m, static_cast<double>(z[v]) * inv_t);
  for (int64_t v = 0; v < vocab; ++v)
    if (z[v] >= floor) p[v] = std::exp(static_cast<double>(z[v]) * inv_t - m);
  renormalize(p);

  if (params.top_p < 1.0) {
    std::vector<int32_t> order;
    for (int64_t v = 0; v < vocab; ++v)
      if (p[v] > 0) order.push_back(static_cast<int32_t>(v));
    std::sort(order.begin(), order.end(),
              [&](int32_t a, int32_t b) { return p[a] != p[b] ? p[a] > p[b] : a < b; });
    double before = 0, threshold = 0;
    for (int32_t v : order) {  // kept iff the mass strictly before it is < top_p
      if (before >= params.top_p) break;
      threshold = p[v];
      before += p[v];
    }
    for (double& x : p)
      if (x < threshold) x = 0;
    renormalize(p);
  }
  if (params.min_p > 0) {
    const double cut = params.min_p * *std::max_element(p.begin(), p.end());
    for (double& x : p)
      if (x < cut) x = 0;
    renormalize(p);
  }
}

SampledToken sample_token(const float* z, int64_t vocab, const SamplingParams& params, double u,
                          std::vector<double>& p) {
  sampling_distribution(z, vocab, params, p);
  SampledToken out;
  // Inverse CDF in id order; if rounding leaves u above the total, take the last kept token.
  double cum = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    if (p[v] <= 0) continue;
    out.id = static_cast<int32_t>(v);
    cum += p[v];
    if (u < cum) break;
  }
  out.sampling_logprob = std::log(p[out.id]);
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t v = 0; v < vocab; ++v) m = std::max(m, static_cast<double>(z[v]));
  double sum = 0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(z[v]) - m);
  out.model_logprob = static_cast<double>(z[out.id]) - m - std::log(sum);
  return out;
}

}  // namespace opd
