// CUDA fused lm_head + distillation loss (the CUDA contract of loss/fused_loss.h): the same loss
// (1 / n_total) * sum_r weight_r * (D_r + sft_alpha * [sft_r] * CE_r) with D_r the generalized
// JSD of the support mode (formulas in loss/divergence.h), its gradients d hidden and
// d lm_head, computed in [row_chunk, vocab_tile] blocks of logits z = hidden @ lm_head^T so
// that no [tokens x vocab] buffer exists. Declarations only (no CUDA headers): fused_loss.cpp
// dispatches here for device tensors in builds with OPD_WITH_CUDA.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "loss/fused_loss.h"
#include "loss/loss_config.h"
#include "loss/teacher_payload.h"

typedef struct CUstream_st* cudaStream_t;

namespace opd::cuda {

// Wall time of each phase of one call, filled when CudaLossOptions::timings is set (events on
// the call's stream; reading them synchronizes at the end of the call, which it does anyway).
struct CudaLossTimings {
  float prepare_ms = 0;   // row checks, error-flag round trip, scratch init
  float forward_ms = 0;   // gather + pass A (+ pass B for full) + row coefficients + sums
  float backward_ms = 0;  // pass C (recompute, dZ, two GEMMs per block) or the sparse kernels
};

// Tuning of the CUDA path (the math does not depend on any of these beyond rounding).
struct CudaLossOptions {
  // Rows per block of the tile GEMMs; 0 = as many as fit the tile budget below (a multiple of
  // 128, at most N).
  int64_t row_chunk = 0;
  // Budget of the [row_chunk, vocab_tile] logit / dZ buffers when row_chunk = 0.
  int64_t tile_budget_bytes = int64_t{40} << 20;
  // Storage of the logit tile for bf16 inputs: F32 (default: the GEMM's fp32 accumulator is
  // kept, LSE and the gathered logits are those of the exact fp32 logits) or BF16 (logits
  // rounded to bf16 as a PyTorch bf16 lm_head produces them: a third of the tile traffic).
  // f32 inputs always use F32.
  DType tile_dtype = DType::F32;
  CudaLossTimings* timings = nullptr;
};

// Scratch bytes of one CUDA call (all of it allocated through Tensor::empty on the device, so
// memory_stats(Device::CUDA) sees it; cuBLAS's own workspace, created with the handle, is not
// included):
//   tiles: row_chunk * ld * (sizeof(tile) * (full ? 2 : 1) + [bf16 inputs, f32 tile] 2)
//          with ld = round_up(min(vocab_tile, V), 16)     (logits, teacher logits, separate dZ)
//   rows:  N * (K + 1) * 8 * 2            gathered z, then s = z/T; sparse coefficients
//        + N * K * 8  [f32 logprobs]      teacher a_k widened to f64 for the row functions
//        + N * kCudaRowStatCols * 8       per-row statistics
//        + N * 4 + 64                     per-row flags, error record and result sums
// The tile part does not grow with N once N > row_chunk; the row part is O(N x K).
int64_t fused_loss_cuda_scratch_bytes(int64_t n, int64_t vocab, int64_t k, const LossConfig& config,
                                      DType input_dtype, DType logprob_dtype,
                                      const CudaLossOptions& options = {});

inline constexpr int64_t kCudaRowStatCols = 10;

// The CUDA fused loss. Tensors are device tensors: hidden [N, H] and lm_head [V, H] in bf16 or
// f32; targets, sft_rows i32 [N]; weights f32|f64 [N]; the teacher payload (validated on the
// host, then copied with teacher_to_device) ids i32 [N, K], logprobs f32|f64 [N, K],
// actual_logprobs f32|f64 [N], valid i32 [N]; full mode: teacher_hidden [N, Ht] and
// teacher_lm_head [Vt, Ht] in hidden's dtype.
// Gradients (both or neither): d_hidden f32 [N, H] is written (every element), d_lm_head f32
// [V, H] is accumulated (+=, the fp32 master gradient), whatever the input dtype: dH sums ~V/tile
// tile products and dW sums micro-batches, both in fp32; a caller that wants bf16 d_hidden
// casts it once.
// Errors: shapes/dtypes/config throw InvalidArgument before any launch. Per-row data (finite
// weights, targets of used rows in [0, V), sft flags in {0, 1}) and teacher ids of used rows
// (in [0, V) or kEmptySlot) are checked on the device; the first violation is reported with
// the CPU's message and error kind, and nothing else is computed (gradients untouched). Kernels
// never dereference an id outside [0, V).
// Synchronizes `stream` before returning (the loss is returned by value).
// Determinism: every path is run-to-run deterministic except `topk` without SFT, whose
// d lm_head rows at the teacher ids are accumulated with fp32 atomicAdd.
LossResult fused_lm_head_loss_cuda(const LossConfig& config, const FusedLossArgs& args,
                                   Tensor* d_hidden, Tensor* d_lm_head,
                                   const CudaLossOptions& options = {},
                                   cudaStream_t stream = nullptr);

// The payload's tensors copied to `device` (validation happens on the host, before this).
inline TeacherTopK teacher_to_device(const TeacherTopK& t, Device device = Device::CUDA) {
  TeacherTopK d;
  d.rows = t.rows;
  d.k = t.k;
  d.ids = t.ids.to(device);
  d.logprobs = t.logprobs.to(device);
  d.actual_logprobs = t.actual_logprobs.to(device);
  d.valid = t.valid.to(device);
  return d;
}

}  // namespace opd::cuda
