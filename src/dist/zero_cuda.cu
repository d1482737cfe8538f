// x[i] *= s over a gradient shard (zero_cuda.h). Grid-stride loop, no alignment assumption
// (a shard view may start anywhere in its buffer), bounds checked on every index.
#include <cuda_runtime.h>

#include "core/cuda/cuda_check.h"
#include "dist/zero_cuda.h"

namespace opd::dist::cuda {

namespace {
__global__ void scale_kernel(float* x, int64_t n, float s) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    x[i] = x[i] * s;
}
}  // namespace

void scale_inplace_f32(float* x, int64_t n, float s, cudaStream_t stream) {
  if (n <= 0) return;
  const int threads = 256;
  const int64_t want = (n + threads - 1) / threads;
  const int blocks = static_cast<int>(want < 4096 ? want : 4096);
  scale_kernel<<<blocks, threads, 0, stream>>>(x, n, s);
  OPD_CUDA_CHECK(cudaGetLastError());
}

}  // namespace opd::dist::cuda
