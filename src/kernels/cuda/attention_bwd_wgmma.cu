// dK and dV of the causal grouped-query attention backward on Hopper (bf16, head_dim 128) with
// warpgroup MMA: FlashAttention-2 algorithm 2 (Dao 2023) in FlashAttention-3's form (Shah et
// al. 2024, section 3.3), a wgmma dQ kernel (second kernel below), and the OPD_ATTENTION_BWD
// selection. (A 5-product variant that added dQ inside this kernel under per-block counters,
// `wgmma-dq`, was slower on the H200 on every shape and was removed in session 7: docs/perf.md.) With P = exp(scale q k^T - lse),
// dP = dout v^T, D = rowsum(dout * out), dS = P * (dP - D):  dV = P^T dout, dK = scale dS^T q.
//
// One CTA = one 128-key tile of one sequence (the AttentionPlan's k_tiles) x one kv head =
// 2 warpgroups of 64 keys. It loops over (query head of the GQA group, 64-query block) pairs
// from the block holding its first key to the end of the sequence, with Q, dO, lse, D of the
// next pair prefetched by cp.async into the other of two buffers. Per pair, each warpgroup
// computes the transposed products (keys as wgmma's M dimension), so that P^T and dS^T come
// out in the accumulator layout, which is the register A operand of the next products:
//   S^T  = K Q^T     wgmma m64n64k16 x 8, K and Q K-major from shared memory
//   dP^T = V dO^T    wgmma m64n64k16 x 8, V and dO K-major
//   P^T = exp2(S^T scale log2e - lse log2e) (0 where key > query), dS^T = P^T (dP^T - D)
//   dV += P^T dO     wgmma m64n128k16 x 4, P^T from registers, dO N-major ([queries][d])
//   dK += dS^T Q     wgmma m64n128k16 x 4, dS^T from registers, Q N-major
// S^T and dP^T are two commit groups: the exponentials run while dP^T is still computed, and
// dV's product runs while dS is formed. dK and dV (64 x 128 f32 each per warpgroup) stay in
// registers over the whole loop: every output element has one owner and a fixed summation
// order (the GQA group sum included), so results are bit-identical run to run.
// Rows past the sequence: Q = dO = 0, lse = +inf, D = 0, so P = dS = 0 there; keys past it
// (zero-filled K, V) are after every valid query, so the causal mask zeroes them.
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/cuda/cuda_check.h"
#include "core/cuda/stream.h"
#include "core/env_choice.h"
#include "core/error.h"
#include "kernels/cuda/attention_mma.h"  // attn::Tile, cp.async commit/wait, pack_bf16
#include "kernels/cuda/attention_wgmma.h"
#include "kernels/cuda/attention_wgmma_ptx.h"

