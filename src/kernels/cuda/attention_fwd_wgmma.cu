// Causal or non-causal grouped-query attention forward for packed variable-length batches on
// Hopper, bf16, head_dim 128, with warpgroup MMA: FlashAttention-3 (Shah et al. 2024) without
// the producer warp. out = softmax(scale q k^T [+ causal mask]) v, lse = m + log(l) (natural
// log, f32), the online softmax of FlashAttention-2 (Dao 2023) kept in registers.
//
// One CTA = one 128-row query block of one sequence (the AttentionPlan's tiles) x one query
// head = 2 warpgroups of 64 rows. Per key tile j (block_n = 64 or 128 keys):
//   S_j = Q K_j^T   wgmma m64nBNk16 x 8, Q and K from 128-byte-swizzled shared memory
//   online softmax of S_j in registers (row max/sum over the quad that shares a row)
//   O += P_j V_j    wgmma m64n128k16 x BN/16, P from registers (S's accumulator layout is
//                   the A-fragment layout), V from shared memory read N-major ([keys][d]).
// K_{j+1} and V_j are loaded with cp.async while tile j is computed (two buffers each: K_j is
// needed one step before V_j). With `overlap`, S_{j+1} is issued before O += P_j V_j is
// waited for, so the softmax of one tile runs while the tensor cores finish the other.
// Causal: only key tiles up to the block's last row are visited; the mask is applied only to
// tiles that cross a warp's first row. Non-causal: keys >= len are masked in the last tile.
// Rows past the sequence end are computed on zero-filled Q and never stored.
// Two more schedules of the same computation (AttentionWgmmaSchedule, second kernel below):
// Producer (a producer warpgroup feeds a cp.async ring on mbarriers; no CTA-wide barrier per
// tile) and PingPong (also the two consumer warpgroups take turns issuing their wgmmas, so one
// softmax overlaps the other's products: FlashAttention-3's inter-warpgroup pipelining).
#include <cuda_bf16.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "core/cuda/cuda_check.h"
#include "core/cuda/stream.h"
#include "core/env_choice.h"
#include "core/error.h"
#include "kernels/cuda/attention_mma.h"  // attn::Tile, cp.async helpers
#include "kernels/cuda/attention_wgmma.h"
#include "kernels/cuda/attention_wgmma_ptx.h"

namespace opd::cuda {
namespace {

using attn::Tile;
using bf16 = __nv_bfloat16;

[[maybe_unused]] constexpr float kLog2e = 1.4426950408889634f;
[[maybe_unused]] constexpr float kLn2 = 0.6931471805599453f;
constexpr int kThreads = 256;                   // 2 warpgroups
constexpr int kBM = AttentionPlan::kTileRows;   // 128 query rows per CTA, 64 per warpgroup
constexpr int kD = 128;
static_assert(kBM == 128, "two warpgroups of 64 rows cover one plan tile");

template <int BN>
constexpr int smem_bytes() {
  return 1024 + (kBM * kD + 4 * BN * kD) * static_cast<int>(sizeof(bf16));  // align + Q + 2(K,V)
}

// Rows [0, ROWS) of a [rows][128] tile into the swizzled panels at shared address dst, all
// threads (the shared loader of attention_wgmma_ptx.h); rows >= valid_rows are zero-filled.
template <int ROWS>
__device__ __forceinline__ void load_tile(uint32_t dst, const bf16* src, int64_t stride,
                                          int valid_rows) {
  wg::load_tile_swz128<ROWS, kThreads>(dst, src, stride, valid_rows);
}

#if OPD_WGMMA_ENABLED
template <int BN>
__device__ __forceinline__ void wgmma_s(float (&s)[BN / 2], uint64_t desc_a, uint64_t desc_b,
                                        int scale_d) {
  if constexpr (BN == 128) {
    wg::wgmma_m64n128k16_ss(s, desc_a, desc_b, scale_d);
  } else {
    wg::wgmma_m64n64k16_ss(s, desc_a, desc_b, scale_d);
  }
}

// Descriptors of the V tile at shared address v_tile for O += P V, one per 16 keys: 2 groups of
// 8 rows (SBO 1024 B) by d = 2 panels of 64 columns (LBO = panel bytes), N-major. Computed
// before a pipeline stage starts: ptxas serializes wgmmas whose inputs are defined by other
// instructions between them.
template <int BN>
__device__ __forceinline__ void v_descs(uint64_t (&desc)[BN / 16], uint32_t v_tile) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) desc[kk] = wg::make_desc(v_tile + kk * 16 * 128, BN * 128, 1024);
}

// O += P V (all BN keys), committed as one group.
template <int BN>
__device__ __forceinline__ void issue_pv(float (&o)[64], uint32_t (&p)[BN / 16][4],
                                         const uint64_t (&desc)[BN / 16]) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) wg::wgmma_m64n128k16_rs_tb(o, p[kk], desc[kk]);
  wg::wgmma_commit();
}
#endif

