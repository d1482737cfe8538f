// The persistent-forward skeleton probe (kernels/cuda/persistent_probe.h): weight slices
// streamed by 1-D bulk copies (cp.async.bulk, completing on an mbarrier per slot) into a ring of
// shared-memory slots, read once, with a grid barrier between phases; two kernels (thread 0
// issues the copies between its reads / a producer warp issues them). Measurement only: no op
// uses it.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/cuda_check.h"
#include "core/error.h"
#include "kernels/cuda/cuda_ops.h"  // sm_count
#include "kernels/cuda/mbarrier.cuh"
#include "kernels/cuda/persistent_probe.h"

namespace opd::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kSmemLimit = 220 * 1024;  // dynamic; the static mbarriers and sums come on top

struct Params {
  const unsigned char* w;
  int64_t phase_bytes[4];
  int64_t phase_off[4];
  int64_t layer_bytes;
  int phases, layers;
  int barrier, prefetch;
  int barrier_every, barrier_thread;
  int slots;  // ring slots in use (producer-warp kernel), <= kSlots
  int relaxed_poll, flag_barrier;
  unsigned long long* timeline;  // [barriers][grid][2] or null (producer-warp kernel)
  unsigned* counter;
  uint32_t* sink;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
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

// One thread per CTA: arrive at the grid barrier (release) and wait until every CTA has (the
// counter reaches barrier x grid). relaxed_poll: relaxed polls and one acquire fence after them.
// With a timeline, the arrival and release globaltimer stamps of this CTA at this barrier.
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned barrier, bool relaxed_poll,
                                             unsigned long long* stamps) {
  unsigned long long t0 = 0, t1 = 0;
  if (stamps) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(counter) : "memory");
  const unsigned target = barrier * gridDim.x;
  unsigned v = 0;
  if (relaxed_poll) {
    do {
      asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
    } while (v < target);
    asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
  } else {
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
    } while (v < target);
  }
  if (stamps) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    stamps[0] = t0;
    stamps[1] = t1;
  }
}

// The same barrier with the release on another word: the last CTA to arrive (its acq_rel add
// returns barrier x grid - 1) stores the barrier's number to counter[1], which the others poll:
// the polled word changes once per barrier instead of with every arrival (both words share one
// 128-byte line here; measured slower than polling the counter, docs/rollout.md).
__device__ __forceinline__ void flag_barrier(unsigned* counter, unsigned barrier,
                                             unsigned long long* stamps) {
  unsigned long long t0 = 0, t1 = 0;
  if (stamps) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  unsigned old = 0;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;\n" : "=r"(old) : "l"(counter) : "memory");
  if (old == barrier * gridDim.x - 1) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(counter + 1), "r"(barrier) : "memory");
  } else {
    unsigned v = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(counter + 1) : "memory");
    } while (v < barrier);
  }
  if (stamps) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    stamps[0] = t0;
    stamps[1] = t1;
  }
}

constexpr int kSlots = 6;            // the ring: kSlots pieces of at most kSlotBytes
constexpr int64_t kSlotBytes = 32768;

__device__ __forceinline__ int pieces_of(const Params& p, int i) {
  const unsigned char* src;
  int64_t bytes;
  slice_of(p, i, src, bytes);
  return static_cast<int>((bytes + kSlotBytes - 1) / kSlotBytes);
}

// Thread 0: expect piece c of phase i on the slot's mbarrier and request it (one bulk copy).
__device__ __forceinline__ void issue_piece(const Params& p, int i, int c, unsigned char* slot,
                                            uint32_t bar) {
  const unsigned char* src;
  int64_t bytes;
  slice_of(p, i, src, bytes);
  const int64_t off = static_cast<int64_t>(c) * kSlotBytes;
  const uint32_t n = static_cast<uint32_t>(bytes - off < kSlotBytes ? bytes - off : kSlotBytes);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // earlier reads of the slot first
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(n)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_u32(slot)),
      "l"(src + off), "r"(n), "r"(bar)
      : "memory");
}

