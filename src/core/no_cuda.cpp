// Device hooks for builds without CUDA: every device request is a clear Unsupported error.
#include "core/tensor.h"

namespace opd::device_hooks {

bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }
CudaMemoryInfo cuda_memory_info() { return {}; }
[[noreturn]] static void no_cuda() {
  OPD_FAIL(Unsupported, "this opd was built without CUDA (nvcc was not found at configure time)");
}
void* cuda_malloc(size_t) { no_cuda(); }
void cuda_free(void*) {}
void cuda_memcpy(void*, Device, const void*, Device, size_t) { no_cuda(); }
void cuda_memset_zero(void*, size_t) { no_cuda(); }

}  // namespace opd::device_hooks
