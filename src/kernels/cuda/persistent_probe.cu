// The persistent-forward skeleton probe (kernels/cuda/persistent_probe.h): weight slices
// streamed by 1-D bulk copies (cp.async.bulk, completing on an mbarrier) into two shared-memory
// buffers, read once, with a grid barrier between phases. Measurement only: no op uses it.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/cuda_check.h"
#include "core/error.h"
#include "kernels/cuda/cuda_ops.h"  // sm_count
#include "kernels/cuda/persistent_probe.h"

namespace opd::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 32768;  // bytes per bulk copy
constexpr int64_t kSmemLimit = 227 * 1024 - 64;

struct Params {
  const unsigned char* w;
  int64_t phase_bytes[4];
  int64_t phase_off[4];
  int64_t layer_bytes;
  int phases, layers;
  int barrier, prefetch;
  int64_t buf_bytes;
  unsigned* counter;
  uint32_t* sink;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_wait_parity(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (done == 0);
}

// Phase i's slice of this CTA: [off, off + bytes) of the phase's weights.
__device__ __forceinline__ void slice_of(const Params& p, int i, const unsigned char*& src,
                                         int64_t& bytes) {
  const int layer = i / p.phases, ph = i % p.phases;
  const int64_t total = p.phase_bytes[ph];
  const int64_t per = ((total + gridDim.x - 1) / gridDim.x + 15) / 16 * 16;
  const int64_t off = static_cast<int64_t>(blockIdx.x) * per;
  bytes = off >= total ? 0 : (total - off < per ? total - off : per);
  src = p.w + static_cast<int64_t>(layer) * p.layer_bytes + p.phase_off[ph] + off;
}

// Thread 0: expect the slice's bytes on the buffer's mbarrier and request them.
__device__ __forceinline__ void issue(const Params& p, int i, unsigned char* buf, uint32_t bar) {
  const unsigned char* src;
  int64_t bytes;
  slice_of(p, i, src, bytes);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // earlier reads of buf first
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(static_cast<uint32_t>(bytes))
               : "memory");
  for (int64_t c = 0; c < bytes; c += kChunk) {
    const uint32_t n = static_cast<uint32_t>(bytes - c < kChunk ? bytes - c : kChunk);
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            smem_u32(buf + c)),
        "l"(src + c), "r"(n), "r"(bar)
        : "memory");
  }
}

__global__ void __launch_bounds__(kThreads, 1) persistent_probe_kernel(Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t mbar[2];
  const int tid = static_cast<int>(threadIdx.x);
  unsigned char* buf[2] = {smem, smem + p.buf_bytes};
  const uint32_t bar[2] = {smem_u32(&mbar[0]), smem_u32(&mbar[1])};
  if (tid == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar[0]) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar[1]) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int n = p.layers * p.phases;
  if (tid == 0 && p.prefetch) issue(p, 0, buf[0], bar[0]);
  uint32_t acc = 0;
  for (int i = 0; i < n; ++i) {
    const int b = i & 1;
    if (tid == 0) {
      if (!p.prefetch) issue(p, i, buf[b], bar[b]);
      else if (i + 1 < n) issue(p, i + 1, buf[b ^ 1], bar[b ^ 1]);
    }
    mbar_wait_parity(bar[b], static_cast<uint32_t>((i >> 1) & 1));
    const unsigned char* src;
    int64_t bytes;
    slice_of(p, i, src, bytes);
    const uint4* v = reinterpret_cast<const uint4*>(buf[b]);
    for (int64_t j = tid; j < bytes / 16; j += kThreads) {
      const uint4 x = v[j];
      acc += x.x ^ x.y ^ x.z ^ x.w;
    }
    __syncthreads();  // the buffer is read: the next issue may overwrite it
    if (p.barrier) {
      if (tid == 0) {
        __threadfence();
        atomicAdd(p.counter, 1u);
        const unsigned target = static_cast<unsigned>(i + 1) * gridDim.x;
        while (*reinterpret_cast<volatile unsigned*>(p.counter) < target) {
        }
        __threadfence();
      }
      __syncthreads();
    }
  }
  // One checksum per CTA (nothing above may be optimized away).
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ uint32_t warp_acc[kThreads / 32];
  if ((tid & 31) == 0) warp_acc[tid >> 5] = acc;
  __syncthreads();
  if (tid == 0) {
    uint32_t s = 0;
    for (int w = 0; w < kThreads / 32; ++w) s += warp_acc[w];
    p.sink[blockIdx.x] = s;
  }
}

}  // namespace

int64_t persistent_probe_slice_bytes(const PersistentProbeArgs& a, int sms) {
  int64_t most = 16;
  for (int ph = 0; ph < a.phases; ++ph)
    most = std::max<int64_t>(most, ((a.phase_bytes[ph] + sms - 1) / sms + 15) / 16 * 16);
  return most;
}

void persistent_probe(const PersistentProbeArgs& a, cudaStream_t stream) {
  OPD_CHECK(a.phases >= 1 && a.phases <= 4 && a.layers >= 1 && a.weights && a.counter && a.sink,
            InvalidArgument, "persistent_probe: 1-4 phases, >= 1 layer, weights, counter, sink");
  const int sms = sm_count();
  Params p{};
  p.w = static_cast<const unsigned char*>(a.weights);
  int64_t off = 0;
  for (int ph = 0; ph < 4; ++ph) {
    OPD_CHECK(a.phase_bytes[ph] % 16 == 0 && a.phase_bytes[ph] >= 0, InvalidArgument,
              "persistent_probe: phase bytes must be multiples of 16");
    p.phase_bytes[ph] = ph < a.phases ? a.phase_bytes[ph] : 0;
    p.phase_off[ph] = off;
    off += p.phase_bytes[ph];
  }
  p.layer_bytes = off;
  p.phases = a.phases;
  p.layers = a.layers;
  p.barrier = a.barrier ? 1 : 0;
  p.prefetch = a.prefetch ? 1 : 0;
  p.buf_bytes = (persistent_probe_slice_bytes(a, sms) + 127) / 128 * 128;
  p.counter = a.counter;
  p.sink = a.sink;
  const int64_t smem = 2 * p.buf_bytes;
  OPD_CHECK(smem <= kSmemLimit, Unsupported, "persistent_probe: two slices of ", p.buf_bytes,
            " bytes exceed shared memory");
  static bool allowed = false;
  if (!allowed) {
    OPD_CUDA_CHECK(cudaFuncSetAttribute(persistent_probe_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kSmemLimit)));
    allowed = true;
  }
  OPD_CUDA_CHECK(cudaMemsetAsync(a.counter, 0, sizeof(unsigned), stream));
  void* args[] = {&p};
  OPD_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(persistent_probe_kernel),
                                             dim3(static_cast<unsigned>(sms)), dim3(kThreads), args,
                                             static_cast<size_t>(smem), stream));
}

}  // namespace opd::cuda
