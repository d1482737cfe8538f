// Tensor's device hooks on the CUDA runtime: storage from the caching allocator
// (core/cuda/allocator.h) on the calling thread's current stream, copies and zero fill.
// Tensor keeps its own byte counters (memory_stats(Device::CUDA): bytes of live tensors);
// the allocator's stats add what is reserved and cached.
#include "core/cuda/allocator.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/stream.h"  // device_count
#include "core/log.h"
#include "core/tensor.h"

namespace opd::device_hooks {

bool cuda_compiled() { return true; }
int cuda_device_count() { return cuda::device_count(); }

void* cuda_malloc(size_t bytes) { return cuda::device_allocator().allocate(bytes, cuda::current_stream()); }

void cuda_free(void* ptr) {
  try {
    cuda::device_allocator().deallocate(ptr);
  } catch (const Error& e) {  // destructor path: never throw, but say so
    log_error("device storage release: ", e.what());
  }
}

// Synchronous on purpose: host buffers are pageable and callers read results right after.
// With a non-default current stream, wait for it first so the copy sees the op's results.
void cuda_memcpy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  cudaMemcpyKind kind = dst_device == Device::CUDA
                            ? (src_device == Device::CUDA ? cudaMemcpyDeviceToDevice
                                                          : cudaMemcpyHostToDevice)
                            : cudaMemcpyDeviceToHost;
  cudaStream_t stream = cuda::current_stream();
  OPD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream));
  OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void cuda_memset_zero(void* ptr, size_t bytes) {
  OPD_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, cuda::current_stream()));
}

}  // namespace opd::device_hooks