namespace opd::cuda {
namespace {

using attn::Tile;
using bf16 = __nv_bfloat16;

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kThreads = 256;                  // 2 warpgroups
constexpr int kBK = AttentionPlan::kTileRows;  // 128 keys per CTA, 64 per warpgroup
constexpr int kBQ = 64;                        // queries per loop step
constexpr int kD = 128;
static_assert(kBK == 128, "two warpgroups of 64 keys cover one plan tile");

constexpr int kKVBytes = kBK * kD * 2;  // one K or V tile: 2 panels of 16 KiB
constexpr int kQBytes = kBQ * kD * 2;   // one Q or dO stage: 2 panels of 8 KiB
// Alignment slack + K + V + 2 stages x (Q, dO) + 2 stages x (lse, D) f32.
constexpr int kSmemBytes = 1024 + 2 * kKVBytes + 4 * kQBytes + 4 * kBQ * 4;

// grid.x = num_tiles * hkv (the plan's k_tiles: key tiles with the most queries after them
// first, kv head fastest); 256 threads.
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_dkdv_wgmma_kernel(const Tile* __restrict__ tiles, int hq, int hkv, float scale,
                                    float scale_log2, const bf16* __restrict__ q,
                                    const bf16* __restrict__ k, const bf16* __restrict__ v,
                                    const bf16* __restrict__ dout, const float* __restrict__ lse,
                                    const float* __restrict__ delta, bf16* __restrict__ dk,
                                    bf16* __restrict__ dv) {
#if OPD_WGMMA_ENABLED
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The 128-byte swizzle is a function of address bits [4:9]: tiles start 1024-byte aligned.
  const uint32_t raw = attn::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const uint32_t sK = base;               // [128][128], later the dK staging tile
  const uint32_t sV = sK + kKVBytes;      // [128][128], later the dV staging tile
  const uint32_t sQ = sV + kKVBytes;      // [2][64][128]
  const uint32_t sdO = sQ + 2 * kQBytes;  // [2][64][128]
  float* sLse = reinterpret_cast<float*>(smem + 2 * kKVBytes + 4 * kQBytes);  // [2][64], log2
  float* sDelta = sLse + 2 * kBQ;                                              // [2][64]

  const Tile tile = tiles[blockIdx.x / hkv];
  const int g = static_cast<int>(blockIdx.x % hkv);
  const int group = hq / hkv;
  const int tid = static_cast<int>(threadIdx.x);
  const int wgi = tid / 128, warp = (tid / 32) % 4, lane = tid % 32;

  const int k0 = tile.block * kBK;              // sequence-relative first key
  const int krows = min(kBK, tile.len - k0);    // valid keys of the tile (>= 1)
  const int i0 = k0 / kBQ;                      // first query block that sees any of them
  const int n_qb = (tile.len + kBQ - 1) / kBQ - i0;  // >= 1: k0 < len
  const int iters = group * n_qb;
  const int64_t q_stride = static_cast<int64_t>(hq) * kD;
  const int64_t kv_stride = static_cast<int64_t>(hkv) * kD;
  const int64_t kv_off = (static_cast<int64_t>(tile.start + k0) * hkv + g) * kD;

  // Step `it`'s query head and first (sequence-relative) query row: heads outer, blocks in
  // order.
  auto step_head = [&](int it) { return g * group + it / n_qb; };
  auto step_row0 = [&](int it) { return (i0 + it % n_qb) * kBQ; };
  // Stage `it` into buffer `buf`:
  // cp.async for Q and dO (rows past the sequence zero-filled), plain stores for lse, D.
  auto load_stage = [&](int it, int buf) {
    const int h = step_head(it);
    const int qr0 = step_row0(it);  // < len: the last block starts before the end
    const int qvalid = min(kBQ, tile.len - qr0);
    const int64_t off = (static_cast<int64_t>(tile.start + qr0) * hq + h) * kD;
    wg::load_tile_swz128<kBQ, kThreads>(sQ + buf * kQBytes, q + off, q_stride, qvalid);
    wg::load_tile_swz128<kBQ, kThreads>(sdO + buf * kQBytes, dout + off, q_stride, qvalid);
    if (tid < kBQ) {
      const int64_t row = static_cast<int64_t>(tile.start + qr0 + tid) * hq + h;
      sLse[buf * kBQ + tid] = tid < qvalid ? lse[row] * kLog2e : INFINITY;
      sDelta[buf * kBQ + tid] = tid < qvalid ? delta[row] : 0.f;
    }
  };

  wg::load_tile_swz128<kBK, kThreads>(sK, k + kv_off, kv_stride, krows);
  wg::load_tile_swz128<kBK, kThreads>(sV, v + kv_off, kv_stride, krows);
  load_stage(0, 0);
  attn::cp_async_commit();

  float dv_acc[64], dk_acc[64];  // 16 keys x 128 of this warp (accumulator layout)
#pragma unroll
  for (int i = 0; i < 64; ++i) dv_acc[i] = dk_acc[i] = 0.f;
  const int warp_key0 = k0 + wgi * 64 + warp * 16;  // sequence-relative
  const int key_lo = warp_key0 + lane / 4;          // key of st[4i + 0..1]; +8 for [4i + 2..3]
  const int wg_row0 = wgi * 64;                     // this warpgroup's rows of the K, V tiles

  for (int it = 0; it < iters; ++it) {
    const int buf = it & 1;
    // Stage `it` landed (this thread's copies done and fenced for the async proxy; after the
    // barrier everyone's, and the lse / D stores too). The barrier also means both warpgroups
    // finished step it - 1 (its wgmmas were waited for), so buffer buf ^ 1 is free.
    attn::cp_async_wait<0>();
    wg::fence_proxy_async();
    __syncthreads();
    if (it + 1 < iters) {
      load_stage(it + 1, buf ^ 1);
      attn::cp_async_commit();
    }
    const uint32_t tq = sQ + buf * kQBytes, tdo = sdO + buf * kQBytes;
    const float* tl = sLse + buf * kBQ;
    const float* td = sDelta + buf * kBQ;
    const int qr0 = step_row0(it);

    // Descriptors before the pipeline stage starts (ptxas serializes wgmmas whose inputs are
    // defined by other instructions between them).
    uint64_t kd[kD / 16], qd[kD / 16], vd[kD / 16], dod[kD / 16];
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      kd[ks] = wg::desc_k_major(sK, kBK, wg_row0, ks);
      vd[ks] = wg::desc_k_major(sV, kBK, wg_row0, ks);
      qd[ks] = wg::desc_k_major(tq, kBQ, 0, ks);
      dod[ks] = wg::desc_k_major(tdo, kBQ, 0, ks);
    }
    uint64_t dod_n[kBQ / 16], qd_n[kBQ / 16];
#pragma unroll
    for (int kk = 0; kk < kBQ / 16; ++kk) {
      dod_n[kk] = wg::desc_n_major(tdo, kBQ, kk * 16);
      qd_n[kk] = wg::desc_n_major(tq, kBQ, kk * 16);
    }

    float st[kBQ / 2], dpt[kBQ / 2];  // 16 keys x 64 queries of this warp
    wg::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) wg::wgmma_m64n64k16_ss(st, kd[ks], qd[ks], ks > 0 ? 1 : 0);
    wg::wgmma_commit();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) wg::wgmma_m64n64k16_ss(dpt, vd[ks], dod[ks], ks > 0 ? 1 : 0);
    wg::wgmma_commit();
    wg::wgmma_wait<1>();  // S^T done; dP^T may still run
    wg::fence_regs(st);