// Online softmax of one key tile (FlashAttention-2): scales S_j into log2 units, masks keys
// after the row (causal: only tiles reaching past this warp's first row hold such keys) or
// past the sequence (non-causal, last tile), updates the row max m and this thread's partial
// row sum l, and leaves exp2(S - m) in s and the factor the old O must be rescaled by in alpha.
template <int BN, bool kCausal>
__device__ __forceinline__ void online_softmax(float (&s)[BN / 2], float (&m)[2], float (&l)[2],
                                               float (&alpha)[2], int n0, int warp_row0,
                                               int row_lo, int kv_end, int lane,
                                               float scale_log2) {
  const bool need_mask = kCausal ? (n0 + BN - 1 > warp_row0) : (n0 + BN > kv_end);
  float mx[2] = {m[0], m[1]};
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[4 * i + e] * scale_log2;
      if (need_mask) {
        const int key = n0 + i * 8 + (lane % 4) * 2 + (e & 1);
        const bool masked = kCausal ? key > row_lo + (e >> 1) * 8 : key >= kv_end;
        if (masked) x = -INFINITY;
      }
      s[4 * i + e] = x;
      mx[e >> 1] = fmaxf(mx[e >> 1], x);
    }
  }
  float mref[2], rowsum[2] = {0.f, 0.f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    // A row with every key masked so far has m = -inf; 0 as its reference keeps
    // exp2(-inf - ref) = 0 instead of exp2(-inf + inf) = NaN.
    mref[r] = mx[r] == -INFINITY ? 0.f : mx[r];
    alpha[r] = exp2f(m[r] - mref[r]);
    m[r] = mx[r];
  }
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) {
    s[i] = exp2f(s[i] - mref[(i >> 1) & 1]);
    rowsum[(i >> 1) & 1] += s[i];
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + rowsum[r];
}

// O *= alpha (per row) and P_j = bf16(s) as A fragments: keys 16kk..16kk+15 are n8 blocks 2kk
// (a0, a1) and 2kk + 1 (a2, a3). Call only once no wgmma reading o or p is in flight.
template <int BN>
__device__ __forceinline__ void rescale_and_pack(float (&o)[64], uint32_t (&p)[BN / 16][4],
                                                 const float (&s)[BN / 2],
                                                 const float (&alpha)[2]) {
#if OPD_WGMMA_ENABLED
  wg::fence_regs(o);
  wg::fence_regs(p);
#endif
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] *= alpha[(i >> 1) & 1];
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    p[kk][0] = attn::pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
    p[kk][1] = attn::pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
    p[kk][2] = attn::pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
    p[kk][3] = attn::pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

// Epilogue of one warp (16 rows of its warpgroup's 64): combine the quad's partial sums,
// normalize, stage the rows in the warpgroup's own (no longer read: every wgmma reading them
// was waited for) rows of the Q tile at sq (generic pointer to the 1024-aligned tile) with the
// tile swizzle (conflict-free), then 16-byte coalesced stores of the rows < rows, and lse.
// row0 = packed row of the tile's first query row.
[[maybe_unused]] __device__ __forceinline__ void store_output(const float (&o)[64], const float (&m)[2],
                                             float (&l)[2], unsigned char* sq, bf16* out,
                                             float* lse, int64_t row0, int rows, int h, int hq,
                                             int wgi, int warp, int lane) {
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
  }
  const int trow = wgi * 64 + warp * 16 + lane / 4;  // tile-relative row of o[4i + 0..1]
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) {
    const uint32_t within = (lane % 4) * 4;
    *reinterpret_cast<uint32_t*>(sq + wg::swz128_offset(kBM, trow, i) + within) =
        attn::pack_bf16(o[4 * i + 0] * inv[0], o[4 * i + 1] * inv[0]);
    *reinterpret_cast<uint32_t*>(sq + wg::swz128_offset(kBM, trow + 8, i) + within) =
        attn::pack_bf16(o[4 * i + 2] * inv[1], o[4 * i + 3] * inv[1]);
  }
  __syncwarp();
  const int64_t q_stride = static_cast<int64_t>(hq) * kD;
  bf16* o_ptr = out + (row0 * hq + h) * kD;
#pragma unroll
  for (int it = 0; it < 16 * (kD / 8) / 32; ++it) {
    const int idx = it * 32 + lane;
    const int row = wgi * 64 + warp * 16 + idx / (kD / 8), chunk = idx % (kD / 8);
    if (row < rows) {
      *reinterpret_cast<uint4*>(o_ptr + row * q_stride + chunk * 8) =
          *reinterpret_cast<const uint4*>(sq + wg::swz128_offset(kBM, row, chunk));
    }
  }
  if (lane % 4 == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = trow + r * 8;
      if (row < rows) lse[(row0 + row) * hq + h] = (m[r] + log2f(l[r])) * kLn2;
    }
  }
}

