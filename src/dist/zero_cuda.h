// Device helper of the ZeRO optimizer (zero.cpp): scaling a gradient shard in place by the
// global clipping coefficient, x[i] *= s (the same f32 product torch's clip_grad_norm_ forms).
// C++17-clean: included by .cu files.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace opd::dist::cuda {

void scale_inplace_f32(float* x, int64_t n, float s, cudaStream_t stream);

}  // namespace opd::dist::cuda
