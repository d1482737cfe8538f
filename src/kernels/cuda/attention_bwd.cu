// Causal grouped-query attention backward on CUDA for packed variable-length batches, the
// FlashAttention-2 scheme (Dao 2023, algorithm 2): with P = exp(scale q k^T - lse),
// dP = dout v^T, D = rowsum(dout * out), dS = P * (dP - D):
//   dv = P^T dout,  dk = scale dS^T q,  dq = scale dS k.
// Three kernels: (1) D per (row, head); (2) dK/dV, one CTA per (128-key block, kv head) looping
// over the query blocks of every query head of its GQA group, dK and dV accumulated in
// registers (so the group sum needs no atomics); (3) dQ, one CTA per (128-row query block,
// query head) looping over key blocks, dQ accumulated in registers.
//
// Determinism: FlashAttention-2 adds dQ with f32 atomics from the dK/dV kernel (5 matrix
// products per key/query block pair, but the sum order depends on scheduling). Kernel (3)
// instead recomputes S and dP (7 products instead of 5: 1.4x the backward tensor-core work)
// and every output element has one owner and a fixed summation order, so results are
// bit-identical run to run and no f32 dQ buffer or conversion pass is needed.
//
// bf16 head_dim 64/128 use mma.sync.m16n8k16 (attention_mma.h); f32 and other head_dim run
// simple warp-per-row kernels with f32 arithmetic. bf16 head_dim 128 on Hopper can run the
// wgmma dK/dV (and dQ) kernels instead (attention_bwd_wgmma.cu; OPD_ATTENTION_BWD,
// attention_wgmma.h).
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "core/cuda/stream.h"
#include "kernels/cuda/attention_mma.h"
#include "kernels/cuda/attention_wgmma.h"  // the wgmma dK/dV kernel and its selection
#include "kernels/cuda/common.cuh"          // dev::aligned16
#include "kernels/cuda/cuda_ops.h"

namespace opd::cuda {
namespace {

using attn::Tile;
using bf16 = __nv_bfloat16;

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kThreads = 256;                       // 8 warps, each owns 16 rows of the block
constexpr int kBlock = AttentionPlan::kTileRows;    // 128 rows per CTA (queries or keys)

// ---- (1) D = rowsum(dout * out), f32 [T, hq]; one warp per (row, head) ---------------------

template <typename T>
__global__ void attention_bwd_delta_kernel(const T* __restrict__ dout, const T* __restrict__ out,
                                           int64_t rows, int d, float* __restrict__ delta) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (r >= rows) return;
  float acc = 0.f;
  for (int c = lane; c < d; c += 32) {
    acc += attn::to_float(dout[r * d + c]) * attn::to_float(out[r * d + c]);
  }
  acc = attn::warp_sum(acc);
  if (lane == 0) delta[r] = acc;
}

// The same with 16-byte loads: G lanes per row (a power of two <= 32; head_dim 128 in bf16:
// 16 lanes of one chunk each, two rows per warp), each lane's chunks summed in order, then the
// lanes by a butterfly. The warp-per-row kernel above loaded 2 bytes per lane (W1's training:
// 6.2 ms per step for ~2.7 ms of bytes, s8h).
template <typename T, int G>
__global__ void attention_bwd_delta_vec_kernel(const T* __restrict__ dout,
                                               const T* __restrict__ out, int64_t rows, int d,
                                               float* __restrict__ delta) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t r = g / G;
  const int lane = static_cast<int>(g % G);
  float acc = 0.f;
  if (r < rows) {
    const uint4* a = reinterpret_cast<const uint4*>(dout + r * d);
    const uint4* b = reinterpret_cast<const uint4*>(out + r * d);
    for (int c = lane; c < d / V; c += G) {
      const uint4 x = __ldg(a + c), y = __ldg(b + c);
      const T* xs = reinterpret_cast<const T*>(&x);
      const T* ys = reinterpret_cast<const T*>(&y);
#pragma unroll
      for (int i = 0; i < V; ++i) acc += attn::to_float(xs[i]) * attn::to_float(ys[i]);
    }
  }
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (r < rows && lane == 0) delta[r] = acc;
}

// ---- (2) dK, dV: bf16 tensor cores ---------------------------------------------------------

template <int D, int BMQ>
constexpr int dkdv_smem_bytes() {
  // K, V [128][D] + 2 stages x (Q, dO [BMQ][D]) bf16 + 2 stages x (lse, D) [BMQ] f32.
  return (2 * kBlock * D + 4 * BMQ * D) * static_cast<int>(sizeof(bf16)) +
         4 * BMQ * static_cast<int>(sizeof(float));
}

