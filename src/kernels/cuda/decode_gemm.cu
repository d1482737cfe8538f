// The weight-streaming decode GEMM of kernels/cuda/gemm.h (decode_gemm): y[m, n] = x[m, k] W[n, k]^T
// (+ bias[n]) for the few rows of a decode step (1 <= m <= 64), bf16 x and W, f32 accumulation on
// the tensor cores (mma.sync m16n8k16), bf16 or f32 y. Bound by the one read of W: every byte of
// W is loaded once, 16 bytes per thread per load, straight into registers (no shared-memory
// round trip); split-K over the CTAs of a thread-block cluster gives enough CTAs to spread W
// over the SMs even when n is only 1024, and the splits are summed through distributed shared
// memory. This file holds decode GEMM v2 (the kernel below), the API entry points (argument
// checks, the version choice: DecodeGemmArgs::version / OPD_DECODE_GEMM, the plans) and the
// dispatch to v3 (decode_gemm_v3.cu: W streamed into shared memory by bulk copies); the mma,
// the epilogue and the cluster reduction are shared with v3 (decode_gemm_common.cuh).
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
// - A CTA is 8 warps: 4 row warps (16 W rows each: 64 rows per CTA) x 2 k warps (alternate
//   chunks of a k tile of 8 or 12 chunks). All of a tile's W loads are issued first, then its
//   x slice (8 x MT rows, zero-padded) is copied to shared memory with cp.async, so the x copy
//   (an L2 hit) overlaps the W stream instead of following it.
// - Measured (docs/rollout.md): correct and deterministic, but slower than cuBLASLt at m = 64
//   on every W1 shape (0.6-0.8x at the best split counts); at m = 1 on par. Off by default.
// - Split-K: the splits of one 64-row block form a cluster (<= 8 CTAs, grid.y = splits). Each
//   CTA leaves its f32 partial in its shared memory; after a cluster barrier, CTA r sums the
//   fragments r, r + splits, ... over the cluster's CTAs in rank order 0, 1, ... (distributed
//   shared memory) and writes y. No workspace, no atomics; the sum order is fixed, so the
//   result is the same bits run to run. (A first version went through a global f32 workspace
//   and a last-CTA-arrives counter: its chain of L2 round trips made it slower than cuBLASLt.)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>  // getenv
#include <cstring>

#include "core/cuda/stream.h"  // check_launch, OPD_CUDA_CHECK
#include "core/error.h"
#include "kernels/cuda/common.cuh"  // to_f32 / from_f32
#include "kernels/cuda/cuda_ops.h"  // sm_count
#include "kernels/cuda/decode_gemm_common.cuh"
#include "kernels/cuda/gemm.h"

