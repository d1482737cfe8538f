// Next-token sampling from one row of logits: temperature, top-k, top-p (nucleus), min-p,
// greedy at temperature 0, with a counter-based random stream per sequence.
//
// The sampling distribution, in Hugging Face generate's order (TemperatureLogitsWarper,
// TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper):
//   s = z / T;  top-k keeps s_i >= (k-th largest s) (ties at the boundary kept);
//   p = softmax over the kept set;  top-p keeps the smallest most-probable prefix whose mass
//   reaches top_p (a token is kept iff the mass of the tokens more probable than it is < top_p;
//   ties kept), renormalize;  min-p keeps p_i >= min_p * max(p), renormalize.
//   T = 0 is greedy: the first argmax of z, probability 1.
// The token is drawn by inverse CDF over the kept tokens in id order with one uniform
// u in [0, 1) (53 bits) of Philox4x32-10 (core/philox.h):
//   key = seed, counter = (step, sample index, prompt key lo, prompt key hi),
// where the prompt key is FNV-1a-64 of the prompt ids (or a caller's stream key) and step is
// the number of tokens this sample has generated so far. A draw therefore depends only on
// (seed, prompt, sample index, step) and the logits row: never on batch composition, n,
// preemption, or which thread samples it.
//
// Two log-probabilities are returned for the drawn token y (log, base e):
//   sampling_logprob = log p_sampling(y), the distribution above (0 for greedy);
//   model_logprob    = z_y - logsumexp(z): the unmodified model at temperature 1, which is what
//                      the `sampled` loss mode and diagnostics need.
// CPU cost O(V) per draw, O(V log V) with top-p; scratch is O(V) doubles.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace opd {

class Tensor;  // core/tensor.h

struct SamplingParams {
  double temperature = 1.0;  // >= 0; 0 = greedy
  double top_p = 1.0;        // (0, 1]; 1 = off
  int64_t top_k = 0;         // >= 0; 0 = off
  double min_p = 0.0;        // [0, 1]; 0 = off
  uint64_t seed = 0;

  bool greedy() const { return temperature == 0.0; }
  // InvalidArgument naming the field, its value and the allowed range.
  void validate() const;
};

// FNV-1a 64-bit over the little-endian bytes of the ids: the default stream key of a prompt.
uint64_t prompt_stream_key(std::span<const int32_t> prompt);

// The uniform of draw `step` of sample `sample_index` of the stream (seed, key): 53 bits of
// Philox4x32-10 output, exactly representable, in [0, 1).
double sampling_uniform(uint64_t seed, uint64_t stream_key, uint32_t sample_index, uint32_t step);

struct SampledToken {
  int32_t id = -1;
  double sampling_logprob = 0;  // under the sampling distribution
  double model_logprob = 0;     // under softmax(z), temperature 1, no filtering
};

// probs[v] = p_sampling(v) (0 outside the kept set), for logits z [vocab].
void sampling_distribution(const float* logits, int64_t vocab, const SamplingParams& params,
                           std::vector<double>& probs);

// Draws one token with uniform u (ignored for greedy). scratch is reused between calls.
SampledToken sample_token(const float* logits, int64_t vocab, const SamplingParams& params,
                          double u, std::vector<double>& scratch);

// Where a row's uniform comes from: sampling_uniform(params.seed, stream_key, sample_index, step).
struct SampleStream {
  uint64_t stream_key = 0;
  uint32_t sample_index = 0;
  uint32_t step = 0;
};

// GPU sampling (rollout/sampler_cuda.h): logits f32 [B, V] on the device stay there; row b is
// drawn with params[b] (validated) and the uniform of streams[b], the same u the CPU draws.
// Only the B results come back (12 B bytes). The CPU path of the engine calls sample_token.
// Throws InvalidData naming the first row with a non-finite logit; Unsupported without CUDA.
std::vector<SampledToken> sample_tokens_cuda(const Tensor& logits,
                                             std::span<const SamplingParams> params,
                                             std::span<const SampleStream> streams);

}  // namespace opd
