// CUDA fused lm_head + distillation loss (fused_loss_cuda.h; the CUDA contract of fused_loss.h):
// loss = (1 / n_total) * sum_r weight_r * (D_r + sft_alpha [sft_r] CE_r), D_r the generalized
// JSD(beta) of the support mode at temperature T, computed from blocks Z = H_c W_t^T of
// [row_chunk, vocab_tile] logits (cuBLAS, fp32 accumulation) reduced on the fly, with the
// per-row math of loss/divergence.h (the same __host__ __device__ functions as the CPU).
//
// Passes (tile path: every mode except `topk` without SFT):
//   prepare   per row: used = weight != 0 && valid; checks (finite weight, target in [0, V),
//             sft flag in {0, 1}, teacher ids of used rows in [0, V) or kEmptySlot) recorded in
//             an error record that the host reads before anything else runs
//   A         for each tile t, chunk c: GEMM Z = H_c W_t^T (full: and the teacher's T);
//             row kernel: online (max, sum exp) of z/T (of z for SFT rows when T != 1; of t/T),
//             merged into per-row f64 statistics; the logits at the K ids and at the target are
//             read out of the tile that holds them (so they are the very values the LSE saw, and
//             an id outside [0, V) matches no tile: it is never read)
//   B (full)  recompute both tiles; D_r += sum_v d_v, G_r += sum_v g_v (f64, block reductions)
//   rows      one thread per row: the divergence.h row functions -> D_r, dense coefficients
//             (on softmax(z/T) and softmax(z)) and sparse coefficients at the K ids and y
//   sums      one block, fixed order: loss sums (deterministic)
//   C         for each tile t, chunk c: recompute Z; row kernel writes dZ = dense * softmax + full
//             term, plus the sparse coefficients of the ids inside the tile (staged in shared
//             memory, so each element is rounded once); GEMMs dH_c += dZ W_t (beta = 0 on the
//             first tile: no memset) and dW_t += dZ^T H_c
// `topk` without SFT touches no tile (both distributions live on the K ids): warp-per-(row, id)
// dot products, the row functions, then dH_r = sum_k c_k W_{i_k} by rows and dW_{i_k} += c_k h_r
// with fp32 atomicAdd (the one non-deterministic path).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>

#include "core/cuda/stream.h"
#include "loss/divergence.h"
#include "loss/fused_loss_cuda.h"

namespace opd::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kRowThreads = 256;   // one block per logit row in the row kernels
constexpr int64_t kAlign = 256;    // byte alignment of each scratch region
constexpr int64_t kLdMultiple = 16;  // tile row stride multiple: 16-byte rows, tensor-op ld

// Per-row statistics columns ([N, kCudaRowStatCols] f64). kLse*/kSum* hold the online
// (max, sum) during pass A; the finalize kernel turns kLse* into log-sum-exps; the row kernel
// then overwrites kSumT / kSum1 with the dense coefficients (as the CPU version does).
enum RowCol : int {
  kLseT = 0,      // max of z/T, then LSE(z/T)
  kSumT = 1,      // sum exp, then dense coefficient on softmax(z/T) (scaled by weight/n_total/T)
  kLse1 = 2,      // max of z, then LSE(z) (SFT rows)
  kSum1 = 3,      // sum exp, then dense coefficient on softmax(z)
  kLseTeach = 4,  // full: max of t/T, then LSE(t/T)
  kSumTeach = 5,  // full: sum exp
  kDiv = 6,       // D_r (full: accumulated in pass B)
  kAux = 7,       // full: G_r = sum_v g_v (pass B); then CE_r
  kKl = 8,        // sampled: log q(y) - log p(y)
  kClamped = 9,   // topk+tail: 1 if the student tail hit the floor
};
static_assert(kCudaRowStatCols == 10, "row stat columns");

// Row flags.
constexpr int kUsed = 1;
constexpr int kSft = 2;

// Error kinds of ErrorRecord::first (row * 4 + kind): the CPU's check order within a row.
constexpr unsigned long long kErrWeight = 0, kErrTarget = 1, kErrSft = 2;
constexpr unsigned long long kNoError = ~0ull;

struct ErrorRecord {
  unsigned long long first;      // smallest row * 4 + kind of a failed per-row check
  unsigned long long bad_ids;    // teacher ids of used rows outside [0, V) and not kEmptySlot
};

// Result sums written by the sums kernel.
enum SumCol : int { kSumDiv = 0, kSumCe = 1, kSumKl = 2, kSumUsed = 3, kSumClamped = 4, kSumCols = 5 };

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

int to_int(int64_t v, const char* what) {
  OPD_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), Unsupported, "fused loss (CUDA): ",
            what, " = ", v, " exceeds the 32-bit range of cuBLAS");
  return static_cast<int>(v);
}

// ---- device helpers -----------------------------------------------------------------------

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16_rn(x); }

// f32 or f64 array element as double (weights, teacher logprobs).
__device__ __forceinline__ double load_real(const void* p, bool f64, int64_t i) {
  return f64 ? static_cast<const double*>(p)[i] : static_cast<double>(static_cast<const float*>(p)[i]);
}

// 16 bytes of a row as floats: 4 f32 or 8 bf16 (rows are 16-byte aligned: ld % 16 == 0).
template <typename T> struct Vec;
template <> struct Vec<float> {
  static constexpr int n = 4;
  __device__ __forceinline__ static void load(const float* row, int64_t q, float* out) {
    const float4 v = reinterpret_cast<const float4*>(row)[q];
    out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
  }
  __device__ __forceinline__ static void store(float* row, int64_t q, const float* in) {
    reinterpret_cast<float4*>(row)[q] = make_float4(in[0], in[1], in[2], in[3]);
  }
};
template <> struct Vec<bf16> {
  static constexpr int n = 8;
  __device__ __forceinline__ static void load(const bf16* row, int64_t q, float* out) {
    const uint4 v = reinterpret_cast<const uint4*>(row)[q];
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(h[e]);
      out[2 * e] = f.x;
      out[2 * e + 1] = f.y;
    }
  }
  __device__ __forceinline__ static void store(bf16* row, int64_t q, const float* in) {
    uint4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int e = 0; e < 4; ++e) h[e] = __floats2bfloat162_rn(in[2 * e], in[2 * e + 1]);
    reinterpret_cast<uint4*>(row)[q] = v;
  }
};

// Calls f(i, z_i, t_i) for i in [0, tw) over the block: 16-byte loads, then the scalar rest.
// `trow` may be null (then t_i = 0).
template <typename TZ, typename F>
__device__ __forceinline__ void for_each_in_row(const TZ* zrow, const TZ* trow, int64_t tw, F f) {
  constexpr int n = Vec<TZ>::n;
  const int64_t nvec = tw / n;
  for (int64_t q = threadIdx.x; q < nvec; q += blockDim.x) {
    float x[n], t[n];
    Vec<TZ>::load(zrow, q, x);
    if (trow) {
      Vec<TZ>::load(trow, q, t);
    } else {
#pragma unroll
      for (int e = 0; e < n; ++e) t[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < n; ++e) f(q * n + e, x[e], t[e]);
  }
  for (int64_t i = nvec * n + threadIdx.x; i < tw; i += blockDim.x)
    f(i, to_f(zrow[i]), trow ? to_f(trow[i]) : 0.f);
}

// Online log-sum-exp state in f32 within a tile (merged into f64 per-row state per tile).
struct Lse32 {
  float m = -INFINITY;
  float s = 0.f;
  __device__ __forceinline__ void add(float x) {
    if (x > m) {
      s = s * expf(m - x) + 1.f;  // m = -inf: 0 * 0 + 1
      m = x;
    } else {
      s += expf(x - m);
    }
  }
  __device__ __forceinline__ void merge(float m2, float s2) {
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) {
      m = m2;
      s = s2;
    } else if (m2 > m) {
      s = s * expf(m - m2) + s2;
      m = m2;
    } else {
      s += s2 * expf(m2 - m);
    }
  }
};