namespace opd::cuda {
namespace {

using namespace decode_gemm_dev;  // mma, store_fragment, cluster_reduce_store, m_tiles

constexpr int kThreads = 256;
constexpr int kRowWarps = 4, kKWarps = 2;
constexpr int kRows = 16 * kRowWarps;  // W rows per CTA
constexpr int kChunk = 32;             // k per chunk: 4 threads x 8 bf16

// Shared memory of one CTA: the x tile (8 MT rows x (chunks x 32 + 32) bf16: the 64-byte pad
// puts the 2 rows a 16-byte load phase touches on disjoint banks) and the f32 partial tile.
constexpr int x_stride(int cpw) { return cpw * kKWarps * kChunk + 32; }
constexpr size_t smem_bytes(int mt, int cpw) {
  return static_cast<size_t>(8 * mt) * x_stride(cpw) * 2 + static_cast<size_t>(kRowWarps) * mt * 32 * 16;
}

// 16 bytes of W: read once, so skip L1 (the stream would only evict x's lines there).
__device__ __forceinline__ uint4 load_stream(const __nv_bfloat16* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// 16-byte global -> shared copy; !valid zero-fills the 16 bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

// MT: 8-row groups of x (m <= 8 MT); CPW: chunks per warp per k tile (tile = 2 CPW chunks).
template <int MT, int CPW, typename OutT>
__global__ void __launch_bounds__(kThreads, 2)
decode_gemm_kernel(const __nv_bfloat16* __restrict__ x, int64_t ldx,
                   const __nv_bfloat16* __restrict__ w, const OutT* __restrict__ bias,
                   OutT* __restrict__ y, int64_t ldy, int m, int64_t n, int64_t k, int splits,
                   int num_chunks) {
  constexpr int kTileChunks = CPW * kKWarps;
  constexpr int kTileK = kTileChunks * kChunk;
  constexpr int kStride = x_stride(CPW);
  constexpr int kXRows = 8 * MT;
  constexpr int kTileFrags = kRowWarps * MT * 32;  // float4 fragments of the CTA's tile
  extern __shared__ __align__(16) unsigned char smem[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);
  float4* part = reinterpret_cast<float4*>(smem + static_cast<size_t>(kXRows) * kStride * 2);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rw = warp % kRowWarps, kw = warp / kRowWarps;
  const int g = lane >> 2, t = lane & 3;
  const int64_t rb = blockIdx.x;
  const int split = blockIdx.y;
  const int64_t row0 = rb * kRows + rw * 16 + g;
  const int c_begin = static_cast<int>(static_cast<int64_t>(num_chunks) * split / splits);
  const int c_end = static_cast<int>(static_cast<int64_t>(num_chunks) * (split + 1) / splits);

  // This thread's W rows row0 and row0 + 8 (rows past n read nothing and stay 0).
  const bool ok0 = row0 < n, ok1 = row0 + 8 < n;
  const __nv_bfloat16* w0 = w + (ok0 ? row0 : 0) * k + 8 * t;
  const __nv_bfloat16* w1 = w + (ok1 ? row0 + 8 : 0) * k + 8 * t;

  float acc[MT][4];
#pragma unroll
  for (int j = 0; j < MT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;

  for (int tc = c_begin; tc < c_end; tc += kTileChunks) {
    const int tile_chunks = min(kTileChunks, c_end - tc);
    // 1. This warp's W for the tile (chunks kw, kw + 2, ...): all loads in flight at once.
    uint4 wv[CPW][2];
#pragma unroll
    for (int i = 0; i < CPW; ++i) {
      const int c = kw + kKWarps * i;
      const int64_t koff = static_cast<int64_t>(tc + c) * kChunk;
      const bool in = c < tile_chunks && koff + 8 * t < k;  // k % 8 == 0: 8 elements or none
      wv[i][0] = in && ok0 ? load_stream(w0 + koff) : make_uint4(0, 0, 0, 0);
      wv[i][1] = in && ok1 ? load_stream(w1 + koff) : make_uint4(0, 0, 0, 0);
    }
    // 2. x[0:8 MT, tile] -> shared, asynchronously (rows >= m and k past the split are 0: x
    //    beyond the shape must not reach the sums, NaN or not).
    if (tc != c_begin) __syncthreads();  // the previous tile's readers are done
    const int64_t k0 = static_cast<int64_t>(tc) * kChunk;
    const int64_t k_lim = min(k, static_cast<int64_t>(tc + tile_chunks) * kChunk);
    for (int e = threadIdx.x; e < kXRows * (kTileK / 8); e += kThreads) {
      const int row = e / (kTileK / 8), seg = e % (kTileK / 8);
      const int64_t kk = k0 + 8 * seg;
      const bool valid = row < m && kk < k_lim;
      cp_async_16(xs + row * kStride + 8 * seg, valid ? x + row * ldx + kk : x, valid);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    __syncthreads();
    // 3. Two mma k-steps per chunk, each W fragment against all MT groups of x.
#pragma unroll
    for (int i = 0; i < CPW; ++i) {
      const int c = kw + kKWarps * i;
      if (c >= tile_chunks) break;  // uniform over the warp
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        const uint4 xb =
            *reinterpret_cast<const uint4*>(xs + (8 * j + g) * kStride + c * kChunk + 8 * t);
        mma(acc[j], wv[i][0].x, wv[i][1].x, wv[i][0].y, wv[i][1].y, xb.x, xb.y);
        mma(acc[j], wv[i][0].z, wv[i][1].z, wv[i][0].w, wv[i][1].w, xb.z, xb.w);
      }
    }
  }

  // The two k warps of each row warp: k warp 0's sum + k warp 1's (fixed order), left in
  // `part` (this CTA's partial of the split) and in k warp 0's registers.
  const int f0 = rw * MT * 32 + lane;  // fragment (rw, j, lane) = f0 + 32 j
  if (kw == 1) {
#pragma unroll
    for (int j = 0; j < MT; ++j) part[f0 + 32 * j] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
  }
  __syncthreads();
  if (kw == 0) {
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      const float4 o = part[f0 + 32 * j];
      acc[j][0] += o.x;
      acc[j][1] += o.y;
      acc[j][2] += o.z;
      acc[j][3] += o.w;
      if (splits == 1) {
        store_fragment<MT, kRows>(f0 + 32 * j, make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]),
                           rb, bias, y, ldy, m, n);
      } else {
        part[f0 + 32 * j] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
      }
    }
  }
  if (splits == 1) return;  // uniform: no cluster was launched

