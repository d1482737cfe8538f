// CUDA tiled lm_head top-K with online log-sum-exp (algorithm, memory and error contract in
// teacher/topk_lm_head_cuda.h; the CPU reference is teacher/topk_lm_head.cpp):
// cuBLASLt GEMM of each [row_chunk, vocab_tile] logit tile in f32, then one CTA per row merges
// the tile into the row's state (online LSE, running top-K by unique 64-bit keys: candidates
// gathered in shared memory, merged by ranks or a radix select), an optional rank pass, and a
// final per-row sort.
//
// Index safety inside the kernels: every slot handed out by a shared-memory counter (atomicAdd
// on s_n) and every count read back from the row state is bounded by the capacity of the array
// it addresses before it is used; a slot outside it is dropped and reported through
// error_flag[2] (a broken invariant: the host turns it into an Internal error), never written.
// Under the intended schedule the bounds never trigger (the counts are exact), so they cost one
// compare per kept key.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "core/cuda/stream.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/gemm.h"
#include "teacher/topk_lm_head_cuda.h"

namespace opd::cuda {
namespace {

using u64 = unsigned long long;
constexpr int kThreads = 256;
constexpr int kCandCap = kTopKLmHeadCandCap;  // candidates of one tile merged in shared memory
static_assert(kThreads == 256, "topk_tile_kernel: hist[256] doubles as one float per thread");

struct RowState {
  u64 thr;        // smallest kept key once `count == k` (candidates must beat it), else 0
  float m, s;     // online LSE of z / T: max and sum of exp(z / T - m)
  float z_actual; // logit of the actual token (NaN until its tile is seen)
  int bad_id;     // first id with a non-finite logit (INT_MAX: none)
  int count;      // kept keys
  int rank;       // #{v : z_v > z_actual}
};
static_assert(sizeof(RowState) == 32, "RowState layout");

// Order-preserving key: larger z first, then smaller id; unique per id, never 0 for a finite z.
__device__ __forceinline__ u64 make_key(float z, int id) {
  if (z == 0.f) z = 0.f;  // -0 and +0 compare equal: one key order (ties go by id)
  unsigned u = __float_as_uint(z);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<u64>(u) << 32) | static_cast<u64>(~static_cast<unsigned>(id));
}
__device__ __forceinline__ float key_z(u64 key) {
  unsigned u = static_cast<unsigned>(key >> 32);
  u = (u & 0x80000000u) ? (u & 0x7fffffffu) : ~u;
  return __uint_as_float(u);
}
__device__ __forceinline__ int key_id(u64 key) {
  return static_cast<int>(~static_cast<unsigned>(key & 0xffffffffull));
}

// Block-wide reductions in a fixed order (deterministic for a given launch shape).
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T* red) {
  return dev::block_reduce<kThreads>(v, op, red);
}
struct MaxF {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumF {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct SumI {
  __device__ int operator()(int a, int b) const { return a + b; }
};
struct MinI {
  __device__ int operator()(int a, int b) const { return min(a, b); }
};
struct MinU {
  __device__ u64 operator()(u64 a, u64 b) const { return a < b ? a : b; }
};

__global__ void init_state_kernel(RowState* states, int64_t rows) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    RowState s;
    s.thr = 0;
    s.m = -INFINITY;
    s.s = 0.f;
    s.z_actual = __int_as_float(0x7fc00000);  // NaN
    s.bad_id = INT_MAX;
    s.count = 0;
    s.rank = 0;
    states[r] = s;
  }
}

// Reports row `row` in error_flag[2] (first row whose merge saw an out-of-bounds slot).
__device__ __forceinline__ void report_slot_overflow(unsigned* error_flag, int64_t row) {
  if (error_flag) atomicMin(&error_flag[2], static_cast<unsigned>(row));
}

// Row loads: with `vec` (vn % 4 == 0 and the row 16-byte aligned) each thread reads 4
// consecutive logits per 16-byte load, kUnroll loads in flight before it uses any (the loop
// was bound by the loads in flight: one 4-byte load per thread at a time reached ~0.7 TB/s);
// otherwise one logit per load. f(x, j) is called for every j in [0, vn) once; which thread
// sees which j, and in which order, is fixed by the launch shape.
constexpr int kUnroll = 4;