// Block-wide f64 sum (fixed order), valid in thread 0. `shm` holds `warps` doubles.
__device__ double block_sum(double v, double* shm) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) shm[warp] = v;
  __syncthreads();
  double r = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < warps; ++w) r += shm[w];
  __syncthreads();
  return r;
}

// ---- kernels ----------------------------------------------------------------------------

struct RowInputs {
  int64_t n, k, vocab;
  const void* weights;
  bool weights_f64;
  const int32_t* valid;     // null in full mode
  const int32_t* targets;
  const int32_t* sft_rows;  // null unless sft_alpha > 0
  const int32_t* ids;       // [n, k]; null when k == 0
};

// Per-row checks and flags (the CPU's check_args order: weight, then target and sft flag of a
// used row; then the teacher ids the gather would see). Also initializes the row statistics.
__global__ void prepare_rows_kernel(RowInputs in, int* flags, double* stats, ErrorRecord* err) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= in.n) return;
  double* st = stats + r * kCudaRowStatCols;
  st[kLseT] = -INFINITY;
  st[kSumT] = 0;
  st[kLse1] = -INFINITY;
  st[kSum1] = 0;
  st[kLseTeach] = -INFINITY;
  st[kSumTeach] = 0;
  st[kDiv] = st[kAux] = st[kKl] = st[kClamped] = 0;
  flags[r] = 0;
  const double w = load_real(in.weights, in.weights_f64, r);
  const unsigned long long row = static_cast<unsigned long long>(r);
  if (!isfinite(w)) {
    atomicMin(&err->first, row * 4 + kErrWeight);
    return;
  }
  const bool used = w != 0.0 && (in.valid == nullptr || in.valid[r] != 0);
  if (!used) return;
  const int32_t y = in.targets[r];
  if (y < 0 || y >= in.vocab) {
    atomicMin(&err->first, row * 4 + kErrTarget);
    return;
  }
  int f = kUsed;
  if (in.sft_rows) {
    const int32_t s = in.sft_rows[r];
    if (s != 0 && s != 1) {
      atomicMin(&err->first, row * 4 + kErrSft);
      return;
    }
    if (s) f |= kSft;
  }
  unsigned long long bad = 0;
  for (int64_t j = 0; j < in.k; ++j) {
    const int32_t id = in.ids[r * in.k + j];
    if (id == kEmptySlot) continue;
    if (id < 0 || id >= in.vocab) ++bad;
  }
  if (bad) atomicAdd(&err->bad_ids, bad);
  flags[r] = f;
}

struct TileParams {
  int64_t row0;    // first row of the chunk
  int64_t v0, tw;  // tile columns [v0, v0 + tw)
  int64_t ldz;     // row stride of the logit tile buffers (elements)
  int64_t k;
  float inv_t;
  bool separate_lse1;  // T != 1: SFT rows need LSE(z) besides LSE(z/T)
};

// Pass A row kernel: online LSEs of this tile merged into the row statistics, and the logits at
// the row's K ids and target that fall inside the tile. A warp per chunk row (kLseRowsPerBlock
// rows per block): each lane loads kLseUnroll 16-byte vectors at a time (spaced a warp apart:
// coalesced), folds them into its (max, sum) with one rescale per group of vectors (the sums of
// a group are independent exps), the lanes merge by a fixed butterfly, and lane 0 merges the
// tile into the row's f64 statistics. (One 256-thread block per row, the element-at-a-time
// online update and a block-wide merge took ~44 us per 4,096 x 4,096 bf16 tile on the H200, ~4x
// its bytes: docs/perf.md, session 16.) Deterministic: fixed orders everywhere.
constexpr int kLseRowsPerBlock = 8;
constexpr int kLseUnroll = 4;

// Folds kVals values (already scaled; -inf for none) into an f32 online (max, sum): one rescale
// per call. Compile-time bounds keep the values in registers.
template <int kVals>
__device__ __forceinline__ void lse_fold(Lse32& l, const float (&v)[kVals]) {
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kVals; ++i) mx = fmaxf(mx, v[i]);
  if (mx == -INFINITY) return;  // nothing but -inf (or no value): no mass
  const float m = fmaxf(l.m, mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kVals; ++i) sum += expf(v[i] - m);
  l.s = (l.m == -INFINITY ? 0.f : l.s * expf(l.m - m)) + sum;
  l.m = m;
}

// Warp-wide merge of Lse32 (fixed butterfly): every lane gets the result.
__device__ __forceinline__ Lse32 warp_lse(Lse32 v) {
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, v.m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, v.s, o);
    v.merge(m2, s2);
  }
  return v;
}

__device__ __forceinline__ void merge_row_lse(double* st, int col_m, int col_s, const Lse32& l) {
  loss::OnlineLse a{st[col_m], st[col_s]};
  a.add_max_sum(l.m, l.s);
  st[col_m] = a.m;
  st[col_s] = a.s;
}

template <typename TZ, bool kTeacher>
__global__ void __launch_bounds__(kLseRowsPerBlock * 32)
lse_tile_kernel(TileParams p, int64_t rows, const TZ* z, const TZ* teacher, const int* flags,
                const int32_t* ids, const int32_t* targets, double* stats, double* zk) {
  constexpr int n = Vec<TZ>::n;
  constexpr int kVals = kLseUnroll * n;
  const int lane = threadIdx.x & 31;
  const int64_t local = blockIdx.x * static_cast<int64_t>(kLseRowsPerBlock) + (threadIdx.x >> 5);
  if (local >= rows) return;  // uniform over the warp
  const int64_t r = p.row0 + local;
  const int f = flags[r];
  if (!(f & kUsed)) return;  // uniform over the warp
  const TZ* zrow = z + local * p.ldz;
  const TZ* trow = kTeacher ? teacher + local * p.ldz : nullptr;
  const bool do1 = p.separate_lse1 && (f & kSft);
  const float inv_t = p.inv_t;
  Lse32 lt, l1, lteach;
  const int64_t nvec = p.tw / n;
  for (int64_t q0 = 0; q0 < nvec; q0 += 32 * kLseUnroll) {
    float x[kVals], t[kVals];
#pragma unroll
    for (int u = 0; u < kLseUnroll; ++u) {
      const int64_t q = q0 + u * 32 + lane;
      if (q < nvec) {
        Vec<TZ>::load(zrow, q, x + u * n);
        if constexpr (kTeacher) Vec<TZ>::load(trow, q, t + u * n);
      } else {
#pragma unroll
        for (int e = 0; e < n; ++e) x[u * n + e] = t[u * n + e] = -INFINITY;
      }
    }
    if (do1) lse_fold(l1, x);
    if constexpr (kTeacher) {
#pragma unroll
      for (int i = 0; i < kVals; ++i) t[i] *= inv_t;
      lse_fold(lteach, t);
    }
#pragma unroll
    for (int i = 0; i < kVals; ++i) x[i] *= inv_t;
    lse_fold(lt, x);
  }
  for (int64_t i = nvec * n + lane; i < p.tw; i += 32) {  // the columns past the last vector
    const float x = to_f(zrow[i]);
    lt.add(x * inv_t);
    if (do1) l1.add(x);
    if constexpr (kTeacher) lteach.add(to_f(trow[i]) * inv_t);
  }
  lt = warp_lse(lt);
  if (do1) l1 = warp_lse(l1);
  if constexpr (kTeacher) lteach = warp_lse(lteach);
  double* st = stats + r * kCudaRowStatCols;
  if (lane == 0) {
    merge_row_lse(st, kLseT, kSumT, lt);
    if (do1) merge_row_lse(st, kLse1, kSum1, l1);
    if constexpr (kTeacher) merge_row_lse(st, kLseTeach, kSumTeach, lteach);
  }
  // Logits at the K ids and the target, from the tile that holds them. An id outside
  // [0, V) lies in no tile and is never read.
  for (int64_t j = lane; j <= p.k; j += 32) {
    const int64_t id = j < p.k ? ids[r * p.k + j] : targets[r];
    if (j < p.k && id == kEmptySlot) continue;
    if (id >= p.v0 && id < p.v0 + p.tw) zk[r * (p.k + 1) + j] = static_cast<double>(to_f(zrow[id - p.v0]));
  }
}

