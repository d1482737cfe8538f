// The weight-streaming decode GEMM of kernels/cuda/gemm.h (decode_gemm): y[m, n] = x[m, k] W[n, k]^T
// (+ bias[n]) for the few rows of a decode step (1 <= m <= 64), bf16 x and W, f32 accumulation on
// the tensor cores (mma.sync m16n8k16), bf16 or f32 y. Bound by the one read of W: every byte of
// W is loaded once, 16 bytes per thread per load, straight into registers (no shared-memory
// round trip); split-K over CTAs gives enough CTAs for every SM even when n is only 1024.
//
// Layout of the work (why each choice):
// - The mma's A operand is W (16 rows of W x 16 k), its B operand is x^T (16 k x 8 rows of x),
//   so a W fragment is used by all ceil(m / 8) 8-row groups of x and m = 1 wastes only 7/8 of
//   the (idle anyway) tensor-core work, not 15/16.
// - 16-byte W loads: a thread (group g = lane / 4, t = lane % 4) loads W[row, 8t .. 8t+7] of a
//   32-wide k chunk for rows g and g + 8 of a 16-row tile. The k order of a dot product is
//   free as long as A and B use the same one, so the two mma k-steps of the chunk take the
//   physical k's 8t + {0..3} and 8t + {4..7} as their logical k's {2t, 2t+1, 2t+8, 2t+9}; the
//   B fragment is then the same 16 bytes of x's row (one shared-memory load).
// - A CTA is 8 warps: 4 row warps (each 16 x RT rows of W) x 2 k warps (alternate chunks of a
//   256-wide k tile); the CTA's slice of x (8 x MT rows x 256 k, zero-padded) is staged in
//   shared memory once per k tile and read by all 4 row warps. Each tile's W loads are issued
//   before the x tile is staged, so the x copy overlaps the W stream.
// - Split-K across CTAs (grid.y = splits): each split's CTA writes an f32 partial tile to the
//   workspace in fragment order (coalesced float4), bumps the tile's counter; the last CTA to
//   arrive sums the splits in split order 0, 1, ... (not arrival order) and writes y, then
//   resets the counter to 0. The result is the same bits run to run.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/stream.h"  // check_launch
#include "core/error.h"
#include "kernels/cuda/common.cuh"  // to_f32 / from_f32
#include "kernels/cuda/cuda_ops.h"  // sm_count
#include "kernels/cuda/gemm.h"

namespace opd::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRowWarps = 4, kKWarps = 2;
constexpr int kChunk = 32;                 // k per chunk: 4 threads x 8 bf16
constexpr int kTileChunks = 8;             // chunks per k tile (x staged per tile)
constexpr int kTileK = kTileChunks * kChunk;
constexpr int kChunksPerWarp = kTileChunks / kKWarps;
// Row stride of the staged x tile: 256 + 32 bf16 = 576 bytes. A 16-byte load phase covers 8
// lanes = 2 rows of x x 64 bytes; the 64-byte pad puts those 2 rows on disjoint banks.
constexpr int kXStride = kTileK + 32;

