// Declarations of the CUDA kernels behind kernels/ops.h (only in builds with OPD_WITH_CUDA).
// Raw device pointers + a stream; shapes were validated by the Tensor-level dispatcher.
// Storage dtypes: activations and weights in `dtype` (f32 or bf16), arithmetic in f32;
// statistics (rstd, lse, losses) and parameter gradients (dw, dtable, dbias) in f32, the
// master-gradient precision. Formulas are stated once, in kernels/ops.h.
#pragma once

#include <cstdint>

#include "core/dtype.h"

typedef struct CUstream_st* cudaStream_t;

namespace opd::cuda {

// ---- index_check.cu: data-carried indices, checked on the device before an op uses them.
enum class IndexRule {
  InRange,          // 0 <= v < limit (token ids)
  InRangeOrIgnore,  // v == -100 or 0 <= v < limit (cross-entropy targets)
  NonNegative,      // v >= 0 (positions)
};
struct IndexCheckResult {
  int64_t first_bad_row = -1;  // -1: all valid
  int32_t value = 0;           // values[first_bad_row]
  int64_t counted = 0;         // rows with v != -100 (InRangeOrIgnore), else n
};
// One pass over values[0, n) with a device error flag (atomicMin of the row, so the report
// names the first bad row like the CPU check), read back synchronously.
IndexCheckResult check_indices(const int32_t* values, int64_t n, IndexRule rule, int64_t limit,
                               cudaStream_t stream);

// ---- rmsnorm.cu (plain and fused with the residual add) ----
// RMSNorm forward over rows of H: y = x * rstd * w. x/y/w share `dtype` (f32 or bf16),
// rstd is f32 [N]; accumulation in f32.
void rmsnorm_forward(const void* x, const void* w, double eps, int64_t n, int64_t h, DType dtype,
                     void* y, float* rstd, cudaStream_t stream);
// dx written, dw (f32) accumulated, deterministically (fixed-order two-stage column sums).
void rmsnorm_backward(const void* dy, const void* x, const void* w, const float* rstd, int64_t n,
                      int64_t h, DType dtype, void* dx, float* dw, cudaStream_t stream);
// sum = x + r (rounded to dtype), y = rmsnorm(sum) * w from the rounded sum.
void rmsnorm_residual_forward(const void* x, const void* r, const void* w, double eps, int64_t n,
                              int64_t h, DType dtype, void* sum, void* y, float* rstd,
                              cudaStream_t stream);
// ds = rmsnorm_dx(dy; sum) + dres (ds may alias dres); dw accumulated.
void rmsnorm_residual_backward(const void* dy, const void* sum, const void* w, const float* rstd,
                               const void* dres, int64_t n, int64_t h, DType dtype, void* ds,
                               float* dw, cudaStream_t stream);

// ---- embedding.cu ---- ids already validated (check_indices). table/out in dtype; dtable f32.
void embedding_forward(const int32_t* ids, const void* table, int64_t n, int64_t vocab,
                       int64_t hidden, DType dtype, void* out, cudaStream_t stream);
// dtable[v, :] += sum over rows t with ids[t] == v of dout[t, :], rows in ascending order:
// a stable radix sort of (id, row) makes each id a segment summed by one block (no atomics).
void embedding_backward(const int32_t* ids, const void* dout, int64_t n, int64_t vocab,
                        int64_t hidden, DType dtype, float* dtable, cudaStream_t stream);

// ---- rope.cu ---- x [n, heads, head_dim] in place; positions validated; inv_freq f32.
// angle = (float)positions[t] * inv_freq[i] in f32 (as the CPU f32 path and transformers).
void rope(void* x, const int32_t* positions, const float* inv_freq, int64_t n, int64_t heads,
          int64_t head_dim, DType dtype, bool inverse, cudaStream_t stream);

// ---- swiglu.cu ---- all [n] in dtype.
void swiglu_forward(const void* gate, const void* up, int64_t n, DType dtype, void* out,
                    cudaStream_t stream);
void swiglu_backward(const void* dout, const void* gate, const void* up, int64_t n, DType dtype,
                     void* dgate, void* dup, cudaStream_t stream);

// ---- elementwise.cu ---- all [n] in dtype; out may alias a or b.
void add(const void* a, const void* b, int64_t n, DType dtype, void* out, cudaStream_t stream);

// ---- cross_entropy.cu ---- logits/dlogits [n, vocab] in dtype; targets validated;
// losses, lse f32 [n]. One block per row, online log-sum-exp (one read of the logits).
void cross_entropy_forward(const void* logits, const int32_t* targets, int64_t n, int64_t vocab,
                           DType dtype, float* losses, float* lse, cudaStream_t stream);
void cross_entropy_backward(const void* logits, const int32_t* targets, const float* lse,
                            int64_t n, int64_t vocab, double scale, DType dtype, void* dlogits,
                            cudaStream_t stream);

// ---- reduce.cu ---- deterministic column sums (fixed order for a given shape).
// out[c] += sum_r x[r, c] for x [n, h] in dtype, out f32 [h].
void column_sum_accumulate(const void* x, int64_t n, int64_t h, DType dtype, float* out,
                           cudaStream_t stream);
// out[c] += sum_g partial[g, c] for f32 partial [groups, h] (second stage of two-stage sums).
void reduce_partials_accumulate(const float* partial, int64_t groups, int64_t h, float* out,
                                cudaStream_t stream);

// ---- philox.cu ---- out[i] = philox_uniform(seed, stream_id, i) for i < n (same as the CPU).
void philox_uniform_fill(float* out, int64_t n, uint64_t seed, uint64_t stream_id,
                         cudaStream_t stream);

// ---- bench_util.cu ---- uniform [lo, hi) fill in f32 or bf16, ints in [lo, hi), and a
// kernel that occupies `stream` for the given time (timed loops queue up behind it).
void fill_uniform(void* out, int64_t n, DType dtype, uint64_t seed, float lo, float hi,
                  cudaStream_t stream);
void fill_ints(int32_t* out, int64_t n, uint64_t seed, int32_t lo, int32_t hi,
               cudaStream_t stream);
void spin(double microseconds, cudaStream_t stream);

// Multiprocessor count of the current device (cached per device).
int sm_count();

}  // namespace opd::cuda