// grid.x = num_tiles * hq (heaviest tiles first, head fastest); 256 threads.
template <int BN, bool kCausal, bool kOverlap>
__global__ void __launch_bounds__(kThreads, 1)
    attention_fwd_wgmma_kernel(const Tile* __restrict__ tiles, int hq, int hkv, float scale_log2,
                               const bf16* __restrict__ q, const bf16* __restrict__ k,
                               const bf16* __restrict__ v, bf16* __restrict__ out,
                               float* __restrict__ lse) {
#if OPD_WGMMA_ENABLED
  static_assert(BN == 64 || BN == 128, "key tile of 64 or 128");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The swizzle is a function of address bits [4:9]: tiles start on 1024-byte boundaries.
  const uint32_t raw = attn::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  constexpr uint32_t kQBytes = kBM * kD * 2, kKVBytes = BN * kD * 2;
  const uint32_t sQ = base;                // [128][128]: panels of 16 KiB
  const uint32_t sK = sQ + kQBytes;        // [2][BN][128]
  const uint32_t sV = sK + 2 * kKVBytes;   // [2][BN][128]

  const Tile tile = tiles[blockIdx.x / hq];
  const int h = static_cast<int>(blockIdx.x % hq);
  const int g = h / (hq / hkv);  // GQA: the kv head this query head reads
  const int tid = static_cast<int>(threadIdx.x);
  const int wgi = tid / 128, warp = (tid / 32) % 4, lane = tid % 32;

  const int q0 = tile.block * kBM;           // sequence-relative first query row
  const int rows = min(kBM, tile.len - q0);  // valid query rows of this block
  const int kv_end = kCausal ? q0 + rows : tile.len;  // keys any valid row can see
  const int n_kv = (kv_end + BN - 1) / BN;
  const int64_t q_stride = static_cast<int64_t>(hq) * kD;
  const int64_t kv_stride = static_cast<int64_t>(hkv) * kD;
  const bf16* q_ptr = q + (static_cast<int64_t>(tile.start + q0) * hq + h) * kD;
  const bf16* k_ptr = k + (static_cast<int64_t>(tile.start) * hkv + g) * kD;
  const bf16* v_ptr = v + (static_cast<int64_t>(tile.start) * hkv + g) * kD;

  // Group: Q and K_0. Rows past the valid range are zero-filled: V rows past kv_end are 0
  // (P is 0 there too, but 0 * garbage could be NaN).
  load_tile<kBM>(sQ, q_ptr, q_stride, rows);
  load_tile<BN>(sK, k_ptr, kv_stride, min(BN, kv_end));
  attn::cp_async_commit();

  float o[64];  // O rows r, r+8 of this warp's 16 x 128 (accumulator layout)
  float s[BN / 2];
  uint32_t p[BN / 16][4];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 16; ++i) p[i][0] = p[i][1] = p[i][2] = p[i][3] = 0u;
  // m in log2 units of the scaled score; l = this thread's partial row sum (a quad shares a
  // row and agrees on m, so the partial sums are combined once at the end).
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int warp_row0 = q0 + wgi * 64 + warp * 16;  // sequence-relative
  const int row_lo = warp_row0 + lane / 4;          // row of s[4i + 0..1]; +8 for [4i + 2..3]
  const uint32_t q_wg = sQ + wgi * 64 * 128;        // this warpgroup's 64 rows, panel 0

  // One key tile; kFirst (j = 0: no P V pending) is peeled off as a constant so that every
  // wgmma stage has the same shape (ptxas serializes wgmmas across data-dependent branches).
  auto step = [&](int j, auto first) {
    constexpr bool kFirst = decltype(first)::value;
    // K_j (and V_{j-1}) landed: this thread's copies done, made visible to the async proxy,
    // and after the barrier everyone's are. The barrier also means every warpgroup finished
    // step j-1, whose wgmmas were waited for: the buffers refilled below are free.
    attn::cp_async_wait<0>();
    wg::fence_proxy_async();
    __syncthreads();
    if (j + 1 < n_kv) {
      const int n1 = (j + 1) * BN;
      load_tile<BN>(sK + ((j + 1) & 1) * kKVBytes, k_ptr + n1 * kv_stride, kv_stride,
                    min(BN, kv_end - n1));
    }
    load_tile<BN>(sV + (j & 1) * kKVBytes, v_ptr + static_cast<int64_t>(j) * BN * kv_stride,
                  kv_stride, min(BN, kv_end - j * BN));
    attn::cp_async_commit();

    uint64_t vd[BN / 16];
    v_descs<BN>(vd, sV + ((j + 1) & 1) * kKVBytes);  // V_{j-1}'s buffer (unused when j = 0)
    if (!kOverlap && !kFirst) {
      wg::wgmma_fence();
      issue_pv<BN>(o, p, vd);
      wg::wgmma_wait<0>();
      wg::fence_regs(o);
    }
    // S_j = Q K_j^T: 8 steps of 16 along d; step ks is panel ks / 4, +32 bytes per 16 columns.
    const uint32_t k_tile = sK + (j & 1) * kKVBytes;
    uint64_t qd[kD / 16], kd[kD / 16];
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      qd[ks] = wg::make_desc(q_wg + (ks >> 2) * (kBM * 128) + (ks & 3) * 32, 16, 1024);
      kd[ks] = wg::make_desc(k_tile + (ks >> 2) * (BN * 128) + (ks & 3) * 32, 16, 1024);
    }
    wg::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) wgmma_s<BN>(s, qd[ks], kd[ks], ks > 0 ? 1 : 0);
    wg::wgmma_commit();
    if (kOverlap && !kFirst) {
      issue_pv<BN>(o, p, vd);  // reads P_{j-1}: left untouched until the wait below
      wg::wgmma_wait<1>();     // S_j done; P_{j-1} V_{j-1} may still run
    } else {
      wg::wgmma_wait<0>();
    }
    wg::fence_regs(s);

    float alpha[2];
    online_softmax<BN, kCausal>(s, m, l, alpha, j * BN, warp_row0, row_lo, kv_end, lane,
                                scale_log2);

    if (kOverlap && !kFirst) wg::wgmma_wait<0>();  // P_{j-1} V_{j-1} is in O: P may change
    rescale_and_pack<BN>(o, p, s, alpha);
  };
  step(0, std::true_type{});
  for (int j = 1; j < n_kv; ++j) step(j, std::false_type{});
  // The last V tile (issued in the last step) and its product.
  attn::cp_async_wait<0>();
  wg::fence_proxy_async();
  __syncthreads();
  {
    uint64_t vd[BN / 16];
    v_descs<BN>(vd, sV + ((n_kv - 1) & 1) * kKVBytes);
    wg::wgmma_fence();
    issue_pv<BN>(o, p, vd);
  }
  wg::wgmma_wait<0>();
  wg::fence_regs(o);

  store_output(o, m, l, smem + (sQ - base), out, lse, tile.start + q0, rows, h, hq, wgi, warp,
               lane);
