// RAII CUDA stream, event and cuBLAS/cuBLASLt handles; device queries (see stream.h).
#include "core/cuda/stream.h"

#include "core/cuda/allocator.h"  // release_stream: cached blocks must not outlive their stream

namespace opd::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: clear the sticky error, report 0
    return 0;
  }
  return n;
}

std::string device_description(int index) {
  cudaDeviceProp prop{};
  OPD_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  return cat(prop.name, " (sm_", prop.major, prop.minor, ", ", prop.multiProcessorCount, " SMs, ",
             static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024 * 1024), " GiB)");
}

Stream::Stream() { OPD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
namespace {
void destroy_stream(cudaStream_t stream) noexcept {
  if (!stream) return;
  try {
    device_allocator().release_stream(stream);
  } catch (...) {  // never throw from a destructor; the stream is destroyed regardless
  }
  (void)cudaStreamDestroy(stream);
}
}  // namespace

Stream::~Stream() { destroy_stream(stream_); }
Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    destroy_stream(stream_);
    stream_ = other.stream_;
    other.stream_ = nullptr;
  }
  return *this;
}
void Stream::synchronize() const { OPD_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

Event::Event() { OPD_CUDA_CHECK(cudaEventCreate(&event_)); }
Event::~Event() {
  if (event_) (void)cudaEventDestroy(event_);
}
void Event::record(cudaStream_t stream) { OPD_CUDA_CHECK(cudaEventRecord(event_, stream)); }
float Event::elapsed_ms_since(const Event& start) const {
  OPD_CUDA_CHECK(cudaEventSynchronize(event_));
  float ms = 0;
  OPD_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, event_));
  return ms;
}

CublasHandle::CublasHandle(cudaStream_t stream) {
  OPD_CUBLAS_CHECK(cublasCreate(&handle_));
  OPD_CUBLAS_CHECK(cublasSetStream(handle_, stream));
  OPD_CUBLAS_CHECK(cublasLtCreate(&lt_));
}
CublasHandle::~CublasHandle() {
  if (lt_) (void)cublasLtDestroy(lt_);
  if (handle_) (void)cublasDestroy(handle_);
}

void check_launch(const char* kernel_name) {
  cudaError_t st = cudaGetLastError();
  if (st != cudaSuccess)
    // cudaGetLastError also returns a sticky fault of earlier asynchronous work (another
    // kernel, a library's GEMM): the message says so, since the name alone misleads.
    OPD_FAIL(Cuda, "launch of ", kernel_name, " failed: ", cudaGetErrorName(st), " (",
             cudaGetErrorString(st), "; the fault may be an earlier kernel's, surfacing here:"
             " CUDA_LAUNCH_BLOCKING=1 attributes it)");
}

}  // namespace opd::cuda
