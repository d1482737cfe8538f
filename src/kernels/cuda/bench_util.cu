// Device helpers for benchmarks and tests: fill a buffer with Philox uniforms (or normals) in its
// storage dtype (no host round trip for GB-sized inputs), and a spin kernel that holds a stream for a
// while so the host can queue a timed loop ahead of the GPU (launch gaps stay out of timings).
#include <cuda_bf16.h>

#include "core/cuda/stream.h"
#include "core/philox.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/pdl.cuh"

namespace opd::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void fill_uniform_kernel(T* out, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    out[i] = dev::from_f32<T>(lo + (hi - lo) * philox_uniform(seed, 5, static_cast<uint64_t>(i)));
}

// Box-Muller on two Philox uniforms per element (u1 in (0, 1] so the log is finite).
template <typename T>
__global__ void fill_normal_kernel(T* out, int64_t n, uint64_t seed, float mean, float std) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float u1 = 1.0f - philox_uniform(seed, 7, 2 * static_cast<uint64_t>(i));
    const float u2 = philox_uniform(seed, 7, 2 * static_cast<uint64_t>(i) + 1);
    const float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    out[i] = dev::from_f32<T>(mean + std * z);
  }
}

__global__ void fill_ints_kernel(int32_t* out, int64_t n, uint64_t seed, int32_t lo, int32_t hi) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float u = philox_uniform(seed, 6, static_cast<uint64_t>(i));
    out[i] = min(hi - 1, lo + static_cast<int32_t>(u * static_cast<float>(hi - lo)));
  }
}

__global__ void spin_kernel(uint64_t ns, bool release_dependents) {
  // A PDL-launched successor may start at once (tests: it runs its prologue while this spins).
  if (release_dependents) dev::pdl_launch_dependents();
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

// Each block spins ~spin_ns (so the blocks of the grid are resident together) and records its
// SM: which SMs a stream's kernels may run on.
__global__ void sm_ids_kernel(int32_t* out, uint64_t spin_ns) {
  uint32_t smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < spin_ns);
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int32_t>(smid);
}

}  // namespace

void sm_ids(int32_t* out, int blocks, cudaStream_t stream) {
  if (blocks <= 0) return;
  sm_ids_kernel<<<blocks, 32, 0, stream>>>(out, 20000);
  check_launch("sm_ids_kernel");
}

void fill_uniform(void* out, int64_t n, DType dtype, uint64_t seed, float lo, float hi,
                  cudaStream_t stream) {
  if (n == 0) return;
  if (dtype == DType::F32) {
    fill_uniform_kernel<float><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
        static_cast<float*>(out), n, seed, lo, hi);
  } else if (dtype == DType::BF16) {
    fill_uniform_kernel<__nv_bfloat16><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(out), n, seed, lo, hi);
  } else {
    OPD_FAIL(Unsupported, "fill_uniform for dtype ", dtype_name(dtype));
  }
  check_launch("fill_uniform_kernel");
}

void fill_normal(void* out, int64_t n, DType dtype, uint64_t seed, float mean, float std,
                 cudaStream_t stream) {
  if (n == 0) return;
  if (dtype == DType::F32) {
    fill_normal_kernel<float><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
        static_cast<float*>(out), n, seed, mean, std);
  } else if (dtype == DType::BF16) {
    fill_normal_kernel<__nv_bfloat16><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(out), n, seed, mean, std);
  } else {
    OPD_FAIL(Unsupported, "fill_normal for dtype ", dtype_name(dtype));
  }
  check_launch("fill_normal_kernel");
}

void fill_ints(int32_t* out, int64_t n, uint64_t seed, int32_t lo, int32_t hi,
               cudaStream_t stream) {
  if (n == 0) return;
  fill_ints_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(out, n, seed, lo, hi);
  check_launch("fill_ints_kernel");
}

void spin(double microseconds, cudaStream_t stream, bool release_dependents) {
  spin_kernel<<<1, 1, 0, stream>>>(static_cast<uint64_t>(microseconds * 1000.0),
                                   release_dependents);
  check_launch("spin_kernel");
}

}  // namespace opd::cuda
