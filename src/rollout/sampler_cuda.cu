// CUDA sampler: one 1024-thread CTA per row of f32 logits; the distribution, filter order and
// draw of rollout/sampler.cpp (contract in rollout/sampler_cuda.h). Passes over the row (it
// stays in L2 between passes, 600 KB at V = 151936): max/argmax, model LSE, [top-k radix select,
// 4 passes], kept mass, [top-p radix select with fixed-point masses, 4 passes + its mass],
// [min-p mass], per-thread range sums for the inverse CDF, one range rescanned by one thread.
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "core/cuda/stream.h"
#include "core/philox.h"
#include "kernels/cuda/common.cuh"
#include "rollout/sampler_cuda.h"

namespace opd::cuda {
namespace {

using u64 = unsigned long long;
constexpr int kNT = 1024;
constexpr int kWarps = kNT / 32;
constexpr double kFixedOne = 4611686018427387904.0;  // 2^62: fixed-point unit of a mass

__device__ __forceinline__ unsigned fkey(float z) {  // order-preserving, -0 == +0
  unsigned u = __float_as_uint(z == 0.f ? 0.f : z);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_to_f(unsigned k) {
  const unsigned u = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  return __uint_as_float(u);
}

template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T r = red[0];
#pragma unroll
  for (int i = 1; i < kWarps; ++i) r = op(r, red[i]);
  __syncthreads();
  return r;
}
struct MaxF {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct MinI {
  __device__ int operator()(int a, int b) const { return min(a, b); }
};
struct MaxI {
  __device__ int operator()(int a, int b) const { return max(a, b); }
};
struct SumD {
  __device__ double operator()(double a, double b) const { return a + b; }
};

__global__ void __launch_bounds__(kNT)
    sample_kernel(const float* __restrict__ logits, int vocab,
                  const SampleRowParams* __restrict__ params, int32_t* __restrict__ ids,
                  float* __restrict__ sampling_lp, float* __restrict__ model_lp,
                  unsigned* error_flag, const int32_t* __restrict__ logits_rows) {
  __shared__ float red_f[kWarps];
  __shared__ int red_i[kWarps];
  __shared__ double red_d[kWarps];
  __shared__ unsigned hist_c[256];
  __shared__ u64 hist_m[256];
  __shared__ double scan[2][kNT];
  __shared__ unsigned s_key;
  __shared__ u64 s_above;
  __shared__ int s_need, s_fail, s_pick;

  const int64_t row = blockIdx.x;
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t src = logits_rows ? static_cast<int64_t>(logits_rows[row]) : row;
  const float* z = logits + src * static_cast<int64_t>(vocab);
  const SampleRowParams P = params[row];
  const int V = vocab;

  // ---- max, first argmax, non-finite check.
  float mx = -INFINITY;
  int arg = INT_MAX, bad = 0;
  for (int j = tid; j < V; j += kNT) {
    const float x = z[j];
    if (!isfinite(x)) {
      bad = 1;
    } else if (x > mx) {  // j increases per thread: the thread's first max
      mx = x;
      arg = j;
    }
  }
  const float zmax = block_reduce(mx, MaxF(), red_f);
  const int argmax = block_reduce(mx == zmax ? arg : INT_MAX, MinI(), red_i);
  if (block_reduce(bad, MaxI(), red_i)) {
    if (tid == 0) {
      ids[row] = -1;
      sampling_lp[row] = model_lp[row] = __int_as_float(0x7fc00000);
      if (error_flag) atomicMin(error_flag, static_cast<unsigned>(row));
    }
    return;
  }
  // ---- model log-sum-exp (temperature 1, unfiltered).
  double acc = 0;
  for (int j = tid; j < V; j += kNT) acc += static_cast<double>(expf(z[j] - zmax));
  const double model_lse = static_cast<double>(zmax) + log(block_reduce(acc, SumD(), red_d));

  if (P.temperature == 0.0) {
    if (tid == 0) {
      ids[row] = argmax;
      sampling_lp[row] = 0.f;
      model_lp[row] = static_cast<float>(static_cast<double>(z[argmax]) - model_lse);
    }
    return;
  }
  const double inv_t = 1.0 / P.temperature;

  // ---- top-k: floor = the k-th largest z (counts per 8-bit digit of the float key).
  float floor_z = -INFINITY;
  if (P.top_k > 0 && P.top_k < V) {
    unsigned prefix = 0, mask = 0;
    int need = static_cast<int>(P.top_k);
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += kNT) hist_c[i] = 0;
      __syncthreads();
      for (int j = tid; j < V; j += kNT) {
        const unsigned k = fkey(z[j]);
        if ((k & mask) == prefix) atomicAdd(&hist_c[(k >> shift) & 255u], 1u);
      }
      __syncthreads();
      if (tid == 0) {
        int cum = 0;
        for (int d = 255; d >= 0; --d) {
          const int h = static_cast<int>(hist_c[d]);
          if (cum + h >= need) {
            s_key = prefix | (static_cast<unsigned>(d) << shift);
            s_need = need - cum;
            break;
          }
          cum += h;
        }
      }
      __syncthreads();
      prefix = s_key;
      need = s_need;
      mask |= 0xffu << shift;
    }
    floor_z = key_to_f(prefix);
  }