#endif  // OPD_WGMMA_ENABLED: the plain sm_90 build has an empty body and is never launched
}

// ---- ping-pong: a producer warp, an mbarrier ring, and turns between the warpgroups -------
// FlashAttention-3 (Shah et al. 2024, sections 3.1-3.2) with cp.async instead of TMA:
//  * warp 8 (the producer) streams K_t and V_t into slot t % kStages of a ring of K/V buffers:
//    it waits for the slot's `empty` mbarrier (both warpgroups finished with tile t - kStages),
//    issues the cp.asyncs and has their completion arrive on the slot's `full` mbarrier
//    (cp.async.mbarrier.arrive.noinc, so it never waits itself). The consumers never meet at a
//    CTA-wide barrier, so nothing forces the two warpgroups into step.
//  * each consumer warpgroup (64 query rows, warps 0-3 and 4-7) runs the overlap schedule:
//    at key tile j it issues S_j = Q K_j^T and O += P_{j-1} V_{j-1}, waits for S_j only, and
//    does the softmax of S_j while P_{j-1} V_{j-1} runs.
//  * the two warpgroups issue their wgmmas in turns: a warpgroup waits on its named barrier
//    (bar.sync id, 256) before issuing and, once issued, arrives on the other's (bar.arrive),
//    warpgroup 0 first. So the tensor cores take 0's products, then 1's, then 0's...: one
//    warpgroup's softmax runs while the other's products run, instead of both softmaxes
//    coinciding. Every warpgroup has n_kv + 1 issue turns (S_0; S_j + P_{j-1}V_{j-1}; the last
//    P V); warpgroup 1 arrives once before its first turn and not after its last, so each
//    barrier ends with every arrival matched.
// Deterministic: the same products in the same order per warpgroup as the overlap variant.
// Three warpgroups: the two consumers (warps 0-7) and the producer (warps 8-11). The
// consumers need ~220 registers, and registers are budgeted per SM quarter (16,384 each, warp
// w on quarter w % 4): even a single producer warp (288 threads) put 3 warps x 32 x 224 on
// quarter 0 and failed to launch (measured: cudaErrorLaunchOutOfResources). So, as in
// FlashAttention-3: launch 384 threads at 168 registers (3 x 32 x 168 <= 16,384), then the
// producer warpgroup drops to kProducerRegs and the consumers rise to kConsumerRegs
// (setmaxnreg; 40 + 2 x 232 = 504 <= 512 per thread slot of a quarter).
constexpr int kPPThreads = kThreads + 128;
[[maybe_unused]] constexpr int kProducerWarp = kThreads / 32;
[[maybe_unused]] constexpr int kProducerRegs = 40;
[[maybe_unused]] constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs + 2 * kConsumerRegs <= 512, "register budget of one SM quarter");
[[maybe_unused]] constexpr uint32_t kBarTurn0 = 1;  // named barrier ids; 0 is __syncthreads'
[[maybe_unused]] constexpr uint32_t kBarQ0 = 3;     // per warpgroup: its Q rows landed (3, 4)

// Ring depth: enough that the producer refills a slot two steps before it is read.
template <int BN>
constexpr int pp_stages() {
  return BN == 64 ? 4 : 3;
}
template <int BN>
constexpr int pp_smem_bytes() {
  return 1024 + (kBM * kD + 2 * pp_stages<BN>() * BN * kD) * static_cast<int>(sizeof(bf16)) +
         2 * pp_stages<BN>() * 8;
}
static_assert(pp_smem_bytes<64>() <= 227 * 1024 && pp_smem_bytes<128>() <= 227 * 1024,
              "the ping-pong ring must fit the 227 KiB of shared memory a CTA may use");

// Rows [row0, row0 + ROWS) of a [TILE_ROWS][128] swizzled tile by NT threads (t in [0, NT));
// rows >= valid_rows are zero-filled and not read (src = the tile's row 0, always valid).
template <int TILE_ROWS, int ROWS, int NT>
__device__ __forceinline__ void load_rows(uint32_t dst, int row0, const bf16* src, int64_t stride,
                                          int valid_rows, int t) {
  constexpr int kChunks = kD / 8;
  static_assert((ROWS * kChunks) % NT == 0, "chunks must divide over the threads");
#pragma unroll
  for (int i = 0; i < ROWS * kChunks / NT; ++i) {
    const int idx = i * NT + t;
    const int row = row0 + idx / kChunks, chunk = idx % kChunks;
    const bool valid = row < valid_rows;
    const bf16* g = valid ? src + row * stride + chunk * 8 : src;
    attn::cp_async_16(dst + wg::swz128_offset(TILE_ROWS, row, chunk), g, valid);
  }
}

