// Programmatic dependent launch (PDL, CUDA 12.3+, compute capability 9.0; CUDA programming guide
// "Programmatic Dependent Launch and Synchronization"): a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the kernel before it in the
// stream (or graph) is still running, once every CTA of that kernel has executed
// griddepcontrol.launch_dependents or exited. It runs its prologue (loads that do not depend on
// the predecessor: weights, block tables, indices uploaded before the step) and then calls
// pdl_wait() (griddepcontrol.wait), which returns when the predecessor grids have *completed*
// and their memory is visible: everything after it sees what a plain stream-ordered launch
// sees. Without the attribute both instructions are no-ops, so one kernel serves both launches.
//
// Rules the decode kernels keep (why a PDL launch cannot change a result):
//   - before pdl_wait(): only loads of memory no kernel of the step writes (weights, the step's
//     uploaded indices, constants), shared-memory work, and error-flag atomics (commutative;
//     the flag was uploaded before the step); no global store of results;
//   - the wait is complete-and-flush of the predecessor, and the predecessor itself started only
//     after its own predecessor triggered: so the chain is transitively ordered even when a
//     kernel triggers before its own wait;
//   - every thread calls pdl_wait() before it exits, also on early-return paths, so a grid never
//     completes before its predecessor (a plain launch after it then also follows the
//     predecessor).
// Only .cu files include it (C++17).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "core/cuda/stream.h"  // OPD_CUDA_CHECK

namespace opd::cuda::dev {

// Waits until the predecessor grids completed and their writes are visible (no-op when the
// kernel was launched without the PDL attribute, or on architectures before sm_90).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets a PDL-launched successor start scheduling (its CTAs run their prologue, then wait for this
// grid to complete). Carries no memory ordering: the successor's pdl_wait() does.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace opd::cuda::dev

namespace opd::cuda {

// kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute when `pdl` is true
// (cudaLaunchKernelEx; capturable in a CUDA graph, where it becomes a programmatic edge).
// Launch errors are thrown (OPD_CUDA_CHECK) with the kernel's name.
template <typename... KArgs, typename... Args>
void launch_kernel(const char* name, void (*kernel)(KArgs...), dim3 grid, dim3 block,
                   size_t smem, cudaStream_t stream, bool pdl, Args&&... args) {
  if (!pdl) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    check_launch(name);
    return;
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t st = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (st != cudaSuccess) {
    (void)cudaGetLastError();
    OPD_FAIL(Cuda, "PDL launch of ", name, " failed: ", cudaGetErrorName(st), " (",
             cudaGetErrorString(st), ")");
  }
}

}  // namespace opd::cuda