  // ---- softmax over the kept set: p1 = e / Z1, e = exp(z / T - m), m = max z / T.
  const double m = static_cast<double>(zmax) * inv_t;
  auto e_of = [&](float x) -> double {
    return static_cast<double>(expf(static_cast<float>(static_cast<double>(x) * inv_t - m)));
  };
  acc = 0;
  for (int j = tid; j < V; j += kNT) {
    const float x = z[j];
    if (x >= floor_z) acc += e_of(x);
  }
  const double Z1 = block_reduce(acc, SumD(), red_d);

  // ---- top-p: t = the largest z with mass{kept, z >= t} >= top_p.
  const bool use_p = P.top_p < 1.0;
  float t_p = -INFINITY;
  double Z2 = 1.0;
  if (use_p) {
    const u64 target = static_cast<u64>(P.top_p * kFixedOne);
    unsigned prefix = 0, mask = 0;
    u64 above = 0;
    bool failed = false;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += kNT) hist_m[i] = 0;
      __syncthreads();
      for (int j = tid; j < V; j += kNT) {
        const float x = z[j];
        if (x < floor_z) continue;
        const unsigned k = fkey(x);
        if ((k & mask) == prefix)
          atomicAdd(&hist_m[(k >> shift) & 255u], static_cast<u64>(e_of(x) / Z1 * kFixedOne));
      }
      __syncthreads();
      if (tid == 0) {
        // Written only here (after the histogram barrier): every thread has read the
        // previous iteration's values by then.
        s_fail = 1;
        u64 cum = above;
        for (int d = 255; d >= 0; --d) {
          const u64 h = hist_m[d];
          if (cum + h >= target) {
            s_key = prefix | (static_cast<unsigned>(d) << shift);
            s_above = cum;
            s_fail = 0;
            break;
          }
          cum += h;
        }
      }
      __syncthreads();
      if (s_fail) {  // the kept mass never reaches top_p (rounding): keep everything
        failed = true;
        break;
      }
      prefix = s_key;
      above = s_above;
      mask |= 0xffu << shift;
    }
    if (!failed) t_p = key_to_f(prefix);
    acc = 0;
    for (int j = tid; j < V; j += kNT) {
      const float x = z[j];
      if (x >= floor_z && x >= t_p) acc += e_of(x) / Z1;
    }
    Z2 = block_reduce(acc, SumD(), red_d);
  }
  // p after top-k/top-p (the CPU divides stage by stage; so does this).
  auto p2_of = [&](float x) -> double {
    double p = e_of(x) / Z1;
    if (use_p) p /= Z2;
    return p;
  };
  // ---- min-p: keep p2 >= min_p * max p2 (max p2 is zmax's: e = 1).
  const bool use_min = P.min_p > 0.0;
  double cut = 0, Z3 = 1.0;
  if (use_min) {
    cut = P.min_p * (use_p ? (1.0 / Z1) / Z2 : 1.0 / Z1);
    acc = 0;
    for (int j = tid; j < V; j += kNT) {
      const float x = z[j];
      if (x >= floor_z && x >= t_p) {
        const double p = p2_of(x);
        if (p >= cut) acc += p;
      }
    }
    Z3 = block_reduce(acc, SumD(), red_d);
  }
  // Final probability of id j (0 when filtered out).
  auto p_of = [&](float x) -> double {
    if (x < floor_z || x < t_p) return 0.0;
    double p = p2_of(x);
    if (use_min) {
      if (p < cut) return 0.0;
      p /= Z3;
    }
    return p;
  };

  // ---- inverse CDF in id order: thread t owns ids [t C, (t + 1) C).
  const Philox4 ctr{{P.step, P.sample_index, static_cast<uint32_t>(P.stream_key),
                     static_cast<uint32_t>(P.stream_key >> 32)}};
  const double u = philox_uniform53(ctr, P.seed);
  const int C = (V + kNT - 1) / kNT;
  const int j0 = min(V, tid * C), j1 = min(V, j0 + C);
  double local = 0;
  int last_kept = -1;
  for (int j = j0; j < j1; ++j) {
    const double p = p_of(z[j]);
    if (p > 0) {
      local += p;
      last_kept = j;
    }
  }
  // Inclusive scan over threads (Hillis-Steele, fixed order): [excl, incl) partitions [0, total).
  int cur = 0;
  scan[0][tid] = local;
  __syncthreads();
  for (int off = 1; off < kNT; off <<= 1) {
    const double v = scan[cur][tid] + (tid >= off ? scan[cur][tid - off] : 0.0);
    scan[cur ^ 1][tid] = v;
    cur ^= 1;
    __syncthreads();
  }
  const double incl = scan[cur][tid], excl = tid > 0 ? scan[cur][tid - 1] : 0.0;
  if (tid == 0) s_pick = -1;
  __syncthreads();
  if (u >= excl && u < incl) {  // at most one thread
    double cum = excl;
    int pick = last_kept;  // if the rescan's rounding leaves u above cum, the range's last kept
    for (int j = j0; j < j1; ++j) {
      const double p = p_of(z[j]);
      if (p <= 0) continue;
      cum += p;
      if (u < cum) {
        pick = j;
        break;
      }
    }
    s_pick = pick;
  }
  __syncthreads();
  int pick = s_pick;
  const int last_overall = block_reduce(last_kept, MaxI(), red_i);
  if (pick < 0) pick = last_overall;  // u beyond the total (rounding): the last kept id
  if (tid == 0) {
    ids[row] = pick;
    sampling_lp[row] = static_cast<float>(log(p_of(z[pick])));
    model_lp[row] = static_cast<float>(static_cast<double>(z[pick]) - model_lse);
  }
}

}  // namespace

void sample_rows(const float* logits, int64_t rows, int64_t vocab, const SampleRowParams* params,
                 int32_t* ids, float* sampling_logprobs, float* model_logprobs,
                 unsigned* error_flag, cudaStream_t stream, const int32_t* logits_rows) {
  OPD_CHECK(vocab >= 1 && vocab < INT_MAX && rows < INT_MAX, InvalidArgument,
            "sample_rows: vocab ", vocab, " and rows ", rows, " must be in [1, 2^31)");
  if (rows == 0) return;
  sample_kernel<<<static_cast<unsigned>(rows), kNT, 0, stream>>>(
      logits, static_cast<int>(vocab), params, ids, sampling_logprobs, model_logprobs, error_flag,
      logits_rows);
  check_launch("sample_kernel");
}

}  // namespace opd::cuda
