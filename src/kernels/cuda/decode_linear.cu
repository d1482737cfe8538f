// opd's decode linear (declared in kernels/cuda/decode_linear.h): y = x W^T (+ bias) for the
// <= 64 rows of a decode step, bf16 operands, f32 accumulation on the tensor cores (mma.sync
// m16n8k16), written so that a PDL launch streams W while the kernel before it still runs.
//
// Why (docs/rollout.md "Decode linear v4"): at W1 a decode step's four per-layer cuBLASLt GEMMs
// move 4-12 MB each and take 6.5-9.9 us for 1-3 us of bytes; what they lose is the launch, the
// DRAM ramp and the tail, not bandwidth. W does not depend on anything the step computes, so
// every CTA here issues its W loads first, into registers, and only then waits
// (griddepcontrol.wait) for the kernel that writes x.
//
// Work split (decode_linear_plan; depends on (n, k) and the device only, never on m):
//   - a warp owns 16 * R16 consecutive W rows (R16 = 1, 2 or 3); a CTA's 8 warps are RG row
//     groups (1 or 2) x 8 / RG k groups: it owns 16 * R16 * RG rows and a contiguous range of
//     32-wide k steps, which its k groups split again; `splits` CTAs of one row block form a
//     thread-block cluster that splits k. The plan takes, among the layouts that run in one wave
//     (one CTA per SM; clusters only as many as the device holds at once: GPC boundaries leave
//     fewer than SMs / size) and keep >= 70% of the SMs busy, the one that reads the fewest x
//     bytes from L2 (every CTA reads x over its k range once: more rows per CTA, fewer reads);
//   - a warp computes its 16 * R16 rows x 8 * MT x rows over its k group's steps (MT = 1, 2, 4,
//     8 groups of 8 x rows, chosen by m);
//   - fragment loads without shared memory for W: lane (g, t) loads 16 bytes of row g (and of
//     row g + 8) at k = 32 s + 8 t ... + 7 and uses them as the A fragments of two m16n8k16
//     products with a permuted k: logical k (2t, 2t+1, 2t+8, 2t+9) <- physical 8t + (0, 1, 2, 3)
//     for the first, 8t + (4, 5, 6, 7) for the second. x (the B operand) uses the same
//     permutation, so lane (g, t) needs exactly x[8 j + g][32 s + 8 t ...] (16 bytes) for both.
//     A dot product does not depend on the order of its k's, so this is x W^T; a warp load of W
//     covers 8 rows x 64 contiguous bytes (16 full 32-byte sectors);
//   - x: staged once per CTA in shared memory after the wait, in fragment order (lane (g, t)'s
//     16 bytes of step i, x group j at one 16-byte slot: conflict-free), copied by the k group's
//     row-group warps (cp.async, rows >= m and k >= K zero-filled), one commit group per step,
//     and step i is computed as soon as it has landed (a named barrier per k group);
//   - reductions in fixed orders: the k groups' partials through shared memory (k group 0 + 1 +
//     ...), then the cluster's CTAs through distributed shared memory (rank 0 + 1 + ...). No atomics,
//     the same bits every run, and a row's result does not depend on m.
//   - PDL (pdl.cuh rules): before pdl_wait() only W loads (weights no kernel of the step writes);
//     the successor is released after the k loop.
// Measured on the H200: docs/rollout.md "Decode linear v4".
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <utility>

#include "core/cuda/stream.h"
#include "kernels/cuda/attention_mma.h"  // attn::cp_async_16 / commit / wait, smem_addr
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"  // sm_count
#include "kernels/cuda/decode_linear.h"
#include "kernels/cuda/pdl.cuh"

namespace opd::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kStepK = 32;         // k per step (two m16n8k16 products)
constexpr int kMaxSplits = 8;      // portable cluster size
constexpr int kSmemBudget = 200 * 1024;  // a plan's dynamic shared memory at most
constexpr int kFragBytes = 32 * 16;  // one accumulator fragment of a warp (32 lanes x float4)

