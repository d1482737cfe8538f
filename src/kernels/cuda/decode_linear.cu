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
//   - a CTA owns 16 * R16 consecutive W rows (R16 = 1, 2 or 3) and a contiguous range of 32-wide
//     k steps; `splits` CTAs of one row block form a thread-block cluster that splits k; the plan
//     takes the most CTAs that run in one wave (one per SM; clusters only as many as the device
//     holds at once: GPC boundaries leave fewer than SMs / size);
//   - the CTA's 8 warps split its k steps again; a warp computes all 16 * R16 rows x 8 * MT x
//     rows over its k steps (MT = 1, 2, 4, 8 groups of 8 x rows, chosen by m);
//   - fragment loads without shared memory for W: lane (g, t) loads 16 bytes of row g (and of
//     row g + 8) at k = 32 s + 8 t ... + 7 and uses them as the A fragments of two m16n8k16
//     products with a permuted k: logical k (2t, 2t+1, 2t+8, 2t+9) <- physical 8t + (0, 1, 2, 3)
//     for the first, 8t + (4, 5, 6, 7) for the second. x (the B operand) uses the same
//     permutation, so lane (g, t) needs exactly x[8 j + g][32 s + 8 t ...] (16 bytes) for both.
//     A dot product does not depend on the order of its k's, so this is x W^T; a warp load of W
//     covers 8 rows x 64 contiguous bytes (16 full 32-byte sectors);
//   - x: each lane loads its own B fragments straight into registers after the wait (16 bytes
//     per x group and step, rows >= m and k >= K as zeros), one step ahead of the products;
//     no shared memory, no exchange between lanes (an earlier version staged them in shared
//     memory with cp.async: its per-copy address registers serialized the issue, ncu s10f);
//   - reductions in fixed orders: the 8 warps' partials through shared memory (warp 0 + 1 + ...),
//     then the cluster's CTAs through distributed shared memory (rank 0 + 1 + ...). No atomics,
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
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"  // sm_count, max_active_clusters
#include "kernels/cuda/decode_linear.h"
#include "kernels/cuda/pdl.cuh"

namespace opd::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kStepK = 32;         // k per step (two m16n8k16 products)
// k steps per warp at most: the range measured on the H200 (W1's plans own 2-6; the W ring holds
// up to 6); a longer k takes more splits or stays on cuBLASLt rather than run unmeasured.
constexpr int kMaxWarpSteps = 6;
constexpr int kMaxSplits = 8;      // portable cluster size
constexpr int kFragBytes = 32 * 16;  // one accumulator fragment of a warp (32 lanes x float4)

