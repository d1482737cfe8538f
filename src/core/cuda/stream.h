// RAII owners of CUDA handles: Stream (cudaStream_t), Event (cudaEvent_t) and CublasHandle
// (cublasHandle_t + cublasLtHandle_t), plus device queries. Moving transfers ownership;
// destructors never throw. Only compiled in CUDA builds.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <string>

#include "core/cuda/cuda_check.h"

// OPD_CUBLAS_CHECK(call): throws opd::Error(Cuda) with the statement, file, line and status.
#define OPD_CUBLAS_CHECK(call)                                                                \
  do {                                                                                        \
    cublasStatus_t opd_cublas_status_ = (call);                                               \
    if (opd_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                        \
      ::opd::throw_error(::opd::ErrorKind::Cuda,                                              \
                         ::opd::cat(#call, " failed at ", __FILE__, ":", __LINE__, ": ",      \
                                    cublasGetStatusName(opd_cublas_status_), " (",            \
                                    cublasGetStatusString(opd_cublas_status_), ")"));         \
    }                                                                                         \
  } while (0)

namespace opd::cuda {

// Number of usable devices; 0 (not an error) when there is no driver or no GPU.
int device_count();
// "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)" for device `index`.
std::string device_description(int index);

class Stream {
 public:
  Stream();  // non-blocking stream on the current device
  ~Stream();
  Stream(Stream&& other) noexcept : stream_(other.stream_) { other.stream_ = nullptr; }
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }
  void synchronize() const;

 private:
  cudaStream_t stream_ = nullptr;
};

class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(cudaStream_t stream);
  float elapsed_ms_since(const Event& start) const;  // synchronizes on this event
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

class CublasHandle {
 public:
  explicit CublasHandle(cudaStream_t stream = nullptr);
  ~CublasHandle();
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  cublasHandle_t get() const { return handle_; }
  cublasLtHandle_t lt() const { return lt_; }

 private:
  cublasHandle_t handle_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
};

// After a kernel launch: throws with the kernel name if the launch failed.
void check_launch(const char* kernel_name);

}  // namespace opd::cuda