template <typename F>
__device__ __forceinline__ void for_each_logit(const float* zr, int vn, bool vec, int tid, F&& f) {
  if (vec) {
    dev::for_each_float4<kThreads, kUnroll>(reinterpret_cast<const float4*>(zr), vn >> 2, tid,
                                            [&](const float4& v, int i) {
                                              f(v.x, 4 * i);
                                              f(v.y, 4 * i + 1);
                                              f(v.z, 4 * i + 2);
                                              f(v.w, 4 * i + 3);
                                            });
  } else {
    for (int j = tid; j < vn; j += kThreads) f(zr[j], j);
  }
}

// One CTA per row of the tile z [rows, vn] (row stride ldz; ids v0 .. v0 + vn - 1).
// Dynamic shared memory: (cand_cap + k) keys: [0, cand_cap) tile candidates, [cand_cap, +k) the
// old kept set during a merge. cand_cap <= kCandCap (smaller only to force the global-memory
// merge path in tests).
__global__ void __launch_bounds__(kThreads)
    topk_tile_kernel(const float* __restrict__ z, int64_t ldz, int vn, int v0, float inv_t,
                     RowState* __restrict__ states, u64* __restrict__ kept_all,
                     const int32_t* __restrict__ actual, int k, int cand_cap,
                     unsigned* __restrict__ error_flag, int64_t row0) {
  extern __shared__ u64 cand[];
  __shared__ int hist[256];
  __shared__ float red_f[kThreads / 32];
  __shared__ int red_i[kThreads / 32];
  __shared__ u64 red_u[kThreads / 32];
  __shared__ int s_n;
  __shared__ u64 s_prefix, s_mask;
  __shared__ int s_need, s_done;

  const int tid = static_cast<int>(threadIdx.x);
  const int64_t row = blockIdx.x;
  const float* zr = z + row * ldz;
  const bool vec = (vn & 3) == 0 && (reinterpret_cast<uintptr_t>(zr) & 15) == 0;
  RowState st = states[row];
  const u64 thr = st.thr;
  // Once the row's kept set is full (thr != 0), a tile holds few candidates (W1: ~64 / (t - 1)
  // in its t-th vocabulary tile): pass 1 then stores them in cand[] as it finds them, and the
  // merge below needs no second pass over the row (it read the whole row again, from L2 at
  // best, for every tile with a candidate: nearly every row of every tile at W1). Before that
  // (the first tiles), pass 1 only counts them. A finite z below the threshold key's z cannot
  // beat it: one float compare per logit before the key is formed.
  const bool collect = k > 0 && thr != 0;  // uniform over the CTA (st is)
  const float thr_z = collect ? key_z(thr) : 0.f;
  if (collect) {
    if (tid == 0) s_n = 0;
    __syncthreads();
  }

  // ---- pass 1: online LSE of z / T, non-finite ids, top-K candidates (stored or counted).
  float lm = -INFINITY, ls = 0.f;
  int c = 0, bad = INT_MAX;
  auto candidate = [&](float x, int id) {  // x finite
    if (collect) {
      if (x >= thr_z) {
        const u64 key = make_key(x, id);
        if (key > thr) {
          const int slot = atomicAdd(&s_n, 1);  // s_n ends as the exact count
          if (slot < cand_cap) cand[slot] = key;
        }
      }
    } else if (k > 0 && make_key(x, id) > thr) {
      ++c;
    }
  };
  auto lse_step = [&](float x, int j) {
    if (!isfinite(x)) {
      bad = min(bad, v0 + j);
      return;
    }
    const float y = x * inv_t;
    if (y > lm) {
      ls = ls * expf(lm - y) + 1.f;  // expf(-inf) = 0 on the first element
      lm = y;
    } else {
      ls += expf(y - lm);
    }
    candidate(x, v0 + j);
  };
  if (vec) {
    // kUnroll x 4 logits per round: their maximum first, so the running sum is rescaled at most
    // once per round and the exponentials of a round are independent of each other.
    const float4* z4 = reinterpret_cast<const float4*>(zr);
    const int n4 = vn >> 2;
    for (int i0 = tid; i0 < n4; i0 += kThreads * kUnroll) {
      float y[kUnroll][4];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float4 v = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
        if (i0 + u * kThreads < n4) v = z4[i0 + u * kThreads];
        y[u][0] = v.x;
        y[u][1] = v.y;
        y[u][2] = v.z;
        y[u][3] = v.w;
      }
      float rm = -INFINITY;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * kThreads;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x = y[u][e];
          if (i < n4 && !isfinite(x)) {
            bad = min(bad, v0 + 4 * i + e);
            y[u][e] = -INFINITY;  // not in the sum
          } else if (i < n4) {
            candidate(x, v0 + 4 * i + e);
            y[u][e] = x * inv_t;
            rm = fmaxf(rm, y[u][e]);
          }
        }
      }
      if (rm > lm) {
        ls *= expf(lm - rm);  // expf(-inf) = 0 on the first round
        lm = rm;
      }
      if (lm > -INFINITY) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
          for (int e = 0; e < 4; ++e)  // expf(-inf) = 0: skipped slots; y == lm: 1 (also at +inf)
            ls += y[u][e] == lm ? 1.f : expf(y[u][e] - lm);
      }
    }
  } else {
    for (int j = tid; j < vn; j += kThreads) lse_step(zr[j], j);
  }
  const float M = block_reduce(lm, MaxF(), red_f);
  // Read after the reduction's barrier (every atomic is done); the next reductions' barriers
  // come before any thread resets s_n below.
  const int collected = collect ? s_n : 0;
  const float S = block_reduce(lm == -INFINITY ? 0.f : ls * expf(lm - M), SumF(), red_f);
  const int C = collect ? collected : block_reduce(c, SumI(), red_i);
  const bool have = collect && C <= cand_cap;  // the tile's candidates are cand[0, C)
  const int B = block_reduce(bad, MinI(), red_i);
  if (M > -INFINITY) {
    const float mn = fmaxf(st.m, M);
    st.s = st.s * expf(st.m - mn) + S * expf(M - mn);
    st.m = mn;
  }
  st.bad_id = min(st.bad_id, B);
  if (actual) {
    const int32_t y = actual[row];
    if (y >= v0 && y < v0 + vn) st.z_actual = zr[y - v0];
  }

  if (C > 0) {
    u64* kept = kept_all + row * k;
    // The kept count comes from memory: bounded before it addresses kept[] or old[].
    int count = st.count;
    if (count < 0 || count > k) {
      if (tid == 0) report_slot_overflow(error_flag, row0 + row);
      count = max(0, min(count, k));
    }
    u64 local_min = ~0ull;
    bool overflow = false;
    if (count + C <= k) {
      // Everything fits: append the candidates.
      if (tid == 0) s_n = 0;
      __syncthreads();
      for_each_logit(zr, vn, vec, tid, [&](float x, int j) {
        if (!isfinite(x)) return;
        const u64 key = make_key(x, v0 + j);
        if (key > thr) {
          const int slot = atomicAdd(&s_n, 1);
          if (slot < C) {  // C slots reserved above: count + slot < k
            kept[count + slot] = key;
            local_min = key < local_min ? key : local_min;
          } else {
            overflow = true;
          }
        }
      });
      if (count + C == k) {
        for (int i = tid; i < count; i += kThreads) local_min = kept[i] < local_min ? kept[i] : local_min;
      }
      const u64 mn = block_reduce(local_min, MinU(), red_u);
      st.count = count + C;
      st.thr = st.count == k ? mn : 0;
    } else {
      // Merge: the k best of (old kept U candidates) by an 8-bit radix select on the keys.
      u64* old = cand + cand_cap;
      for (int i = tid; i < count; i += kThreads) old[i] = kept[i];
      // More candidates than cand[] holds (a row's first tiles): a floor under the k-th best
      // key's z / T from pass 1's per-thread maxima. Any k distinct elements' smallest value is
      // <= the k-th best, so the k-th largest of the threads' maxima (distinct elements: each
      // thread saw its own logits) is such a floor, and every key of the k best has z / T >= it
      // (x -> x * inv_t is monotone under rounding). W1's first tile: ~16,000 candidates, ~75
      // above the floor; without it the radix select re-read the row in each of its rounds.
      float floor_y = -INFINITY;
      if (!have && C > cand_cap && k <= kThreads) {
        float* s_max = reinterpret_cast<float*>(hist);  // hist is free until the radix select
        s_max[tid] = lm;  // this thread's maximum of z / T over its finite logits (or -inf)
        __syncthreads();
        int rank = 0, finite = 0;  // rank: unique, by value then thread index
        for (int j = 0; j < kThreads; ++j) {
          const float o = s_max[j];
          finite += o > -INFINITY;
          rank += o > lm || (o == lm && j < tid);
        }
        __syncthreads();  // every thread read s_max: s_max[0] may be overwritten
        if (finite >= k && rank == k - 1) s_max[0] = lm;  // finite >= k: this lm is finite
        __syncthreads();
        if (finite >= k) floor_y = s_max[0];
        __syncthreads();  // hist is zeroed by the radix select below
      }
      const bool bounded = floor_y > -INFINITY;
      bool in_smem = have;
      int n_cand = have ? C : 0;  // candidates stored in cand[] (<= cand_cap)
      if (!have && (C <= cand_cap || bounded)) {
        if (tid == 0) s_n = 0;
        __syncthreads();
        for_each_logit(zr, vn, vec, tid, [&](float x, int j) {
          if (!isfinite(x) || (bounded && x * inv_t < floor_y)) return;
          const u64 key = make_key(x, v0 + j);
          if (key > thr) {
            const int slot = atomicAdd(&s_n, 1);
            if (slot < cand_cap) cand[slot] = key;
            if (!bounded && slot >= C) overflow = true;  // more than pass 1 counted
          }
        });
        __syncthreads();
        const int found = s_n;  // final after the barrier
        // Bounded: ties at the floor may still leave more than cand[] holds (then the radix
        // select over the row, below). Unbounded: == C unless an invariant broke.
        in_smem = found <= cand_cap;
        n_cand = in_smem ? (bounded ? found : min(found, C)) : 0;
      }
      __syncthreads();
      // visit(f): f(key) over the union, each key once, strided over the block.
      auto visit = [&](auto&& f) {
        if (in_smem) {
          for (int i = tid; i < n_cand; i += kThreads) f(cand[i]);
        } else {
          for_each_logit(zr, vn, vec, tid, [&](float x, int j) {
            if (!isfinite(x)) return;
            const u64 key = make_key(x, v0 + j);
            if (key > thr) f(key);
          });
        }
        for (int i = tid; i < count; i += kThreads) f(old[i]);
      };
      if (in_smem && n_cand + count <= kThreads) {
        // Few keys (a later tile's handful of candidates + the k kept): each thread ranks one
        // key against all of them (keys are unique: ranks are distinct) and the k best land at
        // kept[rank]. One pass and no barrier where the radix select below takes up to 8 rounds
        // of 3 barriers and a serial 256-bucket scan (ncu: 32% of the cycles stalled at
        // barriers). Same set, so the same outputs (the final kernel sorts the kept keys).
        const int n = n_cand + count;
        if (tid < n) {
          const u64 mine = tid < n_cand ? cand[tid] : old[tid - n_cand];
          int rank = 0;
          for (int j = 0; j < n_cand; ++j) rank += cand[j] > mine;
          for (int j = 0; j < count; ++j) rank += old[j] > mine;
          if (rank < k) {
            kept[rank] = mine;
            local_min = mine;
          }
        }
        const int written = min(n, k);  // == k unless an invariant broke (n_cand < C)
        const u64 mn = block_reduce(local_min, MinU(), red_u);
        st.count = written;
        st.thr = written == k ? mn : 0;
        if (overflow) report_slot_overflow(error_flag, row0 + row);
        if (tid == 0) states[row] = st;
        return;
      }
      u64 prefix = 0, mask = 0;
      int need = k;
      for (int shift = 56; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += kThreads) hist[i] = 0;
        __syncthreads();
        visit([&](u64 key) {
          if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
        });
        __syncthreads();
        // s_* are written only here, between two barriers: every thread read the previous
        // values before the barrier above, and reads the new ones after the barrier below.
        if (tid == 0) {
          int cum = 0, found = 0;
          for (int d = 255; d >= 0; --d) {
            const int h = hist[d];
            if (cum + h >= need) {
              s_prefix = prefix | (static_cast<u64>(d) << shift);
              s_mask = mask | (0xffull << shift);
              s_need = need - cum;
              s_done = h == need - cum;  // the whole bucket is in: no finer digit needed
              found = 1;
              break;
            }
            cum += h;
          }
          if (!found) {  // fewer keys than `need` (a broken invariant): keep every key, stop
            s_prefix = 0;
            s_mask = 0;
            s_need = need;
            s_done = 1;
          }
        }
        __syncthreads();
        prefix = s_prefix;
        mask = s_mask;
        need = s_need;
        if (s_done) break;
      }
      // Keys >= prefix are exactly the k best (keys are unique). Old kept is in shared memory,
      // so the global kept array can be overwritten.
      if (tid == 0) s_n = 0;
      __syncthreads();
      visit([&](u64 key) {
        if (key >= prefix) {
          const int slot = atomicAdd(&s_n, 1);
          if (slot < k) {
            kept[slot] = key;
            local_min = key < local_min ? key : local_min;
          } else {
            overflow = true;
          }
        }
      });
      __syncthreads();
      const int written = min(s_n, k);  // == k unless an invariant broke
      const u64 mn = block_reduce(local_min, MinU(), red_u);
      st.count = written;
      st.thr = written == k ? mn : 0;
    }
    if (overflow) report_slot_overflow(error_flag, row0 + row);
  }
  if (tid == 0) states[row] = st;
}