  // Split-K over the cluster: CTA r finishes fragments r, r + splits, ..., summing the
  // cluster's partials in rank order (decode_gemm_common.cuh, shared with v3).
  cluster_reduce_store<MT, kRows>(part, kTileFrags, kThreads, splits, rb, bias, y, ldy, m, n);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <int MT, int CPW, typename OutT>
void launch_typed(const DecodeGemmArgs& a, const DecodeGemmPlan& p, cudaStream_t stream) {
  auto kernel = decode_gemm_kernel<MT, CPW, OutT>;
  constexpr size_t smem = smem_bytes(MT, CPW);
  static const bool configured = [&] {  // > 48 KB of dynamic shared memory needs an opt-in
    OPD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
    return true;
  }();
  (void)configured;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(p.row_blocks), static_cast<unsigned>(p.splits), 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = static_cast<unsigned>(p.splits);
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.splits > 1 ? 1 : 0;
  OPD_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<const __nv_bfloat16*>(a.x), a.ldx,
                                    static_cast<const __nv_bfloat16*>(a.w),
                                    static_cast<const OutT*>(a.bias), static_cast<OutT*>(a.y),
                                    a.ldy, static_cast<int>(a.m), a.n, a.k, p.splits,
                                    p.num_chunks));
  check_launch("decode_gemm_kernel");
}

template <int CPW, typename OutT>
void launch_mt(const DecodeGemmArgs& a, const DecodeGemmPlan& p, cudaStream_t s) {
  switch (m_tiles(a.m)) {
    case 1: return launch_typed<1, CPW, OutT>(a, p, s);
    case 2: return launch_typed<2, CPW, OutT>(a, p, s);
    case 4: return launch_typed<4, CPW, OutT>(a, p, s);
    default: return launch_typed<8, CPW, OutT>(a, p, s);
  }
}

template <typename OutT>
void launch_out(const DecodeGemmArgs& a, const DecodeGemmPlan& p, cudaStream_t s) {
  if (p.chunks_per_warp == 6) return launch_mt<6, OutT>(a, p, s);
  return launch_mt<4, OutT>(a, p, s);
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
  if (a.force_splits < 0) return "force_splits must be >= 0";
  if (a.force_rows != 0 && a.force_rows != 64 && a.force_rows != 128)
    return "force_rows must be 0, 64 or 128";
  if (a.version != 0 && a.version != 2 && a.version != 3) return "version must be 0, 2 or 3";
  return nullptr;
}

namespace {
std::atomic<int> g_version_override{0};
}  // namespace

void decode_gemm_set_default_version(int version) {
  OPD_CHECK(version == 0 || version == 2 || version == 3, InvalidArgument,
            "decode_gemm_set_default_version: ", version, " (0, 2 or 3)");
  g_version_override.store(version, std::memory_order_relaxed);
}

