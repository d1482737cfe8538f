// A measurement, not an op: the skeleton of a persistent decode forward (docs/rollout.md "Next:
// a persistent decode forward") without its arithmetic. One CTA per SM stays resident for a
// whole decode step's worth of phases (layers x phases); in each phase every CTA streams its
// contiguous slice of that phase's weight bytes from HBM into shared memory (1-D bulk copies
// completing on an mbarrier), reads the slice once (a checksum, so nothing is optimized away),
// and, with `barrier`, meets every other CTA at a grid-wide barrier before the next phase.
// With `prefetch` the slice of phase i + 1 is requested before phase i is read and its barrier
// waited on (the weights depend on nothing a phase computes), which is the persistent design's
// claim: the weight stream never stops at a barrier. `opd bench kernels --filter persistent`
// times the variants against the bytes' time at the copy rate.
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace opd::cuda {

struct PersistentProbeArgs {
  const void* weights = nullptr;   // layers x sum(phase_bytes) bytes, 16-byte aligned
  int64_t phase_bytes[4] = {0, 0, 0, 0};  // per layer, multiples of 16; 0 = an empty phase
  int phases = 4;                  // phases per layer (<= 4)
  int layers = 1;
  bool barrier = true;             // a grid barrier after every phase
  bool prefetch = true;            // phase i + 1's slice requested before phase i is read
  unsigned* counter = nullptr;     // one device word for the barrier (zeroed by the launch)
  uint32_t* sink = nullptr;        // [SMs] checksums
};

// Largest slice one CTA gets (shared memory holds two): phase_bytes / SMs rounded up to 16.
int64_t persistent_probe_slice_bytes(const PersistentProbeArgs& a, int sms);
// Launches the probe (cooperative: all CTAs resident, one per SM). Throws Unsupported when a
// slice does not fit twice in shared memory.
void persistent_probe(const PersistentProbeArgs& a, cudaStream_t stream);

}  // namespace opd::cuda