struct Params {
  const bf16* x;
  const bf16* w;
  const bf16* bias;
  bf16* y;
  int m, k, n;
  int steps;       // ceil(k / 32)
  int splits;      // cluster size (1: no cluster)
  int part_offset; // the CTA's summed partial (splits > 1), after the 8 warps' partials
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

template <int R16, int MT, int kDepth>
__global__ void __launch_bounds__(kThreads, 1) decode_linear_kernel(Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
  const int split = static_cast<int>(blockIdx.x) % p.splits;  // == the rank in the cluster
  const int rb = static_cast<int>(blockIdx.x) / p.splits;
  const int row0 = rb * 16 * R16;
  // k steps [c0, c1) of the CTA, [s0, s0 + ns) of the warp.
  const int c0 = split * p.steps / p.splits, c1 = (split + 1) * p.steps / p.splits;
  const int s0 = c0 + warp * (c1 - c0) / kWarps;
  const int ns = c0 + (warp + 1) * (c1 - c0) / kWarps - s0;

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
    if (d < ns) load_w(s0 + d, ring[d]);

  dev::pdl_wait();  // x is the predecessor's output

  // ---- x straight into registers: lane (g, t) loads exactly the 16 bytes it uses as B
  // fragments, x[8 j + g][32 s + 8 t ...] for x group j (rows >= m and k >= K read as zeros);
  // step i + 1's loads are issued before step i is computed (two buffers, alternating with the
  // parity of the step: kDepth is even).
  static_assert(kDepth % 2 == 0, "the x double buffer alternates with the step's parity");
  const bf16* xrow[MT];
  bool rok[MT];
#pragma unroll
  for (int j = 0; j < MT; ++j) {
    rok[j] = 8 * j + g < p.m;
    xrow[j] = p.x + static_cast<int64_t>(rok[j] ? 8 * j + g : 0) * p.k + 8 * t;
  }
  auto load_x = [&](int s, uint4 (&dst)[MT]) {
    const int kk = s * kStepK;
    const bool kin = kk + 8 * t < p.k;
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      dst[j] = make_uint4(0, 0, 0, 0);
      if (rok[j] && kin) dst[j] = *reinterpret_cast<const uint4*>(xrow[j] + kk);
    }
  };
  uint4 xbuf[2][MT];
  if (ns > 0) load_x(s0, xbuf[0]);

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
        if (i + 1 < ns) load_x(s0 + i + 1, xbuf[(d + 1) & 1]);
        const uint4(&xv)[MT] = xbuf[d & 1];
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
        if (i + kDepth < ns) load_w(s0 + i + kDepth, ring[d]);
      }
    }
  }
  dev::pdl_launch_dependents();  // the successor's prologue may start

  // ---- the 8 warps' partials, summed in warp order.
  // Warp w's fragment q of lane l at smem[((w * R16 * MT + q) * 32 + l) * 16].
  {
    float4* red = reinterpret_cast<float4*>(smem) + warp * (R16 * MT * 32);
#pragma unroll
    for (int rt = 0; rt < R16; ++rt)
#pragma unroll
      for (int j = 0; j < MT; ++j)
        red[(rt * MT + j) * 32 + lane] =
            make_float4(acc[rt][j][0], acc[rt][j][1], acc[rt][j][2], acc[rt][j][3]);
  }
  __syncthreads();
  constexpr int kFrags = R16 * MT * 32;
  float4* part = reinterpret_cast<float4*>(smem + p.part_offset);
  for (int f = static_cast<int>(threadIdx.x); f < kFrags; f += kThreads) {
    const float4* red = reinterpret_cast<const float4*>(smem);
    float4 s = red[f];
    for (int w = 1; w < kWarps; ++w) s = add4(s, red[w * kFrags + f]);
    if (p.splits == 1) {
      store_fragment<MT>(p, row0, f, s);
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
    store_fragment<MT>(p, row0, f, s);
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
}

template <int R16, int MT>
void launch(const Params& p, const DecodeLinearPlan& plan, cudaStream_t stream, bool pdl) {
  auto* kernel = decode_linear_kernel<R16, MT, depth_for<R16>()>;
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

template <int R16>
void launch_r16(const Params& p, const DecodeLinearPlan& plan, cudaStream_t stream, bool pdl) {
  if (p.m <= 8) {
    launch<R16, 1>(p, plan, stream, pdl);
  } else if (p.m <= 16) {
    launch<R16, 2>(p, plan, stream, pdl);
  } else if (p.m <= 32) {
    launch<R16, 4>(p, plan, stream, pdl);
  } else {
    launch<R16, 8>(p, plan, stream, pdl);
  }
}

// Shared memory: the 8 warps' f32 partials (R16 x 8 fragments of 32 lanes x 16 bytes each,
// sized for m = 64), then the CTA's summed partial for the cluster (splits > 1).
size_t smem_for(int rows16, int splits) {
  const size_t frags = static_cast<size_t>(rows16) * 8 * kFragBytes;
  return kWarps * frags + (splits > 1 ? frags : 0);
}

}  // namespace

DecodeLinearPlan decode_linear_plan(int64_t n, int64_t k, int sms,
                                    const int (&max_clusters)[4]) {
  DecodeLinearPlan best;
  if (n < 1 || k < 8 || k % 8 != 0 || sms < 1 || n >= (int64_t{1} << 30) ||
      k >= (int64_t{1} << 30) || n * k >= (int64_t{1} << 40)) {
    return best;
  }
  const int64_t steps = (k + kStepK - 1) / kStepK;
  int64_t best_ctas = 0;
  for (int r16 : {1, 2, 3}) {
    const int64_t rb = (n + 16 * r16 - 1) / (16 * r16);
    for (int si = 0; si < 4; ++si) {
      const int s = 1 << si;
      if (s > steps) break;
      const int64_t ctas = rb * s;
      const int64_t ws = ((steps + s - 1) / s + kWarps - 1) / kWarps;
      // One wave: every CTA (one per SM) and, for clusters, every cluster resident at once.
      if (ctas > sms || ws > kMaxWarpSteps || (s > 1 && rb > max_clusters[si])) continue;
      // Most CTAs, then fewer splits, then fewer rows per CTA (the loop order).
      if (ctas <= best_ctas) continue;
      best_ctas = ctas;
      best.ok = true;
      best.rows16 = r16;
      best.splits = s;
      best.row_blocks = rb;
      best.warp_steps = static_cast<int>(ws);
    }
  }
  if (!best.ok) return best;
  best.smem_bytes = smem_for(best.rows16, best.splits);
  return best;
}

// The plan for this device: its SMs and how many clusters of 2, 4, 8 CTAs (one per SM: the
// kernel's registers and shared memory) can be resident at once (GPC boundaries: fewer than
// SMs / size), from the occupancy API once per device.
DecodeLinearPlan decode_linear_device_plan(int64_t n, int64_t k) {
  static std::mutex mu;
  static std::map<int, std::array<int, 4>> caps;
  int device = 0;
  OPD_CUDA_CHECK(cudaGetDevice(&device));
  const int sms = sm_count();
  std::array<int, 4> cap{};
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = caps.find(device);
    if (it == caps.end()) {
      const void* kernel = reinterpret_cast<const void*>(decode_linear_kernel<2, 8, 4>);
      allow_smem(kernel);
      cap[0] = sms;
      for (int si = 1; si < 4; ++si)  // 96 KiB: one CTA per SM, as every plan's CTAs
        cap[si] = max_active_clusters(kernel, kThreads, 96 * 1024, 1 << si);
      it = caps.emplace(device, cap).first;
    }
    cap = it->second;
  }
  const int arr[4] = {cap[0], cap[1], cap[2], cap[3]};
  return decode_linear_plan(n, k, sms, arr);
}