// 16 bytes of W: read once, so skip L1 (the stream would only evict x's lines there).
__device__ __forceinline__ uint4 load_stream(const __nv_bfloat16* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// c += a * b, m16n8k16, bf16 inputs, f32 accumulators (PTX ISA fragment layouts).
__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// RT: 16-row tiles of W per warp (CTA rows = 64 RT); MT: 8-row groups of x (m <= 8 MT).
template <int RT, int MT, typename OutT>
__global__ void __launch_bounds__(kThreads)
decode_gemm_kernel(const __nv_bfloat16* __restrict__ x, int64_t ldx,
                   const __nv_bfloat16* __restrict__ w, const OutT* __restrict__ bias,
                   OutT* __restrict__ y, int64_t ldy, int m, int64_t n, int64_t k, int splits,
                   int num_chunks, float* __restrict__ partials, unsigned* __restrict__ counters) {
  constexpr int kRows = 16 * RT * kRowWarps;
  constexpr int kXRows = 8 * MT;
  constexpr int kFrags = RT * MT;  // accumulator fragments (4 floats each) per thread
  // The x tile, reused after the k loop for the k warps' reduction (kRowWarps x 32 x kFrags
  // float4 = 2048 RT MT bytes <= 4608 MT bytes for RT <= 2).
  __shared__ __align__(16) __nv_bfloat16 xs[kXRows * kXStride];
  static_assert(kRowWarps * 32 * kFrags * 16 <= kXRows * kXStride * 2, "reduction buffer");
  __shared__ unsigned s_last;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rw = warp % kRowWarps, kw = warp / kRowWarps;
  const int g = lane >> 2, t = lane & 3;
  const int rb = blockIdx.x, split = blockIdx.y;
  const int64_t row_base = static_cast<int64_t>(rb) * kRows + rw * 16 * RT;
  const int c_begin = static_cast<int>(static_cast<int64_t>(num_chunks) * split / splits);
  const int c_end = static_cast<int>(static_cast<int64_t>(num_chunks) * (split + 1) / splits);

  // This thread's W rows: row_base + 16 r + 8 h + g (rows past n read nothing, stay 0).
  const __nv_bfloat16* wrow[RT][2];
  bool row_ok[RT][2];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row_base + 16 * r + 8 * h + g;
      row_ok[r][h] = row < n;
      wrow[r][h] = w + (row_ok[r][h] ? row : 0) * k + 8 * t;
    }
  }

  float acc[RT][MT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][j][e] = 0.0f;

  for (int tc = c_begin; tc < c_end; tc += kTileChunks) {
    const int tile_chunks = min(kTileChunks, c_end - tc);
    // 1. This warp's W for the tile (chunks kw, kw + 2, ...): all loads in flight at once.
    uint4 wv[kChunksPerWarp][RT][2];
#pragma unroll
    for (int i = 0; i < kChunksPerWarp; ++i) {
      const int c = kw + kKWarps * i;
      const int64_t koff = static_cast<int64_t>(tc + c) * kChunk;
      const bool in = c < tile_chunks && koff + 8 * t < k;  // k % 8 == 0: 8 elements or none
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          wv[i][r][h] = in && row_ok[r][h] ? load_stream(wrow[r][h] + koff) : make_uint4(0, 0, 0, 0);
    }
    // 2. Stage x[0:8 MT, tile] (rows >= m and k >= the split's end are 0: a garbage or NaN x
    //    beyond the shape must not reach the sums, and the W there is 0 too).
    __syncthreads();  // the previous tile's readers are done
    const int64_t k0 = static_cast<int64_t>(tc) * kChunk;
    const int64_t k_lim = min(k, static_cast<int64_t>(tc + tile_chunks) * kChunk);
    for (int e = threadIdx.x; e < kXRows * (kTileK / 8); e += kThreads) {
      const int row = e / (kTileK / 8), seg = e % (kTileK / 8);
      const int64_t kk = k0 + 8 * seg;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (row < m && kk < k_lim) v = __ldg(reinterpret_cast<const uint4*>(x + row * ldx + kk));
      *reinterpret_cast<uint4*>(xs + row * kXStride + 8 * seg) = v;
    }
    __syncthreads();
    // 3. Two mma k-steps per chunk, each W fragment against all MT groups of x.
#pragma unroll
    for (int i = 0; i < kChunksPerWarp; ++i) {
      const int c = kw + kKWarps * i;
      if (c >= tile_chunks) break;  // uniform over the warp
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        const uint4 xb =
            *reinterpret_cast<const uint4*>(xs + (8 * j + g) * kXStride + c * kChunk + 8 * t);
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          const uint4& a = wv[i][r][0];
          const uint4& b = wv[i][r][1];
          mma(acc[r][j], a.x, b.x, a.y, b.y, xb.x, xb.y);
          mma(acc[r][j], a.z, b.z, a.w, b.w, xb.z, xb.w);
        }
      }
    }
  }

  // Sum the two k warps of each row warp (fixed order: k warp 0's + k warp 1's).
  __syncthreads();
  float4* red = reinterpret_cast<float4*>(xs);
  auto frag = [&](int r, int j) { return ((rw * RT + r) * MT + j) * 32 + lane; };
  if (kw == 1) {
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int j = 0; j < MT; ++j)
        red[frag(r, j)] = make_float4(acc[r][j][0], acc[r][j][1], acc[r][j][2], acc[r][j][3]);
  }
  __syncthreads();
  if (kw == 0) {
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        const float4 o = red[frag(r, j)];
        acc[r][j][0] += o.x;
        acc[r][j][1] += o.y;
        acc[r][j][2] += o.z;
        acc[r][j][3] += o.w;
      }
  }

  if (splits > 1) {
    constexpr int kTileFloats4 = kRowWarps * kFrags * 32;
    float4* part = reinterpret_cast<float4*>(partials);
    if (kw == 0) {
      float4* mine = part + (static_cast<int64_t>(split) * gridDim.x + rb) * kTileFloats4;
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int j = 0; j < MT; ++j)
          __stcg(mine + frag(r, j), make_float4(acc[r][j][0], acc[r][j][1], acc[r][j][2], acc[r][j][3]));
    }
    __threadfence();  // the partial is visible device-wide before the counter says so
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(&counters[rb], 1u) == static_cast<unsigned>(splits - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();  // acquire: the other splits' partials
    if (kw == 0) {
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[r][j][e] = 0.0f;
      for (int s = 0; s < splits; ++s) {  // split order, whoever arrived last
        const float4* p = part + (static_cast<int64_t>(s) * gridDim.x + rb) * kTileFloats4;
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
          for (int j = 0; j < MT; ++j) {
            const float4 o = __ldcg(p + frag(r, j));
            acc[r][j][0] += o.x;
            acc[r][j][1] += o.y;
            acc[r][j][2] += o.z;
            acc[r][j][3] += o.w;
          }
      }
    }
    if (threadIdx.x == 0) counters[rb] = 0;  // ready for the next launch (stream order)
  }

  // Epilogue: c0, c1 = (W row g, x rows 2t, 2t+1), c2, c3 = (W row g + 8, the same x rows).
  if (kw != 0) return;