int decode_gemm_default_version() {
  if (const int v = g_version_override.load(std::memory_order_relaxed); v != 0) return v;
  static const int version = [] {
    const char* env = std::getenv("OPD_DECODE_GEMM");
    if (env == nullptr || *env == '\0' || std::strcmp(env, "v3") == 0) return 3;
    if (std::strcmp(env, "v2") == 0) return 2;
    return 0;
  }();
  OPD_CHECK(version != 0, InvalidArgument, "OPD_DECODE_GEMM must be v2 or v3 (unset: v3), not '",
            std::getenv("OPD_DECODE_GEMM"), "'");
  return version;
}

DecodeGemmPlan decode_gemm_plan(int64_t n, int64_t k, int force_splits, int sms, int version,
                                int force_rows) {
  OPD_CHECK(n >= 1 && k >= 1 && force_splits >= 0 && (version == 0 || version == 2 || version == 3) &&
                (force_rows == 0 || force_rows == 64 || force_rows == 128),
            InvalidArgument, "decode_gemm_plan: n ", n, ", k ", k, ", force_splits ", force_splits,
            ", version ", version, ", force_rows ", force_rows);
  if (sms <= 0) sms = sm_count();
  if (version == 0) version = decode_gemm_default_version();
  if (version == 3) {
    const DecodeGemmPlan p3 = decode_gemm_detail::plan_v3(n, k, force_splits, force_rows, sms);
    if (p3.version == 3) return p3;  // else v3 cannot hold the shape: v2's plan
  }
  DecodeGemmPlan p;
  p.version = 2;
  p.row_blocks = (n + kRows - 1) / kRows;
  p.num_chunks = static_cast<int>((k + kChunk - 1) / kChunk);
  const int max_splits = static_cast<int>(std::min<int64_t>(kMaxSplits, p.num_chunks));
  if (force_splits > 0) {
    p.splits = std::min(force_splits, max_splits);
  } else {
    // The fewest splits that give >= ~0.72 CTAs per SM. Measured on the H200 (132 SMs, m = 64,
    // docs/rollout.md, the decode_gemm_splits.* sweep): more CTAs (more splits) were slower
    // for every W1 shape: q|k|v best at 2 splits (128 CTAs), o at 6 (96), gate|up at 1 (96),
    // down at 4-6 (64-96); this rule picks 2, 6, 1, 6.
    p.splits = max_splits;
    for (int s = 1; s <= max_splits; ++s) {
      if (p.row_blocks * s * 25 >= static_cast<int64_t>(sms) * 18) {
        p.splits = s;
        break;
      }
    }
  }
  OPD_CHECK(p.row_blocks <= 0x7fffffff, InvalidArgument, "decode_gemm: ", p.row_blocks,
            " row blocks for n ", n);
  const int64_t per_split = (p.num_chunks + p.splits - 1) / p.splits;
  p.chunks_per_warp = per_split <= 8 ? 4 : 6;  // tiles of 8 or 12 chunks
  p.smem_bytes = static_cast<int64_t>(smem_bytes(8, p.chunks_per_warp));
  return p;
}

void decode_gemm(const DecodeGemmArgs& a, cudaStream_t stream) {
  const char* why = decode_gemm_unsupported(a);
  OPD_CHECK(why == nullptr, InvalidArgument, "decode_gemm: y[", a.m, ", ", a.n, "] = x[", a.m,
            ", ", a.k, "] W[", a.n, ", ", a.k, "]^T (ldx ", a.ldx, ", ldy ", a.ldy, "): ",
            why ? why : "");
  const DecodeGemmPlan p =
      decode_gemm_plan(a.n, a.k, a.force_splits, a.sm_count, a.version, a.force_rows);
  if (p.version == 3) return decode_gemm_detail::launch_v3(a, p, stream);
  if (a.y_dtype == DType::F32) {
    launch_out<float>(a, p, stream);
  } else {
    launch_out<__nv_bfloat16>(a, p, stream);
  }
}

}  // namespace opd::cuda