namespace {
// The device plan for these operands, or a plan with ok == false when they are not taken (the
// checks of decode_linear_supports): computed once per call.
DecodeLinearPlan plan_for(const void* x, const void* w, const void* y, int64_t m, int64_t k,
                          int64_t n, DType dtype) {
  if (dtype != DType::BF16 || m < 1 || m > kDecodeLinearMaxRows) return {};
  if (!dev::aligned16(x) || !dev::aligned16(w) || !dev::aligned16(y)) return {};
  return decode_linear_device_plan(n, k);
}
}  // namespace

bool decode_linear_supports(const void* x, const void* w, const void* y, int64_t m, int64_t k,
                            int64_t n, DType dtype) {
  return plan_for(x, w, y, m, k, n, dtype).ok;
}

void decode_linear(const void* x, const void* w, const void* bias, int64_t m, int64_t k,
                   int64_t n, DType dtype, void* y, cudaStream_t stream, bool pdl) {
  OPD_CHECK(try_decode_linear(x, w, bias, m, k, n, dtype, y, stream, pdl), Unsupported,
            "decode_linear: ", m, " x ", k, " x ", n, " ", dtype_name(dtype),
            " (needs bf16, 1..64 rows, k % 8 == 0, 16-byte aligned x / W / y, a plan for n, k)");
}

bool try_decode_linear(const void* x, const void* w, const void* bias, int64_t m, int64_t k,
                       int64_t n, DType dtype, void* y, cudaStream_t stream, bool pdl) {
  const DecodeLinearPlan plan = plan_for(x, w, y, m, k, n, dtype);
  if (!plan.ok) return false;
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
  p.part_offset = static_cast<int>(smem_for(plan.rows16, 1));  // after the warps' partials
  switch (plan.rows16) {
    case 1: launch_r16<1>(p, plan, stream, pdl); break;
    case 2: launch_r16<2>(p, plan, stream, pdl); break;
    default: launch_r16<3>(p, plan, stream, pdl); break;
  }
  return true;
}

}  // namespace opd::cuda
