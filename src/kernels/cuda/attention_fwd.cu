// Causal grouped-query attention forward on CUDA for packed variable-length batches, the
// FlashAttention-2 algorithm (Dao 2023): per (128-row query block, query head) one CTA streams
// the key/value blocks of its sequence through shared memory, keeps S = scale q k^T, the online
// softmax (row max m, row sum l) and O in registers, and never materializes [T x T].
// out = softmax(S) v, lse = m + log(l) (natural log, f32) saved for the backward.
// Context plans (AttentionPlan's second constructor): a sequence's len_q query rows are the
// last len_q of its len_k keys, causal bottom-right aligned (FlashAttention-2's convention):
// query i sees keys 0 .. off + i with off = len_k - len_q; off = 0 is the square case, the
// same integer arithmetic and so the same bits.
//
// bf16 head_dim 128 on Hopper runs the wgmma kernel instead (attention_fwd_wgmma.cu; measured
// faster; OPD_ATTENTION_FWD=mma forces the mma.sync kernel below, which stays its reference).
// bf16 head_dim 64/128: mma.sync.m16n8k16 tensor cores (attention_mma.h), 8 warps x 16 query
// rows, key blocks of 64 double-buffered with cp.async, causal mask only on blocks that cross
// the diagonal. Anything else (f32, other head_dim <= 256): a simple warp-per-row kernel with
// f32 arithmetic (the testing path; exact to f32 rounding).
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "core/cuda/stream.h"
#include "kernels/cuda/attention_mma.h"
#include "kernels/cuda/attention_wgmma.h"  // the Hopper kernel for bf16 / head_dim 128
#include "kernels/cuda/cuda_ops.h"

namespace opd::cuda {
namespace {

using attn::Tile;
using bf16 = __nv_bfloat16;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- fast path: bf16, D in {64, 128} -----------------------------------------------------

constexpr int kFwdThreads = 256;  // 8 warps; warp w owns query rows 16w .. 16w+15 of the block
constexpr int kFwdBM = AttentionPlan::kTileRows;  // 128 query rows per CTA

template <int D, int BN>
constexpr int fwd_smem_bytes() {
  return (kFwdBM * D + 4 * BN * D) * static_cast<int>(sizeof(bf16));  // Q + 2 x (K, V)
}

// grid.x = num_tiles * hq, heaviest tiles first (the plan sorts them), head fastest.
template <int D, int BN>
__global__ void __launch_bounds__(kFwdThreads, 1)
    attention_fwd_bf16_kernel(const Tile* __restrict__ tiles,
                              const int32_t* __restrict__ key_ranges, int hq, int hkv,
                              float scale_log2,
                              const bf16* __restrict__ q, const bf16* __restrict__ k,
                              const bf16* __restrict__ v, bf16* __restrict__ out,
                              float* __restrict__ lse) {
  constexpr int BM = kFwdBM, NT = kFwdThreads;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);  // [BM][D], later the output staging tile
  bf16* sK = sQ + BM * D;                        // [2][BN][D]
  bf16* sV = sK + 2 * BN * D;                    // [2][BN][D]

  const Tile tile = tiles[blockIdx.x / hq];
  const int h = static_cast<int>(blockIdx.x % hq);
  const int g = h / (hq / hkv);  // GQA: the kv head this query head reads
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;

  // Context plans: the tile's keys start at k_start in k/v and the query rows sit `off` keys
  // after the sequence's first key (two plain loads: the pairs are only 4-byte aligned).
  int k_start = tile.start, off = 0;
  if (key_ranges != nullptr) {
    k_start = key_ranges[2 * (blockIdx.x / hq)];
    off = key_ranges[2 * (blockIdx.x / hq) + 1];
  }
  const int q0 = tile.block * BM;             // sequence-relative first query row
  const int rows = min(BM, tile.len - q0);    // valid query rows in this block
  const int kv_end = off + q0 + rows;         // causal: the last row sees keys < kv_end
  const int n_kv = (kv_end + BN - 1) / BN;
  const int64_t q_stride = static_cast<int64_t>(hq) * D;
  const int64_t kv_stride = static_cast<int64_t>(hkv) * D;
  const bf16* q_ptr = q + (static_cast<int64_t>(tile.start + q0) * hq + h) * D;
  const bf16* k_ptr = k + (static_cast<int64_t>(k_start) * hkv + g) * D;
  const bf16* v_ptr = v + (static_cast<int64_t>(k_start) * hkv + g) * D;

