// The device side of a rollout step for CUDA models (used by rollout/engine.cpp): one forward
// over the paged cache (PagedForward::step_device) and the step's draws on the GPU
// (cuda::sample_rows), with one host-to-device copy of every index and sampling parameter before
// and one device-to-host copy of the ids, the two log-probabilities and the error flags after:
// one host synchronization per step, never a [B, V] copy.
//
// Decode steps (one new token per sequence, every sequence draws once) are padded to a
// batch-size bucket (decode_bucket) and, with use_graphs, captured in two CUDA graphs per bucket
// (forward; sampling) after one eager warm-up step of that bucket, then replayed: one launch
// instead of ~15 kernels per layer. Padding rows are real, harmless work: token 0 at position 0
// writing and reading slot 0 of a scratch block that no sequence holds, drawn greedily and
// ignored. Every pointer a graph holds is fixed for the runner's life (the io buffer is laid out
// per bucket; the split-KV attention workspace may move when a larger prefill step grows it, and
// the graphs of the old address are then re-captured). The decode grid is sized for the
// longest sequence of the rollout (max_seq_len) in both the graph and the eager path, so the
// two give bit-identical results.
//
// A runner serves successive rollouts (begin_rollout): its buffers and graphs stay, and a graph
// is re-captured only when something it holds changed since its capture: the KV cache's layer
// addresses (the cache is allocated per rollout and released before the training phase),
// num_blocks, table width or max_seq_len. A re-capture updates the existing executable graph in
// place (cudaGraphExecUpdate: no new instantiation) when the topology is unchanged.
#pragma once

#ifdef OPD_WITH_CUDA

#include <cstdint>
#include <memory>
#include <vector>

#include "model/kv_cache.h"
#include "model/paged_forward.h"
#include "rollout/sampler.h"
#include "rollout/sampler_cuda.h"

namespace opd {

struct CudaRunnerLimits {
  int64_t max_tokens = 1;   // new tokens in one step (the engine's max_step_tokens)
  int64_t max_rows = 1;     // sequences in one step
  int64_t max_draws = 1;    // draws in one step (sequences plus forks)
  int64_t table_width = 1;  // block-table columns: ceil(longest sequence / block_size)
  int64_t max_seq_len = 1;  // longest sequence (prompt + max_new_tokens - 1): the decode grid
  int32_t scratch_block = -1;  // a cache block no sequence holds (the padding rows' slot)
  bool use_graphs = true;
  // Sampling: a row split over a thread-block cluster (cuda::sample_rows' default) or, false,
  // one CTA per row (the kernel before issue 6; same distribution, for A/B runs).
  bool cluster_sampler = true;
};

// GPU time by kind of step (CUDA events around the device work of each step).
struct CudaStepTimes {
  double prefill_ms = 0;         // steps with any prefill chunk: forward + sampling
  double decode_forward_ms = 0;  // decode steps: upload + forward
  double sample_ms = 0;          // decode steps: sampling + read-back
  int64_t decode_steps = 0, graph_steps = 0, graph_captures = 0;
  int64_t graph_updates = 0;     // captures that updated an existing executable graph in place
  double capture_ms = 0;         // host time of captures + instantiation/update
};

// The smallest bucket >= batch: 1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192,
// 224, 256, then multiples of 64.
int64_t decode_bucket(int64_t batch);

class CudaStepRunner {
 public:
  struct Draw {
    int64_t row = 0;  // logits row (the sequence's index in the step)
    cuda::SampleRowParams params;
  };
  // forward must outlive the runner, the cache the rollout (begin_rollout's cache: until the
  // next begin_rollout or end_rollout); the cache must hold limits.scratch_block.
  CudaStepRunner(const PagedForward& forward, KvCache& cache, const CudaRunnerLimits& limits,
                 cudaStream_t stream);
  // The next rollout of the same forward: a new cache and limits. Buffers grow if needed;
  // graphs whose captured addresses or bounds changed are marked for re-capture. Resets times().
  void begin_rollout(KvCache& cache, const CudaRunnerLimits& limits);
  // The rollout's cache is about to be destroyed: no step may run until begin_rollout.
  void end_rollout();
  ~CudaStepRunner();
  CudaStepRunner(const CudaStepRunner&) = delete;
  CudaStepRunner& operator=(const CudaStepRunner&) = delete;

  // Runs one step and its draws; returns one token per draw. Index errors are the host
  // checks' (plan_paged_step); non-finite logits give the CPU sampler's InvalidData message.
  std::vector<SampledToken> run(const PagedStep& step, const std::vector<Draw>& draws);
  const CudaStepTimes& times() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace opd

#endif  // OPD_WITH_CUDA
