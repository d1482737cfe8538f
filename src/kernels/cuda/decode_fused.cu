// Fused kernels of the incremental (paged) forward on CUDA, to cut the kernels per layer of a
// decode step (model/paged_forward_cuda.cpp); their reference is the composition of the plain
// ops they replace (kernels/ops.h formulas), tests/cuda/test_cuda_decode_fused.cpp:
//
// qkv_norm_rope_store: from the q, k, v projections of T tokens (row-strided views, e.g. the
//   packed [T, (Hq + 2 Hkv) D] output of one GEMM), per head
//     q' = RoPE(RMSNorm_head(q) * w_q) -> q_out [T, Hq, D] (contiguous),
//     k' = RoPE(RMSNorm_head(k) * w_k) -> k_cache[slot[t]],   v -> v_cache[slot[t]],
//   with RMSNorm skipped when the weight is null (models without q/k norm). Same arithmetic as
//   rmsnorm_forward then rope then kv_cache_store: the normed value is rounded to the storage
//   dtype before RoPE (as the separate kernels store it), rstd = rsqrtf(mean(x^2) + eps),
//   angle = (float)pos * inv_freq[i] with sincosf, f32 arithmetic, one rounding per store.
//   Replaces 5 kernels (2 norms, 2 RoPEs, the store) by one. A slot outside [0, num_slots)
//   is skipped and its token atomicMin-ed into error_flag (never dereferenced).
// swiglu_packed: out[t, i] = silu(gu[t, i]) * gu[t, I + i] for the packed [T, 2I] output of one
//   gate|up GEMM (replaces a GEMM launch and reads the two halves in one pass).
// Both can be launched with programmatic dependent launch (kernels/cuda/pdl.cuh; the `pdl`
// argument): same results, the launch latency and the independent prologue overlap the GEMM.
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "core/cuda/stream.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/pdl.cuh"