struct Params {
  const bf16* x;
  const bf16* w;
  const bf16* bias;
  bf16* y;
  int m, k, n;
  int steps;        // ceil(k / 32)
  int splits;       // cluster size (1: no cluster)
  int part_offset;  // the CTA's summed partial (splits > 1), after the x / warp-partial area
};

// Streaming 16-byte load of weights: no L1 allocation, read-only path. volatile keeps it where
// it is written (before the PDL wait).
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(addr));
  return r;
}

// cp.async.wait_group with a run-time count (the immediate it needs, by cases; n >= the
// groups in flight returns at once).
__device__ __forceinline__ void cp_async_wait_dyn(int n) {
  switch (n) {
    case 0: attn::cp_async_wait<0>(); break;
    case 1: attn::cp_async_wait<1>(); break;
    case 2: attn::cp_async_wait<2>(); break;
    case 3: attn::cp_async_wait<3>(); break;
    case 4: attn::cp_async_wait<4>(); break;
    case 5: attn::cp_async_wait<5>(); break;
    case 6: attn::cp_async_wait<6>(); break;
    default: attn::cp_async_wait<7>(); break;
  }
}

// c += A B, m16n8k16, bf16 in, f32 accumulate: A = 16 W rows x 16 (permuted) k, B = 16 k x 8 x rows.
__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  asm(  // not volatile: the compiler may interleave independent products
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// Fragment f = (rt * MT + j) * 32 + lane of a row block: c0, c1 = (W row 16 rt + g, x rows
// 8 j + 2 t, + 1), c2, c3 = (W row 16 rt + g + 8, the same x rows). W rows >= n and x rows >= m
// are never stored.
template <int MT>
__device__ __forceinline__ void store_fragment(const Params& p, int row0, int f, float4 v) {
  const int lane = f & 31, j = (f >> 5) % MT, rt = (f >> 5) / MT;
  const int g = lane >> 2, t = lane & 3;
  const float c[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 16 * rt + 8 * h + g;
    if (row >= p.n) continue;
    const float b = p.bias ? __bfloat162float(p.bias[row]) : 0.0f;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * j + 2 * t + e;
      if (col < p.m) p.y[static_cast<int64_t>(col) * p.n + row] = __float2bfloat16_rn(c[2 * h + e] + b);
    }
  }
}

// CTA = RG row groups x KG = 8 / RG k groups of warps; warp (rg, kg) = warp % RG, warp / RG owns
// 16 * R16 rows (row group rg) over the k steps of k group kg. The CTA's x fragments are staged
// once in shared memory and read by the RG warps of each k group.
template <int R16, int RG, int MT, int kDepth>
__global__ void __launch_bounds__(kThreads, 1) decode_linear_kernel(Params p) {
  constexpr int KG = kWarps / RG;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  const int rg = warp % RG, kg = warp / RG;
  const int split = static_cast<int>(blockIdx.x) % p.splits;  // == the rank in the cluster
  const int rb = static_cast<int>(blockIdx.x) / p.splits;
  const int cta_row0 = rb * 16 * R16 * RG;
  const int row0 = cta_row0 + rg * 16 * R16;
  // k steps [c0, c1) of the CTA; [g0, g0 + ns) of the warp's k group (local index from c0).
  const int c0 = split * p.steps / p.splits, c1 = (split + 1) * p.steps / p.splits;
  const int g0 = kg * (c1 - c0) / KG;
  const int ns = (kg + 1) * (c1 - c0) / KG - g0;

  // ---- prologue: this warp's first kDepth steps of W into registers (W is never written by a
  // kernel of the step, so this runs before the PDL wait and overlaps the predecessor).
  const bf16* wrow[R16][2];
  bool wok[R16][2];
#pragma unroll
  for (int rt = 0; rt < R16; ++rt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 16 * rt + 8 * h + g;
      wok[rt][h] = row < p.n;
      wrow[rt][h] = p.w + static_cast<int64_t>(wok[rt][h] ? row : 0) * p.k + 8 * t;
    }
  }
  auto load_w = [&](int s, uint4 (&dst)[R16][2]) {
    const int kk = s * kStepK;
    const bool kin = kk + 8 * t < p.k;  // k % 8 == 0: a 16-byte chunk is all in or all out
#pragma unroll
    for (int rt = 0; rt < R16; ++rt) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
        dst[rt][h] = (wok[rt][h] && kin) ? ld_stream(wrow[rt][h] + kk) : make_uint4(0, 0, 0, 0);
    }
  };
  uint4 ring[kDepth][R16][2];
