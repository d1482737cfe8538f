// CUDA kernels of the paged KV cache (formulas in kernels/ops.h, layout in docs/rollout.md):
// kv_cache_store scatters new K/V rows into their cache slots, and paged attention computes
// causal GQA attention of new query rows (decode tokens or prefill chunks) over keys gathered
// through a block table -- the PagedAttention layout (Kwon et al., SOSP 2023) with the
// split-KV ("flash-decoding", Dao et al. 2023) schedule:
//
//   CTA (sequence b, kv head g, query tile, split s) streams the positions
//   [s * split_tokens, (s + 1) * split_tokens) of its sequence (clipped to the causal limit of
//   its rows) and keeps per query row an online softmax in log2 units:
//     m = max_j s_j,  l = sum_j 2^(s_j - m),  acc = sum_j 2^(s_j - m) v_j,  s_j = scale log2(e) q.k_j
//   With one split the CTA writes out = acc / l; otherwise (m, l, acc) go to an f32 workspace
//   and a combine kernel merges the splits: M = max m_s, out = sum 2^(m_s-M) acc_s / sum 2^(m_s-M) l_s.
//
// Two attention kernels: paged_attention_decode_kernel when every sequence has at most one
// query row (max_q_len == 1: decode steps; built for bandwidth, described above it) and
// paged_attention_kernel for prefill chunks and mixed steps (this comment).
//
// Why this shape: decode is bandwidth-bound (each K/V byte is used by group = Hq/Hkv query
// heads only), so one CTA serves all query heads of a kv head and reads each K/V row once;
// the split over positions gives the W1 batch (64 sequences x 8 kv heads = 512 pairs) enough
// CTAs (x splits) to keep 132 SMs' memory pipes busy. Inside a CTA a token's D-element row is
// read by D/8 lanes with one 16-byte load each (bf16), 128 / (D/8) tokens in flight per step
// and 2-4 steps unrolled, so every lane has 4-8 independent 16-byte loads outstanding.
//
// Index safety (DESIGN.md invariant 1): every index read from data (cu_seqlens_q, seq_lens,
// block table entries, slots) is checked in the kernel before it addresses memory; a bad one
// is skipped and reported by atomicMin of the sequence (attention) or row (store) into an
// optional device error flag (initialized to 0xffffffff = no error). The Tensor-level ops of
// paged_dispatch.cpp validate on the host first and name the bad entry like the CPU does.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda/allocator.h"
#include "core/cuda/stream.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/pdl.cuh"

namespace opd::cuda {
namespace {

using bf16 = __nv_bfloat16;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kThreads = 128;  // 4 warps per CTA

__device__ __forceinline__ void report(unsigned* flag, int what) {
  if (flag) atomicMin(flag, static_cast<unsigned>(what));
}

// 8 consecutive elements as f32: one 16-byte load (bf16) or two (f32). p is 16-byte aligned.
__device__ __forceinline__ void load8(const bf16* p, float (&f)[8]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
  f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

struct Params {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* out;
  const int32_t* cu_seqlens_q;
  const int32_t* seq_lens;
  const int32_t* block_tables;
  float* part_acc;  // [splits, total_q, hq, D] (splits > 1)
  float* part_ml;   // [splits, total_q, hq, 2]
  unsigned* error_flag;
  int batch, total_q, hq, hkv, group, num_blocks, block_size, max_blocks;
  int max_q_len, max_seq_len, tiles_per_seq, num_splits, split_tokens;
  int bs_shift;  // log2(block_size) when it is a power of two (W1: 16), else -1 (decode kernel)
  float scale_log2;
};

// grid (batch * tiles_per_seq, hkv, num_splits), kThreads threads. Rows of (b, g) are the
// pairs (query row i, head h in group g) flattened as r = i * group + (h - g * group); a CTA
// owns rows [tile * kRows, tile * kRows + kRows).
template <typename T, int kD, int kRows>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(Params p) {
  constexpr int kLanes = kD / 8;                 // lanes sharing one token's row
  constexpr int kStreams = kThreads / kLanes;    // tokens processed side by side
  constexpr int kUnroll = kRows >= 8 ? 2 : 4;    // tokens per stream per step (loads in flight)
  static_assert(kD % 8 == 0 && kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0,
                "head_dim / 8 must be a power of two <= 32");

  __shared__ float sm_acc[kStreams][kRows][kD];
  __shared__ float sm_m[kStreams][kRows];
  __shared__ float sm_l[kStreams][kRows];
  __shared__ float sm_w[kStreams][kRows];
  __shared__ float sm_M[kRows], sm_L[kRows];

  const int b = static_cast<int>(blockIdx.x) / p.tiles_per_seq;
  const int tile = static_cast<int>(blockIdx.x) % p.tiles_per_seq;
  const int g = static_cast<int>(blockIdx.y), split = static_cast<int>(blockIdx.z);
  const bool reporter = threadIdx.x == 0 && g == 0 && tile == 0 && split == 0;

  // ---- validate this sequence's entries (uniform over the CTA) before using any of them.
  const int q0 = p.cu_seqlens_q[b], q1 = p.cu_seqlens_q[b + 1], len = p.seq_lens[b];
  const int q_len = q1 - q0;
  bool ok = q0 >= 0 && q1 >= q0 && q1 <= p.total_q && q_len <= p.max_q_len && len >= q_len &&
            len <= p.max_seq_len && static_cast<int64_t>(len) <= static_cast<int64_t>(p.max_blocks) * p.block_size;
  if (b == 0 && q0 != 0) ok = false;
  if (b == p.batch - 1 && q1 != p.total_q) ok = false;
  if (!ok) {
    if (reporter) report(p.error_flag, b);
    return;
  }
  const int rows_b = q_len * p.group;
  const int r_first = tile * kRows;
  if (r_first >= rows_b) return;

  const int lane = static_cast<int>(threadIdx.x) % kLanes;
  const int stream = static_cast<int>(threadIdx.x) / kLanes;
  const int ctx = len - q_len;  // positions before this step's first query row

  // Query rows of the tile, pre-scaled so that q.k is the score in log2 units.
  float qv[kRows][8];
  int row_pos[kRows];
  int last_pos = 0;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r_first + i;
    if (r < rows_b) {
      const int qi = r / p.group, h = g * p.group + r % p.group;
      row_pos[i] = ctx + qi;
      last_pos = row_pos[i];
      load8(static_cast<const T*>(p.q) + (static_cast<int64_t>(q0 + qi) * p.hq + h) * kD + lane * 8,
            qv[i]);
#pragma unroll
      for (int c = 0; c < 8; ++c) qv[i][c] *= p.scale_log2;
    } else {
      row_pos[i] = -1;  // masks every key
#pragma unroll
      for (int c = 0; c < 8; ++c) qv[i][c] = 0.f;
    }
  }

  const int t_begin = split * p.split_tokens;
  const int t_end = min(t_begin + p.split_tokens, last_pos + 1);

  float m[kRows], l[kRows], acc[kRows][8];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[i][c] = 0.f;
  }

  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks;
  const int64_t row_stride = static_cast<int64_t>(p.hkv) * kD;  // elements per cache slot

