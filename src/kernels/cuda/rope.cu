// Rotary position embedding on CUDA, in place, Hugging Face "rotate_half" layout (formula in
// kernels/ops.h): for i < d/2, angle = (float)pos[t] * inv_freq[i] (an f32 product, as the CPU
// f32 path and transformers form it), x[i]' = x[i] cos - x[i+d/2] sin,
// x[i+d/2]' = x[i+d/2] cos + x[i] sin; the inverse (backward) rotates by -angle.
// A thread owns W consecutive frequencies of one row for up to kHeadsPerThread heads, so each
// sincosf is reused across heads and both halves move as 16-byte vectors. Positions were
// validated (>= 0) before the launch.
#include <cuda_bf16.h>

#include <cstdint>

#include "core/cuda/stream.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace opd::cuda {
namespace {

using dev::Pack;
constexpr int kThreads = 256;
constexpr int kHeadsPerThread = 4;

template <typename T, int W>
__global__ void rope_kernel(T* x, const int32_t* positions, const float* inv_freq, int64_t n,
                            int64_t heads, int64_t head_dim, float sign) {
  const int64_t half = head_dim / 2;
  const int64_t chunks = half / W;
  const int64_t head_groups = (heads + kHeadsPerThread - 1) / kHeadsPerThread;
  const int64_t total = n * chunks * head_groups;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * kThreads) {
    // Consecutive threads take consecutive chunks of one row and head group (coalesced).
    const int64_t c = idx % chunks;
    const int64_t hg = (idx / chunks) % head_groups;
    const int64_t t = idx / (chunks * head_groups);
    const float pos = static_cast<float>(positions[t]);
    float cs[W], sn[W];
#pragma unroll
    for (int i = 0; i < W; ++i) {
      sincosf(pos * inv_freq[c * W + i], &sn[i], &cs[i]);
      sn[i] *= sign;
    }
    const int64_t h1 = min(heads, (hg + 1) * kHeadsPerThread);
    for (int64_t hd = hg * kHeadsPerThread; hd < h1; ++hd) {
      T* row = x + (t * heads + hd) * head_dim;
      Pack<T, W> a, b;
      a.load_rw(row + c * W);
      b.load_rw(row + half + c * W);
      Pack<T, W> a2, b2;
#pragma unroll
      for (int i = 0; i < W; ++i) {
        a2.f[i] = a.f[i] * cs[i] - b.f[i] * sn[i];
        b2.f[i] = b.f[i] * cs[i] + a.f[i] * sn[i];
      }
      a2.store(row + c * W);
      b2.store(row + half + c * W);
    }
  }
}

template <typename T>
void rope_typed(void* x, const int32_t* positions, const float* inv_freq, int64_t n,
                int64_t heads, int64_t head_dim, float sign, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  T* xt = static_cast<T*>(x);
  const int64_t half = head_dim / 2;
  const int64_t head_groups = (heads + kHeadsPerThread - 1) / kHeadsPerThread;
  if (half % V == 0 && dev::aligned16(xt)) {
    rope_kernel<T, V><<<grid_for(n * (half / V) * head_groups, kThreads), kThreads, 0, stream>>>(
        xt, positions, inv_freq, n, heads, head_dim, sign);
  } else {
    rope_kernel<T, 1><<<grid_for(n * half * head_groups, kThreads), kThreads, 0, stream>>>(
        xt, positions, inv_freq, n, heads, head_dim, sign);
  }
  check_launch("rope_kernel");
}

}  // namespace

void rope(void* x, const int32_t* positions, const float* inv_freq, int64_t n, int64_t heads,
          int64_t head_dim, DType dtype, bool inverse, cudaStream_t stream) {
  if (n == 0 || heads == 0 || head_dim == 0) return;
  const float sign = inverse ? -1.0f : 1.0f;
  switch (dtype) {
    case DType::F32:
      return rope_typed<float>(x, positions, inv_freq, n, heads, head_dim, sign, stream);
    case DType::BF16:
      return rope_typed<__nv_bfloat16>(x, positions, inv_freq, n, heads, head_dim, sign, stream);
    default: OPD_FAIL(Unsupported, "CUDA rope for dtype ", dtype_name(dtype));
  }
}

}  // namespace opd::cuda