#pragma unroll
  for (int d = 0; d < kDepth; ++d)
    if (d < ns) load_w(c0 + g0 + d, ring[d]);

  dev::pdl_wait();  // x is the predecessor's output

  // ---- x fragments of the k group's steps: block (i, j) = 32 lanes x 16 bytes at
  // smem[((g0 + i) * MT + j) * 512 + lane * 16] holds x[8 j + g][32 (c0 + g0 + i) + 8 t ...] for
  // lane (g, t): the B fragments of step i, x group j (rows >= m and k >= K zero-filled).
  // Warp rg of the k group copies the blocks with j % RG == rg, one commit group per step; a step
  // is used after this warp's group has landed and the k group's RG warps have met at a named
  // barrier (bar.sync orders their shared-memory writes before the reads).
  const uint32_t xs = attn::smem_addr(smem) + lane * 16;
  {
    const bf16* xrow[MT];
    bool rok[MT];
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      rok[j] = 8 * j + g < p.m;
      xrow[j] = p.x + static_cast<int64_t>(rok[j] ? 8 * j + g : 0) * p.k + 8 * t;
    }
    for (int i = 0; i < ns; ++i) {
      const int kk = (c0 + g0 + i) * kStepK;
      const bool kin = kk + 8 * t < p.k;
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        if (j % RG != rg) continue;
        const bool ok = rok[j] && kin;
        attn::cp_async_16(xs + ((g0 + i) * MT + j) * kFragBytes, ok ? xrow[j] + kk : p.x, ok);
      }
      attn::cp_async_commit();
    }
  }

  // ---- the k loop: step i's products, then W of step i + kDepth into the freed ring slot.
  float acc[R16][MT][4];