  // Group 0: Q. Group 1: K/V block 0. Rows past the valid range are zero-filled, so V rows
  // past kv_end are 0 (P is 0 there too, but 0 * garbage could be NaN).
  attn::load_tile<BM, D, NT>(sQ, q_ptr, q_stride, rows);
  attn::cp_async_commit();
  attn::load_tile<BN, D, NT>(sK, k_ptr, kv_stride, min(BN, kv_end));
  attn::load_tile<BN, D, NT>(sV, v_ptr, kv_stride, min(BN, kv_end));
  attn::cp_async_commit();
  attn::cp_async_wait<1>();
  __syncthreads();

  // This warp's 16 query rows as A fragments, held for the whole key loop.
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) attn::ldmatrix_x4(qf[kk], attn::a_frag_addr<D>(sQ, warp * 16, kk, lane));

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  // Rows r = lane/4 (c0, c1) and r + 8 (c2, c3) of the warp's 16. m is in log2 units of the
  // scaled score (s * scale * log2 e); l is this thread's partial row sum (the 4 threads of a
  // quad share a row; they agree on m, so partial sums are combined once at the end).
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int row_lo = off + q0 + warp * 16 + lane / 4;  // in key coordinates

  for (int j = 0; j < n_kv; ++j) {
    const int buf = j & 1;
    if (j + 1 < n_kv) {  // prefetch block j+1 into the other buffer (freed by the last barrier)
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

    // S = Q K^T for 16 rows x BN keys.
    float s[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int nn = 0; nn < BN / 16; ++nn) {
        uint32_t b[4];
        attn::ldmatrix_x4(b, attn::b_frag_addr_nk<D>(tK, nn * 16, kk, lane));
        attn::mma_bf16(s[2 * nn], qf[kk], b[0], b[1]);
        attn::mma_bf16(s[2 * nn + 1], qf[kk], b[2], b[3]);
      }
    }

    // Scale into log2 units, then mask keys after the row (only blocks that reach past this
    // warp's first row can hold such keys). Keys >= kv_end are always after every valid row.
    const int n0 = j * BN;
    const bool need_mask = n0 + BN - 1 > off + q0 + warp * 16;
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nt][e] * scale_log2;
        if (need_mask) {
          const int key = n0 + nt * 8 + (lane % 4) * 2 + (e & 1);
          if (key > row_lo + (e >> 1) * 8) x = -INFINITY;
        }
        s[nt][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    }
    float alpha[2], mref[2], rowsum[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      // A row with every key masked so far has m = -inf; use 0 as its reference so that
      // exp2(-inf - ref) = 0 instead of exp2(-inf + inf) = NaN.
      mref[r] = mx[r] == -INFINITY ? 0.f : mx[r];
      alpha[r] = exp2f(m[r] - mref[r]);
      m[r] = mx[r];
    }
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = exp2f(s[nt][e] - mref[e >> 1]);
        rowsum[e >> 1] += s[nt][e];
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + rowsum[r];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= alpha[0];
      o[i][1] *= alpha[0];
      o[i][2] *= alpha[1];
      o[i][3] *= alpha[1];
    }

    // O += P V: P's C fragments repacked as A fragments (k = keys 16kk .. 16kk+15).
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint32_t a[4] = {attn::pack_bf16(s[2 * kk][0], s[2 * kk][1]),
                             attn::pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                             attn::pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             attn::pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t b[4];
        attn::ldmatrix_x4_trans(b, attn::b_frag_addr_kn<D>(tV, kk * 16, dn, lane));
        attn::mma_bf16(o[2 * dn], a, b[0], b[1]);
        attn::mma_bf16(o[2 * dn + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with buffer `buf` before it is refilled
  }

  // Epilogue: combine the quad's partial sums, normalize, stage the warp's 16 rows in its own
  // rows of sQ (no other warp reads them) and write them with 16-byte stores.
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
  }
  const int wrow = warp * 16 + lane / 4;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int col = (lane % 4) * 2;
    *reinterpret_cast<uint32_t*>(sQ + attn::swz<D>(wrow, dt) + col) =
        attn::pack_bf16(o[dt][0] * inv[0], o[dt][1] * inv[0]);
    *reinterpret_cast<uint32_t*>(sQ + attn::swz<D>(wrow + 8, dt) + col) =
        attn::pack_bf16(o[dt][2] * inv[1], o[dt][3] * inv[1]);
  }
  __syncwarp();
  bf16* o_ptr = out + (static_cast<int64_t>(tile.start + q0) * hq + h) * D;