  for (int base = t_begin; base < t_end; base += kStreams * kUnroll) {
    float kf[kUnroll][8], vf[kUnroll][8];
    int pos[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int t = base + u * kStreams + stream;
      bool valid = t < t_end;
      int64_t slot = 0;
      if (valid) {
        const int blk = table[t / p.block_size];
        if (blk < 0 || blk >= p.num_blocks) {
          if (lane == 0) report(p.error_flag, b);
          valid = false;
        } else {
          slot = static_cast<int64_t>(blk) * p.block_size + t % p.block_size;
        }
      }
      if (valid) {
        const int64_t off = slot * row_stride + static_cast<int64_t>(g) * kD + lane * 8;
        load8(kc + off, kf[u]);
        load8(vc + off, vf[u]);
      } else {
        t = 0x7fffffff;  // beyond every row's causal limit: masked below
#pragma unroll
        for (int c = 0; c < 8; ++c) kf[u][c] = vf[u][c] = 0.f;
      }
      pos[u] = t;
    }
    float s[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        float d = 0.f;
#pragma unroll
        for (int c = 0; c < 8; ++c) d = fmaf(qv[i][c], kf[u][c], d);
#pragma unroll
        for (int o = kLanes / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        s[u][i] = pos[u] <= row_pos[i] ? d : -INFINITY;
      }
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      float mx = s[0][i];
#pragma unroll
      for (int u = 1; u < kUnroll; ++u) mx = fmaxf(mx, s[u][i]);
      const float m_new = fmaxf(m[i], mx);
      if (m_new == -INFINITY) continue;  // nothing visible yet: keep the empty state
      const float alpha = exp2f(m[i] - m_new);  // 0 when m[i] = -inf
      float pu[kUnroll];
      float psum = 0.f;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        pu[u] = exp2f(s[u][i] - m_new);  // 0 for masked keys
        psum += pu[u];
      }
      l[i] = l[i] * alpha + psum;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        float a = acc[i][c] * alpha;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) a = fmaf(pu[u], vf[u][c], a);
        acc[i][c] = a;
      }
      m[i] = m_new;
    }
  }

  // ---- merge the streams of this CTA (fixed order: deterministic).
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
#pragma unroll
    for (int c = 0; c < 8; ++c) sm_acc[stream][i][lane * 8 + c] = acc[i][c];
    if (lane == 0) {
      sm_m[stream][i] = m[i];
      sm_l[stream][i] = l[i];
    }
  }
  __syncthreads();
  if (threadIdx.x < kRows) {
    const int i = static_cast<int>(threadIdx.x);
    float M = -INFINITY;
    for (int st = 0; st < kStreams; ++st) M = fmaxf(M, sm_m[st][i]);
    float L = 0.f;
    for (int st = 0; st < kStreams; ++st) {
      const float w = M == -INFINITY ? 0.f : exp2f(sm_m[st][i] - M);
      sm_w[st][i] = w;
      L += w * sm_l[st][i];
    }
    sm_M[i] = M;
    sm_L[i] = L;
  }
  __syncthreads();
  for (int item = static_cast<int>(threadIdx.x); item < kRows * kD; item += kThreads) {
    const int i = item / kD, c = item % kD;
    const int r = r_first + i;
    if (r >= rows_b) continue;
    float a = 0.f;
    for (int st = 0; st < kStreams; ++st) a = fmaf(sm_w[st][i], sm_acc[st][i][c], a);
    const int qi = r / p.group, h = g * p.group + r % p.group;
    const int64_t orow = static_cast<int64_t>(q0 + qi) * p.hq + h;
    if (p.num_splits == 1) {
      const float L = sm_L[i];
      static_cast<T*>(p.out)[orow * kD + c] = dev::from_f32<T>(L > 0.f ? a / L : 0.f);
    } else {
      const int64_t prow = static_cast<int64_t>(split) * p.total_q * p.hq + orow;
      p.part_acc[prow * kD + c] = a;
      if (c == 0) {
        p.part_ml[2 * prow] = sm_M[i];
        p.part_ml[2 * prow + 1] = sm_L[i];
      }
    }
  }
}

