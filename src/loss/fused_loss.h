// Fused lm_head + distillation loss (DESIGN.md "Loss"; formulas in loss/divergence.h): student
// logits z = hidden @ lm_head^T are produced in vocabulary tiles and reduced on the fly (online
// log-sum-exp), the logits at the teacher's K ids and at the target are direct dot products, and
// the backward recomputes the tiles: d z_v = dense_r * softmax(z/T)_v + sft_r * softmax(z)_v
// (+ the full-mode term) + sparse terms at the K ids and the target, so d(hidden) and
// d(lm_head) are accumulated tile by tile with GEMMs. [tokens x vocab] is never materialized.
//
// Loss = (1 / n_total) * sum_rows weight_r * (D_r + sft_alpha * [sft_r] * CE_r), where D_r is
// the per-position divergence of the support mode (or the sampled-mode surrogate) and n_total
// is the number of valid completion tokens of the whole optimizer step (all micro-batches, all
// ranks), so gradient accumulation and data parallelism share one normalizer.
//
// Passes over the vocabulary (tile width = LossConfig::vocab_tile), per call:
//   gather      z at the K ids and the target: N x (K+1) dot products        (all modes)
//   A  LSE      Z_tile = H W_tile^T; online LSE of z/T (and of z for SFT rows;
//               full: also of the teacher's t/T over the first V_student ids)  (all but topk
//                                                                              without SFT)
//   B  diverge  full only: recompute both tiles; D_r += sum_v d_v, G_r += sum_v g_v
//   rows        per-row coefficients from the divergence.h row functions (O(K) per row)
//   C  backward recompute Z_tile (full: and the teacher tile); dZ in place;
//               dH += dZ W_tile; dW_tile += dZ^T H                              (when grads asked)
//   sparse      dH_r += c W_id, dW_id += c h_r at the K ids and the target
// topk without SFT touches no tile at all (both distributions live on the K ids).
//
// Memory beyond inputs and outputs (asserted by tests/loss with memory_stats(Device::CPU)):
//   fused_loss_scratch_bytes = N * min(tile, V) * sizeof(T) * (full ? 2 : 1)   logit tile(s)
//                            + N * (K + 1) * 8                                 gathered z / coefs
//                            + N * kRowStatCols * 8                            per-row stats
// i.e. O(N x K + N x tile), never O(N x V).
//
// CUDA contract (kernels/cuda, to mirror this file; same tiling, same function split):
//   void fused_lm_head_loss_cuda(const LossConfig&, const FusedLossArgs& (device tensors, bf16
//        or f32 hidden/lm_head, teacher ids/logprobs already validated on the host and copied),
//        Tensor* d_hidden, Tensor* d_lm_head, LossResult*, cudaStream_t);
//   - gather: one warp per (row, slot) dot product in fp32; ids outside [0, V) that are not
//     kEmptySlot set an int error flag in device memory and are skipped (never dereferenced);
//     the host reads the flag after the call and throws InvalidData like the CPU version.
//   - pass A/B/C: cuBLASLt GEMM into a [N_chunk, tile] fp32 (or bf16) buffer, then a row
//     kernel doing the online LSE / per-element terms with the divergence.h functions
//     (OPD_LOSS_HD is __host__ __device__); row coefficients with the same row functions.
//   - sparse: dH by rows (no races); dW_id by atomicAdd in fp32 (or sort-by-id for a
//     deterministic mode). Scratch formula as above with sizeof(T) of the tile buffer.
//   - results must match this CPU version to bf16 tolerance (tests compare the two).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "loss/loss_config.h"
#include "loss/teacher_payload.h"

namespace opd {

struct FusedLossArgs {
  Tensor hidden;     // [N, H] f32|f64: final hidden states of the completion rows
  Tensor lm_head;    // [V, H] same dtype: student output embedding (V = student vocab)
  Tensor targets;    // i32 [N]: the completion token y of each row (sampled or dataset)
  Tensor weights;    // f32|f64 [N]: per-row weight; 0 = row not in the loss (mask)
  Tensor sft_rows;   // i32 [N]: 1 = dataset completion token (CE applies); may be undefined
                     // when sft_alpha == 0
  const TeacherTopK* teacher = nullptr;  // topk, topk+tail, sampled: validated payload, N rows
  Tensor teacher_hidden;   // full: [N, Ht] same dtype
  Tensor teacher_lm_head;  // full: [Vt, Ht]; Vt == V, or Vt > V under ClipToStudent (the
                           // teacher is restricted to the student's ids and renormalized)
  double n_total = 0;      // > 0: valid completion tokens of the whole optimizer step
};

struct LossResult {
  double loss = 0;             // the normalized loss of this call (sum over calls = step loss)
  double divergence_sum = 0;   // sum_r weight_r * D_r (unnormalized; sampled: the surrogate)
  double ce_sum = 0;           // sum_r weight_r * [sft_r] * CE_r
  double sampled_kl_sum = 0;   // sampled: sum_r weight_r * (log q(y) - log p(y)), a reverse-KL
                               // estimate for the metrics
  int64_t rows_used = 0;       // rows with weight != 0 that are valid
  int64_t tail_clamped = 0;    // topk+tail rows whose student tail hit the floor
};

inline constexpr int64_t kRowStatCols = 8;

// Scratch bytes of one call (the formula above); `dtype` is the dtype of hidden.
int64_t fused_loss_scratch_bytes(int64_t n, int64_t vocab, int64_t k, const LossConfig& config,
                                 DType dtype);

// Fused lm_head + loss; host tensors run the CPU version below, device tensors (hidden on
// Device::CUDA) the CUDA one (loss/fused_loss_cuda.h: bf16|f32 inputs, f32 gradients, default
// CudaLossOptions, default stream; Unsupported in builds without CUDA).
// CPU: forward only when d_hidden and d_lm_head are null; otherwise both
// must be given: d_hidden [N, H] is written (fully, including rows not in the loss), d_lm_head
// [V, H] is accumulated (+=) so micro-batches can sum into one buffer. Checks shapes, dtypes,
// config, targets of used rows in [0, V); any id that still reaches the gather out of range
// (a payload that skipped validation) is skipped and counted in an error flag, and the call
// then throws InvalidData without touching memory out of range.
LossResult fused_lm_head_loss(const LossConfig& config, const FusedLossArgs& args,
                              Tensor* d_hidden, Tensor* d_lm_head);

// The trainer's budget for the CUDA path's [row_chunk, vocab_tile] buffers (CudaLossOptions::
// tile_budget_bytes; the library default is 40 MiB, which keeps the issue shape's extra memory
// under 64 MiB). 128 MiB makes a W1 micro-batch (4,096 completion rows, tile 4,096) one row
// chunk: bigger tile GEMMs, 11.45 instead of 14.37 ms per call for 107 instead of 41 MB of
// scratch (H200, `opd bench loss --row-chunk`, session 8). Loss and d_hidden are bit-identical;
// d_lm_head sums the rows in fewer GEMM calls (f32 rounding).
inline constexpr int64_t kTrainingLossTileBudgetBytes = int64_t{128} << 20;
// fused_lm_head_loss with that budget on CUDA (0 = the library default); the CPU ignores it.
LossResult fused_lm_head_loss(const LossConfig& config, const FusedLossArgs& args,
                              Tensor* d_hidden, Tensor* d_lm_head, int64_t cuda_tile_budget_bytes);

}  // namespace opd
