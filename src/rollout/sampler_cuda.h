// Sampling on the GPU: the CUDA twin of rollout/sampler.h (same distribution, same filter
// order, same Philox draw), one thread-block cluster of up to 8 CTAs per row of f32 logits
// [B, V] that never leave the device; only B ids and 2B log-probabilities are written. Per row, in the CPU sampler's order:
//   greedy (T = 0): first argmax of z.
//   top-k: floor = the k-th largest z (radix select on order-preserving float keys; ties kept).
//   p1 = softmax(z / T) over {z >= floor}, shifted by m = max z / T (exp args in f64, exp in f32,
//        sums in f64 in a fixed order).
//   top-p: t = the largest z with mass{kept, z >= t} >= top_p (radix select with per-bucket
//        masses as 2^-62 fixed-point integers: exact, order-independent sums), keep z >= t,
//        p2 = p1 / Z2.   min-p: keep p2 >= min_p * max p2, p3 = p2 / Z3.
//   draw: inverse CDF over the kept ids in id order with u = philox_uniform53((step,
//        sample_index, key lo, key hi), seed), the CPU's u; per-thread contiguous id ranges,
//        f64 prefix sums across threads (and across the cluster's CTAs in rank order). u beyond
//        the total (rounding) takes the last kept id.
// sampling_logprob = log p_final(y) (0 for greedy), model_logprob = z_y - logsumexp(z).
// A pick can differ from the CPU's only where u lies within rounding (~1e-7 relative, f32 exp)
// of a CDF boundary. Deterministic: no float atomics.
// Non-finite logits: the row's id is -1 and error_flag (optional, 0xffffffff = none) gets the
// first such row (atomicMin), like the CPU's InvalidData.
// C++17-clean (included by the .cu file).
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace opd::cuda {

struct SampleRowParams {
  double temperature = 1.0;  // >= 0, 0 = greedy
  double top_p = 1.0;        // (0, 1]
  double min_p = 0.0;        // [0, 1]
  int64_t top_k = 0;         // >= 0, 0 = off
  uint64_t seed = 0;
  uint64_t stream_key = 0;
  uint32_t sample_index = 0;
  uint32_t step = 0;
};

// logits f32 [rows, vocab] and params [rows] on the device; outputs [rows] on the device.
// logits_rows (optional, device, [rows]): draw i reads logits row logits_rows[i] instead of i
// (several draws from one row: the n samples of a prompt). The caller validates the map.
// cluster: CTAs sharing one row (0 = by the vocabulary: 8 at V >= 32,769, fewer below, each CTA
// holding its slice of the row in shared memory; 1, 2, 4, 8 = forced, for tests; -1 = the
// one-CTA-per-row kernel that re-reads the row from global memory, also taken when a slice
// would not fit in shared memory). The result depends only on (row, params, vocab, cluster),
// never on the other rows.
void sample_rows(const float* logits, int64_t rows, int64_t vocab, const SampleRowParams* params,
                 int32_t* ids, float* sampling_logprobs, float* model_logprobs,
                 unsigned* error_flag, cudaStream_t stream, const int32_t* logits_rows = nullptr,
                 int cluster = 0);

}  // namespace opd::cuda
