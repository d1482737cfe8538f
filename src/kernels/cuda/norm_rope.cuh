// One attention head of one token through the per-head RMSNorm (Qwen3's q/k norm, rounded to
// the storage dtype as rmsnorm_forward stores it) and rotate-half RoPE, computed by one warp:
// the arithmetic of qkv_norm_rope_store (decode_fused.cu), shared with the decode attention's
// q|k|v prologue (paged_attention.cu), so that both give the same bits.
//
// Lane l owns the pairs (i, i + D/2) for i = l, l + 32, ...; the sum of squares runs over
// i = l, l + 32, ... < D in that order, then dev::warp_sum. A PDL launch computes the first
// kRopePrePairs pairs' terms (norm weights, sin/cos: nothing a kernel of the step writes)
// before its griddepcontrol.wait (norm_rope_prepare), the rest after it (norm_rope_head).
#pragma once

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace opd::cuda::dev {

constexpr int kRopePrePairs = 4;  // pairs per lane precomputed: head_dim <= 2 * 32 * 4 = 256

struct PairTerms {  // what pair i of a head needs besides the head's values
  float w0, w1, sn, cs;
};

template <typename T>
__device__ __forceinline__ PairTerms pair_terms(const T* w, const float* inv_freq, float pos,
                                                int64_t i, int64_t half) {
  PairTerms p;
  p.w0 = w ? to_f32(w[i]) : 1.f;
  p.w1 = w ? to_f32(w[i + half]) : 1.f;
  sincosf(pos * inv_freq[i], &p.sn, &p.cs);
  return p;
}

// Pair i of one head: the normed value as rmsnorm_forward stores it (when normed), then RoPE.
template <typename T>
__device__ __forceinline__ void rope_pair(const T* src, T* dst, int64_t i, int64_t half,
                                          bool normed, float rs, const PairTerms& p) {
  float x0 = to_f32(src[i]), x1 = to_f32(src[i + half]);
  if (normed) {
    x0 = to_f32(from_f32<T>(x0 * rs * p.w0));
    x1 = to_f32(from_f32<T>(x1 * rs * p.w1));
  }
  dst[i] = from_f32<T>(x0 * p.cs - x1 * p.sn);
  dst[i + half] = from_f32<T>(x1 * p.cs + x0 * p.sn);
}

// The lane's first kRopePrePairs pairs' terms (w: the norm weight or null).
template <typename T>
__device__ __forceinline__ void norm_rope_prepare(PairTerms (&pre)[kRopePrePairs], const T* w,
                                                  const float* inv_freq, float pos, int64_t d,
                                                  int lane) {
#pragma unroll
  for (int k = 0; k < kRopePrePairs; ++k) {
    const int64_t i = lane + 32 * k;
    if (i < d / 2) pre[k] = pair_terms(w, inv_freq, pos, i, d / 2);
  }
}

// dst = RoPE(norm(src)) for one head of d elements (norm only when w); every lane of the warp
// calls it (warp_sum). dst may be shared memory.
template <typename T>
__device__ __forceinline__ void norm_rope_head(const T* src, T* dst, const T* w,
                                               const float* inv_freq, float pos, int64_t d,
                                               float eps, const PairTerms (&pre)[kRopePrePairs],
                                               int lane) {
  const int64_t half = d / 2;
  float ss = 0.f;
  for (int64_t i = lane; i < d; i += 32) {
    const float x = to_f32(src[i]);
    ss += x * x;
  }
  const float rs = w ? rsqrtf(warp_sum(ss) / static_cast<float>(d) + eps) : 1.f;
#pragma unroll
  for (int k = 0; k < kRopePrePairs; ++k) {
    const int64_t i = lane + 32 * k;
    if (i < half) rope_pair(src, dst, i, half, w != nullptr, rs, pre[k]);
  }
  for (int64_t i = lane + 32 * kRopePrePairs; i < half; i += 32)  // head_dim > 256
    rope_pair(src, dst, i, half, w != nullptr, rs, pair_terms(w, inv_freq, pos, i, half));
}

}  // namespace opd::cuda::dev
