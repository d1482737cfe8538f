// Decode GEMM v3 of kernels/cuda/gemm.h (decode_gemm, version 3): y[m, n] = x[m, k] W[n, k]^T
// (+ bias[n]) for the 1-64 rows of a decode step, bf16 x and W, f32 accumulation on the tensor
// cores (mma.sync m16n8k16, PTX ISA "Matrix Fragments for mma.m16n8k16"), bf16 or f32 y.
// A CTA's whole W slice is streamed into shared memory by 1-D bulk copies (cp.async.bulk, the
// TMA engine; PTX ISA "Data Movement: cp.async.bulk") issued at kernel start, before the
// programmatic-dependent-launch wait (kernels/cuda/pdl.cuh), completing on mbarriers per k stage.
//
// Why (docs/rollout.md "opd's decode GEMM", "v3"): v1/v2 loaded W into registers, 16 bytes per
// thread per load, so a CTA had a few KB in flight and the W stream was latency-bound (8.7 us at
// m = 1 for 6.3 MB, 1.8 us of bytes). DRAM latency ~0.7 us x 4.15-4.8 TB/s over 132 SMs needs
// ~30 KB in flight per SM; here each CTA has all of its 32-64 KB of W (and its x slice) in flight
// at once, and the W stream starts while the kernel before it (RMSNorm / SwiGLU / attention)
// is still finishing, because W does not depend on it.
//
// Layout of the work:
// - CTA = `kRows` = 64 or 128 consecutive W rows x one k split (split s of a cluster of `splits`
//   CTAs, grid.y = splits). Its k slice [kb, kb + kl) is whole 16-element granules (the last
//   split may end on a half granule: k % 16 == 8).
// - Shared memory: mbarriers, the W tile [kRows x pitch] and the x tile [8 MT x pitch], pitch =
//   32 ceil(granules / splits) + 16 bytes: pitch / 16 is odd, so the 8 rows an ldmatrix phase
//   reads fall on 8 distinct 16-byte bank groups (no conflicts). One bulk copy per (row, stage),
//   issued stage by stage, so stage 0 lands first; 1-4 stages of >= 256 bytes per row (smaller
//   TMA copies cost issue slots for little data). Columns past the slice (a half granule) and
//   rows past n or m are zero-filled by plain stores first: nothing beyond the shape (NaN or not)
//   reaches a sum. x (which the previous kernel writes) is copied only after griddepcontrol.wait,
//   into the same stage barriers (each expects W's and x's bytes of its stage).
// - Math: warp w owns W rows 16w..16w+15 of the CTA against all 8 MT rows of x: per 16-wide k
//   step one ldmatrix.x4 of W (the mma's A operand) and MT/2 ldmatrix.x4 of x (B: x's rows are
//   the mma's n, so x [m, k] row-major is B's "col" layout as is), MT mmas; fragments of step
//   k + 1 are loaded before the mmas of step k. Warps wait for each stage's mbarrier in order.
// - After the last stage the CTA needs no input any more: griddepcontrol.launch_dependents lets a
//   PDL-launched successor start its own prologue (it still waits for this grid to complete
//   before it reads y).
// - Split-K: each CTA leaves its f32 partial in its shared memory (reusing the W/x tiles) and the
//   cluster sums them in rank order through distributed shared memory (decode_gemm_common.cuh,
//   shared with v2): deterministic, no workspace, no atomics.
//
// The plan (plan_v3 below), from the ceilings (H200: 132 SMs, 227 KB of shared memory per CTA,
// 228 KB per SM): at m = 64 the smallest (kRows, splits), 128 rows first (x is re-read once per
// row block: 128-row blocks halve that traffic), that gives >= 0.9 x SMs CTAs which all fit in
// one wave (<= 2 CTAs per SM) with the whole W and x slices in shared memory. W1 shapes:
//   q|k|v   4096 x 1024: 128 rows x 4 splits = 128 CTAs, W 64 KB + x 32 KB, 99 KB smem, 2 stages
//   o       1024 x 2048:  64 rows x 8 splits = 128 CTAs, W 32 KB + x 32 KB, 66 KB smem, 2 stages
//   gate|up 6144 x 1024: 128 rows x 4 splits = 192 CTAs (60 SMs hold 2), W 64 + x 32 KB, 99 KB
//   down    1024 x 3072:  64 rows x 8 splits = 128 CTAs, W 48 KB + x 48 KB, 98 KB smem, 3 stages
//   lm_head 151936 x 1024 (f32 y): no one-wave plan; 128 rows x 4 splits (2 CTAs per SM: one
//           streams while the other computes) = 4748 CTAs in ~18 waves, W 64 KB + x 32 KB each.
// A shape whose smallest slice does not fit (k beyond ~7k at 64 rows x 8 splits) runs v2.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "core/cuda/stream.h"  // check_launch, OPD_CUDA_CHECK
#include "core/error.h"
#include "kernels/cuda/attention_mma.h"       // attn::ldmatrix_x4
#include "kernels/cuda/decode_gemm_common.cuh"  // mma, store_fragment, cluster_reduce_store
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/pdl.cuh"  // pdl_wait, pdl_launch_dependents