    // P^T, masked where the key is after the query (only blocks whose first query precedes
    // this warp's last key hold such pairs). Column (query) of st[4i + e]: 8i + 2(lane % 4) +
    // (e & 1); row (key): key_lo + 8 (e >> 1).
    const bool need_mask = warp_key0 + 15 > qr0;
#pragma unroll
    for (int i = 0; i < kBQ / 8; ++i) {
      const int col = i * 8 + (lane % 4) * 2;
      const float2 l2 = *reinterpret_cast<const float2*>(tl + col);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = exp2f(st[4 * i + e] * scale_log2 - ((e & 1) ? l2.y : l2.x));
        if (need_mask && key_lo + (e >> 1) * 8 > qr0 + col + (e & 1)) p = 0.f;
        st[4 * i + e] = p;
      }
    }
    // A fragments: queries 16kk..16kk+15 are n8 blocks 2kk (a0, a1) and 2kk + 1 (a2, a3).
    uint32_t pa[kBQ / 16][4], dsa[kBQ / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBQ / 16; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) pa[kk][r] = attn::pack_bf16(st[8 * kk + 2 * r], st[8 * kk + 2 * r + 1]);
    }
    wg::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBQ / 16; ++kk) wg::wgmma_m64n128k16_rs_tb(dv_acc, pa[kk], dod_n[kk]);
    wg::wgmma_commit();
    wg::wgmma_wait<1>();  // dP^T done (groups complete in order); dV's product may still run
    wg::fence_regs(dpt);

#pragma unroll
    for (int i = 0; i < kBQ / 8; ++i) {
      const int col = i * 8 + (lane % 4) * 2;
      const float2 dl = *reinterpret_cast<const float2*>(td + col);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        dpt[4 * i + e] = st[4 * i + e] * (dpt[4 * i + e] - ((e & 1) ? dl.y : dl.x));
      }
    }