#pragma unroll
  for (int idx = lane; idx < 16 * (D / 8); idx += 32) {
    const int row = warp * 16 + idx / (D / 8), chunk = idx % (D / 8);
    if (row < rows) {
      *reinterpret_cast<uint4*>(o_ptr + row * q_stride + chunk * 8) =
          *reinterpret_cast<const uint4*>(sQ + attn::swz<D>(row, chunk));
    }
  }
  if (lane % 4 == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wrow + r * 8;
      if (row < rows) {
        lse[static_cast<int64_t>(tile.start + q0 + row) * hq + h] = (m[r] + log2f(l[r])) * kLn2;
      }
    }
  }
}

template <int D, int BN>
void launch_fwd_bf16(const AttentionPlan& plan, const void* q, const void* k, const void* v,
                     int hq, int hkv, double scale, void* out, float* lse, cudaStream_t stream) {
  constexpr int smem = fwd_smem_bytes<D, BN>();
  auto kernel = attention_fwd_bf16_kernel<D, BN>;
  OPD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int64_t blocks = plan.num_tiles() * hq;
  kernel<<<static_cast<unsigned>(blocks), kFwdThreads, smem, stream>>>(
      reinterpret_cast<const Tile*>(plan.q_tiles()), plan.key_ranges(), hq, hkv,
      static_cast<float>(scale) * kLog2e, static_cast<const bf16*>(q), static_cast<const bf16*>(k),
      static_cast<const bf16*>(v), static_cast<bf16*>(out), lse);
  check_launch("attention_fwd_bf16_kernel");
}

// ---- generic path: f32 or bf16 storage, any head_dim <= 256 ------------------------------

constexpr int kNaiveWarps = 4;
constexpr int kNaivePerLane = 8;  // head_dim <= 32 * 8

using attn::find_sequence;
using attn::store_val;
using attn::to_float;
using attn::warp_sum;

// One warp per (row t, query head h); lanes split head_dim; online softmax over keys.
template <typename T>
__global__ void __launch_bounds__(kNaiveWarps * 32)
    attention_fwd_naive_kernel(const int32_t* __restrict__ cu, const int32_t* __restrict__ cu_k,
                               int batch, int64_t total, int hq,
                               int hkv, int d, float scale, const T* __restrict__ q,
                               const T* __restrict__ k, const T* __restrict__ v,
                               T* __restrict__ out, float* __restrict__ lse) {
  const int64_t wid = static_cast<int64_t>(blockIdx.x) * kNaiveWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (wid >= total * hq) return;
  const int64_t t = wid / hq;
  const int h = static_cast<int>(wid % hq), g = h / (hq / hkv);
  // Keys of row t: its sequence's keys ks0 .. ks0 + off + (t - s0), off = len_k - len_q
  // (cu_k == cu for square plans: ks0 = s0, off = 0, the keys s0 .. t).
  const int b = find_sequence(cu, batch, t);
  const int64_t s0 = cu[b], ks0 = cu_k[b];
  const int64_t j_end = ks0 + ((cu_k[b + 1] - ks0) - (cu[b + 1] - s0)) + (t - s0);
  float qr[kNaivePerLane], acc[kNaivePerLane];
#pragma unroll
  for (int i = 0; i < kNaivePerLane; ++i) {
    const int c = lane + 32 * i;
    qr[i] = c < d ? to_float(q[(t * hq + h) * d + c]) : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int64_t j = ks0; j <= j_end; ++j) {
    const T* kj = k + (j * hkv + g) * d;
    const T* vj = v + (j * hkv + g) * d;
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kNaivePerLane; ++i) {
      const int c = lane + 32 * i;
      if (c < d) dot += qr[i] * to_float(kj[c]);
    }
    const float sc = warp_sum(dot) * scale;
    const float m_new = fmaxf(m, sc);
    const float alpha = expf(m - m_new);  // m = -inf on the first key: alpha = 0
    const float p = expf(sc - m_new);
    l = l * alpha + p;
#pragma unroll
    for (int i = 0; i < kNaivePerLane; ++i) {
      const int c = lane + 32 * i;
      acc[i] = acc[i] * alpha + (c < d ? p * to_float(vj[c]) : 0.f);
    }
    m = m_new;
  }
