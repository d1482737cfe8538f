// RMSNorm forward/backward on CUDA, plain and fused with the residual add (formulas in
// kernels/ops.h): s = x (+ r), y = s * rstd * w, rstd = 1/sqrt(mean(s^2) + eps);
// ds = rstd * (w*dy - s * rstd^2 * mean(s*w*dy)) (+ dres), dw += sum_rows dy * s * rstd.
// f32 or bf16 storage, f32 arithmetic. The fused sum is rounded to the storage dtype before
// the norm, so forward and backward see the same s that is stored (as PyTorch does).
//
// Fast path (h a multiple of the 16-byte vector, aligned pointers, h <= 1024 vectors): a row
// is owned by a group of 8-256 threads, the smallest power of two that holds its vectors (a
// 1024-wide bf16 row: 128 threads; a q/k head of 128: 16), several rows per 256-thread block;
// each thread keeps its elements and w in registers, so x (and r) are read once and y (and s)
// written once. The backward accumulates dw in registers over the rows a block owns, combines
// the block's warps in a fixed order, writes one partial row per block, and a fixed-order
// tree over blocks adds it to dw: deterministic, no float atomics. The grid depends only on
// the shape, so results are identical on every GPU. Other shapes take a simple block-per-row
// path that re-reads the row.
// Decode steps may launch the forward fast path with programmatic dependent launch (`pdl`,
// kernels/cuda/pdl.cuh: the weight row loads overlap the predecessor); the other paths ignore it
// (a plain launch is always correct). Same results either way.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/allocator.h"
#include "core/cuda/stream.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/pdl.cuh"

namespace opd::cuda {
namespace {

using dev::Pack;
constexpr int kBlock = 256;

// Sum over the kGroup consecutive threads that own a row (kGroup a power of two, 8 .. kBlock),
// in a fixed order; every thread of the group gets it. Groups of <= 32 threads shuffle inside
// their warp; wider groups add their warps' sums through `red` (kBlock / 32 floats of shared
// memory) between two barriers, so every thread of the block must call it the same number of
// times (the row loops below have a block-uniform trip count).
template <int kGroup>
__device__ __forceinline__ float group_sum(float v, float* red) {
  static_assert(kGroup >= 8 && kGroup <= kBlock && (kGroup & (kGroup - 1)) == 0, "group size");
  if constexpr (kGroup <= 32) {
#pragma unroll
    for (int o = kGroup / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
  } else {
    v = dev::warp_sum(v);
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    constexpr int kWarps = kGroup / 32;
    const int first = warp / kWarps * kWarps;
    float total = 0;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) total += red[first + i];
    __syncthreads();  // red[] is reused by the next call
    return total;
  }
}

// ---------------------------------------------------------------- fast path
// kPdl (decode steps launched with programmatic dependent launch, kernels/cuda/pdl.cuh): the
// norm weight is loaded before waiting for the predecessor (the GEMM that wrote r / x); the
// training path instantiates kPdl = false, unchanged.
template <typename T, int W, int kGroup, int kE, bool kRes, bool kPdl = false>
__global__ void __launch_bounds__(kBlock)
    rms_fwd_fast(const T* x, const T* r, const T* w, float eps, int64_t n, int64_t h, T* sum,
                 T* y, float* rstd) {
  constexpr int kRowsPerBlock = kBlock / kGroup;
  const int lane = threadIdx.x % kGroup;
  Pack<T, W> wv[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    const int64_t col = static_cast<int64_t>(e * kGroup + lane) * W;
    if (col < h) wv[e].load(w + col);
  }
  if constexpr (kPdl) {
    // The next kernel is a GEMM: with opd's decode linear (PDL-launched) its CTAs start
    // streaming their weights as soon as they fit beside this kernel (released before this
    // kernel's own wait: pdl.cuh, the chain stays ordered); cuBLASLt's GEMMs are launched
    // plainly, for which this is a no-op.
    dev::pdl_launch_dependents();
    dev::pdl_wait();
  }
  __shared__ float red[kBlock / 32];
  // Block-uniform trip count (group_sum's barriers): a group past the last row idles along.
  for (int64_t base = blockIdx.x * static_cast<int64_t>(kRowsPerBlock); base < n;
       base += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t row = base + threadIdx.x / kGroup;
    const bool active = row < n;
    Pack<T, W> v[kE];
    float ss = 0;
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      const int64_t col = static_cast<int64_t>(e * kGroup + lane) * W;
      if (active && col < h) {
        v[e].load(x + row * h + col);
        if constexpr (kRes) {
          Pack<T, W> rr;
          rr.load(r + row * h + col);
#pragma unroll
          for (int i = 0; i < W; ++i) v[e].f[i] += rr.f[i];
          v[e].round_to_storage();
          v[e].store(sum + row * h + col);
        }
#pragma unroll
        for (int i = 0; i < W; ++i) ss += v[e].f[i] * v[e].f[i];
      }
    }
    const float rs = rsqrtf(group_sum<kGroup>(ss, red) / static_cast<float>(h) + eps);
    if (!active) continue;
    if (lane == 0) rstd[row] = rs;
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      const int64_t col = static_cast<int64_t>(e * kGroup + lane) * W;
      if (col < h) {
        Pack<T, W> o;
#pragma unroll
        for (int i = 0; i < W; ++i) o.f[i] = v[e].f[i] * rs * wv[e].f[i];
        o.store(y + row * h + col);
      }
    }
  }
}

