// opd's decode linear (y[m, n] = x[m, k] W[n, k]^T (+ bias[n]), m <= 64 rows, bf16, f32
// accumulation): the per-layer GEMMs of a decode step, written for a PDL launch in a CUDA graph.
// Its prologue loads the CTA's first W fragments into registers *before* griddepcontrol.wait,
// so the weight stream (which depends on nothing the step writes) overlaps the kernel before it;
// only the x load, the mma and the reductions wait. Layout and plan: decode_linear.cu.
// docs/rollout.md "Decode linear v4" has the design and the measurements (H200).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

typedef struct CUstream_st* cudaStream_t;

namespace opd::cuda {

// Work split of one (n, k) shape; depends on (n, k) and the device (SMs, resident clusters),
// never on m, so a row's result is the same at every batch size (batch independence) and run to
// run (fixed orders).
struct DecodeLinearPlan {
  bool ok = false;         // false: the shape is not taken (the caller uses cuBLASLt)
  int rows16 = 0;          // a CTA owns 16 * rows16 consecutive W rows (1, 2 or 3)
  int splits = 0;          // k split over a thread-block cluster of this many CTAs
  int64_t row_blocks = 0;  // ceil(n / (16 * rows16)); grid = row_blocks * splits CTAs
  int warp_steps = 0;      // most 32-wide k steps one warp owns
  size_t smem_bytes = 0;   // dynamic shared memory per CTA
};
constexpr int64_t kDecodeLinearMaxRows = 64;
// max_clusters[i]: how many clusters of 2^i CTAs (one CTA per SM) fit on the device at once
// ([0] = sms); a plan never needs more (one wave). The launches use the device's values.
DecodeLinearPlan decode_linear_plan(int64_t n, int64_t k, int sms, const int (&max_clusters)[4]);
// The plan on the current device (its SMs and cluster capacity, queried once per device).
DecodeLinearPlan decode_linear_device_plan(int64_t n, int64_t k);

// Whether decode_linear takes these operands: bf16, 1 <= m <= 64, k % 8 == 0, 16-byte aligned
// x / W / y, a plan for (n, k), int32-sized.
bool decode_linear_supports(const void* x, const void* w, const void* y, int64_t m, int64_t k,
                            int64_t n, DType dtype);

// y = x W^T (+ bias), every operand bf16, row-major and contiguous (x [m, k], W [n, k],
// y [m, n], bias [n] or null). pdl: launched with programmatic stream serialization (pdl.cuh).
// Throws Unsupported when !decode_linear_supports(...).
void decode_linear(const void* x, const void* w, const void* bias, int64_t m, int64_t k,
                   int64_t n, DType dtype, void* y, cudaStream_t stream, bool pdl);
// The same, returning false (and launching nothing) where decode_linear would throw: one plan
// lookup for callers that fall back to cuBLASLt.
bool try_decode_linear(const void* x, const void* w, const void* bias, int64_t m, int64_t k,
                       int64_t n, DType dtype, void* y, cudaStream_t stream, bool pdl);

}  // namespace opd::cuda
