// Elementwise sum on CUDA: out = a + b (residual adds; acc += x is add(acc, x, acc)), rounded
// once from the f32 sum to the storage dtype; 16-byte vectors when size and alignment allow.
#include <cuda_bf16.h>

#include <cstdint>

#include "core/cuda/stream.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace opd::cuda {
namespace {

using dev::Pack;
constexpr int kThreads = 256;

template <typename T, int W>
__global__ void add_kernel(const T* a, const T* b, int64_t chunks, T* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    Pack<T, W> x, y;
    x.load_rw(a + i * W);  // out may alias a or b
    y.load_rw(b + i * W);
#pragma unroll
    for (int k = 0; k < W; ++k) x.f[k] += y.f[k];
    x.store(out + i * W);
  }
}

template <typename T>
void add_typed(const void* a, const void* b, int64_t n, void* out, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const T *at = static_cast<const T*>(a), *bt = static_cast<const T*>(b);
  T* o = static_cast<T*>(out);
  if (n % V == 0 && dev::aligned16(at) && dev::aligned16(bt) && dev::aligned16(o)) {
    add_kernel<T, V><<<grid_for(n / V, kThreads), kThreads, 0, stream>>>(at, bt, n / V, o);
  } else {
    add_kernel<T, 1><<<grid_for(n, kThreads), kThreads, 0, stream>>>(at, bt, n, o);
  }
  check_launch("add_kernel");
}

}  // namespace

void add(const void* a, const void* b, int64_t n, DType dtype, void* out, cudaStream_t stream) {
  if (n == 0) return;
  switch (dtype) {
    case DType::F32: return add_typed<float>(a, b, n, out, stream);
    case DType::BF16: return add_typed<__nv_bfloat16>(a, b, n, out, stream);
    default: OPD_FAIL(Unsupported, "CUDA add for dtype ", dtype_name(dtype));
  }
}

}  // namespace opd::cuda
