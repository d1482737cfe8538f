// Philox uniform fill on CUDA: the same header-only generator as the CPU (core/philox.h),
// so out[i] equals philox_uniform(seed, stream_id, i) computed on the host, bit for bit.
#include "core/cuda/stream.h"
#include "core/philox.h"
#include "kernels/cuda/cuda_ops.h"

namespace opd::cuda {
namespace {

__global__ void philox_uniform_kernel(float* out, int64_t n, uint64_t seed, uint64_t stream_id) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = philox_uniform(seed, stream_id, static_cast<uint64_t>(i));
}

}  // namespace

void philox_uniform_fill(float* out, int64_t n, uint64_t seed, uint64_t stream_id,
                         cudaStream_t stream) {
  if (n == 0) return;
  const int threads = 256;
  const unsigned blocks = static_cast<unsigned>((n + threads - 1) / threads);
  philox_uniform_kernel<<<blocks, threads, 0, stream>>>(out, n, seed, stream_id);
  check_launch("philox_uniform_kernel");
}

}  // namespace opd::cuda