namespace opd::cuda {
namespace {

constexpr int kThreads = 256;  // 8 warps: one (token, head) row per warp

// One warp per (token t, head slot j): j < Hq are query heads, then Hkv key heads, then Hkv
// value heads. Lane l owns the rotate-half pairs (i, i + D/2) for i = l, l + 32, ... < D/2.
//
// PDL (kernels/cuda/pdl.cuh): the first kPrePairs pairs' norm weights and RoPE sin/cos, the
// token's position and slot are computed before pdl_wait() (none of them is written by the
// q|k|v GEMM this kernel follows); the q/k/v rows are read only after it. The successor (the
// decode paged attention) is released at once: its prologue (block tables) overlaps this kernel.
// The arithmetic is the same expressions on the same values either way (bit-identical).
constexpr int kPrePairs = 4;  // pairs per lane precomputed: head_dim <= 2 * 32 * 4 = 256

struct PairTerms {  // what pair i of a head needs besides the head's values
  float w0, w1, sn, cs;
};

template <typename T>
__device__ __forceinline__ PairTerms pair_terms(const T* w, const float* inv_freq, float pos,
                                                   int64_t i, int64_t half) {
  PairTerms p;
  p.w0 = w ? dev::to_f32(w[i]) : 1.f;
  p.w1 = w ? dev::to_f32(w[i + half]) : 1.f;
  sincosf(pos * inv_freq[i], &p.sn, &p.cs);
  return p;
}

// Pair i of one head: the normed value as rmsnorm_forward stores it (when w), then RoPE.
template <typename T>
__device__ __forceinline__ void rope_pair(const T* src, T* dst, int64_t i, int64_t half,
                                          bool normed, float rs, const PairTerms& p) {
  float x0 = dev::to_f32(src[i]), x1 = dev::to_f32(src[i + half]);
  if (normed) {
    x0 = dev::to_f32(dev::from_f32<T>(x0 * rs * p.w0));
    x1 = dev::to_f32(dev::from_f32<T>(x1 * rs * p.w1));
  }
  dst[i] = dev::from_f32<T>(x0 * p.cs - x1 * p.sn);
  dst[i + half] = dev::from_f32<T>(x1 * p.cs + x0 * p.sn);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    qkv_norm_rope_store_kernel(QkvNormRopeStoreArgs a) {
  dev::pdl_launch_dependents();  // the attention may start its prologue now
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t slots_per_token = a.hq + 2 * a.hkv;
  if (warp >= a.n * slots_per_token) {  // whole warps exit together
    dev::pdl_wait();  // every thread waits (pdl.cuh: a grid never completes before its predecessor)
    return;
  }
  const int64_t t = warp / slots_per_token;
  const int64_t j = warp % slots_per_token;
  const int64_t D = a.head_dim, half = D / 2;
  const bool is_q = j < a.hq, is_k = !is_q && j < a.hq + a.hkv;

  T* dst = nullptr;
  const T* src = nullptr;
  const T* w = nullptr;
  if (!is_q) {  // k and v go to the cache: check the slot first
    const int32_t slot = a.slot_mapping[t];
    if (slot < 0 || static_cast<int64_t>(slot) >= a.num_slots) {
      if (lane == 0 && j == a.hq && a.error_flag) atomicMin(a.error_flag, static_cast<unsigned>(t));
      dev::pdl_wait();
      return;
    }
    const int64_t g = is_k ? j - a.hq : j - a.hq - a.hkv;
    dst = static_cast<T*>(is_k ? a.k_cache : a.v_cache) + (static_cast<int64_t>(slot) * a.hkv + g) * D;
    if (!is_k) {  // v: a copy of the GEMM's output
      src = static_cast<const T*>(a.v) + t * a.v_stride + g * D;
      dev::pdl_wait();
      for (int64_t i = lane; i < D; i += 32) dst[i] = src[i];
      return;
    }
    src = static_cast<const T*>(a.k) + t * a.k_stride + g * D;
    w = static_cast<const T*>(a.k_norm);
  } else {
    src = static_cast<const T*>(a.q) + t * a.q_stride + j * D;
    dst = static_cast<T*>(a.q_out) + (t * a.hq + j) * D;
    w = static_cast<const T*>(a.q_norm);
  }
  // ---- prologue: independent of the GEMM's output.
  const float pos = static_cast<float>(a.positions[t]);
  PairTerms pre[kPrePairs];
#pragma unroll
  for (int k = 0; k < kPrePairs; ++k) {
    const int64_t i = lane + 32 * k;
    if (i < half) pre[k] = pair_terms(w, a.inv_freq, pos, i, half);
  }
  dev::pdl_wait();

  float ss = 0.f;
  for (int64_t i = lane; i < D; i += 32) {
    const float x = dev::to_f32(src[i]);
    ss += x * x;
  }
  const float rs = w ? rsqrtf(dev::warp_sum(ss) / static_cast<float>(D) + a.eps) : 1.f;
#pragma unroll
  for (int k = 0; k < kPrePairs; ++k) {
    const int64_t i = lane + 32 * k;
    if (i < half) rope_pair(src, dst, i, half, w != nullptr, rs, pre[k]);
  }
  for (int64_t i = lane + 32 * kPrePairs; i < half; i += 32)  // head_dim > 256
    rope_pair(src, dst, i, half, w != nullptr, rs, pair_terms(w, a.inv_freq, pos, i, half));
}

// expf (not __expf), as swiglu.cu: the f32 path is compared with the CPU at 1e-5.
__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// W consecutive elements per thread (16-byte loads and stores when inter % W == 0 and the
// buffers are 16-byte aligned, else W = 1): the same expression per element either way.
template <typename T, int W>
__global__ void swiglu_packed_kernel(const T* __restrict__ gu, int64_t n, int64_t inter,
                                     T* __restrict__ out) {
  dev::pdl_launch_dependents();  // the down GEMM (opd's, PDL-launched) may stream its weights now
  dev::pdl_wait();  // nothing to do before the gate|up GEMM's output is there (PDL: launch latency)
  const int64_t per_row = inter / W, total = n * per_row;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; c < total;
       c += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t t = c / per_row, i = (c % per_row) * W;
    dev::Pack<T, W> g, u, o;
    g.load(gu + t * 2 * inter + i);
    u.load(gu + t * 2 * inter + inter + i);
#pragma unroll
    for (int k = 0; k < W; ++k) o.f[k] = g.f[k] * sigmoid(g.f[k]) * u.f[k];
    o.store(out + t * inter + i);
  }
}

}  // namespace

void qkv_norm_rope_store(const QkvNormRopeStoreArgs& a, cudaStream_t stream) {
  OPD_CHECK(a.head_dim >= 2 && a.head_dim % 2 == 0 && a.hq >= 1 && a.hkv >= 1 &&
                a.q_stride >= a.hq * a.head_dim && a.k_stride >= a.hkv * a.head_dim &&
                a.v_stride >= a.hkv * a.head_dim && a.num_slots >= 0,
            InvalidArgument, "qkv_norm_rope_store: head_dim ", a.head_dim, ", heads ", a.hq, "/",
            a.hkv, ", strides ", a.q_stride, "/", a.k_stride, "/", a.v_stride);
  if (a.n == 0) return;
  const int64_t warps = a.n * (a.hq + 2 * a.hkv);
  const int64_t blocks = (warps * 32 + kThreads - 1) / kThreads;
  OPD_CHECK(blocks < (int64_t{1} << 31), Unsupported, "qkv_norm_rope_store: grid too large");
  const dim3 grid(static_cast<unsigned>(blocks)), block(kThreads);
  switch (a.dtype) {
    case DType::F32:
      launch_kernel("qkv_norm_rope_store_kernel", qkv_norm_rope_store_kernel<float>, grid, block,
                    0, stream, a.pdl, a);
      break;
    case DType::BF16:
      launch_kernel("qkv_norm_rope_store_kernel", qkv_norm_rope_store_kernel<__nv_bfloat16>, grid,
                    block, 0, stream, a.pdl, a);
      break;
    default: OPD_FAIL(Unsupported, "qkv_norm_rope_store: dtype ", dtype_name(a.dtype));
  }
}

void swiglu_packed_forward(const void* gu, int64_t n, int64_t inter, DType dtype, void* out,
                           cudaStream_t stream, bool pdl) {
  if (n == 0 || inter == 0) return;
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    constexpr int V = 16 / sizeof(T);
    const T* in = static_cast<const T*>(gu);
    T* o = static_cast<T*>(out);
    const dim3 block(kThreads);
    if (inter % V == 0 && dev::aligned16(in) && dev::aligned16(o)) {
      launch_kernel("swiglu_packed_kernel", swiglu_packed_kernel<T, V>,
                    dim3(grid_for(n * (inter / V), kThreads)), block, 0, stream, pdl, in, n,
                    inter, o);
    } else {
      launch_kernel("swiglu_packed_kernel", swiglu_packed_kernel<T, 1>,
                    dim3(grid_for(n * inter, kThreads)), block, 0, stream, pdl, in, n, inter, o);
    }
  };
  switch (dtype) {
    case DType::F32: run(static_cast<float*>(nullptr)); break;
    case DType::BF16: run(static_cast<__nv_bfloat16*>(nullptr)); break;
    default: OPD_FAIL(Unsupported, "swiglu_packed_forward: dtype ", dtype_name(dtype));
  }
}

}  // namespace opd::cuda
