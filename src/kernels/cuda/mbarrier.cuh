// mbarrier helpers shared by the kernels that pipeline copies through shared memory (the wgmma
// attention kernels, kernels/cuda/attention_wgmma_ptx.h; the persistent probe). PTX ISA
// "Parallel Synchronization and Communication Instructions: mbarrier": a 64-bit shared-memory
// object counting arrivals (and, with expect_tx, bytes of asynchronous copies) per phase.
// Initialised by one thread, before a __syncthreads that publishes it.
#pragma once

#include <cstdint>

namespace opd::cuda::mbar {

__device__ __forceinline__ void init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// One arrival (release semantics at CTA scope: this thread's earlier memory operations happen
// before the phase completes).
__device__ __forceinline__ void arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar)
               : "memory");
}
// Waits (acquire) until the phase of parity `parity` has completed. Parity 1 on a fresh barrier
// (phase 0 current) refers to the preceding phase, which counts as complete: a producer's first
// pass over its free slots does not block.
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) {
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

}  // namespace opd::cuda::mbar