// grid.x = num_tiles * hkv, key blocks with the most query rows first. Warp w owns keys
// 16w .. 16w+15 of the block and computes the transposed products (keys as the M dimension):
// S^T = K Q^T, dP^T = V dO^T, so P^T and dS^T come out as C fragments that are directly the
// A operands of dV += P^T dO and dK += dS^T Q.
template <int D, int BMQ>
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_dkdv_bf16_kernel(const Tile* __restrict__ tiles, int hq, int hkv,
                                   float scale, float scale_log2, const bf16* __restrict__ q,
                                   const bf16* __restrict__ k, const bf16* __restrict__ v,
                                   const bf16* __restrict__ dout, const float* __restrict__ lse,
                                   const float* __restrict__ delta, bf16* __restrict__ dk,
                                   bf16* __restrict__ dv) {
  constexpr int NT = kThreads;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sK = reinterpret_cast<bf16*>(smem_raw);  // [128][D], later the dK staging tile
  bf16* sV = sK + kBlock * D;                    // [128][D], later the dV staging tile
  bf16* sQ = sV + kBlock * D;                    // [2][BMQ][D]
  bf16* sdO = sQ + 2 * BMQ * D;                  // [2][BMQ][D]
  float* sLse = reinterpret_cast<float*>(sdO + 2 * BMQ * D);  // [2][BMQ], lse * log2 e
  float* sDelta = sLse + 2 * BMQ;                              // [2][BMQ]

  const Tile tile = tiles[blockIdx.x / hkv];
  const int g = static_cast<int>(blockIdx.x % hkv);
  const int group = hq / hkv;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;

  const int k0 = tile.block * kBlock;          // sequence-relative first key
  const int krows = min(kBlock, tile.len - k0);
  const int i0 = k0 / BMQ;                     // first query block that sees any of these keys
  const int n_qb = (tile.len + BMQ - 1) / BMQ - i0;
  const int iters = group * n_qb;              // (query head, query block) pairs
  const int64_t q_stride = static_cast<int64_t>(hq) * D;
  const int64_t kv_stride = static_cast<int64_t>(hkv) * D;
  const int64_t kv_off = (static_cast<int64_t>(tile.start + k0) * hkv + g) * D;

  // Stage `it` = (head g*group + it / n_qb, query block i0 + it % n_qb) into buffer `buf`.
  // Query rows past the sequence get Q = dO = 0, D = 0 and lse = +inf, so P = 0 there.
  auto load_stage = [&](int it, int buf) {
    const int h = g * group + it / n_qb;
    const int qr0 = (i0 + it % n_qb) * BMQ;
    const int qvalid = min(BMQ, tile.len - qr0);
    const int64_t off = (static_cast<int64_t>(tile.start + qr0) * hq + h) * D;
    attn::load_tile<BMQ, D, NT>(sQ + buf * BMQ * D, q + off, q_stride, qvalid);
    attn::load_tile<BMQ, D, NT>(sdO + buf * BMQ * D, dout + off, q_stride, qvalid);
    if (threadIdx.x < BMQ) {
      const int i = static_cast<int>(threadIdx.x);
      const int64_t row = static_cast<int64_t>(tile.start + qr0 + i) * hq + h;
      sLse[buf * BMQ + i] = i < qvalid ? lse[row] * kLog2e : INFINITY;
      sDelta[buf * BMQ + i] = i < qvalid ? delta[row] : 0.f;
    }
  };

  attn::load_tile<kBlock, D, NT>(sK, k + kv_off, kv_stride, krows);
  attn::load_tile<kBlock, D, NT>(sV, v + kv_off, kv_stride, krows);
  attn::cp_async_commit();
  load_stage(0, 0);
  attn::cp_async_commit();

  float dkacc[D / 8][4], dvacc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dkacc[i][e] = dvacc[i][e] = 0.f;
  }
  const int key_lo = k0 + warp * 16 + lane / 4;  // keys of c0,c1; key_lo + 8 for c2,c3

  for (int it = 0; it < iters; ++it) {
    const int buf = it & 1;
    if (it + 1 < iters) {  // the other buffer was released by the previous iteration's barrier
      load_stage(it + 1, buf ^ 1);
      attn::cp_async_commit();
      attn::cp_async_wait<1>();
    } else {
      attn::cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* tQ = sQ + buf * BMQ * D;
    const bf16* tdO = sdO + buf * BMQ * D;
    const float* tLse = sLse + buf * BMQ;
    const float* tDelta = sDelta + buf * BMQ;
    const int qr0 = (i0 + it % n_qb) * BMQ;

    // S^T = K Q^T and dP^T = V dO^T: 16 keys x BMQ queries per warp.
    float st[BMQ / 8][4], dpt[BMQ / 8][4];
#pragma unroll
    for (int i = 0; i < BMQ / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ak[4], av[4];
      attn::ldmatrix_x4(ak, attn::a_frag_addr<D>(sK, warp * 16, kk, lane));
      attn::ldmatrix_x4(av, attn::a_frag_addr<D>(sV, warp * 16, kk, lane));
#pragma unroll
      for (int nn = 0; nn < BMQ / 16; ++nn) {
        uint32_t b[4];
        attn::ldmatrix_x4(b, attn::b_frag_addr_nk<D>(tQ, nn * 16, kk, lane));
        attn::mma_bf16(st[2 * nn], ak, b[0], b[1]);
        attn::mma_bf16(st[2 * nn + 1], ak, b[2], b[3]);
        attn::ldmatrix_x4(b, attn::b_frag_addr_nk<D>(tdO, nn * 16, kk, lane));
        attn::mma_bf16(dpt[2 * nn], av, b[0], b[1]);
        attn::mma_bf16(dpt[2 * nn + 1], av, b[2], b[3]);
      }
    }

    // P^T = exp2(S^T scale log2e - lse log2e), 0 where the key is after the query (only in
    // blocks whose first query precedes this warp's last key); dS^T = P^T (dP^T - D).
    const bool need_mask = k0 + warp * 16 + 15 > qr0;
#pragma unroll
    for (int nt = 0; nt < BMQ / 8; ++nt) {
      const int col = nt * 8 + (lane % 4) * 2;
      const float2 l2 = *reinterpret_cast<const float2*>(tLse + col);
      const float2 dl = *reinterpret_cast<const float2*>(tDelta + col);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = exp2f(st[nt][e] * scale_log2 - ((e & 1) ? l2.y : l2.x));
        if (need_mask && key_lo + (e >> 1) * 8 > qr0 + col + (e & 1)) p = 0.f;
        st[nt][e] = p;
        dpt[nt][e] = p * (dpt[nt][e] - ((e & 1) ? dl.y : dl.x));
      }
    }

    // dV += P^T dO and dK += dS^T Q (k = the BMQ queries).
#pragma unroll
    for (int kk = 0; kk < BMQ / 16; ++kk) {
      const uint32_t ap[4] = {attn::pack_bf16(st[2 * kk][0], st[2 * kk][1]),
                              attn::pack_bf16(st[2 * kk][2], st[2 * kk][3]),
                              attn::pack_bf16(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                              attn::pack_bf16(st[2 * kk + 1][2], st[2 * kk + 1][3])};
      const uint32_t as[4] = {attn::pack_bf16(dpt[2 * kk][0], dpt[2 * kk][1]),
                              attn::pack_bf16(dpt[2 * kk][2], dpt[2 * kk][3]),
                              attn::pack_bf16(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                              attn::pack_bf16(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t b[4];
        attn::ldmatrix_x4_trans(b, attn::b_frag_addr_kn<D>(tdO, kk * 16, dn, lane));
        attn::mma_bf16(dvacc[2 * dn], ap, b[0], b[1]);
        attn::mma_bf16(dvacc[2 * dn + 1], ap, b[2], b[3]);
        attn::ldmatrix_x4_trans(b, attn::b_frag_addr_kn<D>(tQ, kk * 16, dn, lane));
        attn::mma_bf16(dkacc[2 * dn], as, b[0], b[1]);
        attn::mma_bf16(dkacc[2 * dn + 1], as, b[2], b[3]);
      }
    }
    __syncthreads();  // buffer `buf` is refilled by the next iteration's prefetch
  }

  // Epilogue: each warp stages its 16 rows of dK (scaled) and dV in its own rows of sK / sV
  // (only this warp read them), then 16-byte stores of the valid key rows.
  const int wrow = warp * 16 + lane / 4;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int col = (lane % 4) * 2;
    *reinterpret_cast<uint32_t*>(sK + attn::swz<D>(wrow, dt) + col) =
        attn::pack_bf16(dkacc[dt][0] * scale, dkacc[dt][1] * scale);
    *reinterpret_cast<uint32_t*>(sK + attn::swz<D>(wrow + 8, dt) + col) =
        attn::pack_bf16(dkacc[dt][2] * scale, dkacc[dt][3] * scale);
    *reinterpret_cast<uint32_t*>(sV + attn::swz<D>(wrow, dt) + col) =
        attn::pack_bf16(dvacc[dt][0], dvacc[dt][1]);
    *reinterpret_cast<uint32_t*>(sV + attn::swz<D>(wrow + 8, dt) + col) =
        attn::pack_bf16(dvacc[dt][2], dvacc[dt][3]);
  }
  __syncwarp();
#pragma unroll
  for (int idx = lane; idx < 16 * (D / 8); idx += 32) {
    const int row = warp * 16 + idx / (D / 8), chunk = idx % (D / 8);
    if (row < krows) {
      const int64_t off = kv_off + row * kv_stride + chunk * 8;
      *reinterpret_cast<uint4*>(dk + off) =
          *reinterpret_cast<const uint4*>(sK + attn::swz<D>(row, chunk));
      *reinterpret_cast<uint4*>(dv + off) =
          *reinterpret_cast<const uint4*>(sV + attn::swz<D>(row, chunk));
    }
  }
}

// ---- (3) dQ: bf16 tensor cores -------------------------------------------------------------

template <int D, int BN>
constexpr int dq_smem_bytes() {
  return (2 * kBlock * D + 4 * BN * D) * static_cast<int>(sizeof(bf16));  // Q, dO + 2 x (K, V)
}

// grid.x = num_tiles * hq, query blocks with the most keys first. The forward's structure:
// warp w owns query rows 16w .. 16w+15, holds their Q and dO fragments, and per key block
// computes S = Q K^T, dP = dO V^T, dS = P (dP - D) and dQ += dS K.
template <int D, int BN>
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_dq_bf16_kernel(const Tile* __restrict__ tiles, int hq, int hkv, float scale,
                                 float scale_log2, const bf16* __restrict__ q,
                                 const bf16* __restrict__ k, const bf16* __restrict__ v,
                                 const bf16* __restrict__ dout, const float* __restrict__ lse,
                                 const float* __restrict__ delta, bf16* __restrict__ dq) {
  constexpr int BM = kBlock, NT = kThreads;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // [BM][D], later the dQ staging tile
  bf16* sdO = sQ + BM * D;                       // [BM][D]
  bf16* sK = sdO + BM * D;                       // [2][BN][D]
  bf16* sV = sK + 2 * BN * D;                    // [2][BN][D]

  const Tile tile = tiles[blockIdx.x / hq];
  const int h = static_cast<int>(blockIdx.x % hq);
  const int g = h / (hq / hkv);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;

  const int q0 = tile.block * BM;
  const int rows = min(BM, tile.len - q0);
  const int kv_end = q0 + rows;
  const int n_kv = (kv_end + BN - 1) / BN;
  const int64_t q_stride = static_cast<int64_t>(hq) * D;
  const int64_t kv_stride = static_cast<int64_t>(hkv) * D;
  const int64_t q_off = (static_cast<int64_t>(tile.start + q0) * hq + h) * D;
  const bf16* k_ptr = k + (static_cast<int64_t>(tile.start) * hkv + g) * D;
  const bf16* v_ptr = v + (static_cast<int64_t>(tile.start) * hkv + g) * D;

  attn::load_tile<BM, D, NT>(sQ, q + q_off, q_stride, rows);
  attn::load_tile<BM, D, NT>(sdO, dout + q_off, q_stride, rows);
  attn::cp_async_commit();
  attn::load_tile<BN, D, NT>(sK, k_ptr, kv_stride, min(BN, kv_end));
  attn::load_tile<BN, D, NT>(sV, v_ptr, kv_stride, min(BN, kv_end));
  attn::cp_async_commit();
  attn::cp_async_wait<1>();
  __syncthreads();

  uint32_t qf[D / 16][4], dof[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    attn::ldmatrix_x4(qf[kk], attn::a_frag_addr<D>(sQ, warp * 16, kk, lane));
    attn::ldmatrix_x4(dof[kk], attn::a_frag_addr<D>(sdO, warp * 16, kk, lane));
  }
  // lse (log2 units) and D of rows r and r + 8; rows past the sequence are never stored.
  const int row_lo = q0 + warp * 16 + lane / 4;
  float lse2[2], dl[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_lo + r * 8;
    const int64_t idx = static_cast<int64_t>(tile.start + row) * hq + h;
    lse2[r] = row < tile.len ? lse[idx] * kLog2e : 0.f;
    dl[r] = row < tile.len ? delta[idx] : 0.f;
  }

  float dqacc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dqacc[i][0] = dqacc[i][1] = dqacc[i][2] = dqacc[i][3] = 0.f;

  for (int j = 0; j < n_kv; ++j) {
    const int buf = j & 1;
    if (j + 1 < n_kv) {
      const int n1 = (j + 1) * BN;
      attn::load_tile<BN, D, NT>(sK + (buf ^ 1) * BN * D, k_ptr + n1 * kv_stride, kv_stride,
                                 min(BN, kv_end - n1));
      attn::load_tile<BN, D, NT>(sV + (buf ^ 1) * BN * D, v_ptr + n1 * kv_stride, kv_stride,
                                 min(BN, kv_end - n1));
      attn::cp_async_commit();
      attn::cp_async_wait<1>();
    } else {
      attn::cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* tK = sK + buf * BN * D;
    const bf16* tV = sV + buf * BN * D;

    float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int nn = 0; nn < BN / 16; ++nn) {
        uint32_t b[4];
        attn::ldmatrix_x4(b, attn::b_frag_addr_nk<D>(tK, nn * 16, kk, lane));
        attn::mma_bf16(s[2 * nn], qf[kk], b[0], b[1]);
        attn::mma_bf16(s[2 * nn + 1], qf[kk], b[2], b[3]);
        attn::ldmatrix_x4(b, attn::b_frag_addr_nk<D>(tV, nn * 16, kk, lane));
        attn::mma_bf16(dp[2 * nn], dof[kk], b[0], b[1]);
        attn::mma_bf16(dp[2 * nn + 1], dof[kk], b[2], b[3]);
      }
    }

    const int n0 = j * BN;
    const bool need_mask = n0 + BN - 1 > q0 + warp * 16;
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = exp2f(s[nt][e] * scale_log2 - lse2[e >> 1]);
        if (need_mask && n0 + nt * 8 + (lane % 4) * 2 + (e & 1) > row_lo + (e >> 1) * 8) p = 0.f;
        s[nt][e] = p * (dp[nt][e] - dl[e >> 1]);  // dS
      }
    }

    // dQ += dS K: B[key][d] = K[key][d], keys are K's rows -> ldmatrix.trans.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint32_t a[4] = {attn::pack_bf16(s[2 * kk][0], s[2 * kk][1]),
                             attn::pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                             attn::pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             attn::pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t b[4];
        attn::ldmatrix_x4_trans(b, attn::b_frag_addr_kn<D>(tK, kk * 16, dn, lane));
        attn::mma_bf16(dqacc[2 * dn], a, b[0], b[1]);
        attn::mma_bf16(dqacc[2 * dn + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();
  }

  const int wrow = warp * 16 + lane / 4;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int col = (lane % 4) * 2;
    *reinterpret_cast<uint32_t*>(sQ + attn::swz<D>(wrow, dt) + col) =
        attn::pack_bf16(dqacc[dt][0] * scale, dqacc[dt][1] * scale);
    *reinterpret_cast<uint32_t*>(sQ + attn::swz<D>(wrow + 8, dt) + col) =
        attn::pack_bf16(dqacc[dt][2] * scale, dqacc[dt][3] * scale);
  }
  __syncwarp();