// LSE = max + log(sum) per used row (after the last tile of pass A).
__global__ void finalize_lse_kernel(int64_t n, bool separate_lse1, bool full, const int* flags,
                                    double* stats) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= n || !(flags[r] & kUsed)) return;
  double* st = stats + r * kCudaRowStatCols;
  st[kLseT] = st[kLseT] + log(st[kSumT]);
  if (flags[r] & kSft) st[kLse1] = separate_lse1 ? st[kLse1] + log(st[kSum1]) : st[kLseT];
  if (full) st[kLseTeach] = st[kLseTeach] + log(st[kSumTeach]);
}

// Pass B (full): D_r += sum_v d_v and G_r += sum_v g_v over this tile, f64 per element.
template <typename TZ>
__global__ void __launch_bounds__(kRowThreads)
full_divergence_kernel(TileParams p, double beta, const TZ* z, const TZ* teacher,
                       const int* flags, double* stats) {
  __shared__ double shm[kRowThreads / 32];
  const int64_t r = p.row0 + blockIdx.x;
  if (!(flags[r] & kUsed)) return;
  double* st = stats + r * kCudaRowStatCols;
  const double lse_t = st[kLseT], lse_teach = st[kLseTeach], inv_t = p.inv_t;
  double d = 0, g = 0;
  for_each_in_row(z + blockIdx.x * p.ldz, teacher + blockIdx.x * p.ldz, p.tw,
                  [&](int64_t, float x, float t) {
                    const loss::AtomTerm a = loss::atom_term(inv_t * t - lse_teach,
                                                             inv_t * x - lse_t, beta);
                    d += a.d;
                    g += a.g;
                  });
  d = block_sum(d, shm);
  g = block_sum(g, shm);
  if (threadIdx.x == 0) {
    st[kDiv] += d;
    st[kAux] += g;
  }
}

struct CoefParams {
  int64_t n, k;
  SupportMode mode;
  double beta, inv_t, tail_floor, sft_alpha, n_total;
  const void* weights;
  bool weights_f64;
  const int32_t* ids;
  const void* logprobs;  // [n, k]
  const void* actual;    // [n]
  bool logprobs_f64;
  double* a64;           // [n, k] scratch when logprobs are f32
};

// Per-row divergence values and gradient coefficients, the CPU's row_coefficients: zk becomes
// s = z/T at the K ids (the row functions' input), coef the sparse d z at the K ids and y
// (scaled by weight_r / n_total), stats the dense coefficients, D_r, CE_r, the KL estimate.
__global__ void row_coef_kernel(CoefParams p, const int* flags, double* zk, double* coef,
                                double* stats) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= p.n) return;
  const int64_t k = p.k;
  double* st = stats + r * kCudaRowStatCols;
  double* zr = zk + r * (k + 1);
  double* cr = coef + r * (k + 1);
  const int f = flags[r];
  if (!(f & kUsed)) {
    for (int64_t j = 0; j <= k; ++j) cr[j] = 0;
    st[kSumT] = st[kSum1] = st[kDiv] = st[kAux] = st[kKl] = st[kClamped] = 0;
    return;
  }
  const double scale = load_real(p.weights, p.weights_f64, r) / p.n_total;
  const double scale_t = scale * p.inv_t;  // d/dz = (1/T) d/ds
  const double z_y = zr[k];
  double dense_t = 0, dense_1 = 0, div = 0, ce = 0, kl = 0, sparse_y = 0;
  bool clamped = false;
  switch (p.mode) {
    case SupportMode::Full: {
      div = st[kDiv];
      dense_t = -scale_t * st[kAux];  // -q_v G_r; the g_v part is added per element in pass C
      break;
    }
    case SupportMode::TopK:
    case SupportMode::TopKTail: {
      const double* a;
      if (p.logprobs_f64) {
        a = static_cast<const double*>(p.logprobs) + r * k;
      } else {
        double* a_row = p.a64 + r * k;
        for (int64_t j = 0; j < k; ++j) a_row[j] = static_cast<const float*>(p.logprobs)[r * k + j];
        a = a_row;
      }
      for (int64_t j = 0; j < k; ++j) zr[j] *= p.inv_t;  // s = z / T
      const loss::RowResult res =
          p.mode == SupportMode::TopK
              ? loss::topk_row(k, p.ids + r * k, a, zr, p.beta, cr)
              : loss::topk_tail_row(k, p.ids + r * k, a, zr, st[kLseT], p.beta, p.tail_floor, cr);
      div = res.value;
      dense_t = scale_t * res.dense;
      clamped = res.tail_clamped;
      for (int64_t j = 0; j < k; ++j) cr[j] *= scale_t;
      break;
    }
    case SupportMode::Sampled: {
      for (int64_t j = 0; j < k; ++j) cr[j] = 0;
      const double a_y = load_real(p.actual, p.logprobs_f64, r);
      double ds_y = 0;
      const loss::RowResult res = loss::sampled_row(a_y, p.inv_t * z_y, st[kLseT], &ds_y);
      div = res.value;
      dense_t = scale_t * res.dense;
      sparse_y = scale_t * ds_y;
      kl = (p.inv_t * z_y - st[kLseT]) - a_y;
      break;
    }
  }
  if (f & kSft) {
    ce = loss::cross_entropy_row(z_y, st[kLse1]);
    dense_1 = scale * p.sft_alpha;
    sparse_y -= scale * p.sft_alpha;
  }
  cr[k] = sparse_y;
  st[kSumT] = dense_t;
  st[kSum1] = dense_1;
  st[kDiv] = div;
  st[kAux] = ce;
  st[kKl] = kl;
  st[kClamped] = clamped ? 1.0 : 0.0;
}

// The call's sums in a fixed order (one block): sum_r w_r D_r, w_r CE_r, w_r KL_r, rows, clamps.
constexpr int kSumThreads = 512;
__global__ void __launch_bounds__(kSumThreads)
sums_kernel(int64_t n, const void* weights, bool weights_f64, const int* flags,
            const double* stats, double* out) {
  __shared__ double shm[kSumThreads / 32];
  double acc[kSumCols] = {0, 0, 0, 0, 0};
  for (int64_t r = threadIdx.x; r < n; r += blockDim.x) {
    if (!(flags[r] & kUsed)) continue;
    const double w = load_real(weights, weights_f64, r);
    const double* st = stats + r * kCudaRowStatCols;
    acc[kSumDiv] += w * st[kDiv];
    acc[kSumCe] += w * st[kAux];
    acc[kSumKl] += w * st[kKl];
    acc[kSumUsed] += 1;
    acc[kSumClamped] += st[kClamped];
  }
#pragma unroll
  for (int c = 0; c < kSumCols; ++c) {
    const double v = block_sum(acc[c], shm);
    if (threadIdx.x == 0) out[c] = v;
  }
}