// A [ROWS][128] K or V tile by the producer warpgroup (t in [0, 128)): thread t copies chunk
// t % 16 of rows t / 16, t / 16 + 8, ...; rows 8 apart have the same swizzle (chunk ^ row % 8),
// so its shared offsets are one base + 1024 bytes per copy and its source pointer advances by 8
// rows: a few instructions and registers per copy (the producer runs on kProducerRegs), and
// the copies spread over the four warps' schedulers. Rows >= valid_rows are zero-filled and
// not read (src = the tile's row 0, always valid).
template <int ROWS>
__device__ __forceinline__ void load_tile_producer(uint32_t dst, const bf16* src, int64_t stride,
                                                   int valid_rows, int t) {
  constexpr int kChunks = kD / 8;
  const int chunk = t % kChunks, r = t / kChunks;
  const uint32_t d = dst + wg::swz128_offset(ROWS, r, chunk);
  const bf16* g = src + r * stride + chunk * 8;
#pragma unroll
  for (int i = 0; i < ROWS / 8; ++i) {
    const bool valid = r + 8 * i < valid_rows;
    attn::cp_async_16(d + i * 1024, valid ? g : src, valid);
    g += 8 * stride;
  }
}

// grid.x = num_tiles * hq as above; 384 threads. kTurns = PingPong (else Producer: the same
// without the named-barrier turns).
template <int BN, bool kCausal, bool kTurns>
__global__ void __launch_bounds__(kPPThreads, 1)
    attention_fwd_wgmma_pp_kernel(const Tile* __restrict__ tiles, int hq, int hkv,
                                  float scale_log2, const bf16* __restrict__ q,
                                  const bf16* __restrict__ k, const bf16* __restrict__ v,
                                  bf16* __restrict__ out, float* __restrict__ lse) {
#if OPD_WGMMA_ENABLED
  static_assert(BN == 64 || BN == 128, "key tile of 64 or 128");
  constexpr int kStages = pp_stages<BN>();
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = attn::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  constexpr uint32_t kQBytes = kBM * kD * 2, kKVBytes = BN * kD * 2;
  const uint32_t sQ = base;                           // [128][128]
  const uint32_t sK = sQ + kQBytes;                   // [kStages][BN][128]
  const uint32_t sV = sK + kStages * kKVBytes;        // [kStages][BN][128]
  const uint32_t full_bar = sV + kStages * kKVBytes;  // [kStages]: K_t and V_t landed
  const uint32_t empty_bar = full_bar + kStages * 8;  // [kStages]: both warpgroups done

  const Tile tile = tiles[blockIdx.x / hq];
  const int h = static_cast<int>(blockIdx.x % hq);
  const int g = h / (hq / hkv);
  const int tid = static_cast<int>(threadIdx.x);
  const int warp_id = tid / 32, lane = tid % 32;

  const int q0 = tile.block * kBM;
  const int rows = min(kBM, tile.len - q0);
  const int kv_end = kCausal ? q0 + rows : tile.len;
  const int n_kv = (kv_end + BN - 1) / BN;  // >= 1: a plan tile has >= 1 row
  const int64_t q_stride = static_cast<int64_t>(hq) * kD;
  const int64_t kv_stride = static_cast<int64_t>(hkv) * kD;
  const bf16* q_ptr = q + (static_cast<int64_t>(tile.start + q0) * hq + h) * kD;
  const bf16* k_ptr = k + (static_cast<int64_t>(tile.start) * hkv + g) * kD;
  const bf16* v_ptr = v + (static_cast<int64_t>(tile.start) * hkv + g) * kD;

  if (tid == 0) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      wg::mbar_init(full_bar + 8 * st, 128);  // one .noinc arrival per producer thread
      wg::mbar_init(empty_bar + 8 * st, 8);  // one arrival per consumer warp
    }
  }
  __syncthreads();  // the only CTA-wide barrier (the producer warp leaves early)

  if (warp_id >= kProducerWarp) {
    wg::setmaxnreg_dec<kProducerRegs>();
    for (int t = 0; t < n_kv; ++t) {
      const int slot = t % kStages;
      // Slot free: tile t - kStages released by all 8 consumer warps (passes at once on the
      // first round: parity 1 names the phase before the barrier's first).
      wg::mbar_wait(empty_bar + 8 * slot, ((t / kStages) & 1) ^ 1);
      const int n0 = t * BN, valid = min(BN, kv_end - n0);
      // The thread index hidden from the optimizer per tile, so that per-thread address terms
      // are recomputed per tile instead of hoisted out of this loop and kept live (spills).
      int pt = tid - kThreads;
      asm volatile("" : "+r"(pt));
      // Rows past kv_end are zero-filled: P is 0 there, but 0 * garbage could be NaN.
      load_tile_producer<BN>(sK + slot * kKVBytes, k_ptr + n0 * kv_stride, kv_stride, valid, pt);
      load_tile_producer<BN>(sV + slot * kKVBytes, v_ptr + n0 * kv_stride, kv_stride, valid, pt);
      wg::cp_async_mbar_arrive_noinc(full_bar + 8 * slot);
    }
    // Leave with nothing in flight (cp.async.wait_all).
    attn::cp_async_commit();
    attn::cp_async_wait<0>();
    return;
  }

  wg::setmaxnreg_inc<kConsumerRegs>();
  const int wgi = warp_id / 4, warp = warp_id % 4;
  const uint32_t bar_mine = kBarTurn0 + wgi, bar_other = kBarTurn0 + 1 - wgi;
  // This warpgroup's 64 Q rows, by its own 128 threads; visible to its wgmmas after the
  // proxy fence of each writer and the warpgroup's barrier.
  load_rows<kBM, 64, 128>(sQ, wgi * 64, q_ptr, q_stride, rows, tid % 128);
  attn::cp_async_commit();
  attn::cp_async_wait<0>();
  wg::fence_proxy_async();
  wg::named_bar_sync(kBarQ0 + wgi, 128);
  if (kTurns && wgi == 1) wg::named_bar_arrive(kBarTurn0, 256);  // warpgroup 0 goes first

  float o[64];
  float s[BN / 2];
  uint32_t p[BN / 16][4];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 16; ++i) p[i][0] = p[i][1] = p[i][2] = p[i][3] = 0u;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int warp_row0 = q0 + wgi * 64 + warp * 16;
  const int row_lo = warp_row0 + lane / 4;
  const uint32_t q_wg = sQ + wgi * 64 * 128;

  auto step = [&](int j, auto first) {
    constexpr bool kFirst = decltype(first)::value;
    const int slot = j % kStages;
    const int prev = (j + kStages - 1) % kStages;  // tile j-1's slot (unused when j = 0)
    // K_j and V_j landed (V_j is read one step later, under this same wait). The cp.async
    // writes are the generic proxy's; the fence orders them before this thread's wgmmas.
    wg::mbar_wait(full_bar + 8 * slot, (j / kStages) & 1);
    wg::fence_proxy_async();
    const uint32_t k_tile = sK + slot * kKVBytes;
    uint64_t qd[kD / 16], kd[kD / 16], vd[BN / 16];
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      qd[ks] = wg::make_desc(q_wg + (ks >> 2) * (kBM * 128) + (ks & 3) * 32, 16, 1024);
      kd[ks] = wg::make_desc(k_tile + (ks >> 2) * (BN * 128) + (ks & 3) * 32, 16, 1024);
    }
    v_descs<BN>(vd, sV + prev * kKVBytes);
    if (kTurns) wg::named_bar_sync(bar_mine, 256);  // my turn
    wg::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) wgmma_s<BN>(s, qd[ks], kd[ks], ks > 0 ? 1 : 0);
    wg::wgmma_commit();
    if (!kFirst) issue_pv<BN>(o, p, vd);   // reads P_{j-1}: untouched until the wait below
    if (kTurns) wg::named_bar_arrive(bar_other, 256);  // the other warpgroup's turn
    if (!kFirst) {
      wg::wgmma_wait<1>();  // S_j done; P_{j-1} V_{j-1} may still run
    } else {
      wg::wgmma_wait<0>();
    }
    wg::fence_regs(s);

    float alpha[2];
    online_softmax<BN, kCausal>(s, m, l, alpha, j * BN, warp_row0, row_lo, kv_end, lane,
                                scale_log2);
    if (!kFirst) {
      wg::wgmma_wait<0>();  // P_{j-1} V_{j-1} is in O: P may change, tile j-1 is free
      if (lane == 0) wg::mbar_arrive(empty_bar + 8 * prev);
    }
    rescale_and_pack<BN>(o, p, s, alpha);
  };
  step(0, std::true_type{});
  for (int j = 1; j < n_kv; ++j) step(j, std::false_type{});
  {  // the last turn: P_{n-1} V_{n-1} (V_{n-1} landed under the last step's wait)
    uint64_t vd[BN / 16];
    v_descs<BN>(vd, sV + ((n_kv - 1) % kStages) * kKVBytes);
    if (kTurns) wg::named_bar_sync(bar_mine, 256);
    wg::wgmma_fence();
    issue_pv<BN>(o, p, vd);
    if (kTurns && wgi == 0) wg::named_bar_arrive(bar_other, 256);  // warpgroup 1's last turn
  }
  wg::wgmma_wait<0>();
  wg::fence_regs(o);

  store_output(o, m, l, smem + (sQ - base), out, lse, tile.start + q0, rows, h, hq, wgi, warp,
               lane);
