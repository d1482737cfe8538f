// Checked CUDA runtime calls: OPD_CUDA_CHECK(call) throws opd::Error(Cuda) naming the
// statement, file, line and the runtime's message (STYLE.md 4: do/while(0), never exit()).
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"

#define OPD_CUDA_CHECK(call)                                                              \
  do {                                                                                    \
    cudaError_t opd_cuda_status_ = (call);                                                \
    if (opd_cuda_status_ != cudaSuccess) {                                                \
      ::opd::throw_error(::opd::ErrorKind::Cuda,                                          \
                         ::opd::cat(#call, " failed at ", __FILE__, ":", __LINE__, ": ",  \
                                    cudaGetErrorName(opd_cuda_status_), " (",             \
                                    cudaGetErrorString(opd_cuda_status_), ")"));          \
    }                                                                                     \
  } while (0)
