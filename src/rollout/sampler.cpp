// Sampling distribution, Philox stream and inverse-CDF draw (definitions in sampler.h).
#include "rollout/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "core/error.h"
#include "core/philox.h"
#include "core/tensor.h"
#ifdef OPD_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/allocator.h"    // DeviceBuffer, current_stream
#include "core/cuda/stream.h"       // OPD_CUDA_CHECK
#include "rollout/sampler_cuda.h"   // the kernel
#endif

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
  return philox_uniform53(ctr, seed);
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

std::vector<SampledToken> sample_tokens_cuda(const Tensor& logits,
                                             std::span<const SamplingParams> params,
                                             std::span<const SampleStream> streams) {
#ifndef OPD_WITH_CUDA
  (void)logits;
  (void)params;
  (void)streams;
  OPD_FAIL(Unsupported, "sample_tokens_cuda: this build has no CUDA backend");
#else
  OPD_CHECK(logits.defined() && logits.device() == Device::CUDA && logits.dtype() == DType::F32 &&
                logits.ndim() == 2,
            InvalidArgument, "sample_tokens_cuda: logits must be CUDA f32 [B, V], got ",
            logits.describe());
  const int64_t B = logits.dim(0), V = logits.dim(1);
  OPD_CHECK(static_cast<int64_t>(params.size()) == B && static_cast<int64_t>(streams.size()) == B,
            InvalidArgument, "sample_tokens_cuda: ", params.size(), " params and ",
            streams.size(), " streams for ", B, " rows");
  OPD_CHECK(V >= 1, InvalidArgument, "sampling: empty vocabulary");
  std::vector<SampledToken> out(static_cast<size_t>(B));
  if (B == 0) return out;
  std::vector<cuda::SampleRowParams> rows(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const SamplingParams& p = params[static_cast<size_t>(b)];
    p.validate();
    cuda::SampleRowParams& r = rows[static_cast<size_t>(b)];
    r.temperature = p.temperature;
    r.top_p = p.top_p;
    r.min_p = p.min_p;
    r.top_k = p.top_k;
    r.seed = p.seed;
    r.stream_key = streams[static_cast<size_t>(b)].stream_key;
    r.sample_index = streams[static_cast<size_t>(b)].sample_index;
    r.step = streams[static_cast<size_t>(b)].step;
  }
  cudaStream_t stream = cuda::current_stream();
  const size_t param_bytes = rows.size() * sizeof(cuda::SampleRowParams);
  const size_t result_bytes = static_cast<size_t>(B) * 12 + sizeof(unsigned);
  cuda::DeviceBuffer dparams(param_bytes, stream), dresults(result_bytes, stream);
  OPD_CUDA_CHECK(cudaMemcpyAsync(dparams.get(), rows.data(), param_bytes, cudaMemcpyHostToDevice,
                                 stream));
  int32_t* ids = dresults.as<int32_t>();
  float* slp = reinterpret_cast<float*>(ids + B);
  float* mlp = slp + B;
  unsigned* flag = reinterpret_cast<unsigned*>(mlp + B);
  OPD_CUDA_CHECK(cudaMemsetAsync(flag, 0xff, sizeof(unsigned), stream));
  cuda::sample_rows(logits.data<float>(), B, V, dparams.as<cuda::SampleRowParams>(), ids, slp, mlp,
                    flag, stream);
  std::vector<char> host(result_bytes);
  OPD_CUDA_CHECK(cudaMemcpyAsync(host.data(), dresults.get(), result_bytes,
                                 cudaMemcpyDeviceToHost, stream));
  OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
  const int32_t* hid = reinterpret_cast<const int32_t*>(host.data());
  const float* hs = reinterpret_cast<const float*>(hid + B);
  const float* hm = hs + B;
  unsigned hflag;
  std::memcpy(&hflag, hm + B, sizeof(unsigned));
  OPD_CHECK(hflag == 0xffffffffu, InvalidData, "sampling: row ", hflag,
            " of the logits has a non-finite value");
  for (int64_t b = 0; b < B; ++b) {
    out[static_cast<size_t>(b)].id = hid[b];
    out[static_cast<size_t>(b)].sampling_logprob = hs[b];
    out[static_cast<size_t>(b)].model_logprob = hm[b];
  }
  return out;
#endif
}

}  // namespace opd
