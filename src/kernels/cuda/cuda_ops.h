// Declarations of the CUDA kernels behind kernels/ops.h (only in builds with OPD_WITH_CUDA).
// Raw device pointers + a stream; shapes were validated by the Tensor-level dispatcher.
#pragma once

#include <cstdint>

#include "core/dtype.h"

typedef struct CUstream_st* cudaStream_t;

namespace opd::cuda {

// RMSNorm forward over rows of H: y = x * rstd * w. x/y/w share `dtype` (f32 or bf16),
// rstd is f32 [N]; accumulation in f32.
void rmsnorm_forward(const void* x, const void* w, double eps, int64_t n, int64_t h, DType dtype,
                     void* y, float* rstd, cudaStream_t stream);
// dx written, dw accumulated (f32 for f32 inputs; for bf16 inputs dw is f32 too: master grads).
void rmsnorm_backward(const void* dy, const void* x, const void* w, const float* rstd, int64_t n,
                      int64_t h, DType dtype, void* dx, float* dw, cudaStream_t stream);

// Fill out[i] = philox_uniform(seed, stream_id, i) for i < n (same values as the CPU).
void philox_uniform_fill(float* out, int64_t n, uint64_t seed, uint64_t stream_id,
                         cudaStream_t stream);

}  // namespace opd::cuda
