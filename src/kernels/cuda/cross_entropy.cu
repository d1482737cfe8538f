// Cross-entropy per row on CUDA (formula in kernels/ops.h): lse = log sum_c exp(z_c) by an
// online log-sum-exp (Milakov & Gimelshein 2018: a running (max, scaled sum) per thread, merged
// across the block), so the logits are read once; loss = lse - z[target] (0 for -100).
// Backward: dlogits = scale * (exp(z - lse) - onehot(target)), 0 for ignored rows.
// One block per row, 16-byte vectors when the vocabulary and alignment allow; targets were
// validated (check_indices) before the launch and are re-guarded here.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "core/cuda/stream.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace opd::cuda {
namespace {

using dev::Pack;
constexpr int kThreads = 512;
constexpr int kIgnore = -100;

// (m, s) represents sum = s * exp(m). Merging keeps the larger max; -inf maxima carry s = 0.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;  // both empty
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  m = mx;
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    ce_forward_kernel(const T* logits, const int32_t* targets, int64_t n, int64_t vocab,
                      float* losses, float* lse) {
  __shared__ float sm_m[kThreads / 32], sm_s[kThreads / 32];
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const T* z = logits + row * vocab;
    float m = -INFINITY, s = 0;
    for (int64_t c = static_cast<int64_t>(threadIdx.x) * W; c < vocab;
         c += static_cast<int64_t>(kThreads) * W) {
      Pack<T, W> v;
      v.load(z + c);
      float mv = v.f[0];
#pragma unroll
      for (int i = 1; i < W; ++i) mv = fmaxf(mv, v.f[i]);
      if (mv > m) {
        s *= expf(m - mv);  // m = -inf: exp(-inf) = 0 and s was 0
        m = mv;
      }
      if (m != -INFINITY) {
#pragma unroll
        for (int i = 0; i < W; ++i) s += expf(v.f[i] - m);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
      const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
      lse_merge(m, s, m2, s2);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
      sm_m[warp] = m;
      sm_s[warp] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float bm = sm_m[0], bs = sm_s[0];
      for (int k = 1; k < kThreads / 32; ++k) lse_merge(bm, bs, sm_m[k], sm_s[k]);
      const float row_lse = bm + logf(bs);
      lse[row] = row_lse;
      const int32_t y = targets[row];
      losses[row] = (y == kIgnore || y < 0 || y >= vocab) ? 0.0f : row_lse - dev::to_f32(z[y]);
    }
    __syncthreads();  // sm_* reused by the next row
  }
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads)
    ce_backward_kernel(const T* logits, const int32_t* targets, const float* lse, int64_t n,
                       int64_t vocab, float scale, T* dlogits) {
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const T* z = logits + row * vocab;
    T* dz = dlogits + row * vocab;
    const int32_t y = targets[row];
    const bool ignored = y == kIgnore || y < 0 || y >= vocab;
    const float l = lse[row];
    for (int64_t c = static_cast<int64_t>(threadIdx.x) * W; c < vocab;
         c += static_cast<int64_t>(kThreads) * W) {
      Pack<T, W> v;
      if (!ignored) v.load(z + c);
#pragma unroll
      for (int i = 0; i < W; ++i)
        v.f[i] = ignored ? 0.0f : scale * (expf(v.f[i] - l) - (c + i == y ? 1.0f : 0.0f));
      v.store(dz + c);
    }
  }
}

template <typename T>
void forward_typed(const void* logits, const int32_t* targets, int64_t n, int64_t vocab,
                   float* losses, float* lse, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const T* z = static_cast<const T*>(logits);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(n, 1 << 20));
  if (vocab % V == 0 && dev::aligned16(z)) {
    ce_forward_kernel<T, V><<<blocks, kThreads, 0, stream>>>(z, targets, n, vocab, losses, lse);
  } else {
    ce_forward_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(z, targets, n, vocab, losses, lse);
  }
  check_launch("ce_forward_kernel");
}

template <typename T>
void backward_typed(const void* logits, const int32_t* targets, const float* lse, int64_t n,
                    int64_t vocab, float scale, void* dlogits, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const T* z = static_cast<const T*>(logits);
  T* dz = static_cast<T*>(dlogits);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(n, 1 << 20));
  if (vocab % V == 0 && dev::aligned16(z) && dev::aligned16(dz)) {
    ce_backward_kernel<T, V><<<blocks, kThreads, 0, stream>>>(z, targets, lse, n, vocab, scale, dz);
  } else {
    ce_backward_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(z, targets, lse, n, vocab, scale, dz);
  }
  check_launch("ce_backward_kernel");
}

}  // namespace

void cross_entropy_forward(const void* logits, const int32_t* targets, int64_t n, int64_t vocab,
                           DType dtype, float* losses, float* lse, cudaStream_t stream) {
  if (n == 0) return;
  switch (dtype) {
    case DType::F32: return forward_typed<float>(logits, targets, n, vocab, losses, lse, stream);
    case DType::BF16:
      return forward_typed<__nv_bfloat16>(logits, targets, n, vocab, losses, lse, stream);
    default: OPD_FAIL(Unsupported, "CUDA cross_entropy_forward for dtype ", dtype_name(dtype));
  }
}

void cross_entropy_backward(const void* logits, const int32_t* targets, const float* lse,
                            int64_t n, int64_t vocab, double scale, DType dtype, void* dlogits,
                            cudaStream_t stream) {
  if (n == 0) return;
  const float s = static_cast<float>(scale);
  switch (dtype) {
    case DType::F32:
      return backward_typed<float>(logits, targets, lse, n, vocab, s, dlogits, stream);
    case DType::BF16:
      return backward_typed<__nv_bfloat16>(logits, targets, lse, n, vocab, s, dlogits, stream);
    default: OPD_FAIL(Unsupported, "CUDA cross_entropy_backward for dtype ", dtype_name(dtype));
  }
}

}  // namespace opd::cuda