#pragma unroll
  for (int rt = 0; rt < R16; ++rt)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[rt][j][e] = 0.0f;
  for (int i0 = 0; i0 < ns; i0 += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int i = i0 + d;
      if (i < ns) {
        cp_async_wait_dyn(ns - 1 - i);  // this warp's copies of step i have landed
        if constexpr (RG > 1) {  // ... and those of the other row groups of the k group
          asm volatile("bar.sync %0, %1;\n" ::"r"(1 + kg), "r"(32 * RG) : "memory");
        }
        uint4 xv[MT];
#pragma unroll
        for (int j = 0; j < MT; ++j) xv[j] = ld_shared_v4(xs + ((g0 + i) * MT + j) * kFragBytes);
        // The first k16 half of every (row tile, x group), then the second: 16 or more
        // independent products between two that accumulate into the same fragment.
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
          for (int rt = 0; rt < R16; ++rt)
            mma(acc[rt][j], ring[d][rt][0].x, ring[d][rt][1].x, ring[d][rt][0].y,
                ring[d][rt][1].y, xv[j].x, xv[j].y);
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
          for (int rt = 0; rt < R16; ++rt)
            mma(acc[rt][j], ring[d][rt][0].z, ring[d][rt][1].z, ring[d][rt][0].w,
                ring[d][rt][1].w, xv[j].z, xv[j].w);
        if (i + kDepth < ns) load_w(c0 + g0 + i + kDepth, ring[d]);
      }
    }
  }
  dev::pdl_launch_dependents();  // the successor's prologue may start

  // ---- the KG warps' partials of each row group, summed in k-group order. The partials reuse
  // the x area (after the barrier: every warp is done reading it): warp w's fragment q of lane l
  // at ((w * R16 * MT + q) * 32 + l) * 16.
  __syncthreads();
  constexpr int kWarpFrags = R16 * MT * 32;
  {
    float4* red = reinterpret_cast<float4*>(smem) + warp * kWarpFrags;
#pragma unroll
    for (int rt = 0; rt < R16; ++rt)
#pragma unroll
      for (int j = 0; j < MT; ++j)
        red[(rt * MT + j) * 32 + lane] =
            make_float4(acc[rt][j][0], acc[rt][j][1], acc[rt][j][2], acc[rt][j][3]);
  }
  __syncthreads();
  // CTA fragment f = rg * kWarpFrags + (rt * MT + j) * 32 + lane.
  constexpr int kFrags = RG * kWarpFrags;
  const float4* red = reinterpret_cast<const float4*>(smem);
  float4* part = reinterpret_cast<float4*>(smem + p.part_offset);
  for (int f = static_cast<int>(threadIdx.x); f < kFrags; f += kThreads) {
    const int frg = f / kWarpFrags, q = f % kWarpFrags;
    float4 s = red[frg * kWarpFrags + q];  // warp (frg, 0)
#pragma unroll
    for (int c = 1; c < KG; ++c) s = add4(s, red[(c * RG + frg) * kWarpFrags + q]);
    if (p.splits == 1) {
      store_fragment<MT>(p, cta_row0 + frg * 16 * R16, q, s);
    } else {
      part[f] = s;
    }
  }
  if (p.splits == 1) return;

  // ---- the cluster's partials (the splits of this row block), summed in rank order.
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every CTA's partial written (release/acquire over the cluster)
  const int rank = static_cast<int>(cluster.block_rank());
  for (int f = rank + p.splits * static_cast<int>(threadIdx.x); f < kFrags;
       f += p.splits * kThreads) {
    float4 v[kMaxSplits];
#pragma unroll
    for (int r = 0; r < kMaxSplits; ++r)
      if (r < p.splits) v[r] = *cluster.map_shared_rank(part + f, r);
    float4 s = v[0];
#pragma unroll
    for (int r = 1; r < kMaxSplits; ++r)
      if (r < p.splits) s = add4(s, v[r]);
    store_fragment<MT>(p, cta_row0 + (f / kWarpFrags) * 16 * R16, f % kWarpFrags, s);
  }
  cluster.sync();  // the other CTAs may still read this CTA's partial
}

template <int R16>
constexpr int depth_for() {  // W steps in flight per warp (8 R16 registers per step)
  return R16 == 1 ? 6 : R16 == 2 ? 4 : 2;
}

constexpr int kSmemLimit = 227 * 1024;

// The kernel may use up to kSmemLimit of dynamic shared memory: set once per (kernel, device).
void allow_smem(const void* kernel) {
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  int device = 0;
  OPD_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  if (done.insert({kernel, device}).second)
    OPD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        kSmemLimit));
  prefer_max_shared(kernel);  // pdl.cuh: the split the decode step's other kernels ask for
}

template <int R16, int RG, int MT>
void launch(const Params& p, const DecodeLinearPlan& plan, cudaStream_t stream, bool pdl) {
  auto* kernel = decode_linear_kernel<R16, RG, MT, depth_for<R16>()>;
  allow_smem(reinterpret_cast<const void*>(kernel));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(plan.row_blocks * plan.splits));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = plan.smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int na = 0;
  if (plan.splits > 1) {
    attr[na].id = cudaLaunchAttributeClusterDimension;
    attr[na].val.clusterDim.x = static_cast<unsigned>(plan.splits);
    attr[na].val.clusterDim.y = 1;
    attr[na].val.clusterDim.z = 1;
    ++na;
  }
  if (pdl) {
    attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[na].val.programmaticStreamSerializationAllowed = 1;
    ++na;
  }
  cfg.attrs = attr;
  cfg.numAttrs = static_cast<unsigned>(na);
  const cudaError_t st = cudaLaunchKernelEx(&cfg, kernel, p);
  if (st != cudaSuccess) {
    (void)cudaGetLastError();
    OPD_FAIL(Cuda, "launch of decode_linear_kernel failed: ", cudaGetErrorName(st), " (",
             cudaGetErrorString(st), ")");
  }
}

