// Tensor's device hooks on the CUDA runtime: allocation, copies, zero fill.
// (A caching allocator replaces the raw cudaMalloc here in the CUDA-backend issue.)
#include "core/cuda/cuda_check.h"
#include "core/tensor.h"

namespace opd::device_hooks {

bool cuda_compiled() { return true; }

void* cuda_malloc(size_t bytes) {
  void* p = nullptr;
  cudaError_t st = cudaMalloc(&p, bytes);
  if (st == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    OPD_FAIL(OutOfMemory, "cudaMalloc of ", bytes, " bytes failed: device out of memory");
  }
  OPD_CUDA_CHECK(st);
  return p;
}

void cuda_free(void* ptr) {
  if (ptr) (void)cudaFree(ptr);  // destructor path: never throw
}

void cuda_memcpy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  cudaMemcpyKind kind = dst_device == Device::CUDA
                            ? (src_device == Device::CUDA ? cudaMemcpyDeviceToDevice
                                                          : cudaMemcpyHostToDevice)
                            : cudaMemcpyDeviceToHost;
  OPD_CUDA_CHECK(cudaMemcpy(dst, src, bytes, kind));
}

void cuda_memset_zero(void* ptr, size_t bytes) { OPD_CUDA_CHECK(cudaMemset(ptr, 0, bytes)); }

}  // namespace opd::device_hooks