#endif  // OPD_WGMMA_ENABLED
}

// Writes 1 from the sm_90a build of this file, 0 from the plain sm_90 one: tells the host
// which of the two the driver loaded for this device.
__global__ void wgmma_probe_kernel(int* flag) { *flag = OPD_WGMMA_ENABLED; }

template <int BN, bool kCausal, bool kOverlap>
void launch(const AttentionPlan& plan, const void* q, const void* k, const void* v, int hq,
            int hkv, double scale, void* out, float* lse, cudaStream_t stream) {
  constexpr int smem = smem_bytes<BN>();
  auto kernel = attention_fwd_wgmma_kernel<BN, kCausal, kOverlap>;
  OPD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int64_t blocks = plan.num_tiles() * hq;
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
      reinterpret_cast<const Tile*>(plan.q_tiles()), hq, hkv,
      static_cast<float>(scale) * kLog2e, static_cast<const bf16*>(q), static_cast<const bf16*>(k),
      static_cast<const bf16*>(v), static_cast<bf16*>(out), lse);
  check_launch("attention_fwd_wgmma_kernel");
}

template <int BN, bool kCausal, bool kTurns>
void launch_pp(const AttentionPlan& plan, const void* q, const void* k, const void* v, int hq,
               int hkv, double scale, void* out, float* lse, cudaStream_t stream) {
  constexpr int smem = pp_smem_bytes<BN>();
  auto kernel = attention_fwd_wgmma_pp_kernel<BN, kCausal, kTurns>;
  OPD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int64_t blocks = plan.num_tiles() * hq;
  kernel<<<static_cast<unsigned>(blocks), kPPThreads, smem, stream>>>(
      reinterpret_cast<const Tile*>(plan.q_tiles()), hq, hkv,
      static_cast<float>(scale) * kLog2e, static_cast<const bf16*>(q), static_cast<const bf16*>(k),
      static_cast<const bf16*>(v), static_cast<bf16*>(out), lse);
  check_launch("attention_fwd_wgmma_pp_kernel");
}