// rank pass: state.rank += #{j : z_j > z_actual} over this tile.
__global__ void __launch_bounds__(kThreads)
    topk_rank_kernel(const float* __restrict__ z, int64_t ldz, int vn, int64_t vocab,
                     RowState* __restrict__ states, const int32_t* __restrict__ actual) {
  __shared__ int red_i[kThreads / 32];
  const int64_t row = blockIdx.x;
  const int32_t y = actual[row];
  if (y < 0 || y >= vocab) return;  // uniform over the CTA
  const float zy = states[row].z_actual;
  const float* zr = z + row * ldz;
  int c = 0;
  for (int j = static_cast<int>(threadIdx.x); j < vn; j += kThreads) c += zr[j] > zy;
  const int C = block_reduce(c, SumI(), red_i);
  if (threadIdx.x == 0) states[row].rank += C;
}

// Final per-row sort (bitonic, descending keys) and outputs. Dynamic smem: n2 keys.
__global__ void __launch_bounds__(kThreads)
    topk_finalize_kernel(const RowState* __restrict__ states, const u64* __restrict__ kept_all,
                         const int32_t* __restrict__ actual, int k, int n2, int64_t vocab,
                         double inv_t, int32_t* __restrict__ ids, float* __restrict__ logprobs,
                         float* __restrict__ actual_logprobs, int32_t* __restrict__ ranks,
                         unsigned* error_flag) {
  extern __shared__ u64 keys[];
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t row = blockIdx.x;
  const RowState st = states[row];
  const double lse = static_cast<double>(st.m) + log(static_cast<double>(st.s));
  if (k > 0) {
    const u64* kept = kept_all + row * k;
    // The kept count addresses kept[]: bounded (the tile kernel keeps it in [0, k]).
    const int count = max(0, min(st.count, k));
    if (tid == 0 && count != st.count && error_flag) atomicMin(&error_flag[2], static_cast<unsigned>(row));
    for (int i = tid; i < n2; i += kThreads) keys[i] = i < count ? kept[i] : 0ull;
    __syncthreads();
    for (int size = 2; size <= n2; size <<= 1) {
      for (int stride = size >> 1; stride > 0; stride >>= 1) {
        for (int i = tid; i < n2; i += kThreads) {
          const int j = i ^ stride;
          if (j > i) {
            const u64 a = keys[i], b = keys[j];
            const bool desc = (i & size) == 0;
            if (desc ? a < b : a > b) {
              keys[i] = b;
              keys[j] = a;
            }
          }
        }
        __syncthreads();
      }
    }
    for (int i = tid; i < k; i += kThreads) {
      const u64 key = keys[i];
      if (key == 0) {  // fewer finite logits than k (reported through bad_id)
        ids[row * k + i] = -1;
        logprobs[row * k + i] = __int_as_float(0x7fc00000);
      } else {
        ids[row * k + i] = key_id(key);
        logprobs[row * k + i] = static_cast<float>(static_cast<double>(key_z(key)) * inv_t - lse);
      }
    }
  }
  if (tid == 0) {
    int32_t y = actual ? actual[row] : -1;
    if (y < -1 || y >= vocab) {
      if (error_flag) atomicMin(&error_flag[1], static_cast<unsigned>(row));
      y = -1;
    }
    if (actual_logprobs) {
      actual_logprobs[row] =
          y >= 0 ? static_cast<float>(static_cast<double>(st.z_actual) * inv_t - lse)
                 : __int_as_float(0x7fc00000);
    }
    if (ranks) ranks[row] = y >= 0 ? st.rank + 1 : 0;
    if (st.bad_id != INT_MAX && error_flag) atomicMin(&error_flag[0], static_cast<unsigned>(row));
  }
}