#pragma unroll
  for (int r = 0; r < RT; ++r) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row_base + 16 * r + 8 * h + g;
      if (row >= n) continue;
      const float b = bias ? dev::to_f32(bias[row]) : 0.0f;
#pragma unroll
      for (int j = 0; j < MT; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = 8 * j + 2 * t + e;
          if (col < m) y[col * ldy + row] = dev::from_f32<OutT>(acc[r][j][2 * h + e] + b);
        }
      }
    }
  }
}

int m_tiles(int64_t m) { return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8; }

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <int RT, int MT, typename OutT>
void launch_typed(const DecodeGemmArgs& a, const DecodeGemmPlan& p, void* workspace,
                  cudaStream_t stream) {
  unsigned* counters = static_cast<unsigned*>(workspace);
  float* partials = p.splits > 1
                        ? reinterpret_cast<float*>(static_cast<char*>(workspace) + p.counter_bytes)
                        : nullptr;
  const dim3 grid(static_cast<unsigned>(p.row_blocks), static_cast<unsigned>(p.splits));
  decode_gemm_kernel<RT, MT, OutT><<<grid, kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(a.x), a.ldx, static_cast<const __nv_bfloat16*>(a.w),
      static_cast<const OutT*>(a.bias), static_cast<OutT*>(a.y), a.ldy, static_cast<int>(a.m),
      a.n, a.k, p.splits, p.num_chunks, partials, counters);
  check_launch("decode_gemm_kernel");
}

template <int RT, typename OutT>
void launch_mt(const DecodeGemmArgs& a, const DecodeGemmPlan& p, void* ws, cudaStream_t s) {
  switch (m_tiles(a.m)) {
    case 1: return launch_typed<RT, 1, OutT>(a, p, ws, s);
    case 2: return launch_typed<RT, 2, OutT>(a, p, ws, s);
    case 4: return launch_typed<RT, 4, OutT>(a, p, ws, s);
    default: return launch_typed<RT, 8, OutT>(a, p, ws, s);
  }
}

}  // namespace

const char* decode_gemm_unsupported(const DecodeGemmArgs& a) {
  if (a.m < 1 || a.m > kDecodeGemmMaxRows) return "m must be in [1, 64]";
  if (a.n < 1 || a.n > (int64_t{1} << 30)) return "n must be in [1, 2^30]";
  if (a.k < 8 || a.k % 8 != 0 || a.k > (int64_t{1} << 30))
    return "k must be a positive multiple of 8 (16-byte loads)";
  if (a.x_dtype != DType::BF16 || a.w_dtype != DType::BF16) return "x and W must be bf16";
  if (a.y_dtype != DType::BF16 && a.y_dtype != DType::F32) return "y must be bf16 or f32";
  if (a.ldx < a.k || a.ldx % 8 != 0) return "ldx must be >= k and a multiple of 8";
  if (a.ldy < a.n) return "ldy must be >= n";
  if (!a.x || !a.w || !a.y) return "x, W and y must be given";
  if (!aligned16(a.x) || !aligned16(a.w)) return "x and W must be 16-byte aligned";
  if (a.force_splits < 0 || a.force_row_tiles < 0 || a.force_row_tiles > 2)
    return "force_splits >= 0, force_row_tiles in {0, 1, 2}";
  return nullptr;
}