// Piece c of phase i's slice (<= kSlotBytes of it) in `slot`, read once by the threads
// first, first + stride, ...: its 16-byte words folded into acc (the probe's checksum).
__device__ __forceinline__ void read_piece(const unsigned char* slot, int64_t slice_bytes, int c,
                                           int first, int stride, uint32_t& acc) {
  const int64_t off = static_cast<int64_t>(c) * kSlotBytes;
  const int64_t nb = slice_bytes - off < kSlotBytes ? slice_bytes - off : kSlotBytes;
  const uint4* v = reinterpret_cast<const uint4*>(slot);
  for (int64_t j = first; j < nb / 16; j += stride) {
    const uint4 x = v[j];
    acc += x.x ^ x.y ^ x.z ^ x.w;
  }
}

// One checksum per CTA (so nothing above is optimized away): every thread's acc summed. All
// threads of the CTA call it.
__device__ __forceinline__ void store_checksum(uint32_t acc, uint32_t* sink) {
  __shared__ uint32_t warp_acc[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) warp_acc[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t s = 0;
    for (int w = 0; w < kThreads / 32; ++w) s += warp_acc[w];
    sink[blockIdx.x] = s;
  }
}

// Every phase's slice is cut into pieces of <= kSlotBytes, numbered across phases; piece q lives
// in slot q % kSlots. With prefetch, thread 0 keeps up to kSlots pieces in flight whatever
// phase they belong to, so the weight stream runs on through the grid barriers; without, only
// the current phase's pieces are requested.
__global__ void __launch_bounds__(kThreads, 1) persistent_probe_kernel(Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t mbar[kSlots];
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) {
    for (int q = 0; q < kSlots; ++q) mbar::init(smem_u32(&mbar[q]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int n = p.layers * p.phases;
  int issued = 0, ip = 0, ipc = 0;  // thread 0's cursor: pieces issued, next (phase, piece)
  int consumed = 0;
  unsigned barriers = 0;  // completed so far (the counter's target is barriers x grid)
  uint32_t acc = 0;
  for (int i = 0; i < n; ++i) {
    const int pieces = pieces_of(p, i);
    const unsigned char* src;
    int64_t bytes;
    slice_of(p, i, src, bytes);
    for (int c = 0; c < pieces; ++c) {
      if (tid == 0) {
        const int last_phase = p.prefetch ? n - 1 : i;
        while (issued < consumed + kSlots) {
          while (ip <= last_phase && ipc >= pieces_of(p, ip)) {
            ++ip;
            ipc = 0;
          }
          if (ip > last_phase) break;
          const int q = issued % kSlots;
          issue_piece(p, ip, ipc, smem + static_cast<int64_t>(q) * kSlotBytes, smem_u32(&mbar[q]));
          ++issued;
          ++ipc;
        }
      }
      const int q = consumed % kSlots;
      mbar::wait(smem_u32(&mbar[q]), static_cast<uint32_t>((consumed / kSlots) & 1));
      read_piece(smem + static_cast<int64_t>(q) * kSlotBytes, bytes, c, tid, kThreads, acc);
      __syncthreads();  // the slot is read: it may be refilled
      ++consumed;
    }
    if (p.barrier && ((i + 1) % p.barrier_every == 0 || i + 1 == n)) {
      // Not thread 0: a release by the thread that issued the bulk copies may wait for them.
      ++barriers;
      if (tid == p.barrier_thread) grid_barrier(p.counter, barriers, false, nullptr);
      __syncthreads();
    }
  }
  store_checksum(acc, p.sink);
}


// The same stream with a producer warp: lane 0 of warp 0 requests every piece in order as soon as
// its slot is free (an "empty" mbarrier per slot, one arrival per consumer warp), never waiting
// at a grid barrier; warps 1-7 read the pieces and meet the other CTAs at the barrier (their own
// named barrier, id 1). The question: does the stream then run through the barriers?
__global__ void __launch_bounds__(kThreads, 1) persistent_probe_producer_kernel(Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t full[kSlots];
  __shared__ __align__(8) uint64_t empty[kSlots];
  constexpr int kConsumerWarps = kThreads / 32 - 1;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int q = 0; q < p.slots; ++q) {
      mbar::init(smem_u32(&full[q]), 1);
      mbar::init(smem_u32(&empty[q]), kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int n = p.layers * p.phases;
  uint32_t acc = 0;
  if (warp == 0) {
    if (lane == 0) {
      int g = 0;
      for (int i = 0; i < n; ++i) {
        const int pieces = pieces_of(p, i);
        for (int c = 0; c < pieces; ++c, ++g) {
          const int q = g % p.slots;
          // Free once the consumers read its previous piece (the first pass: the phase before
          // the barrier's first, which counts as complete).
          mbar::wait(smem_u32(&empty[q]), static_cast<uint32_t>(((g / p.slots) & 1) ^ 1));
          issue_piece(p, i, c, smem + static_cast<int64_t>(q) * kSlotBytes, smem_u32(&full[q]));
        }
      }
    }
  } else {
    const int ctid = tid - 32;
    int g = 0;
    unsigned barriers = 0;
    for (int i = 0; i < n; ++i) {
      const int pieces = pieces_of(p, i);
      const unsigned char* src;
      int64_t bytes;
      slice_of(p, i, src, bytes);
      for (int c = 0; c < pieces; ++c, ++g) {
        const int q = g % p.slots;
        mbar::wait(smem_u32(&full[q]), static_cast<uint32_t>((g / p.slots) & 1));
        read_piece(smem + static_cast<int64_t>(q) * kSlotBytes, bytes, c, ctid, kThreads - 32, acc);
        __syncwarp();
        if (lane == 0) mbar::arrive(smem_u32(&empty[q]));
      }
      if (p.barrier && ((i + 1) % p.barrier_every == 0 || i + 1 == n)) {
        asm volatile("bar.sync 1, %0;\n" ::"r"(kThreads - 32) : "memory");
        ++barriers;
        if (ctid == 0) {
          unsigned long long* stamps =
              p.timeline ? p.timeline + (static_cast<int64_t>(barriers - 1) * gridDim.x + blockIdx.x) * 2
                         : nullptr;
          if (p.flag_barrier) flag_barrier(p.counter, barriers, stamps);
          else grid_barrier(p.counter, barriers, p.relaxed_poll != 0, stamps);
        }
        asm volatile("bar.sync 1, %0;\n" ::"r"(kThreads - 32) : "memory");
      }
    }
  }
  store_checksum(acc, p.sink);
}

}  // namespace

void persistent_probe(const PersistentProbeArgs& a, cudaStream_t stream) {
  OPD_CHECK(a.phases >= 1 && a.phases <= 4 && a.layers >= 1 && a.weights && a.counter && a.sink &&
                a.barrier_every >= 1 &&
                a.barrier_thread >= 0 && a.barrier_thread < kThreads && a.slots >= 1 &&
                a.slots <= kSlots,
            InvalidArgument, "persistent_probe: 1-4 phases, >= 1 layer, weights, counter, sink, "
            "barrier_every >= 1, a barrier thread, 1-6 slots");
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
  p.barrier_every = a.barrier_every;
  p.barrier_thread = a.barrier_thread;
  p.slots = a.slots;
  p.relaxed_poll = a.relaxed_poll ? 1 : 0;
  p.flag_barrier = a.flag_barrier ? 1 : 0;
  p.timeline = reinterpret_cast<unsigned long long*>(a.timeline);
  p.counter = a.counter;
  p.sink = a.sink;
  const int64_t smem = kSlots * kSlotBytes;
  const void* kernel = a.producer_warp ? reinterpret_cast<const void*>(persistent_probe_producer_kernel)
                                        : reinterpret_cast<const void*>(persistent_probe_kernel);
  OPD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(kSmemLimit)));
  OPD_CUDA_CHECK(cudaMemsetAsync(a.counter, 0, 2 * sizeof(unsigned), stream));
  void* args[] = {&p};
  OPD_CUDA_CHECK(cudaLaunchCooperativeKernel(kernel,
                                             dim3(static_cast<unsigned>(sms)), dim3(kThreads), args,
                                             static_cast<size_t>(smem), stream));
}

int persistent_probe_max_clusters(int size) {
  const void* kernel = reinterpret_cast<const void*>(persistent_probe_kernel);
  OPD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(kSmemLimit)));
  return max_active_clusters(kernel, kThreads, static_cast<size_t>(kSlots * kSlotBytes), size);
}

}  // namespace opd::cuda