template <int R16, int RG>
void launch_mt(const Params& p, const DecodeLinearPlan& plan, cudaStream_t stream, bool pdl) {
  if (p.m <= 8) {
    launch<R16, RG, 1>(p, plan, stream, pdl);
  } else if (p.m <= 16) {
    launch<R16, RG, 2>(p, plan, stream, pdl);
  } else if (p.m <= 32) {
    launch<R16, RG, 4>(p, plan, stream, pdl);
  } else {
    launch<R16, RG, 8>(p, plan, stream, pdl);
  }
}

template <int R16>
void launch_rg(const Params& p, const DecodeLinearPlan& plan, cudaStream_t stream, bool pdl) {
  if (plan.row_groups == 1) {
    launch_mt<R16, 1>(p, plan, stream, pdl);
  } else {
    launch_mt<R16, 2>(p, plan, stream, pdl);
  }
}

// Shared memory of a plan (sized for m = 64): the x fragments of the CTA's k steps (8 groups x
// 512 bytes per step), reused for the 8 warps' partials, then the CTA's partial for the cluster.
size_t smem_for(int64_t cta_steps, int rows16, int row_groups, int splits) {
  const size_t x = static_cast<size_t>(cta_steps) * 8 * kFragBytes;
  const size_t warps = static_cast<size_t>(kWarps) * rows16 * 8 * kFragBytes;
  const size_t part = splits > 1 ? static_cast<size_t>(row_groups) * rows16 * 8 * kFragBytes : 0;
  return std::max(x, warps) + part;
}

}  // namespace

DecodeLinearPlan decode_linear_plan(int64_t n, int64_t k, int sms,
                                    const int (&max_clusters)[kDecodeLinearMaxSplits]) {
  DecodeLinearPlan best;
  if (n < 1 || k < 8 || k % 8 != 0 || sms < 1 || n >= (int64_t{1} << 30) ||
      k >= (int64_t{1} << 30) || n * k >= (int64_t{1} << 40)) {
    return best;
  }
  const int64_t steps = (k + kStepK - 1) / kStepK;
  // Candidates run in one wave (one CTA per SM; clusters only as many as the device holds at
  // once). Among those with >= 70% of the SMs busy (the W stream needs most SMs), the fewest
  // x bytes read from L2 (row blocks x k: every CTA reads its k range of x once), then the most
  // CTAs, then fewer splits, row groups and rows per warp (the loop order).
  auto better = [&](const DecodeLinearPlan& a, const DecodeLinearPlan& b) {
    const int64_t ca = a.row_blocks * a.splits, cb = b.row_blocks * b.splits;
    const bool fa = 10 * ca >= 7 * sms, fb = 10 * cb >= 7 * sms;
    if (fa != fb) return fa;
    if (fa && a.row_blocks != b.row_blocks) return a.row_blocks < b.row_blocks;
    return ca > cb;
  };
  for (int r16 : {1, 2, 3}) {
    for (int rgroups : {1, 2}) {
      const int64_t rows = 16 * r16 * rgroups;
      const int64_t rb = (n + rows - 1) / rows;
      for (int s = 1; s <= kDecodeLinearMaxSplits && s <= steps; ++s) {
        const int64_t ctas = rb * s;
        const int64_t cta_steps = (steps + s - 1) / s;
        const int64_t ws = (cta_steps + kWarps / rgroups - 1) / (kWarps / rgroups);
        if (ctas > sms || (s > 1 && rb > max_clusters[s - 1])) continue;
        const size_t smem = smem_for(cta_steps, r16, rgroups, s);
        if (smem > static_cast<size_t>(kSmemBudget)) continue;
        DecodeLinearPlan c;
        c.ok = true;
        c.rows16 = r16;
        c.row_groups = rgroups;
        c.splits = s;
        c.row_blocks = rb;
        c.warp_steps = static_cast<int>(ws);
        c.smem_bytes = smem;
        if (!best.ok || better(c, best)) best = c;
      }
    }
  }
  return best;
}