#pragma unroll
  for (int idx = lane; idx < 16 * (D / 8); idx += 32) {
    const int row = warp * 16 + idx / (D / 8), chunk = idx % (D / 8);
    if (row < rows) {
      *reinterpret_cast<uint4*>(dq + q_off + row * q_stride + chunk * 8) =
          *reinterpret_cast<const uint4*>(sQ + attn::swz<D>(row, chunk));
    }
  }
}

template <int D, int BMQ>
void launch_dkdv_bf16(const AttentionPlan& plan, const void* dout, const void* q, const void* k,
                      const void* v, const float* lse, const float* delta, int hq, int hkv,
                      double scale, void* dk, void* dv, cudaStream_t stream) {
  constexpr int smem = dkdv_smem_bytes<D, BMQ>();
  auto kernel = attention_bwd_dkdv_bf16_kernel<D, BMQ>;
  OPD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<static_cast<unsigned>(plan.num_tiles() * hkv), kThreads, smem, stream>>>(
      reinterpret_cast<const Tile*>(plan.k_tiles()), hq, hkv, static_cast<float>(scale),
      static_cast<float>(scale) * kLog2e, static_cast<const bf16*>(q), static_cast<const bf16*>(k),
      static_cast<const bf16*>(v), static_cast<const bf16*>(dout), lse, delta,
      static_cast<bf16*>(dk), static_cast<bf16*>(dv));
  check_launch("attention_bwd_dkdv_bf16_kernel");
}

