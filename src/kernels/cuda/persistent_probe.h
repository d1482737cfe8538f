// A measurement, not an op: the skeleton of a persistent decode forward (docs/rollout.md "Next:
// a persistent decode forward") without its arithmetic. One CTA per SM stays resident for a
// whole decode step's worth of phases (layers x phases); in each phase every CTA streams its
// contiguous slice of that phase's weight bytes from HBM into a ring of six 32 KiB shared-memory
// slots (1-D bulk copies completing on one mbarrier per slot), reads it once (a checksum, so
// nothing is optimized away), and, with `barrier`, meets every other CTA at a grid-wide barrier
// (one release-add and acquire polling on a global counter) before the next phase. With
// `prefetch` the ring is kept full across phases: pieces of the next phases are requested before
// the barrier (the weights depend on nothing a phase computes), which is the persistent
// design's claim: the weight stream never stops at a barrier. Without it only the current
// phase's pieces are requested. `opd bench kernels --filter persistent`
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
  bool prefetch = true;            // the ring kept full across phases
  int barrier_every = 1;           // phases between two barriers (and one after the last)
  int barrier_thread = 32;         // the thread that arrives and polls (0 issues the copies)
  bool producer_warp = false;      // warp 0 only requests pieces (empty/full mbarriers per
                                   // slot) and never waits at a grid barrier; prefetch implied
  int slots = 6;                   // with producer_warp: ring slots of 32 KiB in use (1-6)
  bool relaxed_poll = false;       // with producer_warp: relaxed polls + one acquire fence
  bool flag_barrier = false;       // with producer_warp: the last arriver releases a flag word
  void* timeline = nullptr;        // with producer_warp: [barriers][SMs][2] u64 globaltimer
                                   // stamps (ns): a CTA's arrival at each barrier, its release
  unsigned* counter = nullptr;     // two device words for the barrier (zeroed by the launch)
  uint32_t* sink = nullptr;        // [SMs] checksums
};

// How many thread-block clusters of `size` CTAs (1-16; 16 is a non-portable size) of one CTA per
// SM the device holds at once (0 when it refuses the size): what a clustered persistent design
// could keep resident.
int persistent_probe_max_clusters(int size);
// Launches the probe (cooperative: all CTAs resident, one per SM).
void persistent_probe(const PersistentProbeArgs& a, cudaStream_t stream);

}  // namespace opd::cuda