#pragma unroll
    for (int kk = 0; kk < kBQ / 16; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) dsa[kk][r] = attn::pack_bf16(dpt[8 * kk + 2 * r], dpt[8 * kk + 2 * r + 1]);
    }
    wg::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBQ / 16; ++kk) wg::wgmma_m64n128k16_rs_tb(dk_acc, dsa[kk], qd_n[kk]);
    wg::wgmma_commit();
    // Everything of this step done before the barrier that lets buffer `buf` be refilled (and
    // before pa / dsa are rewritten).
    wg::wgmma_wait<0>();
    wg::fence_regs(dv_acc);
    wg::fence_regs(dk_acc);
  }

  // Epilogue of one warp: stage its 16 rows of dK (scaled) and dV in its own rows of the K and
  // V tiles (only its warpgroup's wgmmas read them, all waited for) with the tile swizzle, then
  // 16-byte coalesced stores of the valid key rows.
  const int trow = wg_row0 + warp * 16 + lane / 4;  // tile row of acc[4i + 0..1]
  unsigned char* stage_k = smem + (sK - base);
  unsigned char* stage_v = smem + (sV - base);
  const uint32_t within = (lane % 4) * 4;
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) {
    const uint32_t lo = wg::swz128_offset(kBK, trow, i) + within;
    const uint32_t hi = wg::swz128_offset(kBK, trow + 8, i) + within;
    *reinterpret_cast<uint32_t*>(stage_k + lo) =
        attn::pack_bf16(dk_acc[4 * i + 0] * scale, dk_acc[4 * i + 1] * scale);
    *reinterpret_cast<uint32_t*>(stage_k + hi) =
        attn::pack_bf16(dk_acc[4 * i + 2] * scale, dk_acc[4 * i + 3] * scale);
    *reinterpret_cast<uint32_t*>(stage_v + lo) = attn::pack_bf16(dv_acc[4 * i + 0], dv_acc[4 * i + 1]);
    *reinterpret_cast<uint32_t*>(stage_v + hi) = attn::pack_bf16(dv_acc[4 * i + 2], dv_acc[4 * i + 3]);
  }
  __syncwarp();
#pragma unroll
  for (int idx_it = 0; idx_it < 16 * (kD / 8) / 32; ++idx_it) {
    const int idx = idx_it * 32 + lane;
    const int row = wg_row0 + warp * 16 + idx / (kD / 8), chunk = idx % (kD / 8);
    if (row < krows) {
      const int64_t off = kv_off + row * kv_stride + chunk * 8;
      const uint32_t so = wg::swz128_offset(kBK, row, chunk);
      *reinterpret_cast<uint4*>(dk + off) = *reinterpret_cast<const uint4*>(stage_k + so);
      *reinterpret_cast<uint4*>(dv + off) = *reinterpret_cast<const uint4*>(stage_v + so);
    }
  }
#endif  // OPD_WGMMA_ENABLED: the plain sm_90 build has an empty body and is never launched
}

// ---- dQ: one CTA per (128-query tile, query head), looping over 64-key tiles ---------------
// The forward's structure with the backward's products (FlashAttention-2 algorithm 2's dQ half,
// kept as a separate kernel so that dQ needs no atomics): each warpgroup owns 64 query rows and
// per key tile computes S = Q K^T and dP = dO V^T (wgmma m64n64k16, Q, dO, K, V K-major),
// dS = P (dP - D) with P = exp2(S scale log2e - lse) causally masked, and dQ += dS K
// (wgmma m64n128k16, dS from registers, K N-major). K and V tiles are double-buffered.
constexpr int kBN = 64;                      // keys per loop step
constexpr int kQTileBytes = kBK * kD * 2;    // Q or dO of the CTA's 128 rows
constexpr int kKTileBytes = kBN * kD * 2;    // one K or V buffer
constexpr int kDqSmemBytes = 1024 + 2 * kQTileBytes + 4 * kKTileBytes;