template <typename T, int W, int kGroup, int kE, bool kRes>
__global__ void __launch_bounds__(kBlock)
    rms_bwd_fast(const T* dy, const T* x, const T* w, const float* rstd, const T* dres, int64_t n,
                 int64_t h, T* dx, float* partial) {
  constexpr int kRowsPerBlock = kBlock / kGroup;
  const int lane = threadIdx.x % kGroup;
  Pack<T, W> wv[kE];
  float dw[kE][W];
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    const int64_t col = static_cast<int64_t>(e * kGroup + lane) * W;
    if (col < h) wv[e].load(w + col);
#pragma unroll
    for (int i = 0; i < W; ++i) dw[e][i] = 0;
  }
  __shared__ float red[kBlock / 32];
  // Block-uniform trip count (group_sum's barriers): a group past the last row idles along.
  // Every load of a row (dy, x, rstd and the residual's gradient) is issued before the
  // reduction, so a row costs one memory round trip.
  for (int64_t base = blockIdx.x * static_cast<int64_t>(kRowsPerBlock); base < n;
       base += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t row = base + threadIdx.x / kGroup;
    const bool active = row < n;
    Pack<T, W> dyv[kE], xv[kE], dv[kE];
    float dot = 0;  // sum_i x_i * w_i * dy_i
    const float rs = active ? rstd[row] : 0.f;
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      const int64_t col = static_cast<int64_t>(e * kGroup + lane) * W;
      if (active && col < h) {
        dyv[e].load(dy + row * h + col);
        xv[e].load(x + row * h + col);
        if constexpr (kRes) dv[e].load_rw(dres + row * h + col);  // dres may alias dx
#pragma unroll
        for (int i = 0; i < W; ++i) dot += xv[e].f[i] * wv[e].f[i] * dyv[e].f[i];
      }
    }
    const float mean = group_sum<kGroup>(dot, red) / static_cast<float>(h);
    if (!active) continue;
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      const int64_t col = static_cast<int64_t>(e * kGroup + lane) * W;
      if (col < h) {
        Pack<T, W> o;
#pragma unroll
        for (int i = 0; i < W; ++i) {
          o.f[i] = rs * (wv[e].f[i] * dyv[e].f[i] - xv[e].f[i] * rs * rs * mean);
          dw[e][i] += dyv[e].f[i] * xv[e].f[i] * rs;
          if constexpr (kRes) o.f[i] += dv[e].f[i];
        }
        o.store(dx + row * h + col);
      }
    }
  }
  float* out = partial + blockIdx.x * h;
  if constexpr (kRowsPerBlock == 1) {
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      const int64_t col = static_cast<int64_t>(e * kGroup + lane) * W;
      if (col < h)
#pragma unroll
        for (int i = 0; i < W; ++i) out[col + i] = dw[e][i];
    }
  } else {
    // Warp-per-row: add the block's warps in warp order (fixed), one partial row per block.
    __shared__ float sm[kRowsPerBlock][kE * kGroup * W];
    const int warp = threadIdx.x / kGroup;
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      const int64_t col = static_cast<int64_t>(e * kGroup + lane) * W;
#pragma unroll
      for (int i = 0; i < W; ++i) sm[warp][col + i] = dw[e][i];
    }
    __syncthreads();
    for (int64_t c = threadIdx.x; c < h; c += kBlock) {
      float t = 0;
#pragma unroll
      for (int k = 0; k < kRowsPerBlock; ++k) t += sm[k][c];
      out[c] = t;
    }
  }
}