template <int D, int BN>
void launch_dq_bf16(const AttentionPlan& plan, const void* dout, const void* q, const void* k,
                    const void* v, const float* lse, const float* delta, int hq, int hkv,
                    double scale, void* dq, cudaStream_t stream) {
  constexpr int smem = dq_smem_bytes<D, BN>();
  auto kernel = attention_bwd_dq_bf16_kernel<D, BN>;
  OPD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<static_cast<unsigned>(plan.num_tiles() * hq), kThreads, smem, stream>>>(
      reinterpret_cast<const Tile*>(plan.q_tiles()), hq, hkv, static_cast<float>(scale),
      static_cast<float>(scale) * kLog2e, static_cast<const bf16*>(q), static_cast<const bf16*>(k),
      static_cast<const bf16*>(v), static_cast<const bf16*>(dout), lse, delta,
      static_cast<bf16*>(dq));
  check_launch("attention_bwd_dq_bf16_kernel");
}

template <int D>
void launch_bwd_bf16(const AttentionPlan& plan, const void* dout, const void* q, const void* k,
                     const void* v, const float* lse, const float* delta, int hq, int hkv,
                     double scale, void* dq, void* dk, void* dv, const AttentionBwdTiles& tiles,
                     AttentionBwdKernel kernel, cudaStream_t stream) {
  if (kernel != AttentionBwdKernel::Mma) {  // 64 queries per step: tiles.dkdv_queries unused
    attention_backward_dkdv_wgmma(plan, dout, q, k, v, lse, delta, hq, hkv, scale, dk, dv,
                                  stream);
  } else if (tiles.dkdv_queries == 32) {
    launch_dkdv_bf16<D, 32>(plan, dout, q, k, v, lse, delta, hq, hkv, scale, dk, dv, stream);
  } else {
    launch_dkdv_bf16<D, 64>(plan, dout, q, k, v, lse, delta, hq, hkv, scale, dk, dv, stream);
  }
  if (kernel == AttentionBwdKernel::WgmmaAll) {  // 64 keys per step: tiles.dq_keys unused
    attention_backward_dq_wgmma(plan, dout, q, k, v, lse, delta, hq, hkv, scale, dq, stream);
  } else if (tiles.dq_keys == 32) {
    launch_dq_bf16<D, 32>(plan, dout, q, k, v, lse, delta, hq, hkv, scale, dq, stream);
  } else {
    launch_dq_bf16<D, 64>(plan, dout, q, k, v, lse, delta, hq, hkv, scale, dq, stream);
  }
}