// grid.x = num_tiles * hq (the plan's q_tiles: query tiles with the most keys first, head
// fastest); 256 threads.
__global__ void __launch_bounds__(kThreads, 1)
    attention_bwd_dq_wgmma_kernel(const Tile* __restrict__ tiles, int hq, int hkv, float scale,
                                  float scale_log2, const bf16* __restrict__ q,
                                  const bf16* __restrict__ k, const bf16* __restrict__ v,
                                  const bf16* __restrict__ dout, const float* __restrict__ lse,
                                  const float* __restrict__ delta, bf16* __restrict__ dq) {
#if OPD_WGMMA_ENABLED
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = attn::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const uint32_t sQ = base;                   // [128][128], later the dQ staging tile
  const uint32_t sdO = sQ + kQTileBytes;      // [128][128]
  const uint32_t sK = sdO + kQTileBytes;      // [2][64][128]
  const uint32_t sV = sK + 2 * kKTileBytes;   // [2][64][128]

  const Tile tile = tiles[blockIdx.x / hq];
  const int h = static_cast<int>(blockIdx.x % hq);
  const int g = h / (hq / hkv);
  const int tid = static_cast<int>(threadIdx.x);
  const int wgi = tid / 128, warp = (tid / 32) % 4, lane = tid % 32;

  const int q0 = tile.block * kBK;            // sequence-relative first query row
  const int rows = min(kBK, tile.len - q0);   // valid rows (>= 1)
  const int kv_end = q0 + rows;               // keys any valid row sees (causal)
  const int n_kv = (kv_end + kBN - 1) / kBN;
  const int64_t q_stride = static_cast<int64_t>(hq) * kD;
  const int64_t kv_stride = static_cast<int64_t>(hkv) * kD;
  const int64_t q_off = (static_cast<int64_t>(tile.start + q0) * hq + h) * kD;
  const bf16* k_ptr = k + (static_cast<int64_t>(tile.start) * hkv + g) * kD;
  const bf16* v_ptr = v + (static_cast<int64_t>(tile.start) * hkv + g) * kD;

  wg::load_tile_swz128<kBK, kThreads>(sQ, q + q_off, q_stride, rows);
  wg::load_tile_swz128<kBK, kThreads>(sdO, dout + q_off, q_stride, rows);
  wg::load_tile_swz128<kBN, kThreads>(sK, k_ptr, kv_stride, min(kBN, kv_end));
  wg::load_tile_swz128<kBN, kThreads>(sV, v_ptr, kv_stride, min(kBN, kv_end));
  attn::cp_async_commit();

  // lse (log2 units) and D of this thread's rows r and r + 8; rows past the sequence get
  // lse = +inf (P = 0) and are never stored.
  const int wg_row0 = wgi * 64;
  const int warp_row0 = q0 + wg_row0 + warp * 16;  // sequence-relative
  const int row_lo = warp_row0 + lane / 4;
  float lse2[2], dl[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_lo + r * 8;
    const int64_t idx = static_cast<int64_t>(tile.start + row) * hq + h;
    lse2[r] = row < tile.len ? lse[idx] * kLog2e : INFINITY;
    dl[r] = row < tile.len ? delta[idx] : 0.f;
  }

  float dq_acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) dq_acc[i] = 0.f;

  for (int j = 0; j < n_kv; ++j) {
    const int buf = j & 1;
    // Tile j landed everywhere; both warpgroups finished tile j - 1 (waited for), so its
    // buffer (buf ^ 1) may be refilled with tile j + 1.
    attn::cp_async_wait<0>();
    wg::fence_proxy_async();
    __syncthreads();
    if (j + 1 < n_kv) {
      const int n1 = (j + 1) * kBN;
      wg::load_tile_swz128<kBN, kThreads>(sK + (buf ^ 1) * kKTileBytes, k_ptr + n1 * kv_stride,
                                          kv_stride, min(kBN, kv_end - n1));
      wg::load_tile_swz128<kBN, kThreads>(sV + (buf ^ 1) * kKTileBytes, v_ptr + n1 * kv_stride,
                                          kv_stride, min(kBN, kv_end - n1));
      attn::cp_async_commit();
    }
    const uint32_t tk = sK + buf * kKTileBytes, tv = sV + buf * kKTileBytes;
    uint64_t qd[kD / 16], kd[kD / 16], dod[kD / 16], vd[kD / 16], kn[kBN / 16];
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      qd[ks] = wg::desc_k_major(sQ, kBK, wg_row0, ks);
      dod[ks] = wg::desc_k_major(sdO, kBK, wg_row0, ks);
      kd[ks] = wg::desc_k_major(tk, kBN, 0, ks);
      vd[ks] = wg::desc_k_major(tv, kBN, 0, ks);
    }
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) kn[kk] = wg::desc_n_major(tk, kBN, kk * 16);

    float s[kBN / 2], dp[kBN / 2];
    wg::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) wg::wgmma_m64n64k16_ss(s, qd[ks], kd[ks], ks > 0 ? 1 : 0);
    wg::wgmma_commit();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) wg::wgmma_m64n64k16_ss(dp, dod[ks], vd[ks], ks > 0 ? 1 : 0);
    wg::wgmma_commit();
    wg::wgmma_wait<1>();  // S done; dP may still run
    wg::fence_regs(s);

    // P, masked where the key is after the row (only tiles reaching past the warp's first row).
    // Row of s[4i + e]: row_lo + 8 (e >> 1); key: n0 + 8i + 2(lane % 4) + (e & 1).
    const int n0 = j * kBN;
    const bool need_mask = n0 + kBN - 1 > warp_row0;