// One CTA per (query row, head): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    paged_attention_combine_kernel(const float* __restrict__ part_acc,
                                   const float* __restrict__ part_ml, int64_t rows, int splits,
                                   int d, T* __restrict__ out) {
  // PDL (decode steps, pdl.cuh): the partials are the attention's output; the successor (the o
  // projection; opd's decode linear streams its weights before its own wait) is released at once.
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int64_t row = blockIdx.x;  // (query row, head) flattened
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, part_ml[2 * (s * rows + row)]);
  float L = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float ms = part_ml[2 * (s * rows + row)];
    if (M != -INFINITY) L += exp2f(ms - M) * part_ml[2 * (s * rows + row) + 1];
  }
  for (int c = static_cast<int>(threadIdx.x); c < d; c += kThreads) {
    float a = 0.f;
    if (M != -INFINITY) {
      for (int s = 0; s < splits; ++s) {
        const float ms = part_ml[2 * (s * rows + row)];
        a = fmaf(exp2f(ms - M), part_acc[(s * rows + row) * d + c], a);
      }
    }
    out[row * d + c] = dev::from_f32<T>(L > 0.f ? a / L : 0.f);
  }
}

// ---- decode-only kernel (every sequence has at most one query row: max_q_len == 1) ----
//
// Built for bandwidth (issue 6): at W1 a decode step reads 3.76 GB of K/V and nothing else of
// that size, so the kernel is a streaming read of each (sequence, kv head)'s K/V rows with the
// arithmetic hidden under it.
//   - CTA = (sequence b, kv head g, tile of up to kRows query heads of g, split s): all query
//     heads of the GQA group share every K/V byte the CTA reads (one read per kv head).
//   - The block ids of the CTA's positions are staged (validated) in shared memory once, so no
//     K/V load waits on a dependent table load (the old kernel paid two latencies per step).
//   - 4 warps; a warp *step* is kLoads 16-byte loads of K and kLoads of V per lane = 4 KiB of
//     K/V per warp (8 tokens at head_dim 128: half a 16-token block). Warps take steps
//     round-robin and double-buffer them in registers: the loads of step n + 4 are issued
//     before step n is computed, so every warp always has one step (4 KiB) in flight; 4 CTAs
//     per SM (<= 128 registers, __launch_bounds__) keep ~64 KiB in flight per SM, above the
//     ~25 KiB that the H200's bandwidth x latency needs.
//   - A token's D-element row is read by D/8 lanes (16 B each, a half warp at D = 128), so a
//     warp-wide load covers 32/(D/8) whole rows: 256 contiguous bytes each, fully coalesced.
//   - f32 scores, online softmax in log2 units, f32 accumulators; the lanes of one token group
//     are one stream, merged in the warp (shuffles), then across warps through shared memory
//     in a fixed order (deterministic).
//   - Launched with PDL, each warp issues its first K/V step before griddepcontrol.wait: every
//     position but this step's token (stored by the predecessor, loaded after the wait) was
//     written by an earlier step, so the first DRAM latency overlaps the predecessor's tail.
//   - Splits only when batch x kv heads would not fill the machine (flash-decoding, Dao et al.
//     2023: FA2's wave-efficiency rule), the partials merged by the combine kernel above.
constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = 32 * kDecodeWarps;
constexpr int kDecodeTable = 1024;  // block ids of one CTA's positions staged in shared memory
constexpr int kDecodeLoads = 4;     // 16-byte K loads (and V loads) per lane per step
constexpr int kMinSplitTokens = 64; // a split's fixed cost (q, table, merge, partials) vs its reads

// Resident CTAs per SM the decode kernel is compiled for (the register cap of
// __launch_bounds__); the split heuristic counts slots with it. f32 (test models) is not tuned.
constexpr int decode_min_blocks(int elem_bytes, int rows) {
  return elem_bytes != 2 ? 1 : rows <= 2 ? 4 : rows == 4 ? 3 : 2;
}

// 16 bytes of K/V, read once per call: the non-coherent path without L1 allocation.
__device__ __forceinline__ uint4 load_stream16(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// 8 elements of T held as kWords 16-byte words -> f32.
template <typename T>
struct Raw8 {
  static constexpr int kWords = 8 * static_cast<int>(sizeof(T)) / 16;  // 1 (bf16) or 2 (f32)
  uint4 w[kWords];
  __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = load_stream16(reinterpret_cast<const uint4*>(p) + i);
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = make_uint4(0u, 0u, 0u, 0u);
  }
  __device__ __forceinline__ void to_f32(float (&f)[8]) const {
    if constexpr (sizeof(T) == 2) {
      // bf16 is the high half of an f32: the element at the lower address is the low 16 bits.
      const unsigned u[4] = {w[0].x, w[0].y, w[0].z, w[0].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(u[i] << 16);
        f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kWords; ++i) {
        f[4 * i] = __uint_as_float(w[i].x);
        f[4 * i + 1] = __uint_as_float(w[i].y);
        f[4 * i + 2] = __uint_as_float(w[i].z);
        f[4 * i + 3] = __uint_as_float(w[i].w);
      }
    }
  }
};

// One warp step's K/V: kDecodeLoads token rows' 8-element slices per lane, and which are real.
template <typename T>
struct DecodeStage {
  Raw8<T> k[kDecodeLoads], v[kDecodeLoads];
  unsigned valid;
};