namespace opd::cuda {
namespace {

using namespace decode_gemm_dev;
using attn::ldmatrix_x4;

constexpr int kMaxStages = 4;
constexpr int kMinStageBytes = 256;     // per row and stage
constexpr int kBarrierBytes = 128;      // kMaxStages mbarriers, padded: the tiles stay 128-aligned
constexpr int64_t kSmemPerCta = 227 * 1024;  // sm_90 opt-in maximum of dynamic shared memory
constexpr int64_t kSmemPerSm = 228 * 1024;   // per SM; the system reserves 1 KB per CTA
constexpr int kMaxCtasPerSm = 2;

// Bytes of one row of a tile: the slice's granules (32 bytes each) + 16 (odd multiple of 16).
int64_t pitch_bytes(int64_t granules, int splits) { return 32 * ((granules + splits - 1) / splits) + 16; }

// Dynamic shared memory of a CTA of `rows` W rows with 8 mt rows of x.
int64_t smem_v3(int rows, int mt, int64_t pitch) {
  const int64_t tiles = (rows + 8 * mt) * pitch;
  const int64_t partial = static_cast<int64_t>(rows / 16) * mt * 32 * 16;  // float4 fragments
  return kBarrierBytes + std::max(tiles, partial);
}

// ---- PTX wrappers (sm_90) ----
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// One arrival (the barrier's only one) that also expects `bytes` of bulk copies.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Waits for the phase of `parity`. A phase that never completes is a bug of this file (bytes
// expected but never copied), not of the data: after ~2^35 clocks (~20 s, far beyond any copy,
// also under compute-sanitizer) trap, so the launch fails with an error instead of hanging the
// stream.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const long long t0 = clock64();
  while (!mbar_try_wait(bar, parity)) {
    if (clock64() - t0 > (1ll << 35)) __trap();
  }
}
// W is read once: evict it from L2 first (x, y and the next kernel's inputs stay).
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// `bytes` (a multiple of 16; both addresses 16-byte aligned) global -> this CTA's shared memory,
// completing on `bar` (complete_tx of the bytes).
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes,
                                         uint32_t bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes,
                                         uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

// The k steps [nk * st / ns, nk * (st + 1) / ns) of stage st, as bytes of a tile row.
__device__ __forceinline__ void stage_bytes(int st, int ns, int nk, int slice_bytes, int& lo,
                                            int& hi) {
  lo = 32 * (nk * st / ns);
  hi = min(32 * (nk * (st + 1) / ns), slice_bytes);
}

// MT: 8-row groups of x (m <= 8 MT); kWarps: 4 or 8 (64 or 128 W rows per CTA).
template <int MT, int kWarps, typename OutT>
__global__ void __launch_bounds__(kWarps * 32, 512 / (kWarps * 32))
decode_gemm_v3_kernel(const __nv_bfloat16* __restrict__ x, int64_t ldx,
                      const __nv_bfloat16* __restrict__ w, const OutT* __restrict__ bias,
                      OutT* __restrict__ y, int64_t ldy, int m, int64_t n, int64_t k, int splits,
                      int pitch) {
  constexpr int kRows = 16 * kWarps, kThreads = 32 * kWarps, kXRows = 8 * MT;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* ws = smem + kBarrierBytes;                 // W tile [kRows x pitch]
  unsigned char* xs = ws + static_cast<size_t>(kRows) * pitch;  // x tile [kXRows x pitch]
  float4* part = reinterpret_cast<float4*>(ws);             // split partials, after the math
  const uint32_t bar0 = smem_u32(smem);                     // stage st: bar0 + 8 st

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t rb = blockIdx.x;
  const int split = blockIdx.y;
  // This CTA's k slice: granules [g0, g1) of 16 k (the last one may hold only 8).
  const int64_t granules = (k + 15) / 16;
  const int64_t g0 = granules * split / splits, g1 = granules * (split + 1) / splits;
  const int64_t kb = 16 * g0;
  const int kl = static_cast<int>(min(16 * g1, k) - kb);  // > 0, a multiple of 8
  const int nk = (kl + 15) / 16;                           // k steps
  const int slice_bytes = 2 * kl;                          // of a tile row
  const int ns = max(1, min(min(kMaxStages, nk), slice_bytes / kMinStageBytes));
  const int rows_w = static_cast<int>(min(static_cast<int64_t>(kRows), n - rb * kRows));

  // 1. Barriers (thread 0: init, then each stage expects its W and x bytes) and the zero fill
  //    of what no copy writes but an mma reads: rows past n / m and the half granule.
  if (tid == 0) {
    for (int st = 0; st < ns; ++st) mbar_init(bar0 + 8 * st, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    for (int st = 0; st < ns; ++st) {
      int lo, hi;
      stage_bytes(st, ns, nk, slice_bytes, lo, hi);
      mbar_arrive_expect_tx(bar0 + 8 * st, static_cast<uint32_t>((rows_w + m) * (hi - lo)));
    }
  }
  for (int r = tid; r < kRows + kXRows; r += kThreads) {
    const bool is_w = r < kRows;
    unsigned char* row = is_w ? ws + static_cast<size_t>(r) * pitch
                              : xs + static_cast<size_t>(r - kRows) * pitch;
    const bool valid = is_w ? r < rows_w : r - kRows < m;
    for (int b = valid ? slice_bytes : 0; b < 32 * nk; b += 16)
      *reinterpret_cast<uint4*>(row + b) = make_uint4(0, 0, 0, 0);
  }
  __syncthreads();  // barriers initialized and armed before any copy completes on them

  // 2. W: every byte of the CTA's slice in flight at once, stage by stage. W is never written by
  //    a kernel of the step, so this runs before the PDL wait.
  {
    const uint64_t policy = evict_first_policy();
    const __nv_bfloat16* wsrc = w + rb * kRows * k + kb;
    const uint32_t ws_u32 = smem_u32(ws);
    for (int i = tid; i < ns * rows_w; i += kThreads) {
      const int st = i / rows_w, r = i - st * rows_w;
      int lo, hi;
      stage_bytes(st, ns, nk, slice_bytes, lo, hi);
      bulk_g2s(ws_u32 + r * pitch + lo, wsrc + r * k + lo / 2, static_cast<uint32_t>(hi - lo),
               bar0 + 8 * st, policy);
    }
  }
  // 3. x is the previous kernel's output: wait for it (every thread: pdl.cuh's rule), then copy.
  dev::pdl_wait();
  {
    const __nv_bfloat16* xsrc = x + kb;
    const uint32_t xs_u32 = smem_u32(xs);
    for (int i = tid; i < ns * m; i += kThreads) {
      const int st = i / m, r = i - st * m;
      int lo, hi;
      stage_bytes(st, ns, nk, slice_bytes, lo, hi);
      bulk_g2s(xs_u32 + r * pitch + lo, xsrc + r * ldx + lo / 2, static_cast<uint32_t>(hi - lo),
               bar0 + 8 * st);
    }
  }

  // 4. Math, stage by stage. ldmatrix addresses: A (W) x4: lane l -> row l % 16, k 8 (l / 16);
  //    B (x) x4 over groups j, j + 1: lane l -> x row 8 (j + l / 16) + l % 8, k 8 ((l / 8) % 2).
  float acc[MT][4];
#pragma unroll
  for (int j = 0; j < MT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
  const bool active = warp * 16 < rows_w;  // uniform over the warp
  const uint32_t a_addr = smem_u32(ws) + (warp * 16 + (lane & 15)) * pitch + (lane >> 4) * 16;
  const uint32_t b_addr = smem_u32(xs) +
                          ((lane & 7) + (MT > 1 ? (lane >> 4) << 3 : 0)) * pitch +
                          ((lane >> 3) & 1) * 16;
  auto load = [&](int kk, uint32_t(&af)[4], uint32_t(&bf)[MT][2]) {
    ldmatrix_x4(af, a_addr + 32 * kk);
    if constexpr (MT == 1) {
      ldmatrix_x2(bf[0], b_addr + 32 * kk);
    } else {
#pragma unroll
      for (int j = 0; j < MT; j += 2) {
        uint32_t r[4];
        ldmatrix_x4(r, b_addr + j * 8 * pitch + 32 * kk);
        bf[j][0] = r[0], bf[j][1] = r[1], bf[j + 1][0] = r[2], bf[j + 1][1] = r[3];
      }
    }
  };
  auto mmas = [&](const uint32_t(&af)[4], const uint32_t(&bf)[MT][2]) {
#pragma unroll
    for (int j = 0; j < MT; ++j) mma(acc[j], af[0], af[1], af[2], af[3], bf[j][0], bf[j][1]);
  };
  for (int st = 0; st < ns; ++st) {
    mbar_wait(bar0 + 8 * st, 0);  // every warp: all copies observed complete before `part`
    if (!active) continue;
    const int k_begin = nk * st / ns, k_end = nk * (st + 1) / ns;
    uint32_t a0[4], a1[4], b0[MT][2], b1[MT][2];
    int kk = k_begin;
    load(kk, a0, b0);
    while (true) {  // two register sets, unrolled by hand (no dynamic register indexing)
      if (kk + 1 < k_end) load(kk + 1, a1, b1);
      mmas(a0, b0);
      if (++kk >= k_end) break;
      if (kk + 1 < k_end) load(kk + 1, a0, b0);
      mmas(a1, b1);
      if (++kk >= k_end) break;
    }
  }
  // Every input of this CTA is in shared memory or registers: a PDL successor may be scheduled
  // (it waits for this grid's completion before reading y).
  dev::pdl_launch_dependents();

  // 5. Epilogue.
  const int f0 = warp * MT * 32 + lane;  // fragment (warp, j, lane) = f0 + 32 j
  if (splits == 1) {
    if (active) {
#pragma unroll
      for (int j = 0; j < MT; ++j)
        store_fragment<MT, kRows>(f0 + 32 * j, make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]),
                                  rb, bias, y, ldy, m, n);
    }
    return;  // uniform: no cluster was launched
  }
  __syncthreads();  // every warp is done with the W and x tiles: `part` reuses them
#pragma unroll
  for (int j = 0; j < MT; ++j)
    part[f0 + 32 * j] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
  cluster_reduce_store<MT, kRows>(part, kWarps * MT * 32, kThreads, splits, rb, bias, y, ldy, m,
                                  n);
}

template <int MT, int kWarps, typename OutT>
void launch_typed(const DecodeGemmArgs& a, const DecodeGemmPlan& p, cudaStream_t stream) {
  auto kernel = decode_gemm_v3_kernel<MT, kWarps, OutT>;
  // > 48 KB of dynamic shared memory needs an opt-in, per device (a process may drive several;
  // setting it twice from two threads is harmless).
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> configured[kMaxDevices];
  int device = 0;
  OPD_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices || !configured[device].load(std::memory_order_acquire)) {
    OPD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kSmemPerCta)));
    if (device >= 0 && device < kMaxDevices) configured[device].store(true, std::memory_order_release);
  }
  const int64_t pitch = pitch_bytes((a.k + 15) / 16, p.splits);
  const int64_t smem = smem_v3(16 * kWarps, MT, pitch);
  OPD_CHECK(smem <= kSmemPerCta, Internal, "decode_gemm v3: ", smem, " bytes of shared memory");
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(p.row_blocks), static_cast<unsigned>(p.splits), 1);
  cfg.blockDim = dim3(32 * kWarps, 1, 1);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int na = 0;
  if (p.splits > 1) {
    attr[na].id = cudaLaunchAttributeClusterDimension;
    attr[na].val.clusterDim.x = 1;
    attr[na].val.clusterDim.y = static_cast<unsigned>(p.splits);
    attr[na].val.clusterDim.z = 1;
    ++na;
  }
  if (a.pdl) {
    attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[na].val.programmaticStreamSerializationAllowed = 1;
    ++na;
  }
  cfg.attrs = attr;
  cfg.numAttrs = na;
  OPD_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<const __nv_bfloat16*>(a.x), a.ldx,
                                    static_cast<const __nv_bfloat16*>(a.w),
                                    static_cast<const OutT*>(a.bias), static_cast<OutT*>(a.y),
                                    a.ldy, static_cast<int>(a.m), a.n, a.k, p.splits,
                                    static_cast<int>(pitch)));
  check_launch("decode_gemm_v3_kernel");
}

