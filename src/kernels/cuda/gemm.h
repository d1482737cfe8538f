// GEMM on CUDA through cuBLASLt, for the dense layers of kernels/ops.h (row-major):
//   forward          y [n, out]  = x [n, in] W [out, in]^T (+ bias [out], fused as the epilogue)
//   backward input   dx [n, in]  = dy [n, out] W [out, in]
//   backward weight  dW [out, in] += dy^T x          (beta = 1: micro-batches accumulate)
// Operands f32 or bf16, accumulation always f32 (CUBLAS_COMPUTE_32F: true f32, no TF32, for
// f32 operands); outputs in the operand dtype or f32 (bf16 activations with f32 master
// gradients). A row-major [r, c] matrix is a column-major [c, r] one, so each product is issued
// transposed: y^T = W x^T is a "TN" GEMM with m = out, n = n, k = in.
// The algorithm is chosen by cuBLASLt's heuristic once per (shape, dtypes, epilogue, pointer
// alignment) and cached with its descriptors; the workspace (32 MiB per stream) comes from
// the caching allocator once. Decode GEMMs (GemmArgs::tune: a few rows against a large weight,
// bound by the weight read) instead time the heuristic's candidates and their split-K variants
// once per plan and keep the fastest (the heuristic's first choice is tuned for large GEMMs).
// C++17-clean.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"

typedef struct CUstream_st* cudaStream_t;

namespace opd::cuda {

// Column-major D = alpha * op(A) op(B) + beta * C with C == D (cuBLAS conventions): op(A) is
// [m, k], op(B) is [k, n], D is [m, n] with leading dimension ldd. bias (optional, [m], in the
// output dtype) is added to every column by the epilogue.
struct GemmArgs {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  DType ab_dtype = DType::BF16;  // A and B
  DType d_dtype = DType::BF16;   // C/D (and bias)
  const void* bias = nullptr;
  float alpha = 1.0f, beta = 0.0f;
  // Choose the algorithm by timing (beta == 0 only; the plan is separate from the untuned one,
  // so other callers of the same shape are unaffected): up to 8 heuristic candidates plus
  // split-K 2/4/8/16 variants of the first 4, 3 runs each with the L2 flushed before every run
  // (the decode step streams its weights from HBM), median; ~3 ms once per shape.
  // A first call inside a CUDA graph capture cannot time: it uses the heuristic's choice and
  // the next call outside a capture tunes.
  bool tune = false;
};
void gemm(const GemmArgs& args, cudaStream_t stream);

// The three products of a dense layer (row-major, shapes above). `in_dtype` is the dtype of
// x, W and dy; y, bias and dx are in `out_dtype`; dW in `dw_dtype`.
// tune: GemmArgs::tune (decode-shaped calls: n = a few rows).
void linear_forward(const void* x, const void* w, const void* bias, int64_t n, int64_t in,
                    int64_t out, DType in_dtype, DType out_dtype, void* y, cudaStream_t stream,
                    bool tune = false);
void linear_backward_input(const void* dy, const void* w, int64_t n, int64_t in, int64_t out,
                           DType in_dtype, DType out_dtype, void* dx, cudaStream_t stream);
void linear_backward_weight(const void* dy, const void* x, int64_t n, int64_t in, int64_t out,
                            DType in_dtype, DType dw_dtype, void* dw, cudaStream_t stream);

// GEMMs issued on `stream` plan for `sms` SMs (cuBLASLt's SM count target) instead of the
// device's: for a stream of one group of a cuda::SmPartition. 0 removes the entry (do so before
// the stream is destroyed: a later stream may get the same handle). The plans are cached per
// target, so streams of different groups never share one.
void gemm_set_stream_sm_count(cudaStream_t stream, int sms);

// The same GEMM through plain cuBLAS (cublasGemmEx, default algorithm): the library baseline
// `opd bench kernels` compares against. Uses its own handle on `stream`.
void gemm_cublas_reference(const GemmArgs& args, cudaStream_t stream);

struct GemmCacheStats {
  int64_t plans = 0;              // cached (shape, dtype, alignment) plans
  int64_t heuristic_queries = 0;  // cublasLtMatmulAlgoGetHeuristic calls so far
  int64_t calls = 0;
  int64_t tuned_plans = 0;        // plans whose algorithm was chosen by timing
  double tuning_ms = 0;           // host time spent timing candidates
};
GemmCacheStats gemm_cache_stats();

// What the tuning chose for each tuned plan (for `opd bench kernels` and logs): the shape, the
// number of candidates timed, the heuristic's first choice's and the chosen algorithm's median
// times (us) and the chosen split-K count.
struct GemmTuneRecord {
  int64_t m = 0, n = 0, k = 0;
  int candidates = 0;
  double heuristic_us = 0, best_us = 0;
  int best_index = 0, split_k = 1;
};
std::vector<GemmTuneRecord> gemm_tune_records();

// y [n, out] += bias [out] broadcast over rows (used when the bias epilogue is unavailable).
void add_bias_rows(void* y, const void* bias, int64_t n, int64_t out, DType dtype,
                   cudaStream_t stream);

}  // namespace opd::cuda