#pragma unroll
  for (int i = 0; i < kNaivePerLane; ++i) {
    const int c = lane + 32 * i;
    if (c < d) store_val(out + (t * hq + h) * d + c, acc[i] / l);
  }
  if (lane == 0) lse[t * hq + h] = m + logf(l);
}

template <typename T>
void launch_fwd_naive(const AttentionPlan& plan, const void* q, const void* k, const void* v,
                      int hq, int hkv, int d, double scale, void* out, float* lse,
                      cudaStream_t stream) {
  const int64_t warps = plan.total_rows() * hq;
  const int64_t blocks = (warps + kNaiveWarps - 1) / kNaiveWarps;
  attention_fwd_naive_kernel<T><<<static_cast<unsigned>(blocks), kNaiveWarps * 32, 0, stream>>>(
      plan.device_cu_seqlens(), plan.device_cu_seqlens_k(), static_cast<int>(plan.batch()),
      plan.total_rows(), hq, hkv, d,
      static_cast<float>(scale), static_cast<const T*>(q), static_cast<const T*>(k),
      static_cast<const T*>(v), static_cast<T*>(out), lse);
  check_launch("attention_fwd_naive_kernel");
}

}  // namespace

bool attention_has_fast_path(DType dtype, int64_t head_dim) {
  return dtype == DType::BF16 && (head_dim == 64 || head_dim == 128);
}

void attention_forward(const AttentionPlan& plan, const void* q, const void* k, const void* v,
                       int64_t hq, int64_t hkv, int64_t d, double scale, DType dtype, void* out,
                       float* lse, cudaStream_t stream) {
  OPD_CHECK(hkv >= 1 && hq % hkv == 0, InvalidArgument, "CUDA attention_forward: query heads ",
            hq, " must be a multiple of kv heads ", hkv);
  OPD_CHECK(d >= 1 && d <= 32 * kNaivePerLane, Unsupported, "CUDA attention_forward: head_dim ",
            d, " is not supported (1 .. ", 32 * kNaivePerLane, ")");
  OPD_CHECK(plan.num_tiles() * hq < (int64_t{1} << 31) && plan.total_rows() * hq < (int64_t{1} << 33),
            Unsupported, "CUDA attention_forward: ", plan.total_rows(), " rows x ", hq,
            " heads is too large for one launch");
  if (plan.total_rows() == 0 || hq == 0) return;
  const int iq = static_cast<int>(hq), ik = static_cast<int>(hkv), id = static_cast<int>(d);
  if (dtype == DType::BF16) {
    // bf16 / head_dim 128: the wgmma kernel where OPD_ATTENTION_FWD or the measured default
    // picks it (attention_wgmma.h), else the mma.sync kernel below (also its reference).
    if (d == 128 && !plan.has_context()) {  // the wgmma kernel takes square plans only
      const AttentionFwdKernel kernel = resolve_attention_fwd_kernel(dtype, d, stream);
      if (kernel != AttentionFwdKernel::Mma) {
        return attention_forward_wgmma(plan, q, k, v, hq, hkv, scale, /*causal=*/true, out, lse,
                                       stream, attention_wgmma_config(kernel));
      }
    }
    if (d == 128) return launch_fwd_bf16<128, 64>(plan, q, k, v, iq, ik, scale, out, lse, stream);
    if (d == 64) return launch_fwd_bf16<64, 64>(plan, q, k, v, iq, ik, scale, out, lse, stream);
    return launch_fwd_naive<bf16>(plan, q, k, v, iq, ik, id, scale, out, lse, stream);
  }
  if (dtype == DType::F32) {
    return launch_fwd_naive<float>(plan, q, k, v, iq, ik, id, scale, out, lse, stream);
  }
  OPD_FAIL(Unsupported, "CUDA attention_forward for dtype ", dtype_name(dtype),
           " (f32 or bf16)");
}

}  // namespace opd::cuda
