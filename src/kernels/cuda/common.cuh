// Device helpers shared by the CUDA kernels: f32/bf16 element access with f32 arithmetic,
// 16-byte vector loads/stores (4 floats or 8 bf16 per access), warp/block reductions, and
// launch-size helpers. Only .cu files include it (C++17).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace opd::cuda::dev {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// A 16-byte vector of T: kVec = 4 floats or 8 bf16. Loaded/stored with one 128-bit access.
template <typename T>
struct Vec {
  static constexpr int kVec = 16 / sizeof(T);
  T v[kVec];
};
template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const T* p) {  // p 16-byte aligned
  Vec<T> r;
  *reinterpret_cast<uint4*>(r.v) = __ldg(reinterpret_cast<const uint4*>(p));
  return r;
}
template <typename T>
__device__ __forceinline__ Vec<T> load_vec_rw(const T* p) {  // p may be written by this kernel
  Vec<T> r;
  *reinterpret_cast<uint4*>(r.v) = *reinterpret_cast<const uint4*>(p);
  return r;
}
template <typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T>& v) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(v.v);
}

// W consecutive elements of T as f32, loaded/stored with one access when W * sizeof(T) == 16
// (the vector path) or element by element when W == 1 (any alignment, the fallback path).
template <typename T, int W>
struct Pack {
  float f[W];
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (W * sizeof(T) == 16) {
      const Vec<T> v = load_vec(p);
#pragma unroll
      for (int i = 0; i < W; ++i) f[i] = to_f32(v.v[i]);
    } else {
#pragma unroll
      for (int i = 0; i < W; ++i) f[i] = to_f32(p[i]);
    }
  }
  // For memory this kernel also writes (no read-only cache path).
  __device__ __forceinline__ void load_rw(const T* p) {
    if constexpr (W * sizeof(T) == 16) {
      const Vec<T> v = load_vec_rw(p);
#pragma unroll
      for (int i = 0; i < W; ++i) f[i] = to_f32(v.v[i]);
    } else {
#pragma unroll
      for (int i = 0; i < W; ++i) f[i] = to_f32(p[i]);
    }
  }
  __device__ __forceinline__ void store(T* p) const {
    if constexpr (W * sizeof(T) == 16) {
      Vec<T> v;
#pragma unroll
      for (int i = 0; i < W; ++i) v.v[i] = from_f32<T>(f[i]);
      store_vec(p, v);
    } else {
#pragma unroll
      for (int i = 0; i < W; ++i) p[i] = from_f32<T>(f[i]);
    }
  }
  // Round every element to T and back (the value a store then load would give).
  __device__ __forceinline__ void round_to_storage() {
#pragma unroll
    for (int i = 0; i < W; ++i) f[i] = to_f32(from_f32<T>(f[i]));
  }
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a block of kThreads threads (a multiple of 32); every thread gets the result.
// The order of additions is fixed by the launch shape, so results are run-to-run identical.
template <int kThreads>
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[kThreads / 32];
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = 0;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) total += partial[i];
  __syncthreads();  // partial[] is reused by the next call
  return total;
}

template <int kThreads>
__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[kThreads / 32];
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float m = partial[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; ++i) m = fmaxf(m, partial[i]);
  __syncthreads();
  return m;
}

// op-reduction over a block of kThreads threads (a multiple of 32) through the caller's shared
// red[kThreads / 32]: warp butterflies, then red[0], red[1], ... in order, so the result is
// run-to-run identical and every thread gets it.
template <int kThreads, typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T r = red[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; ++i) r = op(r, red[i]);
  __syncthreads();  // red[] is reused by the next call
  return r;
}

// Address is 16-byte aligned (vector paths need the base pointers and row strides aligned).
__host__ __device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Calls f(v, i) for every float4 v = p[i], i in [0, n4), strided over kThreads threads (thread
// `tid`), kUnroll 16-byte loads issued before any is used: a row pass bound by the loads in
// flight (one per thread) gets kUnroll times as many. Each thread sees its i in increasing order.
template <int kThreads, int kUnroll, typename F>
__device__ __forceinline__ void for_each_float4(const float4* p, int n4, int tid, F&& f) {
  for (int i0 = tid; i0 < n4; i0 += kThreads * kUnroll) {
    float4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i0 + u * kThreads < n4) v[u] = p[i0 + u * kThreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i0 + u * kThreads < n4) f(v[u], i0 + u * kThreads);
  }
}

}  // namespace opd::cuda::dev

namespace opd::cuda {

// Grid of blocks for n work items, capped (grid-stride loops cover the rest).
inline unsigned grid_for(int64_t n, int threads, int64_t max_blocks = 65535LL * 16) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  if (b > max_blocks) b = max_blocks;
  return static_cast<unsigned>(b);
}

}  // namespace opd::cuda