template <int kWarps, typename OutT>
void launch_mt(const DecodeGemmArgs& a, const DecodeGemmPlan& p, cudaStream_t s) {
  switch (m_tiles(a.m)) {
    case 1: return launch_typed<1, kWarps, OutT>(a, p, s);
    case 2: return launch_typed<2, kWarps, OutT>(a, p, s);
    case 4: return launch_typed<4, kWarps, OutT>(a, p, s);
    default: return launch_typed<8, kWarps, OutT>(a, p, s);
  }
}

template <typename OutT>
void launch_out(const DecodeGemmArgs& a, const DecodeGemmPlan& p, cudaStream_t s) {
  if (p.rows == 128) return launch_mt<8, OutT>(a, p, s);
  return launch_mt<4, OutT>(a, p, s);
}

}  // namespace

namespace decode_gemm_detail {

DecodeGemmPlan plan_v3(int64_t n, int64_t k, int force_splits, int force_rows, int sms) {
  const int64_t granules = (k + 15) / 16;
  const int max_splits = static_cast<int>(std::min<int64_t>(kMaxSplits, granules));
  const int64_t target = (9 * static_cast<int64_t>(sms) + 9) / 10;  // ceil(0.9 SMs)
  auto make = [&](int rows, int splits) {
    DecodeGemmPlan p;
    p.version = 3;
    p.rows = rows;
    p.splits = splits;
    p.row_blocks = (n + rows - 1) / rows;
    const int64_t per_split = (granules + splits - 1) / splits;
    p.num_chunks = static_cast<int>((k + 31) / 32);
    p.stages = static_cast<int>(std::max<int64_t>(
        1, std::min<int64_t>(std::min<int64_t>(kMaxStages, per_split), 32 * per_split / kMinStageBytes)));
    p.smem_bytes = smem_v3(rows, 8, pitch_bytes(granules, splits));  // at m = 64
    return p;
  };
  auto fits = [&](const DecodeGemmPlan& p) { return p.smem_bytes <= kSmemPerCta; };
  auto per_sm = [&](const DecodeGemmPlan& p) {
    return std::min<int64_t>(kMaxCtasPerSm, kSmemPerSm / (p.smem_bytes + 1024));
  };
  auto ctas = [&](const DecodeGemmPlan& p) { return p.row_blocks * p.splits; };
  auto one_wave = [&](const DecodeGemmPlan& p) { return ctas(p) <= sms * per_sm(p); };
  std::vector<int> rows_order = {128, 64};
  if (force_rows > 0) rows_order = {force_rows};
  DecodeGemmPlan none;
  none.version = 2;

  if (force_splits > 0) {
    const int s = std::min(force_splits, max_splits);
    if (force_rows == 0 && ((n + 127) / 128) * s < target) rows_order = {64, 128};
    for (int rows : rows_order) {
      const DecodeGemmPlan p = make(rows, s);
      if (fits(p)) return p;
    }
    return none;
  }
  // The smallest split count reaching the target in one wave, 128-row CTAs first.
  for (int rows : rows_order) {
    for (int s = 1; s <= max_splits; ++s) {
      const DecodeGemmPlan p = make(rows, s);
      if (fits(p) && ctas(p) >= target && one_wave(p)) return p;
    }
  }
  if ((n + 127) / 128 >= target) {
    // Large n (lm_head): several waves whatever the split; the fewest splits that let two CTAs
    // share an SM (one streams while the other computes), else the fewest that fit.
    const int rows = force_rows > 0 ? force_rows : 128;
    for (int s = 1; s <= max_splits; ++s) {
      const DecodeGemmPlan p = make(rows, s);
      if (fits(p) && per_sm(p) >= 2) return p;
    }
    for (int s = 1; s <= max_splits; ++s) {
      const DecodeGemmPlan p = make(rows, s);
      if (fits(p)) return p;
    }
    return none;
  }
  // Small n: too few rows to reach the target; the most CTAs that fit in one wave, 64-row CTAs
  // first (fewer idle rows).
  DecodeGemmPlan best = none;
  std::vector<int> small_order = force_rows > 0 ? rows_order : std::vector<int>{64, 128};
  for (int rows : small_order) {
    for (int s = max_splits; s >= 1; --s) {
      const DecodeGemmPlan p = make(rows, s);
      if (fits(p) && one_wave(p) && (best.version != 3 || ctas(p) > ctas(best))) best = p;
    }
  }
  if (best.version == 3) return best;
  for (int rows : small_order) {  // more CTAs than one wave holds: the fewest splits that fit
    for (int s = 1; s <= max_splits; ++s) {
      const DecodeGemmPlan p = make(rows, s);
      if (fits(p)) return p;
    }
  }
  return none;
}

void launch_v3(const DecodeGemmArgs& a, const DecodeGemmPlan& p, cudaStream_t stream) {
  OPD_CHECK(p.version == 3 && (p.rows == 64 || p.rows == 128) && p.splits >= 1 &&
                p.splits <= kMaxSplits && p.row_blocks >= 1 && p.row_blocks <= 0x7fffffff,
            Internal, "decode_gemm v3: bad plan (", p.rows, " rows, ", p.splits, " splits, ",
            p.row_blocks, " row blocks)");
  if (a.y_dtype == DType::F32) {
    launch_out<float>(a, p, stream);
  } else {
    launch_out<__nv_bfloat16>(a, p, stream);
  }
}

}  // namespace decode_gemm_detail
}  // namespace opd::cuda
