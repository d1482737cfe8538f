// Row-broadcast bias add on CUDA: y[r, c] += bias[c] for y [n, out] (the fallback when the
// cuBLASLt bias epilogue is unavailable for a shape or pointer alignment).
#include <cuda_bf16.h>

#include <cstdint>

#include "core/cuda/stream.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemm.h"

namespace opd::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void add_bias_rows_kernel(T* y, const T* bias, int64_t n, int64_t out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n * out;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    y[i] = dev::from_f32<T>(dev::to_f32(y[i]) + dev::to_f32(bias[i % out]));
}

}  // namespace

void add_bias_rows(void* y, const void* bias, int64_t n, int64_t out, DType dtype,
                   cudaStream_t stream) {
  if (n == 0 || out == 0) return;
  if (dtype == DType::F32) {
    add_bias_rows_kernel<float><<<grid_for(n * out, kThreads), kThreads, 0, stream>>>(
        static_cast<float*>(y), static_cast<const float*>(bias), n, out);
  } else if (dtype == DType::BF16) {
    add_bias_rows_kernel<__nv_bfloat16><<<grid_for(n * out, kThreads), kThreads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(y), static_cast<const __nv_bfloat16*>(bias), n, out);
  } else {
    OPD_FAIL(Unsupported, "CUDA add_bias_rows for dtype ", dtype_name(dtype));
  }
  check_launch("add_bias_rows_kernel");
}

}  // namespace opd::cuda