// grid (batch * tiles_per_seq, hkv, num_splits), kDecodeThreads threads. A CTA owns query
// heads g * group + [tile * kRows, tile * kRows + kRows) of sequence b's (only) query row.
template <typename T, int kD, int kRows>
__global__ void __launch_bounds__(kDecodeThreads, decode_min_blocks(sizeof(T), kRows))
    paged_attention_decode_kernel(Params p) {
  constexpr int kLanes = kD / 8;                       // lanes sharing one token's row
  constexpr int kTokPerLoad = 32 / kLanes;             // rows one warp-wide load covers
  constexpr int kStepTokens = kDecodeLoads * kTokPerLoad;
  static_assert(kD % 8 == 0 && kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0,
                "head_dim / 8 must be a power of two <= 32");

  __shared__ int sm_blk[kDecodeTable];
  __shared__ __align__(16) float sm_acc[kDecodeWarps][kRows][kD];
  __shared__ float sm_m[kDecodeWarps][kRows], sm_l[kDecodeWarps][kRows];

  const int b = static_cast<int>(blockIdx.x) / p.tiles_per_seq;
  const int tile = static_cast<int>(blockIdx.x) % p.tiles_per_seq;
  const int g = static_cast<int>(blockIdx.y), split = static_cast<int>(blockIdx.z);
  const bool reporter = threadIdx.x == 0 && g == 0 && tile == 0 && split == 0;

  // ---- validate this sequence's entries (uniform over the CTA) before using any of them.
  const int q0 = p.cu_seqlens_q[b], q1 = p.cu_seqlens_q[b + 1], len = p.seq_lens[b];
  const int q_len = q1 - q0;
  bool ok = q0 >= 0 && q1 >= q0 && q1 <= p.total_q && q_len <= p.max_q_len && len >= q_len &&
            len <= p.max_seq_len &&
            static_cast<int64_t>(len) <= static_cast<int64_t>(p.max_blocks) * p.block_size;
  if (b == 0 && q0 != 0) ok = false;
  if (b == p.batch - 1 && q1 != p.total_q) ok = false;
  if (!ok) {
    if (reporter) report(p.error_flag, b);
    dev::pdl_wait();  // every thread waits (pdl.cuh: a grid never completes before its predecessor)
    return;
  }
  const int rows_b = q_len * p.group;  // 0 (no query row) or the group
  const int r_first = tile * kRows;
  if (r_first >= rows_b) {  // uniform over the CTA: before any __syncthreads
    dev::pdl_wait();
    return;
  }

  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % kLanes;          // 8-element slice of a row
  const int sub = (static_cast<int>(threadIdx.x) % 32) / kLanes;    // row within a warp load

  // Positions [t0, t1) of this split; the query row (position len - 1) sees all of [0, len).
  const int t0 = split * p.split_tokens;
  int t1 = min(t0 + p.split_tokens, len);
  int blk0 = 0, n_blk = 0;
  if (t1 > t0) {
    blk0 = t0 / p.block_size;
    n_blk = (t1 - 1) / p.block_size - blk0 + 1;  // < max_blocks - blk0: len was checked above
  }
  if (n_blk > kDecodeTable) {  // the launch never does this (splits are sized for the table)
    if (reporter) report(p.error_flag, b);
    n_blk = 0;
    t1 = t0;
  }
  // ---- stage the split's block ids; a bad one becomes -1 (its tokens are skipped) and is
  // reported. With a PDL launch this overlaps the predecessor kernel.
  {
    const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks + blk0;
    for (int i = static_cast<int>(threadIdx.x); i < n_blk; i += kDecodeThreads) {
      int id = table[i];
      if (id < 0 || id >= p.num_blocks) {
        report(p.error_flag, b);
        id = -1;
      }
      sm_blk[i] = id;
    }
  }

  // Position len - 1 holds this step's token, whose K/V the predecessor (qkv_norm_rope_store or
  // kv_cache_store) makes: t_last when this split holds it, else -1.
  const int t_last = len - 1 >= t0 && len - 1 < t1 ? len - 1 : -1;
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  const int64_t row_stride = static_cast<int64_t>(p.hkv) * kD;  // elements per cache slot
  const int64_t head_off = static_cast<int64_t>(g) * kD + lane * 8;
  const int n_steps = t1 > t0 ? (t1 - t0 + kStepTokens - 1) / kStepTokens : 0;

  // K and V of position t (block bi, cache block id) into slot j of a stage.
  auto load_token = [&](DecodeStage<T>& st, int j, int id, int t, int bi) {
    const int64_t off =
        (static_cast<int64_t>(id) * p.block_size + (t - bi * p.block_size)) * row_stride +
        head_off;
    st.k[j].load(kc + off);
    st.v[j].load(vc + off);
    st.valid |= 1u << j;
  };
  // Issue the loads of warp step `step` (nothing for a step past the end or a masked token).
  // defer_last (before the PDL wait): position t_last, whose K/V this step makes, is left out
  // (masked) for patch_last below to fill after the wait.
  auto load_stage = [&](DecodeStage<T>& st, int step, bool defer_last) {
    st.valid = 0u;
#pragma unroll
    for (int j = 0; j < kDecodeLoads; ++j) {
      const int t = t0 + step * kStepTokens + j * kTokPerLoad + sub;
      // Block and slot of position t: a shift for power-of-two block sizes (no integer
      // division in the load path), a division otherwise.
      const int bi = p.bs_shift >= 0 ? t >> p.bs_shift : t / p.block_size;
      int id = -1;
      if (step < n_steps && t < t1 && !(defer_last && t == t_last)) id = sm_blk[bi - blk0];
      if (id >= 0) {
        load_token(st, j, id, t, bi);
      } else {
        st.k[j].zero();  // V must be finite: p = 0 times it is added below
        st.v[j].zero();
      }
    }
  };
  // The deferred position of a stage loaded before the wait, from the cache after it (the
  // predecessor stored it), as load_stage would have loaded it.
  auto patch_last = [&](DecodeStage<T>& st, int step) {
    if (t_last < 0 || step >= n_steps) return;
#pragma unroll
    for (int j = 0; j < kDecodeLoads; ++j) {
      const int t = t0 + step * kStepTokens + j * kTokPerLoad + sub;
      if (t != t_last) continue;
      const int bi = p.bs_shift >= 0 ? t >> p.bs_shift : t / p.block_size;
      const int id = sm_blk[bi - blk0];
      if (id >= 0) load_token(st, j, id, t, bi);
    }
  };

  // The warp's first K/V step is issued before the wait: every position but t_last was stored
  // by an earlier step (no kernel of this step writes it), so its DRAM latency overlaps the
  // predecessor's tail, the wait and the q work below.
  __syncthreads();  // the block ids staged
  DecodeStage<T> sa, sb;
  int step = warp;
  load_stage(sa, step, true);

  // PDL (kernels/cuda/pdl.cuh): everything above reads only the step's uploaded indices and
  // K/V of earlier steps; q and the K/V this step stores come from the predecessor
  // (qkv_norm_rope_store): wait for it here.
  dev::pdl_wait();

  // Query heads of the tile, pre-scaled so that q.k is the score in log2 units. Heads beyond
  // the group (a partial tile) compute on zeros and are never written.
  float qv[kRows][8];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r_first + i;
    if (r < rows_b) {
      const int h = g * p.group + r;
      load8(static_cast<const T*>(p.q) + (static_cast<int64_t>(q0) * p.hq + h) * kD + lane * 8, qv[i]);
#pragma unroll
      for (int c = 0; c < 8; ++c) qv[i][c] *= p.scale_log2;
    } else {
#pragma unroll
      for (int c = 0; c < 8; ++c) qv[i][c] = 0.f;
    }
  }
  __syncthreads();

  float m[kRows], l[kRows], acc[kRows][8];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[i][c] = 0.f;
  }

  // Scores of the step's rows, then the online-softmax update of the stream (the kLanes lanes
  // that share a row hold the same scores after the reduction, so every lane of a stream
  // updates identically). All 32 lanes run every shuffle: the trip counts are CTA-uniform.
  auto compute_stage = [&](const DecodeStage<T>& st) {
    float s[kDecodeLoads][kRows];
#pragma unroll
    for (int j = 0; j < kDecodeLoads; ++j) {
      float kf[8];
      st.k[j].to_f32(kf);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        float d = 0.f;
#pragma unroll
        for (int c = 0; c < 8; ++c) d = fmaf(qv[i][c], kf[c], d);
#pragma unroll
        for (int o = kLanes / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        s[j][i] = (st.valid >> j) & 1u ? d : -INFINITY;
      }
    }
    float pr[kDecodeLoads][kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      float mx = s[0][i];
#pragma unroll
      for (int j = 1; j < kDecodeLoads; ++j) mx = fmaxf(mx, s[j][i]);
      const float m_new = fmaxf(m[i], mx);
      const bool none = m_new == -INFINITY;  // nothing visible yet: keep the empty state
      const float alpha = none ? 1.f : exp2f(m[i] - m_new);  // 0 when m[i] = -inf
      float psum = 0.f;
#pragma unroll
      for (int j = 0; j < kDecodeLoads; ++j) {
        pr[j][i] = none ? 0.f : exp2f(s[j][i] - m_new);  // 0 for masked rows
        psum += pr[j][i];
      }
      l[i] = l[i] * alpha + psum;
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[i][c] *= alpha;
      m[i] = none ? m[i] : m_new;
    }
#pragma unroll
    for (int j = 0; j < kDecodeLoads; ++j) {
      float vf[8];
      st.v[j].to_f32(vf);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[i][c] = fmaf(pr[j][i], vf[c], acc[i][c]);
      }
    }
  };

  // ---- stream: warp w computes steps w, w + 4, w + 8, ...; the next one is always loading.
  patch_last(sa, step);
  while (step < n_steps) {
    load_stage(sb, step + kDecodeWarps, false);
    compute_stage(sa);
    step += kDecodeWarps;
    if (step >= n_steps) break;
    load_stage(sa, step + kDecodeWarps, false);
    compute_stage(sb);
    step += kDecodeWarps;
  }
  // Every K/V load of this CTA is done: the successor (the combine, or the o projection) may
  // start its prologue (no memory ordering: it waits for this grid to complete).
  dev::pdl_launch_dependents();

  // ---- merge the warp's streams (lanes sub and sub ^ 1, ... hold the same slice of other
  // rows): butterfly over the row bits of the lane index, fixed order.
