// CUDA sampler: the distribution, filter order and draw of rollout/sampler.cpp (contract in
// rollout/sampler_cuda.h), in two kernels with the same per-element arithmetic:
// - sample_cluster_kernel (default): a row is split over a thread-block cluster of up to 8 CTAs
//   (W1: 8 x 18,992 ids, 512 threads per CTA); each CTA stages its slice of the row in shared memory with one
//   global read, and the passes (max/argmax, model LSE with the kept mass, [top-k radix select,
//   4 rounds], [top-p radix select with fixed-point masses, 4 rounds + its mass], [min-p mass],
//   the inverse CDF's range sums and scan, one range rescanned by one thread) read shared memory;
//   reductions and histograms go through distributed shared memory in rank order.
// - sample_kernel (a slice beyond shared memory, V > ~430k, or forced): one 1024-thread CTA per
//   row, every pass over the row in global memory (it stays in L2 between passes).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <vector>

#include "core/cuda/stream.h"
#include "core/philox.h"
#include "kernels/cuda/common.cuh"
#include "rollout/sampler_cuda.h"

namespace opd::cuda {
namespace {

namespace cg = cooperative_groups;
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
  return dev::block_reduce<kNT>(v, op, red);
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

// ---------------------------------------------------------------- the cluster kernel
// One row per thread-block cluster of C CTAs (C = 8 at W1: 64 rows -> 512 CTAs on 132 SMs
// instead of 64 CTAs); CTA c of the cluster owns the contiguous slice [c S, (c + 1) S) of the row
// (S a multiple of 4 floats, so 16-byte loads stay aligned) and reads it from global memory once,
// with 16-byte loads kLoadUnroll deep, into its shared memory (S x 4 bytes: 76 KB at V = 151936);
// every later pass reads shared memory. Each reduction is the CTA's block reduction, then a
// cluster exchange: thread 0 publishes the CTA's part in a shared slot, a cluster barrier, lane r
// of warp 0 reads rank r's slot through distributed shared memory, and the parts are folded in
// rank order (deterministic; every CTA gets the same value). Histograms of the radix selects are
// summed the same way (integer counts and 2^-62 fixed-point masses: order-independent). The
// inverse CDF: thread t of CTA c owns a contiguous range of c's slice (id order), a block scan
// gives its [excl, incl) relative to the CTA, the CTA totals are chained in rank order; each
// boundary is computed once and shared by the two ranges that meet there, so the ranges
// partition [0, total) exactly and at most one thread of the cluster picks. Same filters, same
// per-element arithmetic, same u as sample_kernel above; only the f64 summation order differs.
// 512 threads and <= 64 registers (__launch_bounds__(kCT, 2)): two CTAs per SM (1024 threads x
// 64 registers fill the register file; a 1024-thread CTA would leave one per SM, 4 waves at W1).
constexpr int kCT = 512;             // threads per CTA
constexpr int kCWarps = kCT / 32;
constexpr int kMaxCluster = 8;       // portable cluster size
constexpr int kMinSlice = 4096;      // fewer CTAs per row below this many ids per CTA
constexpr int kLoadUnroll = 4;       // 16-byte loads in flight per thread while staging
// Dynamic shared memory the kernel may take (the H100/H200 opt-in limit, 227 KB, less the
// kernel's static shared memory with margin); a row slice beyond it runs sample_kernel.
constexpr size_t kMaxSliceBytes = 227 * 1024 - 16 * 1024;

// What a CTA publishes to its cluster in one exchange.
struct Part {
  double d0, d1;
  float f;
  int i0, i1;
};

__device__ __forceinline__ Part shfl_part(const Part& v, int src) {
  Part r;
  r.d0 = __shfl_sync(0xffffffffu, v.d0, src);
  r.d1 = __shfl_sync(0xffffffffu, v.d1, src);
  r.f = __shfl_sync(0xffffffffu, v.f, src);
  r.i0 = __shfl_sync(0xffffffffu, v.i0, src);
  r.i1 = __shfl_sync(0xffffffffu, v.i1, src);
  return r;
}

struct ClusterShared {
  Part slot[2];                  // exchange slots, alternating (read remotely)
  Part result;                   // the folded exchange, broadcast to the CTA
  unsigned hist_c[2][256];       // top-k counts per digit, alternating rounds (read remotely)
  u64 hist_m[2][256];            // top-p masses per digit, alternating rounds (read remotely)
  unsigned tot_c[256];           // the cluster's summed histogram
  u64 tot_m[256];
  double wsum[kCWarps];          // block scan: warp totals, then exclusive warp offsets
  double wincl[kCWarps];         // block scan: the inclusive value of each warp's last thread
  float red_f[kCWarps];
  int red_i[kCWarps];
  double red_d[kCWarps];
  unsigned s_key;
  u64 s_above;
  int s_need, s_fail, s_pick;
};

// Publishes thread 0's `mine` in the next slot; after the cluster barrier lane r < C of warp 0
// holds rank r's part (other lanes: zeros). Call with the whole CTA.
__device__ __forceinline__ Part publish(cg::cluster_group& cl, ClusterShared& sh, int& round,
                                        const Part& mine) {
  Part* slot = &sh.slot[round & 1];
  ++round;
  if (threadIdx.x == 0) *slot = mine;
  cl.sync();
  Part v{};
  if (threadIdx.x < cl.num_blocks()) v = *cl.map_shared_rank(slot, static_cast<int>(threadIdx.x));
  return v;
}

template <typename T, typename Op>
__device__ __forceinline__ T cta_reduce(T v, Op op, T* red) {
  return dev::block_reduce<kCT>(v, op, red);
}

// Sum of a double over the cluster: CTA sums folded in rank order (the same value everywhere).
__device__ __forceinline__ double cluster_sum(cg::cluster_group& cl, ClusterShared& sh, int& round,
                                              double local) {
  Part mine{};
  mine.d0 = cta_reduce(local, SumD(), sh.red_d);
  const Part v = publish(cl, sh, round, mine);
  if (threadIdx.x < 32) {
    double acc = 0;
    for (int r = 0; r < static_cast<int>(cl.num_blocks()); ++r) acc += shfl_part(v, r).d0;
    if (threadIdx.x == 0) sh.result.d0 = acc;
  }
  __syncthreads();
  return sh.result.d0;
}

// One round of a radix select over the cluster: after each CTA filled hist[b], the cluster's
// total per digit into tot (threads < 256), then the CTA barrier.
template <typename H>
__device__ __forceinline__ void sum_histograms(cg::cluster_group& cl, H (&hist)[256],
                                               H (&tot)[256]) {
  cl.sync();
  for (int i = static_cast<int>(threadIdx.x); i < 256; i += kCT) {
    H t = 0;
    for (int r = 0; r < static_cast<int>(cl.num_blocks()); ++r) t += cl.map_shared_rank(hist, r)[i];
    tot[i] = t;
  }
  __syncthreads();
}

__device__ void sample_cluster_body(cg::cluster_group& cl, ClusterShared& sh, float* zs,
                                    const float* __restrict__ logits, int vocab, int slice,
                                    const SampleRowParams* __restrict__ params,
                                    int32_t* __restrict__ ids, float* __restrict__ sampling_lp,
                                    float* __restrict__ model_lp, unsigned* error_flag,
                                    const int32_t* __restrict__ logits_rows) {
  const int C = static_cast<int>(cl.num_blocks());
  const int rank = static_cast<int>(cl.block_rank());
  const int64_t row = blockIdx.x / C;
  const int tid = static_cast<int>(threadIdx.x);
  const bool writer = rank == 0 && tid == 0;
  const int64_t src = logits_rows ? static_cast<int64_t>(logits_rows[row]) : row;
  const float* z = logits + src * static_cast<int64_t>(vocab);
  const SampleRowParams P = params[row];
  const int V = vocab;
  const int b0 = min(V, rank * slice), n = min(V, b0 + slice) - b0;  // this CTA's ids [b0, b0 + n)
  int round = 0;

  // ---- stage the slice in shared memory; max, first argmax, non-finite check on the way.
  float mx = -INFINITY;
  int arg = INT_MAX, bad = 0;
  auto see = [&](float x, int j) {  // j increases per thread: the thread's first max
    if (!isfinite(x)) {
      bad = 1;
    } else if (x > mx) {
      mx = x;
      arg = j;
    }
  };
  const float* zr = z + b0;
  int done = 0;  // elements staged by the vector loop
  if ((reinterpret_cast<uintptr_t>(zr) & 15u) == 0) {
    const int n4 = n / 4;
    dev::for_each_float4<kCT, kLoadUnroll>(
        reinterpret_cast<const float4*>(zr), n4, tid, [&](const float4& v, int i) {
          reinterpret_cast<float4*>(zs)[i] = v;
          see(v.x, b0 + 4 * i);
          see(v.y, b0 + 4 * i + 1);
          see(v.z, b0 + 4 * i + 2);
          see(v.w, b0 + 4 * i + 3);
        });
    done = 4 * n4;
  }
  for (int j = done + tid; j < n; j += kCT) {
    const float x = zr[j];
    zs[j] = x;
    see(x, b0 + j);
  }
  // (cta_reduce's barriers order the shared-memory writes above before every later read.)
  {
    Part mine{};
    mine.f = cta_reduce(mx, MaxF(), sh.red_f);
    mine.i0 = cta_reduce(mx == mine.f ? arg : INT_MAX, MinI(), sh.red_i);
    mine.i1 = cta_reduce(bad, MaxI(), sh.red_i);
    const Part v = publish(cl, sh, round, mine);
    if (tid < 32) {
      Part acc = shfl_part(v, 0);
      for (int r = 1; r < C; ++r) {
        const Part o = shfl_part(v, r);
        if (o.f > acc.f) {
          acc.f = o.f;
          acc.i0 = o.i0;
        } else if (o.f == acc.f) {
          acc.i0 = min(acc.i0, o.i0);
        }
        acc.i1 = max(acc.i1, o.i1);
      }
      if (tid == 0) sh.result = acc;
    }
    __syncthreads();
  }
  const float zmax = sh.result.f;
  const int argmax = sh.result.i0;
  if (sh.result.i1) {  // uniform over the cluster
    if (writer) {
      ids[row] = -1;
      sampling_lp[row] = model_lp[row] = __int_as_float(0x7fc00000);
      if (error_flag) atomicMin(error_flag, static_cast<unsigned>(row));
    }
    return;
  }
  const bool greedy = P.temperature == 0.0;
  const double inv_t = greedy ? 1.0 : 1.0 / P.temperature;
  const bool use_k = !greedy && P.top_k > 0 && P.top_k < V;
  const double m = static_cast<double>(zmax) * inv_t;
  // At T = 1, exp(z / T - m) is the model's own exp(z - zmax) (the f64 difference of two floats,
  // rounded to float, is the float difference): one exponential per id serves both sums below.
  const bool unit_t = inv_t == 1.0;
  auto e_of = [&](float x) -> double {
    if (unit_t) return static_cast<double>(expf(x - zmax));
    return static_cast<double>(expf(static_cast<float>(static_cast<double>(x) * inv_t - m)));
  };

  // ---- model log-sum-exp (temperature 1, unfiltered); without top-k the kept mass Z1 of the
  // same pass (both need only zmax; at T = 1 they are the same sum).
  double model_lse, Z1 = 0;
  {
    double acc = 0, acc1 = 0;
    const bool with_z1 = !greedy && !use_k && !unit_t;
    for (int j = tid; j < n; j += kCT) {
      const float x = zs[j];
      acc += static_cast<double>(expf(x - zmax));
      if (with_z1) acc1 += e_of(x);
    }
    Part mine{};
    mine.d0 = cta_reduce(acc, SumD(), sh.red_d);
    mine.d1 = with_z1 ? cta_reduce(acc1, SumD(), sh.red_d) : 0.0;
    const Part v = publish(cl, sh, round, mine);
    if (tid < 32) {
      double s0 = 0, s1 = 0;
      for (int r = 0; r < C; ++r) {
        const Part o = shfl_part(v, r);
        s0 += o.d0;
        s1 += o.d1;
      }
      if (tid == 0) {
        sh.result.d0 = s0;
        sh.result.d1 = s1;
      }
    }
    __syncthreads();
    model_lse = static_cast<double>(zmax) + log(sh.result.d0);
    Z1 = unit_t && !use_k ? sh.result.d0 : sh.result.d1;
  }
  if (greedy) {
    if (writer) {
      ids[row] = argmax;
      sampling_lp[row] = 0.f;
      model_lp[row] = static_cast<float>(static_cast<double>(z[argmax]) - model_lse);
    }
    return;
  }

  // ---- top-k: floor = the k-th largest z (counts per 8-bit digit of the float key).
  float floor_z = -INFINITY;
  if (use_k) {
    unsigned prefix = 0, mask = 0;
    int need = static_cast<int>(P.top_k);
    int b = 0;
    for (int shift = 24; shift >= 0; shift -= 8, b ^= 1) {
      for (int i = tid; i < 256; i += kCT) sh.hist_c[b][i] = 0;
      __syncthreads();
      for (int j = tid; j < n; j += kCT) {
        const unsigned k = fkey(zs[j]);
        if ((k & mask) == prefix) atomicAdd(&sh.hist_c[b][(k >> shift) & 255u], 1u);
      }
      sum_histograms(cl, sh.hist_c[b], sh.tot_c);
      if (tid == 0) {
        int cum = 0;
        for (int d = 255; d >= 0; --d) {
          const int h = static_cast<int>(sh.tot_c[d]);
          if (cum + h >= need) {
            sh.s_key = prefix | (static_cast<unsigned>(d) << shift);
            sh.s_need = need - cum;
            break;
          }
          cum += h;
        }
      }
      __syncthreads();
      prefix = sh.s_key;
      need = sh.s_need;
      mask |= 0xffu << shift;
    }
    floor_z = key_to_f(prefix);
    double acc = 0;
    for (int j = tid; j < n; j += kCT) {
      const float x = zs[j];
      if (x >= floor_z) acc += e_of(x);
    }
    Z1 = cluster_sum(cl, sh, round, acc);
  }
  // Probabilities are e times reciprocals of the normalizers (one f64 multiply per id instead
  // of a division; the one-CTA kernel divides, as the CPU does: the two agree to the last
  // bits of a probability, so picks can differ only for a u within ~1e-16 of a CDF boundary).
  const double r1 = 1.0 / Z1;

  // ---- top-p: t = the largest z with mass{kept, z >= t} >= top_p.
  const bool use_p = P.top_p < 1.0;
  float t_p = -INFINITY;
  double Z2 = 1.0;
  if (use_p) {
    const u64 target = static_cast<u64>(P.top_p * kFixedOne);
    unsigned prefix = 0, mask = 0;
    u64 above = 0;
    bool failed = false;
    int b = 0;
    for (int shift = 24; shift >= 0; shift -= 8, b ^= 1) {
      for (int i = tid; i < 256; i += kCT) sh.hist_m[b][i] = 0;
      __syncthreads();
      for (int j = tid; j < n; j += kCT) {
        const float x = zs[j];
        if (x < floor_z) continue;
        const unsigned k = fkey(x);
        if ((k & mask) == prefix)
          atomicAdd(&sh.hist_m[b][(k >> shift) & 255u], static_cast<u64>(e_of(x) * r1 * kFixedOne));
      }
      sum_histograms(cl, sh.hist_m[b], sh.tot_m);
      if (tid == 0) {
        sh.s_fail = 1;
        u64 cum = above;
        for (int d = 255; d >= 0; --d) {
          const u64 h = sh.tot_m[d];
          if (cum + h >= target) {
            sh.s_key = prefix | (static_cast<unsigned>(d) << shift);
            sh.s_above = cum;
            sh.s_fail = 0;
            break;
          }
          cum += h;
        }
      }
      __syncthreads();
      if (sh.s_fail) {  // the kept mass never reaches top_p (rounding): keep everything
        failed = true;
        break;
      }
      prefix = sh.s_key;
      above = sh.s_above;
      mask |= 0xffu << shift;
    }
    if (!failed) t_p = key_to_f(prefix);
    double acc = 0;
    for (int j = tid; j < n; j += kCT) {
      const float x = zs[j];
      if (x >= floor_z && x >= t_p) acc += e_of(x) * r1;
    }
    Z2 = cluster_sum(cl, sh, round, acc);
  }
  const double r2 = 1.0 / Z2;
  auto p2_of = [&](float x) -> double {
    double p = e_of(x) * r1;
    if (use_p) p *= r2;
    return p;
  };
  // ---- min-p: keep p2 >= min_p * max p2 (max p2 is zmax's: e = 1).
  const bool use_min = P.min_p > 0.0;
  double cut = 0, Z3 = 1.0;
  if (use_min) {
    cut = P.min_p * (use_p ? r1 * r2 : r1);
    double acc = 0;
    for (int j = tid; j < n; j += kCT) {
      const float x = zs[j];
      if (x >= floor_z && x >= t_p) {
        const double p = p2_of(x);
        if (p >= cut) acc += p;
      }
    }
    Z3 = cluster_sum(cl, sh, round, acc);
  }
  const double r3 = 1.0 / Z3;
  auto p_of = [&](float x) -> double {
    if (x < floor_z || x < t_p) return 0.0;
    double p = p2_of(x);
    if (use_min) {
      if (p < cut) return 0.0;
      p *= r3;
    }
    return p;
  };

  // ---- inverse CDF in id order: thread t owns slice ids [t R, (t + 1) R).
  const Philox4 ctr{{P.step, P.sample_index, static_cast<uint32_t>(P.stream_key),
                     static_cast<uint32_t>(P.stream_key >> 32)}};
  const double u = philox_uniform53(ctr, P.seed);
  const int R = (n + kCT - 1) / kCT;
  const int j0 = min(n, tid * R), j1 = min(n, j0 + R);
  double local = 0;
  int last_kept = -1;
  for (int j = j0; j < j1; ++j) {
    const double p = p_of(zs[j]);
    if (p > 0) {
      local += p;
      last_kept = b0 + j;
    }
  }
  // Block scan: warp-inclusive by shuffles, warp offsets by warp 0. A thread's incl is computed
  // once; the next thread's excl is that same value (shuffle, or wincl across warps).
  const int lane = tid & 31, warp = tid >> 5;
  double v = local;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  if (lane == 31) sh.wsum[warp] = v;
  __syncthreads();
  if (warp == 0) {
    // Exclusive warp offsets in warp order (sequential: 32 adds, one lane's chain).
    if (lane == 0) {
      double acc = 0;
      for (int w = 0; w < kCWarps; ++w) {
        const double t = sh.wsum[w];
        sh.wsum[w] = acc;
        acc += t;
      }
    }
  }
  __syncthreads();
  const double incl_l = v + sh.wsum[warp];
  if (lane == 31) sh.wincl[warp] = incl_l;
  const double up = __shfl_up_sync(0xffffffffu, incl_l, 1);
  __syncthreads();
  const double excl_l = lane > 0 ? up : (warp > 0 ? sh.wincl[warp - 1] : 0.0);
  // CTA totals chained in rank order: offset_c = offset_{c-1} + total_{c-1}, total_c = the
  // last thread's incl (so the boundary between two CTAs is one computed value).
  double offset;
  int last_overall;
  {
    Part mine{};
    mine.d0 = sh.wincl[kCWarps - 1];
    mine.i0 = cta_reduce(last_kept, MaxI(), sh.red_i);
    const Part pv = publish(cl, sh, round, mine);
    if (tid < 32) {
      double off = 0, mine_off = 0;
      int last = -1;
      for (int r = 0; r < C; ++r) {
        const Part o = shfl_part(pv, r);
        if (r == rank) mine_off = off;
        off += o.d0;
        last = max(last, o.i0);
      }
      if (tid == 0) {
        sh.result.d0 = mine_off;
        sh.result.i0 = last;
        sh.s_pick = -1;
      }
    }
    __syncthreads();
    offset = sh.result.d0;
    last_overall = sh.result.i0;
  }
  const double excl = offset + excl_l, incl = offset + incl_l;
  if (u >= excl && u < incl) {  // at most one thread of the cluster
    double cum = excl;
    int pick = last_kept;  // if the rescan's rounding leaves u above cum, the range's last kept
    for (int j = j0; j < j1; ++j) {
      const double p = p_of(zs[j]);
      if (p <= 0) continue;
      cum += p;
      if (u < cum) {
        pick = b0 + j;
        break;
      }
    }
    sh.s_pick = pick;
  }
  __syncthreads();
  {
    Part mine{};
    mine.i0 = sh.s_pick;
    const Part pv = publish(cl, sh, round, mine);
    if (tid < 32) {
      int pick = -1;
      for (int r = 0; r < C; ++r) pick = max(pick, shfl_part(pv, r).i0);
      if (tid == 0) sh.result.i0 = pick;
    }
    __syncthreads();
  }
  int pick = sh.result.i0;
  if (pick < 0) pick = last_overall;  // u beyond the total (rounding): the last kept id
  if (writer) {
    ids[row] = pick;
    sampling_lp[row] = static_cast<float>(log(p_of(z[pick])));
    model_lp[row] = static_cast<float>(static_cast<double>(z[pick]) - model_lse);
  }
}

// grid rows x C CTAs in clusters of C, kCT threads, slice x 4 bytes of dynamic shared memory.
__global__ void __launch_bounds__(kCT, 2)
    sample_cluster_kernel(const float* __restrict__ logits, int vocab, int slice,
                          const SampleRowParams* __restrict__ params, int32_t* __restrict__ ids,
                          float* __restrict__ sampling_lp, float* __restrict__ model_lp,
                          unsigned* error_flag, const int32_t* __restrict__ logits_rows) {
  __shared__ ClusterShared sh;
  extern __shared__ __align__(16) float zs[];
  cg::cluster_group cl = cg::this_cluster();
  sample_cluster_body(cl, sh, zs, logits, vocab, slice, params, ids, sampling_lp, model_lp,
                      error_flag, logits_rows);
  // Every return of the body is uniform over the cluster; no CTA leaves while another may still
  // read its shared memory.
  cl.sync();
}

}  // namespace

namespace {

// C CTAs per row: the smallest power of two (<= 8) that leaves each CTA <= kMinSlice ids, or
// `force` (1..8); slice = ceil(V / C) rounded up to 4 floats. cluster 0: sample_kernel (force
// -1, or a slice too large for shared memory).
struct ClusterPlan {
  int cluster = 0;
  int slice = 0;
};
ClusterPlan cluster_plan(int64_t vocab, int force) {
  ClusterPlan p;
  if (force < 0) return p;
  int64_t c = force > 0 ? force : 1;
  if (force == 0)
    while (c < kMaxCluster && (vocab + c - 1) / c > kMinSlice) c *= 2;
  const int64_t slice = ((vocab + c - 1) / c + 3) / 4 * 4;
  if (static_cast<size_t>(slice) * sizeof(float) > kMaxSliceBytes) return p;
  p.cluster = static_cast<int>(c);
  p.slice = static_cast<int>(slice);
  return p;
}

// Per device: the dynamic shared memory limit raised for the cluster kernel, and whether a
// cluster of each size with that much shared memory can be resident (else sample_kernel runs).
struct DeviceSetup {
  bool done = false;
  bool ok[kMaxCluster + 1] = {};
};
bool cluster_kernel_usable(int cluster) {
  static std::mutex mu;
  static std::vector<DeviceSetup> setups;
  int dev = 0;
  OPD_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (setups.size() <= static_cast<size_t>(dev)) setups.resize(static_cast<size_t>(dev) + 1);
  DeviceSetup& d = setups[static_cast<size_t>(dev)];
  if (!d.done) {
    // The largest slice any plan uses; set once (not a stream operation: allowed while a
    // stream is being captured).
    OPD_CUDA_CHECK(cudaFuncSetAttribute(sample_cluster_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kMaxSliceBytes)));
    // All of the unified L1/shared memory as shared: two CTAs of a W1 row (2 x ~85 KB) per SM.
    OPD_CUDA_CHECK(cudaFuncSetAttribute(sample_cluster_kernel,
                                        cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    for (int c = 1; c <= kMaxCluster; c *= 2) {
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(static_cast<unsigned>(c));
      cfg.blockDim = dim3(kCT);
      cfg.dynamicSmemBytes = kMaxSliceBytes;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = static_cast<unsigned>(c);
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      int clusters = 0;
      const cudaError_t st = cudaOccupancyMaxActiveClusters(&clusters, sample_cluster_kernel, &cfg);
      if (st != cudaSuccess) (void)cudaGetLastError();
      d.ok[c] = st == cudaSuccess && clusters >= 1;
    }
    d.done = true;
  }
  return cluster >= 1 && cluster <= kMaxCluster && d.ok[cluster];
}

}  // namespace

void sample_rows(const float* logits, int64_t rows, int64_t vocab, const SampleRowParams* params,
                 int32_t* ids, float* sampling_logprobs, float* model_logprobs,
                 unsigned* error_flag, cudaStream_t stream, const int32_t* logits_rows,
                 int cluster) {
  OPD_CHECK(vocab >= 1 && vocab < INT_MAX && rows < INT_MAX / kMaxCluster, InvalidArgument,
            "sample_rows: vocab ", vocab, " and rows ", rows, " must be in [1, 2^31)");
  OPD_CHECK(cluster >= -1 && cluster <= kMaxCluster && (cluster <= 0 || (cluster & (cluster - 1)) == 0),
            InvalidArgument, "sample_rows: cluster ", cluster, " (0 = auto, -1 = one CTA per row, "
            "or 1, 2, 4, 8)");
  if (rows == 0) return;
  const ClusterPlan plan = cluster_plan(vocab, cluster);
  if (plan.cluster > 0 && cluster_kernel_usable(plan.cluster)) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(rows * plan.cluster));
    cfg.blockDim = dim3(kCT);
    cfg.dynamicSmemBytes = static_cast<size_t>(plan.slice) * sizeof(float);
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(plan.cluster);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    OPD_CUDA_CHECK(cudaLaunchKernelEx(&cfg, sample_cluster_kernel, logits, static_cast<int>(vocab),
                                      plan.slice, params, ids, sampling_logprobs, model_logprobs,
                                      error_flag, logits_rows));
    return;
  }
  sample_kernel<<<static_cast<unsigned>(rows), kNT, 0, stream>>>(
      logits, static_cast<int>(vocab), params, ids, sampling_logprobs, model_logprobs, error_flag,
      logits_rows);
  check_launch("sample_kernel");
}

}  // namespace opd::cuda