// ---- generic path: f32 or bf16 storage, any head_dim <= 256 ------------------------------

constexpr int kNaiveWarps = 4;
constexpr int kNaivePerLane = 8;

// dq: one warp per (query row t, query head h), keys cu[b] .. t.
template <typename T>
__global__ void __launch_bounds__(kNaiveWarps * 32)
    attention_bwd_dq_naive_kernel(const int32_t* __restrict__ cu, int batch, int64_t total,
                                  int hq, int hkv, int d, float scale, const T* __restrict__ q,
                                  const T* __restrict__ k, const T* __restrict__ v,
                                  const T* __restrict__ dout, const float* __restrict__ lse,
                                  const float* __restrict__ delta, T* __restrict__ dq) {
  const int64_t wid = static_cast<int64_t>(blockIdx.x) * kNaiveWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (wid >= total * hq) return;
  const int64_t t = wid / hq;
  const int h = static_cast<int>(wid % hq), g = h / (hq / hkv);
  const int64_t s0 = cu[attn::find_sequence(cu, batch, t)];
  float qr[kNaivePerLane], dor[kNaivePerLane], acc[kNaivePerLane];
#pragma unroll
  for (int i = 0; i < kNaivePerLane; ++i) {
    const int c = lane + 32 * i;
    qr[i] = c < d ? attn::to_float(q[(t * hq + h) * d + c]) : 0.f;
    dor[i] = c < d ? attn::to_float(dout[(t * hq + h) * d + c]) : 0.f;
    acc[i] = 0.f;
  }
  const float row_lse = lse[t * hq + h], row_delta = delta[t * hq + h];
  for (int64_t j = s0; j <= t; ++j) {
    const T* kj = k + (j * hkv + g) * d;
    const T* vj = v + (j * hkv + g) * d;
    float dot = 0.f, dp = 0.f;
#pragma unroll
    for (int i = 0; i < kNaivePerLane; ++i) {
      const int c = lane + 32 * i;
      if (c < d) {
        dot += qr[i] * attn::to_float(kj[c]);
        dp += dor[i] * attn::to_float(vj[c]);
      }
    }
    const float p = expf(attn::warp_sum(dot) * scale - row_lse);
    const float ds = p * (attn::warp_sum(dp) - row_delta);
#pragma unroll
    for (int i = 0; i < kNaivePerLane; ++i) {
      const int c = lane + 32 * i;
      if (c < d) acc[i] += ds * attn::to_float(kj[c]);
    }
  }
#pragma unroll
  for (int i = 0; i < kNaivePerLane; ++i) {
    const int c = lane + 32 * i;
    if (c < d) attn::store_val(dq + (t * hq + h) * d + c, acc[i] * scale);
  }
}

