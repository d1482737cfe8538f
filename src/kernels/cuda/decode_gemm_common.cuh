// Device code shared by the two decode GEMM kernels of kernels/cuda/gemm.h (decode_gemm.cu: v2,
// decode_gemm_v3.cu: v3), y[m, n] = x[m, k] W[n, k]^T (+ bias[n]): the bf16 mma.sync m16n8k16
// (f32 accumulators; PTX ISA "Matrix Fragments for mma.m16n8k16"), the epilogue that writes one
// accumulator fragment, and the deterministic split-K sum over a thread-block cluster through
// distributed shared memory (each split leaves its f32 partial in its shared memory; CTA r of
// the cluster sums fragments r, r + splits, ... over the ranks in order 0, 1, ...: no workspace,
// no atomics, the same bits run to run). Only .cu files include it (C++17).
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"  // to_f32 / from_f32
#include "kernels/cuda/gemm.h"     // DecodeGemmArgs, DecodeGemmPlan

namespace opd::cuda::decode_gemm_dev {

constexpr int kMaxSplits = 8;  // portable cluster size

// c += a * b, m16n8k16, bf16 inputs, f32 accumulators. A = 16 W rows x 16 k (a0: rows 0-7 k 0-7,
// a1: rows 8-15 k 0-7, a2: rows 0-7 k 8-15, a3: rows 8-15 k 8-15), B = 16 k x 8 rows of x.
__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Fragment numbering of a CTA's accumulators: f = (row warp rw, x group j, lane) ->
// (rw * MT + j) * 32 + lane. Writes fragment f of row block rb (kRows W rows per block): c0, c1 =
// (W row g, x rows 8j + 2t, 8j + 2t + 1), c2, c3 = (W row g + 8, the same x rows), plus the bias.
// W rows >= n and x rows >= m are never stored.
template <int MT, int kRows, typename OutT>
__device__ __forceinline__ void store_fragment(int f, float4 c, int64_t rb, const OutT* bias,
                                               OutT* y, int64_t ldy, int m, int64_t n) {
  const int lane = f & 31, j = (f >> 5) % MT, rw = (f >> 5) / MT;
  const int g = lane >> 2, t = lane & 3;
  const float v[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = rb * kRows + rw * 16 + 8 * h + g;
    if (row >= n) continue;
    const float b = bias ? dev::to_f32(bias[row]) : 0.0f;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * j + 2 * t + e;
      if (col < m) y[col * ldy + row] = dev::from_f32<OutT>(v[2 * h + e] + b);
    }
  }
}

// Split-K epilogue over the cluster (splits > 1, one cluster = the splits of one row block):
// `part` (this CTA's shared memory, the same offset in every CTA of the cluster) holds the
// CTA's `frags` float4 fragments. All threads of all CTAs call it. CTA r stores fragments
// r, r + splits, ... as the sum over ranks 0, 1, ..., splits - 1 (a fixed order).
template <int MT, int kRows, typename OutT>
__device__ __forceinline__ void cluster_reduce_store(const float4* part, int frags,
                                                     int nthreads, int splits, int64_t rb,
                                                     const OutT* bias, OutT* y, int64_t ldy,
                                                     int m, int64_t n) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every partial written (release/acquire across the cluster)
  const int rank = static_cast<int>(cluster.block_rank());
  for (int f = rank + splits * static_cast<int>(threadIdx.x); f < frags; f += splits * nthreads) {
    float4 v[kMaxSplits];
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s)
      if (s < splits) v[s] = *cluster.map_shared_rank(const_cast<float4*>(part) + f, s);
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) {
      if (s < splits) {
        sum.x += v[s].x;
        sum.y += v[s].y;
        sum.z += v[s].z;
        sum.w += v[s].w;
      }
    }
    store_fragment<MT, kRows>(f, sum, rb, bias, y, ldy, m, n);
  }
  cluster.sync();  // the other CTAs may still read this CTA's partial
}

// 8-row groups of x the kernels are instantiated for (m <= 8 MT).
inline int m_tiles(int64_t m) { return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8; }

}  // namespace opd::cuda::decode_gemm_dev

// Host side of v3 (decode_gemm_v3.cu), called by decode_gemm.cu's decode_gemm_plan/decode_gemm.
namespace opd::cuda::decode_gemm_detail {
// v3's plan for (n, k), or a plan with version 2 when no v3 launch can hold the shape.
DecodeGemmPlan plan_v3(int64_t n, int64_t k, int force_splits, int force_rows, int sms);
void launch_v3(const DecodeGemmArgs& a, const DecodeGemmPlan& p, cudaStream_t stream);
}  // namespace opd::cuda::decode_gemm_detail