struct DzParams {
  TileParams t;
  double beta;
  bool full, same_lse;  // same_lse: T == 1, softmax(z/T) == softmax(z)
  const void* weights;  // full: the per-element term is scaled by weight_r / n_total / T
  bool weights_f64;
  double n_total, inv_t;
};

// Pass C row kernel: dZ of one chunk row over the tile. The dense part goes to a shared f32
// row; the sparse coefficients of the ids inside the tile are added there (teacher ids: one
// thread each, unique per row after validation, shared atomicAdd keeps even a duplicated id
// memory-safe; then the target by one thread, so the order is fixed); the row is written once
// in the dZ dtype. In place when dz aliases z (every read of the row precedes the barrier).
// kFull is a template flag so the other modes do not carry full mode's f64 registers.
template <typename TZ, typename TD, bool kFull>
__global__ void __launch_bounds__(kRowThreads)
dz_tile_kernel(DzParams p, const TZ* z, const TZ* teacher, TD* dz, const int* flags,
               const double* stats, const double* coef, const int32_t* ids,
               const int32_t* targets) {
  extern __shared__ float srow[];
  const TileParams& tp = p.t;
  const int64_t r = tp.row0 + blockIdx.x;
  const int f = flags[r];
  const int64_t tw = tp.tw;
  TD* drow = dz + blockIdx.x * tp.ldz;
  constexpr int n = Vec<TD>::n;
  const int64_t nvec = tw / n;
  if (!(f & kUsed)) {  // rows outside the loss: zero dZ (uniform over the block)
    float zero[n];
#pragma unroll
    for (int e = 0; e < n; ++e) zero[e] = 0.f;
    for (int64_t q = threadIdx.x; q < nvec; q += blockDim.x) Vec<TD>::store(drow, q, zero);
    for (int64_t i = nvec * n + threadIdx.x; i < tw; i += blockDim.x) drow[i] = from_f<TD>(0.f);
    return;
  }
  const double* st = stats + r * kCudaRowStatCols;
  const float dense_t = static_cast<float>(st[kSumT]);
  const float dense_1 = static_cast<float>(st[kSum1]);
  const float lse_t = static_cast<float>(st[kLseT]);
  const float lse_1 = static_cast<float>(st[kLse1]);
  const float inv_t = tp.inv_t;
  const double lse_t64 = st[kLseT], lse_teach = st[kLseTeach];
  const double full_scale =
      kFull ? load_real(p.weights, p.weights_f64, r) / p.n_total * p.inv_t : 0.0;
  const TZ* zrow = z + blockIdx.x * tp.ldz;
  const TZ* trow = kFull ? teacher + blockIdx.x * tp.ldz : nullptr;
  for_each_in_row(zrow, trow, tw, [&](int64_t i, float x, float t) {
    const float logq = x * inv_t - lse_t;
    float d;
    if (p.same_lse) {
      d = (dense_t + dense_1) * expf(logq);
    } else {
      d = 0.f;
      if (dense_t != 0.f) d += dense_t * expf(logq);
      if (dense_1 != 0.f) d += dense_1 * expf(x - lse_1);
    }
    if (kFull) {
      const double g = loss::atom_term(static_cast<double>(inv_t) * t - lse_teach,
                                       static_cast<double>(inv_t) * x - lse_t64, p.beta).g;
      d += static_cast<float>(full_scale * g);
    }
    srow[i] = d;
  });
  __syncthreads();
  const int64_t k = tp.k;
  const double* cr = coef + r * (k + 1);
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
    const double c = cr[j];
    if (c == 0.0) continue;
    const int64_t id = ids[r * k + j];
    if (id >= tp.v0 && id < tp.v0 + tw) atomicAdd(&srow[id - tp.v0], static_cast<float>(c));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const double c = cr[k];
    const int64_t y = targets[r];
    if (c != 0.0 && y >= tp.v0 && y < tp.v0 + tw) srow[y - tp.v0] += static_cast<float>(c);
  }
  __syncthreads();
  for (int64_t q = threadIdx.x; q < nvec; q += blockDim.x) Vec<TD>::store(drow, q, srow + q * n);
  for (int64_t i = nvec * n + threadIdx.x; i < tw; i += blockDim.x) drow[i] = from_f<TD>(srow[i]);
}

// ---- sparse path (topk without SFT) --------------------------------------------------------

// One warp per (row, slot): z at the slot's id as an fp32 dot product. Ids outside [0, V) are
// skipped (never dereferenced).
template <typename TIn>
__global__ void gather_dot_kernel(int64_t n, int64_t k, int64_t h, int64_t vocab, const TIn* hidden,
                                  const TIn* lm_head, const int* flags, const int32_t* ids,
                                  const int32_t* targets, double* zk) {
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp >= n * (k + 1)) return;
  const int64_t r = warp / (k + 1), j = warp % (k + 1);
  if (!(flags[r] & kUsed)) return;
  const int64_t id = j < k ? ids[r * k + j] : targets[r];
  if (id < 0 || id >= vocab) return;  // kEmptySlot and anything that skipped validation
  const TIn* hr = hidden + r * h;
  const TIn* wr = lm_head + id * h;
  float acc = 0.f;
  for (int64_t i = lane; i < h; i += 32) acc += to_f(hr[i]) * to_f(wr[i]);
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) zk[r * (k + 1) + j] = acc;
}

// dH_r = sum_j c_j W_{id_j} (slots in order: deterministic); every row written.
template <typename TIn>
__global__ void sparse_dh_kernel(int64_t k, int64_t h, int64_t vocab, const TIn* lm_head,
                                 const int* flags, const int32_t* ids, const int32_t* targets,
                                 const double* coef, float* dh) {
  const int64_t r = blockIdx.x;
  const bool used = flags[r] & kUsed;
  const double* cr = coef + r * (k + 1);
  for (int64_t i = threadIdx.x; i < h; i += blockDim.x) {
    float acc = 0.f;
    if (used) {
      for (int64_t j = 0; j <= k; ++j) {
        const double c = cr[j];
        const int64_t id = j < k ? ids[r * k + j] : targets[r];
        if (c == 0.0 || id < 0 || id >= vocab) continue;
        acc += static_cast<float>(c) * to_f(lm_head[id * h + i]);
      }
    }
    dh[r * h + i] = acc;
  }
}

// dW_{id_j} += c_j h_r (fp32 atomics: rows of different tokens may share an id).
template <typename TIn>
__global__ void sparse_dw_kernel(int64_t k, int64_t h, int64_t vocab, const TIn* hidden,
                                 const int* flags, const int32_t* ids, const int32_t* targets,
                                 const double* coef, float* dw) {
  const int64_t r = blockIdx.x;
  if (!(flags[r] & kUsed)) return;
  const double* cr = coef + r * (k + 1);
  for (int64_t j = 0; j <= k; ++j) {
    const double c = cr[j];
    const int64_t id = j < k ? ids[r * k + j] : targets[r];
    if (c == 0.0 || id < 0 || id >= vocab) continue;
    const float cf = static_cast<float>(c);
    for (int64_t i = threadIdx.x; i < h; i += blockDim.x)
      atomicAdd(&dw[id * h + i], cf * to_f(hidden[r * h + i]));
  }
}

// ---- host side --------------------------------------------------------------------------

unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

template <typename T> cudaDataType_t cuda_type();
template <> cudaDataType_t cuda_type<float>() { return CUDA_R_32F; }
template <> cudaDataType_t cuda_type<bf16>() { return CUDA_R_16BF; }