#pragma unroll
    for (int i = 0; i < kBN / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = exp2f(s[4 * i + e] * scale_log2 - lse2[e >> 1]);
        if (need_mask && n0 + i * 8 + (lane % 4) * 2 + (e & 1) > row_lo + (e >> 1) * 8) p = 0.f;
        s[4 * i + e] = p;
      }
    }
    wg::wgmma_wait<0>();
    wg::fence_regs(dp);
    uint32_t dsa[kBN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i0 = 8 * kk + 2 * r;  // two floats of one row: same (e >> 1)
        const float dl_r = dl[r & 1];
        dsa[kk][r] = attn::pack_bf16(s[i0] * (dp[i0] - dl_r), s[i0 + 1] * (dp[i0 + 1] - dl_r));
      }
    }
    wg::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) wg::wgmma_m64n128k16_rs_tb(dq_acc, dsa[kk], kn[kk]);
    wg::wgmma_commit();
    wg::wgmma_wait<0>();  // before the barrier that lets buffer `buf` be refilled
    wg::fence_regs(dq_acc);
  }

  // Epilogue of one warp: scale, stage its 16 rows in its own rows of the Q tile (read only by
  // its warpgroup's wgmmas, all waited for), 16-byte coalesced stores of the valid rows.
  const int trow = wg_row0 + warp * 16 + lane / 4;
  unsigned char* stage = smem + (sQ - base);
  const uint32_t within = (lane % 4) * 4;
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) {
    *reinterpret_cast<uint32_t*>(stage + wg::swz128_offset(kBK, trow, i) + within) =
        attn::pack_bf16(dq_acc[4 * i + 0] * scale, dq_acc[4 * i + 1] * scale);
    *reinterpret_cast<uint32_t*>(stage + wg::swz128_offset(kBK, trow + 8, i) + within) =
        attn::pack_bf16(dq_acc[4 * i + 2] * scale, dq_acc[4 * i + 3] * scale);
  }
  __syncwarp();
#pragma unroll
  for (int idx_it = 0; idx_it < 16 * (kD / 8) / 32; ++idx_it) {
    const int idx = idx_it * 32 + lane;
    const int row = wg_row0 + warp * 16 + idx / (kD / 8), chunk = idx % (kD / 8);
    if (row < rows) {
      *reinterpret_cast<uint4*>(dq + q_off + row * q_stride + chunk * 8) =
          *reinterpret_cast<const uint4*>(stage + wg::swz128_offset(kBK, row, chunk));
    }
  }
#endif  // OPD_WGMMA_ENABLED
}

// The setting: set_*_kernel's value, else OPD_ATTENTION_BWD (read once), else Auto
// (core/env_choice.h).
EnvChoice g_setting{"OPD_ATTENTION_BWD",
                     {{"auto", static_cast<int>(AttentionBwdKernel::Auto)},
                      {"mma", static_cast<int>(AttentionBwdKernel::Mma)},
                      {"wgmma", static_cast<int>(AttentionBwdKernel::Wgmma)},
                      {"wgmma-all", static_cast<int>(AttentionBwdKernel::WgmmaAll)}},
                     static_cast<int>(AttentionBwdKernel::Auto)};

AttentionBwdKernel setting_or_throw() { return static_cast<AttentionBwdKernel>(g_setting.get()); }

// What Auto means where the device runs sm_90a code: the wgmma dK/dV and dQ kernels, the
// fastest measured (H200, session 7, docs/perf.md "Attention backward — the wgmma kernels
// measured"): 4 x 4096 GQA 16/8 2.10 ms vs mma 3.47, wgmma 2.54.
constexpr AttentionBwdKernel kAutoChoice = AttentionBwdKernel::WgmmaAll;

}  // namespace

void set_attention_bwd_kernel(AttentionBwdKernel kernel) {
  g_setting.set(static_cast<int>(kernel));
}

AttentionBwdKernel attention_bwd_kernel_setting() { return setting_or_throw(); }

const char* attention_bwd_kernel_name(AttentionBwdKernel kernel) {
  switch (kernel) {
    case AttentionBwdKernel::Auto: return "auto";
    case AttentionBwdKernel::Mma: return "mma";
    case AttentionBwdKernel::Wgmma: return "wgmma";
    case AttentionBwdKernel::WgmmaAll: return "wgmma-all";
  }
  return "?";
}

