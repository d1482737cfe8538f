// RMSNorm forward/backward on CUDA (formula in kernels/ops.h): y = x * rstd * w,
// rstd = 1/sqrt(mean(x^2) + eps); f32 or bf16 storage, f32 accumulation.
// Forward/backward-dx: one block per row, block-wide reductions through warp shuffles.
// Backward-dw is deterministic (no atomics): row groups write partial column sums to a
// scratch buffer, then one pass adds the groups in a fixed order into dw.
#include <cuda_bf16.h>

#include <cstdint>

#include "core/cuda/stream.h"
#include "kernels/cuda/cuda_ops.h"

namespace opd::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}

// Sum over the block; every thread gets the result.
__device__ float block_sum(float v) {
  __shared__ float partial[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = 0;
  for (int i = 0; i < kThreads / 32; ++i) total += partial[i];
  __syncthreads();  // partial[] is reused by the next call
  return total;
}

template <typename T>
__global__ void rmsnorm_forward_kernel(const T* x, const T* w, float eps, int64_t h, T* y,
                                       float* rstd) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * h;
  float ss = 0;
  for (int64_t i = threadIdx.x; i < h; i += kThreads) {
    float v = load(xr, i);
    ss += v * v;
  }
  const float r = rsqrtf(block_sum(ss) / static_cast<float>(h) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  T* yr = y + row * h;
  for (int64_t i = threadIdx.x; i < h; i += kThreads) store(yr, i, load(xr, i) * r * load(w, i));
}

template <typename T>
__global__ void rmsnorm_backward_dx_kernel(const T* dy, const T* x, const T* w,
                                           const float* rstd, int64_t h, T* dx) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * h;
  const T* dyr = dy + row * h;
  float dot = 0;  // sum_i x_i * w_i * dy_i
  for (int64_t i = threadIdx.x; i < h; i += kThreads) dot += load(xr, i) * load(w, i) * load(dyr, i);
  const float mean = block_sum(dot) / static_cast<float>(h);
  const float r = rstd[row];
  T* dxr = dx + row * h;
  for (int64_t i = threadIdx.x; i < h; i += kThreads)
    store(dxr, i, r * (load(w, i) * load(dyr, i) - load(xr, i) * r * r * mean));
}

// partial[g, i] = sum over rows of group g of dy * x * rstd (column i).
template <typename T>
__global__ void rmsnorm_backward_dw_partial_kernel(const T* dy, const T* x, const float* rstd,
                                                   int64_t n, int64_t h, int64_t rows_per_group,
                                                   float* partial) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (i >= h) return;
  const int64_t g = blockIdx.y;
  const int64_t begin = g * rows_per_group;
  const int64_t end = min(n, begin + rows_per_group);
  float acc = 0;
  for (int64_t r = begin; r < end; ++r) acc += load(dy, r * h + i) * load(x, r * h + i) * rstd[r];
  partial[g * h + i] = acc;
}

__global__ void rmsnorm_backward_dw_reduce_kernel(const float* partial, int64_t groups, int64_t h,
                                                  float* dw) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (i >= h) return;
  float acc = 0;
  for (int64_t g = 0; g < groups; ++g) acc += partial[g * h + i];
  dw[i] += acc;
}

template <typename T>
void forward_impl(const void* x, const void* w, double eps, int64_t n, int64_t h, void* y,
                  float* rstd, cudaStream_t stream) {
  if (n == 0) return;
  rmsnorm_forward_kernel<T><<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(w), static_cast<float>(eps), h,
      static_cast<T*>(y), rstd);
  check_launch("rmsnorm_forward_kernel");
}

template <typename T>
void backward_impl(const void* dy, const void* x, const void* w, const float* rstd, int64_t n,
                   int64_t h, void* dx, float* dw, cudaStream_t stream) {
  if (n == 0) return;
  rmsnorm_backward_dx_kernel<T><<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
      static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w), rstd, h,
      static_cast<T*>(dx));
  check_launch("rmsnorm_backward_dx_kernel");
  // Enough row groups to fill the GPU, each long enough to amortize its partial row.
  const int64_t groups = std::min<int64_t>(128, (n + 31) / 32);
  const int64_t rows_per_group = (n + groups - 1) / groups;
  float* partial = nullptr;
  OPD_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&partial),
                                 static_cast<size_t>(groups * h) * sizeof(float), stream));
  const unsigned col_blocks = static_cast<unsigned>((h + kThreads - 1) / kThreads);
  rmsnorm_backward_dw_partial_kernel<T><<<dim3(col_blocks, static_cast<unsigned>(groups)), kThreads,
                                          0, stream>>>(static_cast<const T*>(dy),
                                                       static_cast<const T*>(x), rstd, n, h,
                                                       rows_per_group, partial);
  check_launch("rmsnorm_backward_dw_partial_kernel");
  rmsnorm_backward_dw_reduce_kernel<<<col_blocks, kThreads, 0, stream>>>(partial, groups, h, dw);
  check_launch("rmsnorm_backward_dw_reduce_kernel");
  OPD_CUDA_CHECK(cudaFreeAsync(partial, stream));
}

}  // namespace

void rmsnorm_forward(const void* x, const void* w, double eps, int64_t n, int64_t h, DType dtype,
                     void* y, float* rstd, cudaStream_t stream) {
  switch (dtype) {
    case DType::F32: return forward_impl<float>(x, w, eps, n, h, y, rstd, stream);
    case DType::BF16: return forward_impl<__nv_bfloat16>(x, w, eps, n, h, y, rstd, stream);
    default: OPD_FAIL(Unsupported, "CUDA rmsnorm_forward for dtype ", dtype_name(dtype));
  }
}

void rmsnorm_backward(const void* dy, const void* x, const void* w, const float* rstd, int64_t n,
                      int64_t h, DType dtype, void* dx, float* dw, cudaStream_t stream) {
  switch (dtype) {
    case DType::F32: return backward_impl<float>(dy, x, w, rstd, n, h, dx, dw, stream);
    case DType::BF16: return backward_impl<__nv_bfloat16>(dy, x, w, rstd, n, h, dx, dw, stream);
    default: OPD_FAIL(Unsupported, "CUDA rmsnorm_backward for dtype ", dtype_name(dtype));
  }
}

}  // namespace opd::cuda
