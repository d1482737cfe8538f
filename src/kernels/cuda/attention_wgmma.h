// Host API of the Hopper attention forward (attention_fwd_wgmma.cu) and of the Hopper dK/dV
// kernel of the backward (attention_bwd_wgmma.cu), with their process-wide selections.
// Forward: FlashAttention-3-style
// (Shah et al. 2024) causal or non-causal GQA forward over a packed varlen batch with
// warpgroup MMA (wgmma.mma_async, sm_90a) for bf16, head_dim 128, and the process-wide choice
// between it and the mma.sync kernel (attention_fwd.cu) that attention_forward makes.
// Same contract as attention_forward (kernels/cuda/cuda_ops.h): q/out [T, hq, 128] bf16,
// k/v [T, hkv, 128] bf16, lse f32 [T, hq] = natural-log log-sum-exp of the scaled scores.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"
#include "kernels/cuda/cuda_ops.h"  // AttentionPlan

namespace opd::cuda {

// Which kernel attention_forward runs where both can (bf16, head_dim 128, causal). Every other
// case (f32, other head_dim) always runs the kernels of attention_fwd.cu. Wgmma = the wgmma
// kernel with its CTA-wide barrier per key tile, WgmmaPingPong = its warp-specialized
// ping-pong variant (attention_wgmma_config says which knobs each runs with). Auto = the
// measured choice on a device that runs sm_90a code, else mma.
enum class AttentionFwdKernel { Auto, Mma, Wgmma, WgmmaPingPong };

// Kernel knobs (benchmark and test variants; every variant computes the same result):
// block_n = keys per K/V tile (64 or 128); overlap = issue S_j = Q K_j^T before waiting for
// O += P_{j-1} V_{j-1}, so the softmax of tile j runs while the tensor cores do the previous
// P V (FlashAttention-3's intra-warpgroup pipelining); off = each product waited for at once.
// schedule = how the CTA's warps cooperate:
//  Synced:   256 threads, every thread loads its share of K/V with cp.async (two buffers) and
//            the two warpgroups meet at a CTA-wide barrier every key tile.
//  Producer: warp-specialized (FlashAttention-3): one extra producer warp streams K/V tiles
//            through a 4-stage (block_n 64) or 3-stage (128) cp.async ring guarded by
//            mbarriers, so the consumer warpgroups never wait at a CTA-wide barrier.
//  PingPong: Producer, and the two consumer warpgroups take turns issuing their wgmmas (named
//            barriers), so one warpgroup's softmax runs while the other's products occupy the
//            tensor cores instead of both softmaxes coinciding.
// Producer and PingPong require overlap (their warpgroups pipeline the overlap way).
enum class AttentionWgmmaSchedule { Synced, Producer, PingPong };

// Default: 64 keys with overlap, synced: the fastest synced variant on 3 of the 4
// BENCHMARKS.md shapes on the H200 (within 1.3% of 128 keys on the fourth; docs/perf.md).
struct AttentionWgmmaConfig {
  int block_n = 64;
  bool overlap = true;
  AttentionWgmmaSchedule schedule = AttentionWgmmaSchedule::Synced;
};

// True when the current device runs this library's sm_90a code (a Hopper GPU; the sm_90
// fallback build of the kernel has no wgmma and is never launched). Probed once per device.
bool attention_wgmma_available();
// The same, for launches on `stream`: false (without probing) while `stream` is being captured
// into a CUDA graph and the device was not probed before.
bool attention_wgmma_available_on(cudaStream_t stream);

// The wgmma forward. Throws Unsupported unless attention_wgmma_available(), InvalidArgument
// on bad heads / config. Deterministic (no atomics): every output element is written once by
// one thread in a fixed order. Shared memory per CTA of 128 query rows: 32 KiB (Q) +
// 4 x block_n x 256 B (K, V double buffered) + 1 KiB alignment; Producer and PingPong:
// 32 KiB (Q) + stages x 2 x block_n x 256 B (stages = 4 for block_n 64, 3 for 128) + 1 KiB +
// the mbarriers. No device allocation.
void attention_forward_wgmma(const AttentionPlan& plan, const void* q, const void* k,
                             const void* v, int64_t hq, int64_t hkv, double scale, bool causal,
                             void* out, float* lse, cudaStream_t stream,
                             const AttentionWgmmaConfig& config = {});

// The knobs attention_forward runs the wgmma kernel with for `kernel` (Wgmma or
// WgmmaPingPong; InvalidArgument for the others).
AttentionWgmmaConfig attention_wgmma_config(AttentionFwdKernel kernel);

// The process-wide setting: initially from the environment variable OPD_ATTENTION_FWD
// (`mma`, `wgmma`, `wgmma-pingpong` or `auto`; unset = auto; anything else is an
// InvalidArgument error at the first attention call); set_attention_fwd_kernel overrides it
// (tests, benchmarks).
void set_attention_fwd_kernel(AttentionFwdKernel kernel);
AttentionFwdKernel attention_fwd_kernel_setting();
// What attention_forward runs for (dtype, head_dim) on the current device: Mma, Wgmma or
// WgmmaPingPong (Auto resolved; a forced wgmma kernel where the device cannot run it is an
// Unsupported error).
// The probe of attention_wgmma_available() is skipped while `stream` is being captured into a
// CUDA graph (the mma kernel runs then, unless the device was probed before).
AttentionFwdKernel resolve_attention_fwd_kernel(DType dtype, int64_t head_dim,
                                                cudaStream_t stream = nullptr);
const char* attention_fwd_kernel_name(AttentionFwdKernel kernel);

// ---- backward ------------------------------------------------------------------------------
// Which kernels attention_backward (cuda_ops.h) runs for bf16, head_dim 128 (every other case
// always runs the kernels of attention_bwd.cu). Mma = the mma.sync dK/dV and dQ kernels;
// Wgmma = attention_backward_dkdv_wgmma below + the mma.sync dQ kernel (so dq is bit-identical
// to Mma's); WgmmaAll = attention_backward_dkdv_wgmma + attention_backward_dq_wgmma. Auto = WgmmaAll where the device runs sm_90a code
// (the fastest on the H200, docs/perf.md "Attention backward — the wgmma kernels measured"),
// else Mma.
enum class AttentionBwdKernel { Auto, Mma, Wgmma, WgmmaAll };

// The process-wide setting: initially from OPD_ATTENTION_BWD (`mma`, `wgmma`, `wgmma-all`
// or `auto`; unset = auto; anything else is an InvalidArgument error at the first backward call);
// set_attention_bwd_kernel overrides it (tests, benchmarks).
void set_attention_bwd_kernel(AttentionBwdKernel kernel);
AttentionBwdKernel attention_bwd_kernel_setting();
// What attention_backward runs for (dtype, head_dim) on the device of `stream`: Mma, Wgmma or
// WgmmaAll (Auto resolved; a forced wgmma setting on a device without sm_90a code is an
// Unsupported error).
AttentionBwdKernel resolve_attention_bwd_kernel(DType dtype, int64_t head_dim,
                                                cudaStream_t stream = nullptr);
const char* attention_bwd_kernel_name(AttentionBwdKernel kernel);

// dK, dV of the causal GQA backward (FlashAttention-2 algorithm 2 / FlashAttention-3 section
// 3.3) with wgmma, bf16, head_dim 128: dout/q [T, hq, 128], k/v [T, hkv, 128] bf16, lse f32
// [T, hq] (natural log, the forward's), delta f32 [T, hq] = rowsum(dout * out); dk, dv
// [T, hkv, 128] bf16 written (not accumulated), dk including `scale`. One CTA per (128-key
// tile, kv head) loops over every query head of the group: deterministic, no atomics.
// Shared memory per CTA: 64 KiB (K, V) + 2 stages x (16 KiB Q + 16 KiB dO + 512 B lse/delta)
// + 1 KiB alignment = 130 KiB. Throws Unsupported unless attention_wgmma_available_on(stream).
void attention_backward_dkdv_wgmma(const AttentionPlan& plan, const void* dout, const void* q,
                                   const void* k, const void* v, const float* lse,
                                   const float* delta, int64_t hq, int64_t hkv, double scale,
                                   void* dk, void* dv, cudaStream_t stream);

// dQ of the same backward with wgmma (same operands; dq [T, hq, 128] bf16 written, including
// `scale`): one CTA per (128-query tile, query head), 2 warpgroups of 64 rows, looping over the
// 64-key tiles up to the tile's last row: S = Q K^T, dP = dO V^T, dS = P (dP - D), dQ += dS K.
// Deterministic (one owner per element, fixed order). Shared memory: 32 KiB Q + 32 KiB dO +
// 2 x (16 KiB K + 16 KiB V) + 1 KiB alignment = 129 KiB. Throws as the dK/dV kernel does.
void attention_backward_dq_wgmma(const AttentionPlan& plan, const void* dout, const void* q,
                                 const void* k, const void* v, const float* lse,
                                 const float* delta, int64_t hq, int64_t hkv, double scale,
                                 void* dq, cudaStream_t stream);


}  // namespace opd::cuda