AttentionBwdKernel resolve_attention_bwd_kernel(DType dtype, int64_t head_dim,
                                                cudaStream_t stream) {
  const AttentionBwdKernel s = setting_or_throw();
  if (dtype != DType::BF16 || head_dim != kD || s == AttentionBwdKernel::Mma) {
    return AttentionBwdKernel::Mma;
  }
  if (s == AttentionBwdKernel::Wgmma || s == AttentionBwdKernel::WgmmaAll) {
    OPD_CHECK(attention_wgmma_available_on(stream), Unsupported, "attention backward: the ",
              attention_bwd_kernel_name(s), " kernels were requested (OPD_ATTENTION_BWD or "
              "set_attention_bwd_kernel) but this device does not run sm_90a code");
    return s;
  }
  if (kAutoChoice != AttentionBwdKernel::Mma && attention_wgmma_available_on(stream)) {
    return kAutoChoice;
  }
  return AttentionBwdKernel::Mma;
}

namespace {
// The checks both launchers share; false when there is nothing to compute.
bool check_args(const char* op, const AttentionPlan& plan, int64_t hq, int64_t hkv, double scale,
                cudaStream_t stream) {
  OPD_CHECK(hkv >= 1 && hq >= 1 && hq % hkv == 0, InvalidArgument, "CUDA ", op,
            ": query heads ", hq, " must be a positive multiple of kv heads ", hkv);
  OPD_CHECK(std::isfinite(scale), InvalidArgument, "CUDA ", op, ": scale ", scale);
  OPD_CHECK(plan.num_tiles() * hq < (int64_t{1} << 31) && plan.total_rows() * hq < (int64_t{1} << 33),
            Unsupported, "CUDA ", op, ": ", plan.total_rows(), " rows x ", hq,
            " heads is too large for one launch");
  OPD_CHECK(attention_wgmma_available_on(stream), Unsupported, "CUDA ", op,
            ": this device does not run sm_90a (wgmma) code");
  return plan.total_rows() > 0 && plan.num_tiles() > 0;
}
}  // namespace

void attention_backward_dkdv_wgmma(const AttentionPlan& plan, const void* dout, const void* q,
                                   const void* k, const void* v, const float* lse,
                                   const float* delta, int64_t hq, int64_t hkv, double scale,
                                   void* dk, void* dv, cudaStream_t stream) {
  if (!check_args("attention_backward_dkdv_wgmma", plan, hq, hkv, scale, stream)) return;
  auto kernel = attention_bwd_dkdv_wgmma_kernel;
  OPD_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  kernel<<<static_cast<unsigned>(plan.num_tiles() * hkv), kThreads, kSmemBytes, stream>>>(
      reinterpret_cast<const Tile*>(plan.k_tiles()), static_cast<int>(hq), static_cast<int>(hkv),
      static_cast<float>(scale), static_cast<float>(scale) * kLog2e, static_cast<const bf16*>(q),
      static_cast<const bf16*>(k), static_cast<const bf16*>(v), static_cast<const bf16*>(dout),
      lse, delta, static_cast<bf16*>(dk), static_cast<bf16*>(dv));
  check_launch("attention_bwd_dkdv_wgmma_kernel");
}

void attention_backward_dq_wgmma(const AttentionPlan& plan, const void* dout, const void* q,
                                 const void* k, const void* v, const float* lse,
                                 const float* delta, int64_t hq, int64_t hkv, double scale,
                                 void* dq, cudaStream_t stream) {
  if (!check_args("attention_backward_dq_wgmma", plan, hq, hkv, scale, stream)) return;
  auto kernel = attention_bwd_dq_wgmma_kernel;
  OPD_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kDqSmemBytes));
  kernel<<<static_cast<unsigned>(plan.num_tiles() * hq), kThreads, kDqSmemBytes, stream>>>(
      reinterpret_cast<const Tile*>(plan.q_tiles()), static_cast<int>(hq), static_cast<int>(hkv),
      static_cast<float>(scale), static_cast<float>(scale) * kLog2e, static_cast<const bf16*>(q),
      static_cast<const bf16*>(k), static_cast<const bf16*>(v), static_cast<const bf16*>(dout),
      lse, delta, static_cast<bf16*>(dq));
  check_launch("attention_bwd_dq_wgmma_kernel");
}

}  // namespace opd::cuda