// ---------------------------------------------------------------- any shape
template <typename T, bool kRes>
__global__ void __launch_bounds__(kBlock)
    rms_fwd_slow(const T* x, const T* r, const T* w, float eps, int64_t h, T* sum, T* y,
                 float* rstd) {
  const int64_t row = blockIdx.x;
  float ss = 0;
  for (int64_t i = threadIdx.x; i < h; i += kBlock) {
    float v = dev::to_f32(x[row * h + i]);
    if constexpr (kRes) {
      v = dev::to_f32(dev::from_f32<T>(v + dev::to_f32(r[row * h + i])));
      sum[row * h + i] = dev::from_f32<T>(v);
    }
    ss += v * v;
  }
  const float rs = rsqrtf(dev::block_sum<kBlock>(ss) / static_cast<float>(h) + eps);
  if (threadIdx.x == 0) rstd[row] = rs;
  const T* s = kRes ? sum : x;  // the same thread wrote sum[i] above: no race
  for (int64_t i = threadIdx.x; i < h; i += kBlock)
    y[row * h + i] = dev::from_f32<T>(dev::to_f32(s[row * h + i]) * rs * dev::to_f32(w[i]));
}

template <typename T, bool kRes>
__global__ void __launch_bounds__(kBlock)
    rms_bwd_dx_slow(const T* dy, const T* x, const T* w, const float* rstd, const T* dres,
                    int64_t h, T* dx) {
  const int64_t row = blockIdx.x;
  float dot = 0;
  for (int64_t i = threadIdx.x; i < h; i += kBlock)
    dot += dev::to_f32(x[row * h + i]) * dev::to_f32(w[i]) * dev::to_f32(dy[row * h + i]);
  const float mean = dev::block_sum<kBlock>(dot) / static_cast<float>(h);
  const float rs = rstd[row];
  for (int64_t i = threadIdx.x; i < h; i += kBlock) {
    float v = rs * (dev::to_f32(w[i]) * dev::to_f32(dy[row * h + i]) -
                    dev::to_f32(x[row * h + i]) * rs * rs * mean);
    if constexpr (kRes) v += dev::to_f32(dres[row * h + i]);
    dx[row * h + i] = dev::from_f32<T>(v);
  }
}

// partial[g, i] = sum over the rows of group g of dy * x * rstd (column i).
template <typename T>
__global__ void rms_dw_partial_slow(const T* dy, const T* x, const float* rstd, int64_t n,
                                    int64_t h, int64_t rows_per_group, float* partial) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(kBlock) + threadIdx.x;
  if (i >= h) return;
  const int64_t g = blockIdx.y;
  const int64_t end = min(n, (g + 1) * rows_per_group);
  float acc = 0;
  for (int64_t r = g * rows_per_group; r < end; ++r)
    acc += dev::to_f32(dy[r * h + i]) * dev::to_f32(x[r * h + i]) * rstd[r];
  partial[g * h + i] = acc;
}

// ---------------------------------------------------------------- dispatch
struct Args {
  const void *x, *r, *w, *dy, *dres;
  const float* rstd_in;
  double eps;
  int64_t n, h;
  void *sum, *y, *dx;
  float *rstd, *dw;
  cudaStream_t stream;
  bool pdl = false;  // forward fast path: programmatic dependent launch (pdl.cuh)
};

// Batches of at most this many rows are decode-sized (try_fast).
constexpr int64_t kFewRows = 256;

// Blocks of the backward: each writes one partial row of dw, so their number trades
// parallelism against the partial traffic; it depends only on the shape.
int64_t bwd_blocks(int64_t n, int rows_per_block, int64_t h) {
  // 512: one wave on an H200 at the fast path's 4 blocks per SM (63 registers per thread).
  const int64_t cap = 512;
  return std::max<int64_t>(1, std::min<int64_t>((n + rows_per_block - 1) / rows_per_block, cap));
}