// Column-major cuBLAS GEMM with fp32 compute (bf16 inputs on the tensor cores; f32 inputs in
// plain fp32: the default math mode never uses TF32 for CUBLAS_COMPUTE_32F).
void gemm(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n,
          int64_t k, const void* a, cudaDataType_t at, int64_t lda, const void* b,
          cudaDataType_t bt, int64_t ldb, float beta, void* c, cudaDataType_t ct, int64_t ldc) {
  const float alpha = 1.f;
  OPD_CUBLAS_CHECK(cublasGemmEx(handle, ta, tb, to_int(m, "m"), to_int(n, "n"), to_int(k, "k"),
                                &alpha, a, at, to_int(lda, "lda"), b, bt, to_int(ldb, "ldb"), &beta,
                                c, ct, to_int(ldc, "ldc"), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// One cuBLAS handle per host thread, created on first use (creation costs milliseconds).
cublasHandle_t thread_handle(cudaStream_t stream) {
  thread_local std::unique_ptr<CublasHandle> handle;
  if (!handle) handle = std::make_unique<CublasHandle>(stream);
  OPD_CUBLAS_CHECK(cublasSetStream(handle->get(), stream));
  return handle->get();
}

// Scratch layout: one device allocation carved into aligned regions (counted by memory_stats).
struct Plan {
  int64_t n = 0, k = 0, vocab = 0;
  int64_t tile = 0, ld = 0, row_chunk = 0;
  bool tiles = false, full = false, separate_dz = false, a64 = false;
  size_t tile_elem = 4, dz_elem = 2;
  // byte offsets
  int64_t off_z = 0, off_t = 0, off_dz = 0, off_zk = 0, off_coef = 0, off_a64 = 0, off_stats = 0,
          off_flags = 0, off_err = 0, off_sums = 0, total = 0;
};

Plan make_plan(int64_t n, int64_t vocab, int64_t k, const LossConfig& config, DType input_dtype,
               DType logprob_dtype, const CudaLossOptions& o) {
  Plan p;
  p.n = n;
  p.k = k;
  p.vocab = vocab;
  p.full = config.mode == SupportMode::Full;
  p.tiles = config.mode != SupportMode::TopK || config.sft_alpha > 0;
  p.a64 = (config.mode == SupportMode::TopK || config.mode == SupportMode::TopKTail) &&
          logprob_dtype == DType::F32 && k > 0;
  const bool bf16_in = input_dtype == DType::BF16;
  p.tile_elem = bf16_in && o.tile_dtype == DType::BF16 ? 2 : 4;
  p.separate_dz = bf16_in && p.tile_elem == 4;  // f32 logits, bf16 dZ for the tensor-core GEMMs
  p.dz_elem = bf16_in ? 2 : 4;
  p.tile = std::min(config.vocab_tile, vocab);
  p.ld = round_up(p.tile, kLdMultiple);
  const int64_t per_row = p.ld * static_cast<int64_t>(p.tile_elem * (p.full ? 2 : 1) +
                                                      (p.separate_dz ? p.dz_elem : 0));
  if (o.row_chunk > 0) {
    p.row_chunk = std::min(o.row_chunk, n);
  } else {
    // The most rows that fit the budget (a multiple of 128, the GEMM's tile height), then
    // balanced so the last chunk is not a sliver: 8192 rows in chunks of 5120 become 2 x 4096.
    const int64_t fit = std::max<int64_t>(128, o.tile_budget_bytes / per_row / 128 * 128);
    const int64_t chunks = (n + fit - 1) / std::max<int64_t>(fit, 1);
    p.row_chunk = std::min(n, std::min(fit, round_up((n + chunks - 1) / std::max<int64_t>(chunks, 1), 128)));
  }
  int64_t off = 0;
  auto region = [&](int64_t bytes) {
    const int64_t at = off;
    off += round_up(std::max<int64_t>(bytes, 0), kAlign);
    return at;
  };
  if (p.tiles) {
    p.off_z = region(p.row_chunk * p.ld * static_cast<int64_t>(p.tile_elem));
    if (p.full) p.off_t = region(p.row_chunk * p.ld * static_cast<int64_t>(p.tile_elem));
    if (p.separate_dz) p.off_dz = region(p.row_chunk * p.ld * static_cast<int64_t>(p.dz_elem));
  }
  p.off_zk = region(n * (k + 1) * 8);
  p.off_coef = region(n * (k + 1) * 8);
  if (p.a64) p.off_a64 = region(n * k * 8);
  p.off_stats = region(n * kCudaRowStatCols * 8);
  p.off_flags = region(n * 4);
  p.off_err = region(static_cast<int64_t>(sizeof(ErrorRecord)));
  p.off_sums = region(kSumCols * 8);
  p.total = off;
  return p;
}

void check_device(const Tensor& t, const char* name) {
  OPD_CHECK(t.defined(), InvalidArgument, "fused loss (CUDA): ", name, " is missing");
  OPD_CHECK(t.device() == Device::CUDA, InvalidArgument, "fused loss (CUDA): ", name,
            " must be a device tensor, got ", t.describe());
}
void check_shape(const Tensor& t, const Shape& shape, const char* name) {
  check_device(t, name);
  OPD_CHECK(t.shape() == shape, InvalidArgument, "fused loss (CUDA): ", name, " has shape ",
            shape_str(t.shape()), ", expected ", shape_str(shape));
}
void check_real(const Tensor& t, const char* name) {
  OPD_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F64, InvalidArgument,
            "fused loss (CUDA): ", name, " must be f32 or f64, got ", dtype_name(t.dtype()));
}
void check_i32(const Tensor& t, const char* name) {
  OPD_CHECK(t.dtype() == DType::I32, InvalidArgument, "fused loss (CUDA): ", name,
            " must be i32, got ", dtype_name(t.dtype()));
}

// Copies `bytes` from device memory to the host (error path and results).
void d2h(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  OPD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
  OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
}

template <typename TIn, typename TZ>
class CudaFusedLoss {
 public:
  CudaFusedLoss(const LossConfig& c, const FusedLossArgs& a, Tensor* dh, Tensor* dw,
                const CudaLossOptions& o, cudaStream_t s)
      : c_(c), a_(a), dh_(dh), dw_(dw), o_(o), stream_(s) {}

  LossResult run();

 private:
  using TD = TIn;  // dZ dtype: the GEMM operand type
  void check_args();
  void check_errors();
  void tile_gemm(const void* w, const void* h, int64_t hdim, int64_t v0, int64_t tw, int64_t row0,
                 int64_t rows, void* out);
  void pass_a();
  void pass_b();
  void pass_c();
  void sparse_path_forward();
  void sparse_path_backward();
  TileParams tile_params(int64_t row0, int64_t v0, int64_t tw) const {
    return TileParams{row0, v0, tw, plan_.ld, k_, static_cast<float>(inv_t_), separate_lse1_};
  }
  template <typename T> T* at(int64_t off) const {
    return reinterpret_cast<T*>(static_cast<char*>(scratch_.raw()) + off);
  }

  const LossConfig& c_;
  const FusedLossArgs& a_;
  Tensor* dh_;
  Tensor* dw_;
  const CudaLossOptions& o_;
  cudaStream_t stream_;
  cublasHandle_t blas_ = nullptr;
  int64_t n_ = 0, h_ = 0, v_ = 0, k_ = 0, ht_ = 0;
  double inv_t_ = 1;
  bool full_ = false, separate_lse1_ = false;
  Plan plan_;
  Tensor scratch_;
  const int32_t* ids_ = nullptr;
  const int32_t* targets_ = nullptr;
  int* flags_ = nullptr;
  double *zk_ = nullptr, *coef_ = nullptr, *stats_ = nullptr;
};

template <typename TIn, typename TZ>
void CudaFusedLoss<TIn, TZ>::check_args() {
  check_loss_config(c_);
  check_device(a_.hidden, "hidden");
  OPD_CHECK(a_.hidden.ndim() == 2 && a_.lm_head.defined() && a_.lm_head.ndim() == 2,
            InvalidArgument, "fused loss (CUDA): hidden [N, H] and lm_head [V, H] must be 2-d, got ",
            a_.hidden.describe(), " and ", a_.lm_head.describe());
  n_ = a_.hidden.dim(0);
  h_ = a_.hidden.dim(1);
  v_ = a_.lm_head.dim(0);
  check_shape(a_.lm_head, {v_, h_}, "lm_head");
  OPD_CHECK(a_.lm_head.dtype() == a_.hidden.dtype(), InvalidArgument,
            "fused loss (CUDA): lm_head dtype ", dtype_name(a_.lm_head.dtype()), " != hidden dtype ",
            dtype_name(a_.hidden.dtype()));
  OPD_CHECK(v_ >= 1 && v_ <= INT32_MAX, InvalidArgument, "fused loss (CUDA): vocabulary ", v_,
            " must be in [1, 2^31)");
  check_shape(a_.targets, {n_}, "targets");
  check_i32(a_.targets, "targets");
  check_shape(a_.weights, {n_}, "weights");
  check_real(a_.weights, "weights");
  OPD_CHECK(std::isfinite(a_.n_total) && a_.n_total > 0, InvalidArgument,
            "fused loss (CUDA): n_total ", a_.n_total, " must be finite and > 0");
  if (c_.sft_alpha > 0) {
    check_shape(a_.sft_rows, {n_}, "sft_rows");
    check_i32(a_.sft_rows, "sft_rows");
  }
  full_ = c_.mode == SupportMode::Full;
  DType logprob_dtype = DType::F64;
  if (full_) {
    OPD_CHECK(a_.teacher_hidden.defined() && a_.teacher_hidden.ndim() == 2 &&
                  a_.teacher_lm_head.defined() && a_.teacher_lm_head.ndim() == 2,
              InvalidArgument, "fused loss (CUDA): full mode needs teacher_hidden [N, Ht] and "
              "teacher_lm_head [Vt, Ht]");
    ht_ = a_.teacher_hidden.dim(1);
    const int64_t vt = a_.teacher_lm_head.dim(0);
    check_shape(a_.teacher_hidden, {n_, ht_}, "teacher_hidden");
    check_shape(a_.teacher_lm_head, {vt, ht_}, "teacher_lm_head");
    OPD_CHECK(a_.teacher_hidden.dtype() == a_.hidden.dtype() &&
                  a_.teacher_lm_head.dtype() == a_.hidden.dtype(),
              InvalidArgument, "fused loss (CUDA): teacher tensors must have the student's dtype ",
              dtype_name(a_.hidden.dtype()));
    OPD_CHECK(vt >= v_, InvalidArgument, "fused loss (CUDA): full mode: teacher vocabulary ", vt,
              " is smaller than the student's ", v_,
              " (student ids the teacher cannot score would get p = 0)");
    OPD_CHECK(vt == v_ || c_.vocab_policy == VocabPolicy::ClipToStudent, InvalidData,
              "fused loss (CUDA): full mode: teacher vocabulary ", vt, " is larger than the student's ",
              v_, " (vocab policy 'error'; 'clip-to-student' renormalizes over the student's ids)");
  } else {
    OPD_CHECK(a_.teacher != nullptr, InvalidArgument, "fused loss (CUDA): mode ",
              support_mode_name(c_.mode), " needs a validated teacher payload");
    const TeacherTopK& t = *a_.teacher;
    k_ = t.k;
    OPD_CHECK(t.rows == n_, InvalidArgument, "fused loss (CUDA): teacher payload has ", t.rows,
              " rows, hidden has ", n_);
    OPD_CHECK(k_ >= 1 || c_.mode == SupportMode::Sampled, InvalidArgument,
              "fused loss (CUDA): mode ", support_mode_name(c_.mode),
              " needs K >= 1 teacher entries per row, got ", k_);
    check_shape(t.ids, {n_, k_}, "teacher ids");
    check_i32(t.ids, "teacher ids");
    check_shape(t.logprobs, {n_, k_}, "teacher logprobs");
    check_real(t.logprobs, "teacher logprobs");
    check_shape(t.actual_logprobs, {n_}, "teacher actual_logprobs");
    OPD_CHECK(t.actual_logprobs.dtype() == t.logprobs.dtype(), InvalidArgument,
              "fused loss (CUDA): teacher actual_logprobs and logprobs must share a dtype");
    check_shape(t.valid, {n_}, "teacher valid");
    check_i32(t.valid, "teacher valid");
    logprob_dtype = t.logprobs.dtype();
  }
  if (dh_ || dw_) {
    OPD_CHECK(dh_ && dw_, InvalidArgument,
              "fused loss (CUDA): give both d_hidden and d_lm_head (or neither for forward only)");
    check_shape(*dh_, {n_, h_}, "d_hidden");
    check_shape(*dw_, {v_, h_}, "d_lm_head");
    OPD_CHECK(dh_->dtype() == DType::F32 && dw_->dtype() == DType::F32, InvalidArgument,
              "fused loss (CUDA): gradients are f32 (fp32 accumulation), got d_hidden ",
              dtype_name(dh_->dtype()), " and d_lm_head ", dtype_name(dw_->dtype()));
    OPD_CHECK(dh_->writable() && dw_->writable(), InvalidArgument,
              "fused loss (CUDA): gradient tensors must be writable");
  }
  OPD_CHECK(o_.row_chunk >= 0 && o_.tile_budget_bytes > 0, InvalidArgument,
            "fused loss (CUDA): row_chunk ", o_.row_chunk, " and tile budget ",
            o_.tile_budget_bytes, " must be >= 0 and > 0");
  OPD_CHECK(o_.tile_dtype == DType::F32 || o_.tile_dtype == DType::BF16, InvalidArgument,
            "fused loss (CUDA): tile dtype must be f32 or bf16, got ", dtype_name(o_.tile_dtype));
  plan_ = make_plan(n_, v_, k_, c_, a_.hidden.dtype(), logprob_dtype, o_);
}

// Reads the error record (one small copy and a sync) and throws the CPU's error, naming the
// first offending row and its value, before anything else is computed.
template <typename TIn, typename TZ>
void CudaFusedLoss<TIn, TZ>::check_errors() {
  ErrorRecord rec{};
  d2h(&rec, at<ErrorRecord>(plan_.off_err), sizeof rec, stream_);
  if (rec.first != kNoError) {
    const int64_t row = static_cast<int64_t>(rec.first / 4);
    switch (rec.first % 4) {
      case kErrWeight: {
        double w = 0;
        if (a_.weights.dtype() == DType::F64) {
          d2h(&w, a_.weights.data<double>() + row, sizeof w, stream_);
        } else {
          float wf = 0;
          d2h(&wf, a_.weights.data<float>() + row, sizeof wf, stream_);
          w = wf;
        }
        OPD_FAIL(InvalidData, "fused loss: weight of row ", row, " is ", w);
      }
      case kErrTarget: {
        int32_t y = 0;
        d2h(&y, targets_ + row, sizeof y, stream_);
        OPD_FAIL(InvalidData, "fused loss: target id ", y, " of row ", row,
                 " is outside the student vocabulary [0, ", v_, ")");
      }
      default: {
        int32_t f = 0;
        d2h(&f, a_.sft_rows.data<int32_t>() + row, sizeof f, stream_);
        OPD_FAIL(InvalidArgument, "fused loss: sft_rows[", row, "] = ", f, " must be 0 or 1");
      }
    }
  }
  if (rec.bad_ids != 0) {
    OPD_FAIL(InvalidData, "fused loss: ", rec.bad_ids, " teacher ids outside [0, ", v_,
             ") reached the gather (payload not validated?); they were skipped and nothing was "
             "computed");
  }
}

// out[rows, tw] (row stride plan_.ld) = h[row0 : row0 + rows] w[v0 : v0 + tw]^T.
template <typename TIn, typename TZ>
void CudaFusedLoss<TIn, TZ>::tile_gemm(const void* w, const void* h, int64_t hdim, int64_t v0,
                                       int64_t tw, int64_t row0, int64_t rows, void* out) {
  const TIn* wt = static_cast<const TIn*>(w) + v0 * hdim;
  const TIn* hc = static_cast<const TIn*>(h) + row0 * hdim;
  gemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, tw, rows, hdim, wt, cuda_type<TIn>(), hdim, hc,
       cuda_type<TIn>(), hdim, 0.f, out, cuda_type<TZ>(), plan_.ld);
}

template <typename TIn, typename TZ>
void CudaFusedLoss<TIn, TZ>::pass_a() {
  TZ* z = at<TZ>(plan_.off_z);
  TZ* t = full_ ? at<TZ>(plan_.off_t) : nullptr;
  for (int64_t v0 = 0; v0 < v_; v0 += plan_.tile) {
    const int64_t tw = std::min(plan_.tile, v_ - v0);
    for (int64_t row0 = 0; row0 < n_; row0 += plan_.row_chunk) {
      const int64_t rows = std::min(plan_.row_chunk, n_ - row0);
      tile_gemm(a_.lm_head.raw(), a_.hidden.raw(), h_, v0, tw, row0, rows, z);
      if (full_) tile_gemm(a_.teacher_lm_head.raw(), a_.teacher_hidden.raw(), ht_, v0, tw, row0, rows, t);
      const unsigned blocks = blocks_for(rows, kLseRowsPerBlock);
      if (full_) {
        lse_tile_kernel<TZ, true><<<blocks, kLseRowsPerBlock * 32, 0, stream_>>>(
            tile_params(row0, v0, tw), rows, z, t, flags_, ids_, targets_, stats_, zk_);
      } else {
        lse_tile_kernel<TZ, false><<<blocks, kLseRowsPerBlock * 32, 0, stream_>>>(
            tile_params(row0, v0, tw), rows, z, nullptr, flags_, ids_, targets_, stats_, zk_);
      }
      check_launch("lse_tile_kernel");
    }
  }
  finalize_lse_kernel<<<blocks_for(n_, 256), 256, 0, stream_>>>(n_, separate_lse1_, full_, flags_,
                                                                 stats_);
  check_launch("finalize_lse_kernel");
}

template <typename TIn, typename TZ>
void CudaFusedLoss<TIn, TZ>::pass_b() {
  TZ* z = at<TZ>(plan_.off_z);
  TZ* t = at<TZ>(plan_.off_t);
  for (int64_t v0 = 0; v0 < v_; v0 += plan_.tile) {
    const int64_t tw = std::min(plan_.tile, v_ - v0);
    for (int64_t row0 = 0; row0 < n_; row0 += plan_.row_chunk) {
      const int64_t rows = std::min(plan_.row_chunk, n_ - row0);
      tile_gemm(a_.lm_head.raw(), a_.hidden.raw(), h_, v0, tw, row0, rows, z);
      tile_gemm(a_.teacher_lm_head.raw(), a_.teacher_hidden.raw(), ht_, v0, tw, row0, rows, t);
      full_divergence_kernel<TZ><<<static_cast<unsigned>(rows), kRowThreads, 0, stream_>>>(
          tile_params(row0, v0, tw), c_.beta, z, t, flags_, stats_);
      check_launch("full_divergence_kernel");
    }
  }
}

template <typename TIn, typename TZ>
void CudaFusedLoss<TIn, TZ>::pass_c() {
  TZ* z = at<TZ>(plan_.off_z);
  TZ* t = full_ ? at<TZ>(plan_.off_t) : nullptr;
  // dZ in place over the logits unless they are f32 and the GEMM operands bf16.
  TD* dz = plan_.separate_dz ? at<TD>(plan_.off_dz) : reinterpret_cast<TD*>(z);
  float* dh = dh_->data<float>();
  float* dw = dw_->data<float>();
  const TIn* w = static_cast<const TIn*>(a_.lm_head.raw());
  const TIn* h = static_cast<const TIn*>(a_.hidden.raw());
  const size_t smem = static_cast<size_t>(plan_.tile) * sizeof(float);
  if (smem > 48 * 1024) {
    int device = 0, max_smem = 0;
    OPD_CUDA_CHECK(cudaGetDevice(&device));
    OPD_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    OPD_CHECK(smem <= static_cast<size_t>(max_smem), Unsupported, "fused loss (CUDA): vocab_tile ",
              plan_.tile, " needs a ", smem, "-byte shared row in the dZ kernel; this device allows ",
              max_smem, " (use vocab_tile <= ", max_smem / 4, ")");
    OPD_CUDA_CHECK(cudaFuncSetAttribute(dz_tile_kernel<TZ, TD, false>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
    OPD_CUDA_CHECK(cudaFuncSetAttribute(dz_tile_kernel<TZ, TD, true>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  DzParams dp{};
  dp.beta = c_.beta;
  dp.full = full_;
  dp.same_lse = c_.temperature == 1.0;
  dp.weights = a_.weights.raw();
  dp.weights_f64 = a_.weights.dtype() == DType::F64;
  dp.n_total = a_.n_total;
  dp.inv_t = inv_t_;
  for (int64_t v0 = 0; v0 < v_; v0 += plan_.tile) {
    const int64_t tw = std::min(plan_.tile, v_ - v0);
    for (int64_t row0 = 0; row0 < n_; row0 += plan_.row_chunk) {
      const int64_t rows = std::min(plan_.row_chunk, n_ - row0);
      tile_gemm(a_.lm_head.raw(), a_.hidden.raw(), h_, v0, tw, row0, rows, z);
      if (full_) tile_gemm(a_.teacher_lm_head.raw(), a_.teacher_hidden.raw(), ht_, v0, tw, row0, rows, t);
      dp.t = tile_params(row0, v0, tw);
      if (full_) {
        dz_tile_kernel<TZ, TD, true><<<static_cast<unsigned>(rows), kRowThreads, smem, stream_>>>(
            dp, z, t, dz, flags_, stats_, coef_, ids_, targets_);
      } else {
        dz_tile_kernel<TZ, TD, false><<<static_cast<unsigned>(rows), kRowThreads, smem, stream_>>>(
            dp, z, t, dz, flags_, stats_, coef_, ids_, targets_);
      }
      check_launch("dz_tile_kernel");
      // dH_c (+)= dZ W_t: column-major dH^T[H, rows] = W_t^T[H, tw] dZ^T[tw, rows]; the first
      // tile overwrites (beta 0), so d_hidden needs no memset and every element is written.
      gemm(blas_, CUBLAS_OP_N, CUBLAS_OP_N, h_, rows, tw, w + v0 * h_, cuda_type<TIn>(), h_, dz,
           cuda_type<TD>(), plan_.ld, v0 == 0 ? 0.f : 1.f, dh + row0 * h_, CUDA_R_32F, h_);
      // dW_t += dZ^T H_c: column-major dW_t^T[H, tw] = H_c^T[H, rows] dZ[rows, tw].
      gemm(blas_, CUBLAS_OP_N, CUBLAS_OP_T, h_, tw, rows, h + row0 * h_, cuda_type<TIn>(), h_, dz,
           cuda_type<TD>(), plan_.ld, 1.f, dw + v0 * h_, CUDA_R_32F, h_);
    }
  }
}

template <typename TIn, typename TZ>
void CudaFusedLoss<TIn, TZ>::sparse_path_forward() {
  const int64_t warps = n_ * (k_ + 1);
  gather_dot_kernel<TIn><<<blocks_for(warps * 32, 256), 256, 0, stream_>>>(
      n_, k_, h_, v_, static_cast<const TIn*>(a_.hidden.raw()),
      static_cast<const TIn*>(a_.lm_head.raw()), flags_, ids_, targets_, zk_);
  check_launch("gather_dot_kernel");
}

template <typename TIn, typename TZ>
void CudaFusedLoss<TIn, TZ>::sparse_path_backward() {
  sparse_dh_kernel<TIn><<<static_cast<unsigned>(n_), 256, 0, stream_>>>(
      k_, h_, v_, static_cast<const TIn*>(a_.lm_head.raw()), flags_, ids_, targets_, coef_,
      dh_->data<float>());
  check_launch("sparse_dh_kernel");
  sparse_dw_kernel<TIn><<<static_cast<unsigned>(n_), 256, 0, stream_>>>(
      k_, h_, v_, static_cast<const TIn*>(a_.hidden.raw()), flags_, ids_, targets_, coef_,
      dw_->data<float>());
  check_launch("sparse_dw_kernel");
}

template <typename TIn, typename TZ>
LossResult CudaFusedLoss<TIn, TZ>::run() {
  check_args();
  if (n_ == 0) return LossResult{};  // empty micro-batch: d_hidden is empty, d_lm_head untouched
  inv_t_ = 1.0 / c_.temperature;
  separate_lse1_ = c_.sft_alpha > 0 && c_.temperature != 1.0;
  blas_ = thread_handle(stream_);
  std::unique_ptr<Event> ev[4];
  if (o_.timings) {
    for (auto& e : ev) e = std::make_unique<Event>();
    ev[0]->record(stream_);
  }

  // One allocation (plan_.total is a multiple of kAlign bytes), counted by memory_stats.
  scratch_ = Tensor::empty({plan_.total / 4}, DType::I32, Device::CUDA);
  zk_ = at<double>(plan_.off_zk);
  coef_ = at<double>(plan_.off_coef);
  stats_ = at<double>(plan_.off_stats);
  flags_ = at<int>(plan_.off_flags);
  targets_ = a_.targets.data<int32_t>();
  ids_ = (!full_ && k_ > 0) ? a_.teacher->ids.data<int32_t>() : nullptr;

  // prepare: error record "no error", zk = 0 (slots without a logit stay 0 like the CPU's)
  ErrorRecord init{kNoError, 0};
  OPD_CUDA_CHECK(cudaMemcpyAsync(at<ErrorRecord>(plan_.off_err), &init, sizeof init,
                                 cudaMemcpyHostToDevice, stream_));
  OPD_CUDA_CHECK(cudaMemsetAsync(zk_, 0, static_cast<size_t>(n_ * (k_ + 1) * 8), stream_));
  RowInputs ri{n_, k_, v_, a_.weights.raw(), a_.weights.dtype() == DType::F64,
               full_ ? nullptr : a_.teacher->valid.data<int32_t>(), targets_,
               c_.sft_alpha > 0 ? a_.sft_rows.data<int32_t>() : nullptr, ids_};
  prepare_rows_kernel<<<blocks_for(n_, 256), 256, 0, stream_>>>(ri, flags_, stats_,
                                                                 at<ErrorRecord>(plan_.off_err));
  check_launch("prepare_rows_kernel");
  check_errors();  // synchronizes; throws before any output is touched
  if (o_.timings) ev[1]->record(stream_);

  // forward
  if (plan_.tiles) {
    pass_a();
    if (full_) pass_b();
  } else {
    sparse_path_forward();
  }
  CoefParams cp{};
  cp.n = n_;
  cp.k = k_;
  cp.mode = c_.mode;
  cp.beta = c_.beta;
  cp.inv_t = inv_t_;
  cp.tail_floor = c_.tail_floor;
  cp.sft_alpha = c_.sft_alpha;
  cp.n_total = a_.n_total;
  cp.weights = a_.weights.raw();
  cp.weights_f64 = a_.weights.dtype() == DType::F64;
  cp.ids = ids_;
  if (!full_) {
    cp.logprobs = a_.teacher->logprobs.raw();
    cp.actual = a_.teacher->actual_logprobs.raw();
    cp.logprobs_f64 = a_.teacher->logprobs.dtype() == DType::F64;
  }
  cp.a64 = plan_.a64 ? at<double>(plan_.off_a64) : nullptr;
  row_coef_kernel<<<blocks_for(n_, 128), 128, 0, stream_>>>(cp, flags_, zk_, coef_, stats_);
  check_launch("row_coef_kernel");
  double* sums = at<double>(plan_.off_sums);
  sums_kernel<<<1, kSumThreads, 0, stream_>>>(n_, a_.weights.raw(), cp.weights_f64, flags_, stats_,
                                              sums);
  check_launch("sums_kernel");
  if (o_.timings) ev[2]->record(stream_);

  // backward
  if (dh_) {
    if (plan_.tiles) {
      pass_c();
    } else {
      sparse_path_backward();
    }
  }
  if (o_.timings) ev[3]->record(stream_);

  double host_sums[kSumCols];
  d2h(host_sums, sums, sizeof host_sums, stream_);
  LossResult res;
  res.divergence_sum = host_sums[kSumDiv];
  res.ce_sum = host_sums[kSumCe];
  res.sampled_kl_sum = host_sums[kSumKl];
  res.rows_used = static_cast<int64_t>(host_sums[kSumUsed]);
  res.tail_clamped = static_cast<int64_t>(host_sums[kSumClamped]);
  res.loss = (res.divergence_sum + c_.sft_alpha * res.ce_sum) / a_.n_total;
  if (o_.timings) {
    o_.timings->prepare_ms = ev[1]->elapsed_ms_since(*ev[0]);
    o_.timings->forward_ms = ev[2]->elapsed_ms_since(*ev[1]);
    o_.timings->backward_ms = ev[3]->elapsed_ms_since(*ev[2]);
  }
  return res;
}

}  // namespace

int64_t fused_loss_cuda_scratch_bytes(int64_t n, int64_t vocab, int64_t k, const LossConfig& config,
                                      DType input_dtype, DType logprob_dtype,
                                      const CudaLossOptions& options) {
  return make_plan(n, vocab, k, config, input_dtype, logprob_dtype, options).total;
}

LossResult fused_lm_head_loss_cuda(const LossConfig& config, const FusedLossArgs& args,
                                   Tensor* d_hidden, Tensor* d_lm_head,
                                   const CudaLossOptions& options, cudaStream_t stream) {
  OPD_CHECK(args.hidden.defined(), InvalidArgument, "fused loss (CUDA): hidden is missing");
  switch (args.hidden.dtype()) {
    case DType::F32:
      return CudaFusedLoss<float, float>(config, args, d_hidden, d_lm_head, options, stream).run();
    case DType::BF16:
      if (options.tile_dtype == DType::BF16)
        return CudaFusedLoss<bf16, bf16>(config, args, d_hidden, d_lm_head, options, stream).run();
      return CudaFusedLoss<bf16, float>(config, args, d_hidden, d_lm_head, options, stream).run();
    default:
      OPD_FAIL(InvalidArgument, "fused loss (CUDA): hidden must be bf16 or f32, got ",
               dtype_name(args.hidden.dtype()));
  }
}

}  // namespace opd::cuda