#pragma unroll
  for (int o = kLanes; o < 32; o <<= 1) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[i], o);
      const float lo = __shfl_xor_sync(0xffffffffu, l[i], o);
      const float M = fmaxf(m[i], mo);
      const float wa = M == -INFINITY ? 0.f : exp2f(m[i] - M);
      const float wb = M == -INFINITY ? 0.f : exp2f(mo - M);
      l[i] = l[i] * wa + lo * wb;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const float ao = __shfl_xor_sync(0xffffffffu, acc[i][c], o);
        acc[i][c] = acc[i][c] * wa + ao * wb;
      }
      m[i] = M;
    }
  }
  if (sub == 0) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      float4* dst = reinterpret_cast<float4*>(&sm_acc[warp][i][lane * 8]);
      dst[0] = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      dst[1] = make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
      if (lane == 0) {
        sm_m[warp][i] = m[i];
        sm_l[warp][i] = l[i];
      }
    }
  }
  __syncthreads();

  // ---- merge the warps (fixed order) and write the output or this split's partial.
  for (int item = static_cast<int>(threadIdx.x); item < kRows * kD; item += kDecodeThreads) {
    const int i = item / kD, c = item % kD;
    const int r = r_first + i;
    if (r >= rows_b) continue;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) M = fmaxf(M, sm_m[w][i]);
    float L = 0.f, a = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float wt = exp2f(sm_m[w][i] - M);
        L = fmaf(wt, sm_l[w][i], L);
        a = fmaf(wt, sm_acc[w][i][c], a);
      }
    }
    const int64_t orow = static_cast<int64_t>(q0) * p.hq + g * p.group + r;
    if (p.num_splits == 1) {
      static_cast<T*>(p.out)[orow * kD + c] = dev::from_f32<T>(L > 0.f ? a / L : 0.f);
    } else {
      const int64_t prow = static_cast<int64_t>(split) * p.total_q * p.hq + orow;
      p.part_acc[prow * kD + c] = a;
      if (c == 0) {
        p.part_ml[2 * prow] = M;
        p.part_ml[2 * prow + 1] = L;
      }
    }
  }
}