template <typename T, int W, int kGroup, int kE, bool kRes>
void launch_fast(const Args& a, bool forward) {
  constexpr int kRowsPerBlock = kBlock / kGroup;
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  if (forward) {
    const unsigned blocks = grid_for(a.n, kRowsPerBlock, 1 << 20);
    if (a.pdl) {
      launch_kernel("rms_fwd_fast", rms_fwd_fast<T, W, kGroup, kE, kRes, true>, dim3(blocks),
                    dim3(kBlock), 0, a.stream, true, x, static_cast<const T*>(a.r), w,
                    static_cast<float>(a.eps), a.n, a.h, static_cast<T*>(a.sum),
                    static_cast<T*>(a.y), a.rstd);
      return;
    }
    rms_fwd_fast<T, W, kGroup, kE, kRes><<<blocks, kBlock, 0, a.stream>>>(
        x, static_cast<const T*>(a.r), w, static_cast<float>(a.eps), a.n, a.h,
        static_cast<T*>(a.sum), static_cast<T*>(a.y), a.rstd);
    check_launch("rms_fwd_fast");
    return;
  }
  const int64_t blocks = bwd_blocks(a.n, kRowsPerBlock, a.h);
  DeviceBuffer partial(static_cast<size_t>(blocks * a.h) * sizeof(float), a.stream);
  rms_bwd_fast<T, W, kGroup, kE, kRes><<<static_cast<unsigned>(blocks), kBlock, 0, a.stream>>>(
      static_cast<const T*>(a.dy), x, w, a.rstd_in, static_cast<const T*>(a.dres), a.n, a.h,
      static_cast<T*>(a.dx), partial.as<float>());
  check_launch("rms_bwd_fast");
  reduce_partials_accumulate(partial.as<float>(), blocks, a.h, a.dw, a.stream);
}

// Picks the register layout for `chunks` accesses of W elements per row; false if too long.
template <typename T, int W, bool kRes>
bool try_fast(const Args& a, bool forward) {
  // A row of `chunks` W-wide accesses is owned by the smallest power-of-two group that holds it
  // (no idle lane for power-of-two rows: 1024 bf16 = 128 threads, two rows per block; a q/k
  // head of 128 = 16 threads, sixteen rows per block), longer rows by the block, kE accesses
  // per thread.
  // Decode-sized batches (<= kFewRows rows) keep a row per warp or per block: the few rows then
  // spread over as many SMs as possible (latency bounds them, not bandwidth; two 1024-wide rows
  // per block made the W1 rollout ~25 ms slower).
  const int64_t chunks = a.h / W;
  const bool few = a.n <= kFewRows;
  if (chunks <= 8 && !few) launch_fast<T, W, 8, 1, kRes>(a, forward);
  else if (chunks <= 16 && !few) launch_fast<T, W, 16, 1, kRes>(a, forward);
  else if (chunks <= 32) launch_fast<T, W, 32, 1, kRes>(a, forward);
  else if (chunks <= 64 && !few) launch_fast<T, W, 64, 1, kRes>(a, forward);
  else if (chunks <= 128 && !few) launch_fast<T, W, 128, 1, kRes>(a, forward);
  else if (chunks <= 256) launch_fast<T, W, 256, 1, kRes>(a, forward);
  else if (chunks <= 512) launch_fast<T, W, 256, 2, kRes>(a, forward);
  else if (chunks <= 1024) launch_fast<T, W, 256, 4, kRes>(a, forward);
  else return false;
  return true;
}