DecodeGemmPlan decode_gemm_plan(int64_t n, int64_t k, int force_splits, int force_row_tiles,
                                int sms) {
  OPD_CHECK(n >= 1 && k >= 1 && force_splits >= 0 && force_row_tiles >= 0 && force_row_tiles <= 2,
            InvalidArgument, "decode_gemm_plan: n ", n, ", k ", k, ", force_splits ", force_splits,
            ", force_row_tiles ", force_row_tiles);
  if (sms <= 0) sms = sm_count();
  DecodeGemmPlan p;
  // Large n (the lm_head: >= 2 CTAs per SM without any split) takes 128-row CTAs: half the
  // re-reads of x per byte of W.
  p.row_tiles = force_row_tiles > 0 ? force_row_tiles : (n >= 256LL * sms ? 2 : 1);
  const int64_t rows = 16LL * kRowWarps * p.row_tiles;
  p.row_blocks = (n + rows - 1) / rows;
  p.num_chunks = static_cast<int>((k + kChunk - 1) / kChunk);
  if (force_splits > 0) {
    p.splits = static_cast<int>(std::min<int64_t>(force_splits, p.num_chunks));
  } else {
    // ~1.5 CTAs per SM, but no split below one full k tile (each split's f32 partial is
    // written and read back through L2); then the fewest splits that give the same number of
    // k tiles per split (no split ends with a mostly empty tile).
    const int64_t want = (3LL * sms / 2 + p.row_blocks - 1) / p.row_blocks;
    const int64_t cap = std::max<int64_t>(1, p.num_chunks / kTileChunks);
    const int64_t s = std::clamp<int64_t>(want, 1, cap);
    const int64_t per = (p.num_chunks + s - 1) / s;
    const int64_t tile_span = (per + kTileChunks - 1) / kTileChunks * kTileChunks;
    p.splits = static_cast<int>(std::max<int64_t>(1, (p.num_chunks + tile_span - 1) / tile_span));
  }
  OPD_CHECK(p.row_blocks <= 0x7fffffff && p.splits <= 65535, InvalidArgument,
            "decode_gemm: grid ", p.row_blocks, " x ", p.splits, " too large for n ", n, ", k ", k);
  p.counter_bytes = static_cast<size_t>((p.row_blocks * 4 + 255) / 256 * 256);
  // Partial tiles sized for m = 64 (one plan serves every decode bucket).
  p.workspace_bytes = p.splits > 1 ? p.counter_bytes + static_cast<size_t>(p.splits) *
                                                           p.row_blocks * rows *
                                                           kDecodeGemmMaxRows * sizeof(float)
                                   : 0;
  return p;
}

size_t decode_gemm_workspace_bytes(int64_t n, int64_t k) {
  return decode_gemm_plan(n, k).workspace_bytes;
}

void decode_gemm(const DecodeGemmArgs& a, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream) {
  const char* why = decode_gemm_unsupported(a);
  OPD_CHECK(why == nullptr, InvalidArgument, "decode_gemm: y[", a.m, ", ", a.n, "] = x[", a.m,
            ", ", a.k, "] W[", a.n, ", ", a.k, "]^T (ldx ", a.ldx, ", ldy ", a.ldy, "): ",
            why ? why : "");
  const DecodeGemmPlan p =
      decode_gemm_plan(a.n, a.k, a.force_splits, a.force_row_tiles, a.sm_count);
  OPD_CHECK(p.splits == 1 || (workspace && workspace_bytes >= p.workspace_bytes &&
                              aligned16(workspace)),
            InvalidArgument, "decode_gemm: [", a.m, ", ", a.n, ", ", a.k, "] with ", p.splits,
            " splits needs a 16-byte aligned, zero-initialized workspace of ", p.workspace_bytes,
            " bytes (got ", workspace_bytes, ")");
  const bool f32 = a.y_dtype == DType::F32;
  if (p.row_tiles == 2) {
    f32 ? launch_mt<2, float>(a, p, workspace, stream)
        : launch_mt<2, __nv_bfloat16>(a, p, workspace, stream);
  } else {
    f32 ? launch_mt<1, float>(a, p, workspace, stream)
        : launch_mt<1, __nv_bfloat16>(a, p, workspace, stream);
  }
}

}  // namespace opd::cuda