// kv_cache_store: thread per W-element chunk of a [hkv * d] row (W = 16 bytes when aligned).
template <typename T, int W>
__global__ void kv_cache_store_kernel(const T* __restrict__ k, const T* __restrict__ v,
                                      const int32_t* __restrict__ slots, int64_t n,
                                      int64_t num_slots, int64_t row_elems, T* __restrict__ kc,
                                      T* __restrict__ vc, unsigned* flag) {
  const int64_t chunks = row_elems / W, total = n * chunks;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / chunks, c = (i % chunks) * W;
    const int32_t s = slots[t];
    if (s < 0 || s >= num_slots) {
      if (c == 0) report(flag, static_cast<int>(t));
      continue;
    }
    const int64_t src = t * row_elems + c, dst = static_cast<int64_t>(s) * row_elems + c;
    if constexpr (W * sizeof(T) == 16) {
      *reinterpret_cast<uint4*>(kc + dst) = __ldg(reinterpret_cast<const uint4*>(k + src));
      *reinterpret_cast<uint4*>(vc + dst) = __ldg(reinterpret_cast<const uint4*>(v + src));
    } else {
#pragma unroll
      for (int e = 0; e < W; ++e) {
        kc[dst + e] = k[src + e];
        vc[dst + e] = v[src + e];
      }
    }
  }
}

template <typename T>
void launch_store(const PagedStoreArgs& a, cudaStream_t stream) {
  const int64_t row = a.hkv * a.head_dim;
  constexpr int kW = 16 / sizeof(T);
  const bool vec = row % kW == 0 && dev::aligned16(a.k) && dev::aligned16(a.v) &&
                   dev::aligned16(a.k_cache) && dev::aligned16(a.v_cache);
  const int64_t total = a.n * (vec ? row / kW : row);
  const unsigned grid = grid_for(total, 256);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  T* kc = static_cast<T*>(a.k_cache);
  T* vc = static_cast<T*>(a.v_cache);
  const int64_t num_slots = a.num_blocks * a.block_size;
  if (vec) {
    kv_cache_store_kernel<T, kW><<<grid, 256, 0, stream>>>(k, v, a.slot_mapping, a.n, num_slots,
                                                           row, kc, vc, a.error_flag);
  } else {
    kv_cache_store_kernel<T, 1><<<grid, 256, 0, stream>>>(k, v, a.slot_mapping, a.n, num_slots,
                                                          row, kc, vc, a.error_flag);
  }
  check_launch("kv_cache_store_kernel");
}

template <typename T, int kD, int kRows>
void launch_rows(const Params& p, dim3 grid, cudaStream_t stream) {
  paged_attention_kernel<T, kD, kRows><<<grid, kThreads, 0, stream>>>(p);
  check_launch("paged_attention_kernel");
}

template <typename T, int kD>
void launch_d(const Params& p, int rows, dim3 grid, cudaStream_t stream) {
  switch (rows) {
    case 1: launch_rows<T, kD, 1>(p, grid, stream); break;
    case 2: launch_rows<T, kD, 2>(p, grid, stream); break;
    case 4: launch_rows<T, kD, 4>(p, grid, stream); break;
    default: launch_rows<T, kD, 8>(p, grid, stream); break;
  }
}

template <typename T>
void launch_attention(const Params& p, int d, int rows, dim3 grid, cudaStream_t stream) {
  switch (d) {
    // 8 and 16: the small test models (fixtures); one token row is read by 1-2 lanes.
    case 8: launch_d<T, 8>(p, rows, grid, stream); break;
    case 16: launch_d<T, 16>(p, rows, grid, stream); break;
    case 32: launch_d<T, 32>(p, rows, grid, stream); break;
    case 64: launch_d<T, 64>(p, rows, grid, stream); break;
    case 128: launch_d<T, 128>(p, rows, grid, stream); break;
    case 256: launch_d<T, 256>(p, rows, grid, stream); break;
    default: OPD_FAIL(Unsupported, "paged_attention on CUDA: head_dim ", d, " (8, 16, 32, 64, 128 or 256)");
  }
}

template <typename T, int kD, int kRows>
void launch_decode_rows(const Params& p, dim3 grid, cudaStream_t stream, bool pdl) {
  launch_kernel("paged_attention_decode_kernel", paged_attention_decode_kernel<T, kD, kRows>, grid,
                dim3(kDecodeThreads), 0, stream, pdl, p);
}

template <typename T, int kD>
void launch_decode_d(const Params& p, int rows, dim3 grid, cudaStream_t stream, bool pdl) {
  switch (rows) {
    case 1: launch_decode_rows<T, kD, 1>(p, grid, stream, pdl); break;
    case 2: launch_decode_rows<T, kD, 2>(p, grid, stream, pdl); break;
    case 4: launch_decode_rows<T, kD, 4>(p, grid, stream, pdl); break;
    default: launch_decode_rows<T, kD, 8>(p, grid, stream, pdl); break;
  }
}