// The plan for this device: its SMs and how many clusters of 2, 4, 8 CTAs (one per SM: the
// kernel's registers and shared memory) can be resident at once (GPC boundaries: fewer than
// SMs / size), from the occupancy API once per device.
DecodeLinearPlan decode_linear_device_plan(int64_t n, int64_t k) {
  static std::mutex mu;
  static std::map<int, std::array<int, kDecodeLinearMaxSplits>> caps;
  int device = 0;
  OPD_CUDA_CHECK(cudaGetDevice(&device));
  const int sms = sm_count();
  std::array<int, kDecodeLinearMaxSplits> cap{};
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = caps.find(device);
    if (it == caps.end()) {
      const void* kernel = reinterpret_cast<const void*>(decode_linear_kernel<2, 1, 8, 4>);
      allow_smem(kernel);
      cap[0] = sms;
      for (int c = 2; c <= kDecodeLinearMaxSplits; ++c) {
        cudaLaunchConfig_t cfg{};
        cfg.gridDim = dim3(static_cast<unsigned>(sms / c * c));
        cfg.blockDim = dim3(kThreads);
        cfg.dynamicSmemBytes = 96 * 1024;  // one CTA per SM, as every plan's CTAs
        cudaLaunchAttribute attr{};
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim.x = static_cast<unsigned>(c);
        attr.val.clusterDim.y = 1;
        attr.val.clusterDim.z = 1;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        int count = 0;
        if (cudaOccupancyMaxActiveClusters(&count, kernel, &cfg) != cudaSuccess) {
          (void)cudaGetLastError();
          count = 0;  // no clusters of this size
        }
        cap[c - 1] = count;
      }
      it = caps.emplace(device, cap).first;
    }
    cap = it->second;
  }
  int arr[kDecodeLinearMaxSplits];
  for (int c = 0; c < kDecodeLinearMaxSplits; ++c) arr[c] = cap[c];
  return decode_linear_plan(n, k, sms, arr);
}

bool decode_linear_supports(const void* x, const void* w, const void* y, int64_t m, int64_t k,
                            int64_t n, DType dtype) {
  if (dtype != DType::BF16 || m < 1 || m > kDecodeLinearMaxRows) return false;
  if (!dev::aligned16(x) || !dev::aligned16(w) || !dev::aligned16(y)) return false;
  return decode_linear_device_plan(n, k).ok;
}

void decode_linear(const void* x, const void* w, const void* bias, int64_t m, int64_t k,
                   int64_t n, DType dtype, void* y, cudaStream_t stream, bool pdl) {
  OPD_CHECK(decode_linear_supports(x, w, y, m, k, n, dtype), Unsupported,
            "decode_linear: ", m, " x ", k, " x ", n, " ", dtype_name(dtype),
            " (needs bf16, 1..64 rows, k % 8 == 0, 16-byte aligned x / W / y, a plan for n, k)");
  const DecodeLinearPlan plan = decode_linear_device_plan(n, k);
  Params p{};
  p.x = static_cast<const bf16*>(x);
  p.w = static_cast<const bf16*>(w);
  p.bias = static_cast<const bf16*>(bias);
  p.y = static_cast<bf16*>(y);
  p.m = static_cast<int>(m);
  p.k = static_cast<int>(k);
  p.n = static_cast<int>(n);
  p.steps = static_cast<int>((k + kStepK - 1) / kStepK);
  p.splits = plan.splits;
  p.part_offset = static_cast<int>(plan.smem_bytes) -
                  (plan.splits > 1 ? plan.row_groups * plan.rows16 * 8 * kFragBytes : 0);
  switch (plan.rows16) {
    case 1: launch_rg<1>(p, plan, stream, pdl); break;
    case 2: launch_rg<2>(p, plan, stream, pdl); break;
    default: launch_rg<3>(p, plan, stream, pdl); break;
  }
}

}  // namespace opd::cuda