template <typename T, bool kRes>
void launch_slow(const Args& a, bool forward) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  const unsigned rows = static_cast<unsigned>(a.n);
  if (forward) {
    rms_fwd_slow<T, kRes><<<rows, kBlock, 0, a.stream>>>(x, static_cast<const T*>(a.r), w,
                                                         static_cast<float>(a.eps), a.h,
                                                         static_cast<T*>(a.sum),
                                                         static_cast<T*>(a.y), a.rstd);
    check_launch("rms_fwd_slow");
    return;
  }
  rms_bwd_dx_slow<T, kRes><<<rows, kBlock, 0, a.stream>>>(
      static_cast<const T*>(a.dy), x, w, a.rstd_in, static_cast<const T*>(a.dres), a.h,
      static_cast<T*>(a.dx));
  check_launch("rms_bwd_dx_slow");
  const int64_t groups = std::min<int64_t>(128, (a.n + 31) / 32);
  const int64_t rows_per_group = (a.n + groups - 1) / groups;
  DeviceBuffer partial(static_cast<size_t>(groups * a.h) * sizeof(float), a.stream);
  const unsigned col_blocks = static_cast<unsigned>((a.h + kBlock - 1) / kBlock);
  rms_dw_partial_slow<T><<<dim3(col_blocks, static_cast<unsigned>(groups)), kBlock, 0, a.stream>>>(
      static_cast<const T*>(a.dy), x, a.rstd_in, a.n, a.h, rows_per_group, partial.as<float>());
  check_launch("rms_dw_partial_slow");
  reduce_partials_accumulate(partial.as<float>(), groups, a.h, a.dw, a.stream);
}

template <typename T, bool kRes>
void run_typed(const Args& a, bool forward) {
  constexpr int V = 16 / sizeof(T);
  const bool aligned = dev::aligned16(a.x) && dev::aligned16(a.w) &&
                       (forward ? dev::aligned16(a.y) && (!kRes || (dev::aligned16(a.r) &&
                                                                    dev::aligned16(a.sum)))
                                : dev::aligned16(a.dy) && dev::aligned16(a.dx) &&
                                      (!kRes || dev::aligned16(a.dres)));
  if (aligned && a.h % V == 0 && try_fast<T, V, kRes>(a, forward)) return;
  if (try_fast<T, 1, kRes>(a, forward)) return;
  launch_slow<T, kRes>(a, forward);
}

void run(const Args& a, DType dtype, bool residual, bool forward, const char* op) {
  if (a.n == 0) return;
  OPD_CHECK(a.n <= 0x7fffffff && a.h > 0, InvalidArgument, op, ": n ", a.n, ", h ", a.h);
  if (dtype == DType::F32) {
    residual ? run_typed<float, true>(a, forward) : run_typed<float, false>(a, forward);
  } else if (dtype == DType::BF16) {
    residual ? run_typed<__nv_bfloat16, true>(a, forward)
             : run_typed<__nv_bfloat16, false>(a, forward);
  } else {
    OPD_FAIL(Unsupported, "CUDA ", op, " for dtype ", dtype_name(dtype));
  }
}

}  // namespace

void rmsnorm_forward(const void* x, const void* w, double eps, int64_t n, int64_t h, DType dtype,
                     void* y, float* rstd, cudaStream_t stream, bool pdl) {
  Args a{x, nullptr, w, nullptr, nullptr, nullptr, eps, n, h, nullptr, y, nullptr, rstd, nullptr,
         stream, pdl};
  run(a, dtype, false, true, "rmsnorm_forward");
}

void rmsnorm_backward(const void* dy, const void* x, const void* w, const float* rstd, int64_t n,
                      int64_t h, DType dtype, void* dx, float* dw, cudaStream_t stream) {
  Args a{x, nullptr, w, dy, nullptr, rstd, 0.0, n, h, nullptr, nullptr, dx, nullptr, dw, stream};
  run(a, dtype, false, false, "rmsnorm_backward");
}

void rmsnorm_residual_forward(const void* x, const void* r, const void* w, double eps, int64_t n,
                              int64_t h, DType dtype, void* sum, void* y, float* rstd,
                              cudaStream_t stream, bool pdl) {
  Args a{x, r, w, nullptr, nullptr, nullptr, eps, n, h, sum, y, nullptr, rstd, nullptr, stream, pdl};
  run(a, dtype, true, true, "rmsnorm_residual_forward");
}

void rmsnorm_residual_backward(const void* dy, const void* sum, const void* w, const float* rstd,
                               const void* dres, int64_t n, int64_t h, DType dtype, void* ds,
                               float* dw, cudaStream_t stream) {
  Args a{sum, nullptr, w, dy, dres, rstd, 0.0, n, h, nullptr, nullptr, ds, nullptr, dw, stream};
  run(a, dtype, true, false, "rmsnorm_residual_backward");
}

}  // namespace opd::cuda
