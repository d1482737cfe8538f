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

// ---- decode_gemm.cu / decode_gemm_v3.cu: the weight-streaming GEMM of decode steps (ours) ----
// y[m, n] = x[m, k] W[n, k]^T (+ bias[n]) for 1 <= m <= 64 rows (a decode batch), bf16 x and
// W, f32 accumulation (tensor cores), y in bf16 or f32 (bias in y's dtype). Bound by the one
// read of W; split over k across the CTAs of a cluster, summed in a fixed order (same bits run
// to run; the plan depends on (n, k) only, so a row's bits do not depend on m either).
// Two kernels: v2 (decode_gemm.cu: W loaded into registers) and v3 (decode_gemm_v3.cu: a CTA's
// whole W slice streamed into shared memory by bulk copies issued at kernel start, before the
// programmatic-dependent-launch wait). Requirements (else InvalidArgument naming the shape, or
// decode_gemm_unsupported's reason): k % 8 == 0, ldx >= k and ldx % 8 == 0, x and W 16-byte
// aligned, W contiguous [n, k], ldy >= n. Callers fall back to linear_forward otherwise.
// Shapes v3 cannot hold in shared memory (k beyond ~7k at m = 64 with 8 splits) run v2.
// No workspace, no host synchronization, no allocation: capturable in a CUDA graph.
constexpr int64_t kDecodeGemmMaxRows = 64;
struct DecodeGemmArgs {
  const void* x = nullptr;  // [m, k], row stride ldx (elements)
  int64_t ldx = 0;
  const void* w = nullptr;  // [n, k] contiguous
  const void* bias = nullptr;  // [n] in y_dtype, or none
  void* y = nullptr;        // [m, n], row stride ldy (elements)
  int64_t ldy = 0;
  int64_t m = 0, n = 0, k = 0;
  DType x_dtype = DType::BF16, w_dtype = DType::BF16, y_dtype = DType::BF16;
  int force_splits = 0;     // > 0: this many k splits (at most 8; benchmarks, tests); 0: the plan's
  int force_rows = 0;       // v3: 64 or 128 W rows per CTA (benchmarks, tests); 0: the plan's
  int sm_count = 0;         // 0: the current device's
  // 2 or 3: that kernel; 0: decode_gemm_default_version() (env OPD_DECODE_GEMM=v2|v3, default v3).
  int version = 0;
  // Launch with programmatic stream serialization (kernels/cuda/pdl.cuh): v3 streams W before
  // griddepcontrol.wait, so W's read overlaps the tail of the kernel before it. v2 has no wait
  // and is always launched plainly.
  bool pdl = false;
};
// The launch shape for (n, k). v2: ceil(n / 64) row blocks x `splits` k splits (one cluster per
// row block), k tiles of 2 x chunks_per_warp chunks of 32. v3: ceil(n / rows) row blocks x
// `splits` (one cluster per row block), each CTA's k slice in `stages` mbarrier stages,
// smem_bytes of dynamic shared memory at m = 64 (decode_gemm_v3.cu says how it is chosen).
struct DecodeGemmPlan {
  int version = 2;
  int splits = 1, num_chunks = 0, chunks_per_warp = 4;
  int64_t row_blocks = 0;
  int rows = 64, stages = 1;
  int64_t smem_bytes = 0;
};
// version 0: the default (decode_gemm_default_version); a v3 request that v3 cannot hold
// returns v2's plan (version 2). force_rows: v3 only (64 or 128; 0: the plan's).
DecodeGemmPlan decode_gemm_plan(int64_t n, int64_t k, int force_splits = 0, int sm_count = 0,
                                int version = 0, int force_rows = 0);
// The version of `version = 0` calls: the override when one is set, else 3 unless the
// environment says OPD_DECODE_GEMM=v2 (read once; another value is an InvalidArgument error).
int decode_gemm_default_version();
// Overrides the default for the whole process (tests and benches select a kernel for callers
// that pass version 0, e.g. PagedForward); 0 goes back to the environment's choice.
void decode_gemm_set_default_version(int version);
// nullptr when decode_gemm can run these arguments, else the reason (for a fallback).
const char* decode_gemm_unsupported(const DecodeGemmArgs& args);
void decode_gemm(const DecodeGemmArgs& args, cudaStream_t stream);

// y [n, out] += bias [out] broadcast over rows (used when the bias epilogue is unavailable).
void add_bias_rows(void* y, const void* bias, int64_t n, int64_t out, DType dtype,
                   cudaStream_t stream);

}  // namespace opd::cuda