template <int BN>
void launch_bn(const AttentionPlan& plan, const void* q, const void* k, const void* v, int hq,
               int hkv, double scale, bool causal, bool overlap, void* out, float* lse,
               cudaStream_t stream, AttentionWgmmaSchedule schedule) {
  if (schedule == AttentionWgmmaSchedule::PingPong) {
    if (causal) return launch_pp<BN, true, true>(plan, q, k, v, hq, hkv, scale, out, lse, stream);
    return launch_pp<BN, false, true>(plan, q, k, v, hq, hkv, scale, out, lse, stream);
  }
  if (schedule == AttentionWgmmaSchedule::Producer) {
    if (causal) return launch_pp<BN, true, false>(plan, q, k, v, hq, hkv, scale, out, lse, stream);
    return launch_pp<BN, false, false>(plan, q, k, v, hq, hkv, scale, out, lse, stream);
  }
  if (causal) {
    if (overlap) return launch<BN, true, true>(plan, q, k, v, hq, hkv, scale, out, lse, stream);
    return launch<BN, true, false>(plan, q, k, v, hq, hkv, scale, out, lse, stream);
  }
  if (overlap) return launch<BN, false, true>(plan, q, k, v, hq, hkv, scale, out, lse, stream);
  return launch<BN, false, false>(plan, q, k, v, hq, hkv, scale, out, lse, stream);
}

// -1 unknown, 0 no, 1 yes; per device ordinal (more devices than this: probed every call).
constexpr int kMaxProbedDevices = 64;
std::atomic<int> g_probe[kMaxProbedDevices];
std::atomic<int> g_probe_init{0};

bool probe_device(int device, cudaStream_t stream) {
  if (device < kMaxProbedDevices) {
    if (g_probe_init.exchange(1) == 0) {
      for (auto& x : g_probe) x.store(-1);
    }
    const int known = g_probe[device].load();
    if (known >= 0) return known == 1;
  }
  // The probe allocates and synchronizes: never inside a stream capture. There the answer is
  // "no" for this call only (the mma.sync kernel runs), and the next eager call probes.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  OPD_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return false;
  int prop_major = 0, prop_minor = 0;
  OPD_CUDA_CHECK(cudaDeviceGetAttribute(&prop_major, cudaDevAttrComputeCapabilityMajor, device));
  OPD_CUDA_CHECK(cudaDeviceGetAttribute(&prop_minor, cudaDevAttrComputeCapabilityMinor, device));
  int result = 0;
  if (prop_major == 9 && prop_minor == 0) {  // sm_90a code runs on compute capability 9.0 only
    int* flag = nullptr;
    OPD_CUDA_CHECK(cudaMalloc(&flag, sizeof(int)));
    wgmma_probe_kernel<<<1, 1>>>(flag);
    cudaError_t st = cudaGetLastError();
    int host = 0;
    if (st == cudaSuccess) st = cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost);
    (void)cudaFree(flag);
    OPD_CUDA_CHECK(st);
    result = host == 1 ? 1 : 0;
  }
  if (device < kMaxProbedDevices) g_probe[device].store(result);
  return result == 1;
}

bool available_on(cudaStream_t stream) {
  int device = 0;
  OPD_CUDA_CHECK(cudaGetDevice(&device));
  return probe_device(device, stream);
}

// The setting: set_*_kernel's value, else OPD_ATTENTION_FWD (read once), else Auto
// (core/env_choice.h).
EnvChoice g_setting{"OPD_ATTENTION_FWD",
                     {{"auto", static_cast<int>(AttentionFwdKernel::Auto)},
                      {"mma", static_cast<int>(AttentionFwdKernel::Mma)},
                      {"wgmma", static_cast<int>(AttentionFwdKernel::Wgmma)},
                      {"wgmma-pingpong", static_cast<int>(AttentionFwdKernel::WgmmaPingPong)}},
                     static_cast<int>(AttentionFwdKernel::Auto)};

AttentionFwdKernel setting_or_throw() { return static_cast<AttentionFwdKernel>(g_setting.get()); }

