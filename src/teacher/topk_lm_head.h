// Tiled lm_head top-K (the CPU reference of teacher scoring's vocabulary pass): for each row r
// of hidden states h_r, the logits z = h_r W^T over all V ids are produced in vocabulary tiles
// and reduced on the fly, never as an [N x V] buffer:
//   LSE_r   = log sum_v exp(z_v / T)           online: m' = max(m, max_tile), s' = s e^(m-m') + ...
//   top-K   = the K largest z_v (a running heap per row; ties: smaller id first)
//   a_k     = z_{i_k} / T - LSE_r,   actual = z_y / T - LSE_r   (y = the row's actual token)
// Optionally one sampled id per row by the Gumbel-max trick over the same tiles:
//   y* = argmax_v z_v / Ts + g_v,  g_v = -log(-log u_v),  u_v = philox_uniform(seed, stream_r, v)
// (exactly a sample of softmax(z / Ts)); Ts = 0 is argmax z.
//
// Memory beyond inputs and outputs (asserted by tests/teacher with memory_stats(Device::CPU)):
//   topk_lm_head_scratch_bytes = min(N, row_chunk) * min(tile, V) * 4       logit tile (f32)
// plus per-row state on the host heap: N * (K * 8 + 48) bytes. Never O(N x V).
//
// CUDA (teacher/topk_lm_head_cuda.{h,cu}): when hidden and lm_head are CUDA tensors (bf16 or
// f32) the same function runs cuBLASLt tiles + one CTA per row (online LSE, running top-K merged
// across tiles by radix select), same ordering rule; sampling is CPU-only. Device memory:
// topk_lm_head_cuda_workspace_bytes (O(N x K + row_chunk x tile)) plus the outputs.
// topk_lm_head_device is the seam for a CUDA scorer: device hidden rows in, device results out.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace opd {

struct TopKLmHeadArgs {
  Tensor hidden;   // f32 [N, H]
  Tensor lm_head;  // f32 [V, H]
  std::vector<int32_t> actual;  // [N]: the token at the scored position, or -1 (none); or empty
  int64_t k = 0;                // 0 <= k <= V
  double temperature = 1.0;     // > 0
  int64_t vocab_tile = 4096;
  int64_t row_chunk = 512;
  // Ranks of the actual tokens, 1 + #{v : z_v > z_y} (a second pass over the tiles).
  bool want_ranks = false;
  // Sampling (optional): one id per row.
  bool sample = false;
  double sample_temperature = 1.0;  // >= 0 (0 = argmax)
  uint64_t seed = 0;
  std::vector<uint64_t> streams;    // [N]: Philox stream per row
};

struct TopKLmHeadResult {
  std::vector<int32_t> ids;              // [N * k]
  std::vector<float> logprobs;           // [N * k]
  std::vector<float> actual_logprobs;    // [N]; NaN where actual = -1
  std::vector<int64_t> actual_ranks;     // [N] when want_ranks (0 where actual = -1)
  std::vector<int32_t> sampled;          // [N] when sampling
  std::vector<float> sampled_logprobs;   // [N] at `temperature`
};

// Throws InvalidArgument for shapes/options, InvalidData for an actual id outside [0, V) and
// Internal for a non-finite logit (naming the row and id). CPU tensors: f32; CUDA tensors:
// bf16 or f32 (hidden and lm_head of one dtype), results copied back to the host.
TopKLmHeadResult topk_lm_head(const TopKLmHeadArgs& args);

// Results left on the device (CUDA).
struct TopKLmHeadDeviceResult {
  Tensor ids;              // i32 [N, k]
  Tensor logprobs;         // f32 [N, k]
  Tensor actual_logprobs;  // f32 [N]: NaN where actual is -1 or undefined
  Tensor actual_ranks;     // i32 [N] when want_ranks (0 where actual = -1)
};
// hidden [N, H] and lm_head [V, H]: CUDA, bf16 or f32 (one dtype). actual: i32 [N] on the GPU
// (or the CPU), -1 = none, or undefined. Checks actual ids on the device first (InvalidData as
// above), then runs on the current stream and synchronizes once to read the error flags.
TopKLmHeadDeviceResult topk_lm_head_device(const Tensor& hidden, const Tensor& lm_head,
                                           const Tensor& actual, int64_t k, double temperature,
                                           bool want_ranks = false, int64_t vocab_tile = 16384,
                                           int64_t row_chunk = 2048);

int64_t topk_lm_head_scratch_bytes(int64_t rows, int64_t vocab, int64_t vocab_tile,
                                   int64_t row_chunk);

}  // namespace opd