// dk, dv: one warp per (key row j, kv head g), over the group's query heads and queries
// j .. end of the sequence.
template <typename T>
__global__ void __launch_bounds__(kNaiveWarps * 32)
    attention_bwd_dkdv_naive_kernel(const int32_t* __restrict__ cu, int batch, int64_t total,
                                    int hq, int hkv, int d, float scale, const T* __restrict__ q,
                                    const T* __restrict__ k, const T* __restrict__ v,
                                    const T* __restrict__ dout, const float* __restrict__ lse,
                                    const float* __restrict__ delta, T* __restrict__ dk,
                                    T* __restrict__ dv) {
  const int64_t wid = static_cast<int64_t>(blockIdx.x) * kNaiveWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (wid >= total * hkv) return;
  const int64_t j = wid / hkv;
  const int g = static_cast<int>(wid % hkv), group = hq / hkv;
  const int64_t s1 = cu[attn::find_sequence(cu, batch, j) + 1];
  float kr[kNaivePerLane], vr[kNaivePerLane], dka[kNaivePerLane], dva[kNaivePerLane];
#pragma unroll
  for (int i = 0; i < kNaivePerLane; ++i) {
    const int c = lane + 32 * i;
    kr[i] = c < d ? attn::to_float(k[(j * hkv + g) * d + c]) : 0.f;
    vr[i] = c < d ? attn::to_float(v[(j * hkv + g) * d + c]) : 0.f;
    dka[i] = dva[i] = 0.f;
  }
  for (int h = g * group; h < (g + 1) * group; ++h) {
    for (int64_t t = j; t < s1; ++t) {
      const T* qt = q + (t * hq + h) * d;
      const T* dot_ = dout + (t * hq + h) * d;
      float dot = 0.f, dp = 0.f;
#pragma unroll
      for (int i = 0; i < kNaivePerLane; ++i) {
        const int c = lane + 32 * i;
        if (c < d) {
          dot += kr[i] * attn::to_float(qt[c]);
          dp += vr[i] * attn::to_float(dot_[c]);
        }
      }
      const float p = expf(attn::warp_sum(dot) * scale - lse[t * hq + h]);
      const float ds = p * (attn::warp_sum(dp) - delta[t * hq + h]);
#pragma unroll
      for (int i = 0; i < kNaivePerLane; ++i) {
        const int c = lane + 32 * i;
        if (c < d) {
          dka[i] += ds * attn::to_float(qt[c]);
          dva[i] += p * attn::to_float(dot_[c]);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kNaivePerLane; ++i) {
    const int c = lane + 32 * i;
    if (c < d) {
      attn::store_val(dk + (j * hkv + g) * d + c, dka[i] * scale);
      attn::store_val(dv + (j * hkv + g) * d + c, dva[i]);
    }
  }
}

template <typename T>
void launch_bwd_naive(const AttentionPlan& plan, const void* dout, const void* q, const void* k,
                      const void* v, const float* lse, const float* delta, int hq, int hkv, int d,
                      double scale, void* dq, void* dk, void* dv, cudaStream_t stream) {
  const int64_t n = plan.total_rows();
  const int batch = static_cast<int>(plan.batch());
  const float sc = static_cast<float>(scale);
  attention_bwd_dq_naive_kernel<T>
      <<<static_cast<unsigned>((n * hq + kNaiveWarps - 1) / kNaiveWarps), kNaiveWarps * 32, 0,
         stream>>>(plan.device_cu_seqlens(), batch, n, hq, hkv, d, sc, static_cast<const T*>(q),
                   static_cast<const T*>(k), static_cast<const T*>(v),
                   static_cast<const T*>(dout), lse, delta, static_cast<T*>(dq));
  check_launch("attention_bwd_dq_naive_kernel");
  attention_bwd_dkdv_naive_kernel<T>
      <<<static_cast<unsigned>((n * hkv + kNaiveWarps - 1) / kNaiveWarps), kNaiveWarps * 32, 0,
         stream>>>(plan.device_cu_seqlens(), batch, n, hq, hkv, d, sc, static_cast<const T*>(q),
                   static_cast<const T*>(k), static_cast<const T*>(v),
                   static_cast<const T*>(dout), lse, delta, static_cast<T*>(dk),
                   static_cast<T*>(dv));
  check_launch("attention_bwd_dkdv_naive_kernel");
}

template <typename T, int G>
void launch_delta_vec(const void* dout, const void* out, int64_t rows, int d, float* delta,
                      cudaStream_t stream) {
  constexpr int kThreadsPerBlock = 256;
  const int64_t threads = rows * G;
  attention_bwd_delta_vec_kernel<T, G>
      <<<static_cast<unsigned>((threads + kThreadsPerBlock - 1) / kThreadsPerBlock),
         kThreadsPerBlock, 0, stream>>>(static_cast<const T*>(dout), static_cast<const T*>(out),
                                        rows, d, delta);
  check_launch("attention_bwd_delta_vec_kernel");
}

template <typename T>
void launch_delta(const void* dout, const void* out, int64_t rows, int d, float* delta,
                  cudaStream_t stream) {
  if (rows == 0) return;  // no grid of zero blocks
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  const int chunks = d / V;  // 16-byte chunks per row
  if (d % V == 0 && chunks >= 1 && dev::aligned16(dout) && dev::aligned16(out)) {
    if (chunks <= 4) return launch_delta_vec<T, 4>(dout, out, rows, d, delta, stream);
    if (chunks <= 8) return launch_delta_vec<T, 8>(dout, out, rows, d, delta, stream);
    if (chunks <= 16) return launch_delta_vec<T, 16>(dout, out, rows, d, delta, stream);
    return launch_delta_vec<T, 32>(dout, out, rows, d, delta, stream);
  }
  constexpr int kWarps = 8;
  attention_bwd_delta_kernel<T>
      <<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(
          static_cast<const T*>(dout), static_cast<const T*>(out), rows, d, delta);
  check_launch("attention_bwd_delta_kernel");
}

// Stream-ordered scratch: freed on the stream after the kernels that use it, also on error.
class ScratchF32 {
 public:
  ScratchF32(int64_t n, cudaStream_t stream) : stream_(stream) {
    OPD_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&ptr_),
                                   static_cast<size_t>(n) * sizeof(float), stream));
  }
  ~ScratchF32() {
    if (ptr_) (void)cudaFreeAsync(ptr_, stream_);
  }
  ScratchF32(const ScratchF32&) = delete;
  ScratchF32& operator=(const ScratchF32&) = delete;
  float* get() const { return ptr_; }

 private:
  float* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace

void attention_backward(const AttentionPlan& plan, const void* dout, const void* q, const void* k,
                        const void* v, const void* out, const float* lse, int64_t hq, int64_t hkv,
                        int64_t d, double scale, DType dtype, void* dq, void* dk, void* dv,
                        cudaStream_t stream, const AttentionBwdTiles& tiles) {
  OPD_CHECK((tiles.dkdv_queries == 32 || tiles.dkdv_queries == 64) &&
                (tiles.dq_keys == 32 || tiles.dq_keys == 64),
            InvalidArgument, "CUDA attention_backward: tile sizes ", tiles.dkdv_queries, ", ",
            tiles.dq_keys, " (each 32 or 64)");
  OPD_CHECK(hkv >= 1 && hq % hkv == 0, InvalidArgument, "CUDA attention_backward: query heads ",
            hq, " must be a multiple of kv heads ", hkv);
  OPD_CHECK(d >= 1 && d <= 32 * kNaivePerLane, Unsupported, "CUDA attention_backward: head_dim ",
            d, " is not supported (1 .. ", 32 * kNaivePerLane, ")");
  OPD_CHECK(plan.num_tiles() * hq < (int64_t{1} << 31) && plan.total_rows() * hq < (int64_t{1} << 33),
            Unsupported, "CUDA attention_backward: ", plan.total_rows(), " rows x ", hq,
            " heads is too large for one launch");
  OPD_CHECK(dtype == DType::BF16 || dtype == DType::F32, Unsupported,
            "CUDA attention_backward for dtype ", dtype_name(dtype), " (f32 or bf16)");
  if (plan.total_rows() == 0 || hq == 0) return;
  const int iq = static_cast<int>(hq), ik = static_cast<int>(hkv), id = static_cast<int>(d);
  const int64_t rows = plan.total_rows() * hq;
  ScratchF32 delta(rows, stream);
  if (dtype == DType::BF16) {
    launch_delta<bf16>(dout, out, rows, id, delta.get(), stream);
    if (d == 128) {
      return launch_bwd_bf16<128>(plan, dout, q, k, v, lse, delta.get(), iq, ik, scale, dq, dk,
                                  dv, tiles, resolve_attention_bwd_kernel(dtype, d, stream),
                                  stream);
    }
    if (d == 64) {
      return launch_bwd_bf16<64>(plan, dout, q, k, v, lse, delta.get(), iq, ik, scale, dq, dk,
                                 dv, tiles, AttentionBwdKernel::Mma, stream);
    }
    return launch_bwd_naive<bf16>(plan, dout, q, k, v, lse, delta.get(), iq, ik, id, scale, dq,
                                  dk, dv, stream);
  }
  launch_delta<float>(dout, out, rows, id, delta.get(), stream);
  launch_bwd_naive<float>(plan, dout, q, k, v, lse, delta.get(), iq, ik, id, scale, dq, dk, dv,
                          stream);
}

}  // namespace opd::cuda