template <typename T>
void launch_decode(const Params& p, int d, int rows, dim3 grid, cudaStream_t stream, bool pdl) {
  switch (d) {
    case 8: launch_decode_d<T, 8>(p, rows, grid, stream, pdl); break;
    case 16: launch_decode_d<T, 16>(p, rows, grid, stream, pdl); break;
    case 32: launch_decode_d<T, 32>(p, rows, grid, stream, pdl); break;
    case 64: launch_decode_d<T, 64>(p, rows, grid, stream, pdl); break;
    case 128: launch_decode_d<T, 128>(p, rows, grid, stream, pdl); break;
    case 256: launch_decode_d<T, 256>(p, rows, grid, stream, pdl); break;
    default: OPD_FAIL(Unsupported, "paged_attention on CUDA: head_dim ", d, " (8, 16, 32, 64, 128 or 256)");
  }
}

// Query heads per decode CTA: the whole GQA group rounded up to a power of two (<= 8), so
// each K/V byte is read once per kv head for groups up to 8 (W1: group 2, one tile).
int decode_rows_per_cta(int64_t group) { return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8; }

// Splits for the decode kernel: one unless batch x kv heads x tiles leaves the machine's CTA
// slots (SMs x resident CTAs) under-filled; then the count with the best wave efficiency
// (CTAs / slots over its ceiling; the smallest count within 85% of the best, as FA2's
// num_splits_heuristic), with at least kMinSplitTokens positions per split.
int64_t decode_splits(int64_t ctas, int64_t slots, int64_t max_len) {
  if (ctas >= slots * 8 / 10) return 1;
  const int64_t max_splits = std::max<int64_t>(1, std::min<int64_t>(
      128, (max_len + kMinSplitTokens - 1) / kMinSplitTokens));
  auto efficiency = [&](int64_t s) {
    const double waves = static_cast<double>(ctas * s) / static_cast<double>(slots);
    return waves / std::ceil(waves);
  };
  double best = 0;
  for (int64_t s = 1; s <= max_splits; ++s) best = std::max(best, efficiency(s));
  for (int64_t s = 1; s <= max_splits; ++s)
    if (efficiency(s) >= 0.85 * best) return s;
  return 1;
}

}  // namespace

bool paged_attention_supports(DType dtype, int64_t head_dim) {
  return (dtype == DType::BF16 || dtype == DType::F32) &&
         (head_dim == 8 || head_dim == 16 || head_dim == 32 || head_dim == 64 ||
          head_dim == 128 || head_dim == 256);
}

PagedAttentionLaunch paged_attention_launch(const PagedAttentionArgs& a) {
  PagedAttentionLaunch l;
  const int64_t group = a.hkv > 0 ? a.hq / a.hkv : 1;
  if (a.max_q_len <= 1) {  // decode: paged_attention_decode_kernel
    l.decode = true;
    l.rows_per_cta = decode_rows_per_cta(group);
    l.tiles_per_seq = static_cast<int>((group + l.rows_per_cta - 1) / l.rows_per_cta);
    const int64_t ctas = std::max<int64_t>(1, a.batch * l.tiles_per_seq * a.hkv);
    const int64_t slots = static_cast<int64_t>(a.sm_count > 0 ? a.sm_count : sm_count()) *
                          decode_min_blocks(static_cast<int>(dtype_size(a.dtype)), l.rows_per_cta);
    const int64_t max_len = std::max<int64_t>(1, a.max_seq_len);
    // A split of n positions spans at most (n - 1) / block_size + 2 blocks, which must fit the
    // kDecodeTable ids staged in shared memory: n <= (kDecodeTable - 1) x block_size.
    const int64_t max_split_tokens = (kDecodeTable - 1) * std::max<int64_t>(1, a.block_size);
    const int64_t min_splits = (max_len + max_split_tokens - 1) / max_split_tokens;
    int64_t splits = a.force_splits > 0 ? a.force_splits : decode_splits(ctas, slots, max_len);
    splits = std::max(splits, min_splits);
    splits = std::max<int64_t>(1, std::min<int64_t>(splits, max_len));
    l.split_tokens = static_cast<int>((max_len + splits - 1) / splits);
    l.num_splits = static_cast<int>((max_len + l.split_tokens - 1) / l.split_tokens);
    l.workspace_bytes = l.num_splits > 1
                            ? static_cast<size_t>(l.num_splits) * a.total_q * a.hq *
                                  (a.head_dim + 2) * sizeof(float)
                            : 0;
    return l;
  }
  const int64_t rows = std::max<int64_t>(1, a.max_q_len * group);
  l.rows_per_cta = rows >= 8 ? 8 : rows >= 4 ? 4 : rows >= 2 ? 2 : 1;
  l.tiles_per_seq = static_cast<int>((rows + l.rows_per_cta - 1) / l.rows_per_cta);
  const int64_t ctas = std::max<int64_t>(1, a.batch * l.tiles_per_seq * a.hkv);
  // Split the positions until the grid holds ~2 waves of 8 CTAs per SM, but never below 64
  // positions per split (a split's fixed cost: q loads, the in-CTA merge, the combine).
  const int64_t target = 16LL * (a.sm_count > 0 ? a.sm_count : sm_count());
  const int64_t max_len = std::max<int64_t>(1, a.max_seq_len);
  int64_t splits = (target + ctas - 1) / ctas;
  splits = std::min<int64_t>(splits, (max_len + 63) / 64);
  if (a.force_splits > 0) splits = a.force_splits;
  splits = std::max<int64_t>(1, std::min<int64_t>(splits, max_len));
  l.split_tokens = static_cast<int>((max_len + splits - 1) / splits);
  l.num_splits = static_cast<int>((max_len + l.split_tokens - 1) / l.split_tokens);
  l.workspace_bytes = l.num_splits > 1
                          ? static_cast<size_t>(l.num_splits) * a.total_q * a.hq *
                                (a.head_dim + 2) * sizeof(float)
                          : 0;
  return l;
}