// What Auto means for bf16 / head_dim 128 / causal on a device that can run wgmma, chosen by
// `opd bench attention` on the H200 (docs/perf.md "Attention — wgmma forward"): the ping-pong
// schedule with 128-key tiles was the fastest variant on all four W1 shapes in one call
// (session 5, 2026-11-30: 258 / 247 / 433 / 415 TFLOP/s, 1.12-1.14x the synced kernel, which was
// 1.27-1.43x the mma.sync one); its tests (every variant vs the f64 reference and the mma kernel)
// and memcheck passed in the same call.
constexpr AttentionFwdKernel kAutoChoice = AttentionFwdKernel::WgmmaPingPong;
// The knobs of each (docs/perf.md): the synced kernel's fastest on 3 of the 4 shapes was 64
// keys + overlap; the ping-pong one's 128 keys (3-stage ring) on all 4.
constexpr AttentionWgmmaConfig kWgmmaConfig{64, true, AttentionWgmmaSchedule::Synced};
constexpr AttentionWgmmaConfig kPingPongConfig{128, true, AttentionWgmmaSchedule::PingPong};

}  // namespace

bool attention_wgmma_available() { return available_on(nullptr); }
bool attention_wgmma_available_on(cudaStream_t stream) { return available_on(stream); }

void set_attention_fwd_kernel(AttentionFwdKernel kernel) {
  g_setting.set(static_cast<int>(kernel));
}

AttentionFwdKernel attention_fwd_kernel_setting() { return setting_or_throw(); }

const char* attention_fwd_kernel_name(AttentionFwdKernel kernel) {
  switch (kernel) {
    case AttentionFwdKernel::Auto: return "auto";
    case AttentionFwdKernel::Mma: return "mma";
    case AttentionFwdKernel::Wgmma: return "wgmma";
    case AttentionFwdKernel::WgmmaPingPong: return "wgmma-pingpong";
  }
  return "?";
}

AttentionFwdKernel resolve_attention_fwd_kernel(DType dtype, int64_t head_dim,
                                                cudaStream_t stream) {
  const AttentionFwdKernel s = setting_or_throw();
  if (dtype != DType::BF16 || head_dim != kD || s == AttentionFwdKernel::Mma) {
    return AttentionFwdKernel::Mma;
  }
  if (s == AttentionFwdKernel::Wgmma || s == AttentionFwdKernel::WgmmaPingPong) {
    OPD_CHECK(available_on(stream), Unsupported, "attention forward: the ",
              attention_fwd_kernel_name(s), " kernel was requested (OPD_ATTENTION_FWD or "
              "set_attention_fwd_kernel) but this device does not run sm_90a code");
    return s;
  }
  if (kAutoChoice != AttentionFwdKernel::Mma && available_on(stream)) return kAutoChoice;
  return AttentionFwdKernel::Mma;
}

AttentionWgmmaConfig attention_wgmma_config(AttentionFwdKernel kernel) {
  switch (kernel) {
    case AttentionFwdKernel::Wgmma: return kWgmmaConfig;
    case AttentionFwdKernel::WgmmaPingPong: return kPingPongConfig;
    default: break;
  }
  OPD_FAIL(InvalidArgument, "attention_wgmma_config: ", attention_fwd_kernel_name(kernel),
           " is not a wgmma kernel");
}

void attention_forward_wgmma(const AttentionPlan& plan, const void* q, const void* k,
                             const void* v, int64_t hq, int64_t hkv, double scale, bool causal,
                             void* out, float* lse, cudaStream_t stream,
                             const AttentionWgmmaConfig& config) {
  OPD_CHECK(hkv >= 1 && hq >= 1 && hq % hkv == 0, InvalidArgument,
            "CUDA attention_forward_wgmma: query heads ", hq, " must be a positive multiple of kv heads ",
            hkv);
  OPD_CHECK(config.block_n == 64 || config.block_n == 128, InvalidArgument,
            "CUDA attention_forward_wgmma: block_n ", config.block_n, " (64 or 128)");
  OPD_CHECK(config.schedule == AttentionWgmmaSchedule::Synced ||
                config.schedule == AttentionWgmmaSchedule::Producer ||
                config.schedule == AttentionWgmmaSchedule::PingPong,
            InvalidArgument, "CUDA attention_forward_wgmma: schedule ",
            static_cast<int>(config.schedule));
  OPD_CHECK(config.overlap || config.schedule == AttentionWgmmaSchedule::Synced, InvalidArgument,
            "CUDA attention_forward_wgmma: the producer and ping-pong schedules need overlap "
            "(their warpgroups pipeline their products the overlap way)");
  OPD_CHECK(std::isfinite(scale), InvalidArgument, "CUDA attention_forward_wgmma: scale ", scale);
  OPD_CHECK(plan.num_tiles() * hq < (int64_t{1} << 31) && plan.total_rows() * hq < (int64_t{1} << 33),
            Unsupported, "CUDA attention_forward_wgmma: ", plan.total_rows(), " rows x ", hq,
            " heads is too large for one launch");
  OPD_CHECK(available_on(stream), Unsupported,
            "CUDA attention_forward_wgmma: this device does not run sm_90a (wgmma) code");
  if (plan.total_rows() == 0 || plan.num_tiles() == 0) return;
  const int iq = static_cast<int>(hq), ik = static_cast<int>(hkv);
  if (config.block_n == 128) {
    return launch_bn<128>(plan, q, k, v, iq, ik, scale, causal, config.overlap, out, lse, stream,
                          config.schedule);
  }
  return launch_bn<64>(plan, q, k, v, iq, ik, scale, causal, config.overlap, out, lse, stream,
                       config.schedule);
}

}  // namespace opd::cuda