struct Layout {
  float* tile;
  RowState* states;
  u64* kept;
};
size_t align256(size_t b) { return (b + 255) / 256 * 256; }
Layout layout(void* ws, int64_t rows, int64_t vocab, int64_t k, int64_t tile, int64_t chunk) {
  char* p = static_cast<char*>(ws);
  Layout l;
  l.tile = reinterpret_cast<float*>(p);
  p += align256(static_cast<size_t>(std::min(rows, chunk) * std::min(tile, vocab)) * 4);
  l.states = reinterpret_cast<RowState*>(p);
  p += align256(static_cast<size_t>(rows) * sizeof(RowState));
  l.kept = reinterpret_cast<u64*>(p);
  return l;
}

int next_pow2(int64_t n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace

size_t topk_lm_head_cuda_workspace_bytes(int64_t rows, int64_t vocab, int64_t k,
                                         int64_t vocab_tile, int64_t row_chunk) {
  return align256(static_cast<size_t>(std::min(rows, row_chunk) * std::min(vocab_tile, vocab)) * 4) +
         align256(static_cast<size_t>(rows) * sizeof(RowState)) +
         static_cast<size_t>(rows) * static_cast<size_t>(k) * sizeof(u64);
}

void topk_lm_head_cuda(const TopKLmHeadCudaArgs& a, void* workspace, cudaStream_t stream) {
  const bool from_logits = a.logits != nullptr;
  OPD_CHECK(from_logits || a.dtype == DType::BF16 || a.dtype == DType::F32, Unsupported,
            "topk_lm_head on CUDA: dtype ", dtype_name(a.dtype), " (bf16 or f32)");
  OPD_CHECK(a.k >= 0 && a.k <= a.vocab && a.k <= kTopKLmHeadMaxK, InvalidArgument,
            "topk_lm_head on CUDA: k = ", a.k, " is outside [0, min(V = ", a.vocab, ", ",
            kTopKLmHeadMaxK, ")]");
  OPD_CHECK(std::isfinite(a.temperature) && a.temperature > 0, InvalidArgument,
            "topk_lm_head: temperature ", a.temperature, " must be finite and > 0");
  OPD_CHECK(a.vocab_tile > 0 && a.row_chunk > 0 && a.vocab >= 1 &&
                (from_logits || a.hidden_dim >= 1),
            InvalidArgument, "topk_lm_head on CUDA: vocab_tile ", a.vocab_tile, ", row_chunk ",
            a.row_chunk, ", vocab ", a.vocab, ", hidden ", a.hidden_dim, " must be > 0");
  OPD_CHECK(a.candidate_capacity >= 1 && a.candidate_capacity <= kCandCap, InvalidArgument,
            "topk_lm_head on CUDA: candidate_capacity ", a.candidate_capacity, " is outside [1, ",
            kCandCap, "]");
  OPD_CHECK(a.vocab < INT_MAX && a.rows < INT_MAX, Unsupported,
            "topk_lm_head on CUDA: rows ", a.rows, " / vocab ", a.vocab, " exceed int32");
  if (a.rows == 0) return;
  OPD_CHECK(workspace != nullptr, InvalidArgument, "topk_lm_head on CUDA: no workspace");
  const int64_t R = a.rows, V = a.vocab, H = a.hidden_dim, K = a.k;
  const int64_t tile = std::min(a.vocab_tile, V), chunk = std::min(a.row_chunk, R);
  const Layout l = layout(workspace, R, V, K, tile, chunk);
  const size_t esz = from_logits ? 4 : dtype_size(a.dtype);
  const float inv_t = static_cast<float>(1.0 / a.temperature);

  init_state_kernel<<<grid_for(R, kThreads), kThreads, 0, stream>>>(l.states, R);
  check_launch("init_state_kernel");
  const int cand_cap = a.candidate_capacity;
  const size_t tile_smem = static_cast<size_t>(cand_cap + K) * sizeof(u64);
  // Opt in above 32 KiB: dynamic + the kernel's ~1.4 KiB of static shared memory must fit the
  // 48 KiB default otherwise.
  if (tile_smem > 32 * 1024) {
    OPD_CUDA_CHECK(cudaFuncSetAttribute(topk_tile_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(tile_smem)));
  }
  const char* hidden = static_cast<const char*>(a.hidden);
  const char* lm_head = static_cast<const char*>(a.lm_head);
  // row_kernel(z, ldz, v0, vn, r0, rn): z points at logit (r0, v0), rows ldz floats apart.
  auto for_tiles = [&](auto&& row_kernel) {
    // Vocabulary tiles outside, row chunks inside: the lm_head (V x H, the big operand) is read
    // once; the hidden rows (R x H) once per tile.
    for (int64_t v0 = 0; v0 < V; v0 += tile) {
      const int64_t vn = std::min(tile, V - v0);
      for (int64_t r0 = 0; r0 < R; r0 += chunk) {
        const int64_t rn = std::min(chunk, R - r0);
        if (from_logits) {
          row_kernel(a.logits + r0 * V + v0, V, v0, vn, r0, rn);
        } else {
          linear_forward(hidden + r0 * H * esz, lm_head + v0 * H * esz, nullptr, rn, H, vn,
                         a.dtype, DType::F32, l.tile, stream);
          row_kernel(l.tile, vn, v0, vn, r0, rn);
        }
      }
    }
  };
  for_tiles([&](const float* z, int64_t ldz, int64_t v0, int64_t vn, int64_t r0, int64_t rn) {
    topk_tile_kernel<<<static_cast<unsigned>(rn), kThreads, tile_smem, stream>>>(
        z, ldz, static_cast<int>(vn), static_cast<int>(v0), inv_t, l.states + r0,
        l.kept + r0 * K, a.actual ? a.actual + r0 : nullptr, static_cast<int>(K), cand_cap,
        a.error_flag, r0);
    // cudaGetLastError also returns an earlier kernel's asynchronous fault (e.g. the GEMM's):
    // check_launch names this kernel but says so.
    check_launch("topk_tile_kernel");
  });
  if (a.want_ranks && a.actual) {
    for_tiles([&](const float* z, int64_t ldz, int64_t v0, int64_t vn, int64_t r0, int64_t rn) {
      topk_rank_kernel<<<static_cast<unsigned>(rn), kThreads, 0, stream>>>(
          z, ldz, static_cast<int>(vn), V, l.states + r0, a.actual + r0);
      check_launch("topk_rank_kernel");
    });
  }
  const int n2 = K > 0 ? next_pow2(K) : 1;
  const size_t fin_smem = static_cast<size_t>(n2) * sizeof(u64);
  if (fin_smem > 32 * 1024) {
    OPD_CUDA_CHECK(cudaFuncSetAttribute(topk_finalize_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(fin_smem)));
  }
  topk_finalize_kernel<<<static_cast<unsigned>(R), kThreads, fin_smem, stream>>>(
      l.states, l.kept, a.actual, static_cast<int>(K), n2, V, 1.0 / a.temperature, a.ids,
      a.logprobs, a.actual_logprobs, a.want_ranks ? a.actual_ranks : nullptr, a.error_flag);
  check_launch("topk_finalize_kernel");
}

int32_t topk_lm_head_cuda_bad_id(const void* workspace, int64_t rows, int64_t vocab, int64_t k,
                                 int64_t vocab_tile, int64_t row_chunk, int64_t row,
                                 cudaStream_t stream) {
  const int64_t tile = std::min(vocab_tile, vocab), chunk = std::min(row_chunk, rows);
  const Layout l = layout(const_cast<void*>(workspace), rows, vocab, k, tile, chunk);
  RowState st;
  OPD_CUDA_CHECK(cudaMemcpyAsync(&st, l.states + row, sizeof(RowState), cudaMemcpyDeviceToHost,
                                 stream));
  OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
  return st.bad_id == INT_MAX ? -1 : st.bad_id;
}

}  // namespace opd::cuda