void paged_attention(const PagedAttentionArgs& a, void* workspace, cudaStream_t stream) {
  OPD_CHECK(paged_attention_supports(a.dtype, a.head_dim), Unsupported,
            "paged_attention on CUDA: dtype ", dtype_name(a.dtype), " head_dim ", a.head_dim,
            " (bf16 or f32, head_dim 8/16/32/64/128/256)");
  OPD_CHECK(a.hkv >= 1 && a.hq % a.hkv == 0, InvalidArgument, "paged_attention: query heads ",
            a.hq, " must be a multiple of kv heads ", a.hkv);
  OPD_CHECK(a.total_q < (int64_t{1} << 31) / std::max<int64_t>(1, a.hq) &&
                a.num_blocks * a.block_size < (int64_t{1} << 31) && a.max_seq_len < (1 << 30),
            Unsupported, "paged_attention on CUDA: sizes exceed the kernels' int32 indices");
  OPD_CHECK(dev::aligned16(a.q) && dev::aligned16(a.k_cache) && dev::aligned16(a.v_cache),
            Unsupported, "paged_attention on CUDA: q and the caches must be 16-byte aligned");
  if (a.batch == 0 || a.total_q == 0) return;
  const PagedAttentionLaunch l = paged_attention_launch(a);
  OPD_CHECK(l.num_splits == 1 || workspace != nullptr, InvalidArgument,
            "paged_attention: ", l.num_splits, " splits need a workspace of ", l.workspace_bytes,
            " bytes");
  Params p{};
  p.q = a.q;
  p.k_cache = a.k_cache;
  p.v_cache = a.v_cache;
  p.out = a.out;
  p.cu_seqlens_q = a.cu_seqlens_q;
  p.seq_lens = a.seq_lens;
  p.block_tables = a.block_tables;
  p.part_acc = static_cast<float*>(workspace);
  p.part_ml = p.part_acc + static_cast<int64_t>(l.num_splits) * a.total_q * a.hq * a.head_dim;
  p.error_flag = a.error_flag;
  p.batch = static_cast<int>(a.batch);
  p.total_q = static_cast<int>(a.total_q);
  p.hq = static_cast<int>(a.hq);
  p.hkv = static_cast<int>(a.hkv);
  p.group = static_cast<int>(a.hq / a.hkv);
  p.num_blocks = static_cast<int>(a.num_blocks);
  p.block_size = static_cast<int>(a.block_size);
  p.max_blocks = static_cast<int>(a.max_blocks);
  p.max_q_len = static_cast<int>(a.max_q_len);
  p.max_seq_len = static_cast<int>(a.max_seq_len);
  p.tiles_per_seq = l.tiles_per_seq;
  p.num_splits = l.num_splits;
  p.split_tokens = l.split_tokens;
  p.bs_shift = -1;
  for (int sh = 0; sh < 31; ++sh)
    if ((int64_t{1} << sh) == a.block_size) p.bs_shift = sh;
  p.scale_log2 = static_cast<float>(a.scale) * kLog2e;
  OPD_CHECK(a.batch * l.tiles_per_seq < (int64_t{1} << 31) && a.hkv <= 65535 &&
                l.num_splits <= 65535,
            Unsupported, "paged_attention on CUDA: grid too large");
  const dim3 grid(static_cast<unsigned>(a.batch * l.tiles_per_seq), static_cast<unsigned>(a.hkv),
                  static_cast<unsigned>(l.num_splits));
  const int d = static_cast<int>(a.head_dim);
  if (l.decode) {
    // The general kernel below has no pdl_wait: only the decode kernel may be launched early.
    if (a.dtype == DType::BF16) {
      launch_decode<bf16>(p, d, l.rows_per_cta, grid, stream, a.pdl);
    } else {
      launch_decode<float>(p, d, l.rows_per_cta, grid, stream, a.pdl);
    }
  } else if (a.dtype == DType::BF16) {
    launch_attention<bf16>(p, d, l.rows_per_cta, grid, stream);
  } else {
    launch_attention<float>(p, d, l.rows_per_cta, grid, stream);
  }
  if (l.num_splits > 1 && !a.skip_combine) {
    const int64_t rows = a.total_q * a.hq;
    // PDL only behind the decode kernel (the general kernel is never launched early).
    const bool pdl = a.pdl && l.decode;
    const unsigned grid_rows = static_cast<unsigned>(rows);
    if (a.dtype == DType::BF16) {
      launch_kernel("paged_attention_combine_kernel", paged_attention_combine_kernel<bf16>,
                    dim3(grid_rows), dim3(kThreads), 0, stream, pdl,
                    static_cast<const float*>(p.part_acc), static_cast<const float*>(p.part_ml),
                    rows, l.num_splits, d, static_cast<bf16*>(a.out));
    } else {
      launch_kernel("paged_attention_combine_kernel", paged_attention_combine_kernel<float>,
                    dim3(grid_rows), dim3(kThreads), 0, stream, pdl,
                    static_cast<const float*>(p.part_acc), static_cast<const float*>(p.part_ml),
                    rows, l.num_splits, d, static_cast<float*>(a.out));
    }
  }
}

void kv_cache_store(const PagedStoreArgs& a, cudaStream_t stream) {
  OPD_CHECK(a.dtype == DType::BF16 || a.dtype == DType::F32, Unsupported,
            "kv_cache_store on CUDA: dtype ", dtype_name(a.dtype), " (bf16 or f32)");
  if (a.n == 0 || a.hkv * a.head_dim == 0) return;
  if (a.dtype == DType::BF16) {
    launch_store<bf16>(a, stream);
  } else {
    launch_store<float>(a, stream);
  }
}

}  // namespace opd::cuda
