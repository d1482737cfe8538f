// Rollout engine: batched generation for many prompts from the live model weights, with a
// paged KV cache (model/kv_cache.h), continuous batching, chunked prefill, n samples per prompt
// sharing the prompt's KV blocks, and preemption by recompute under a KV memory budget.
//
// Scheduling, once per step (one PagedForward::step over all scheduled tokens):
//   1. running sequences, oldest first, each get their uncomputed tokens (1 when decoding; a
//      chunk of a prompt or of a recompute), within max_step_tokens. A sequence that needs a
//      block when none is free preempts the youngest running sequence (its blocks are
//      released; it goes back to the front of the queue and later recomputes prompt +
//      generated tokens), or itself when it is the youngest. The oldest always advances.
//   2. waiting requests (and preempted sequences) join while step tokens, sequence slots
//      (max_running) and free blocks for their first chunk remain.
//   3. a sequence whose tokens are all computed samples its next token from its logits row;
//      a request's first sample, when its prompt is done, forks the n - 1 others (they retain
//      the prompt blocks; a partially filled last block is copied on first write).
//   4. finished sequences (EOS, stop string, max_new_tokens) leave and free their blocks.
// A draw depends only on (seed, prompt, sample index, step) and its logits (rollout/sampler.h),
// so outputs do not depend on batch composition, n, max_step_tokens or preemption.
// The cache is allocated by generate() and released before it returns (the training phase
// between rollouts gets its memory back).
// CUDA models (weights on the device, bf16 or f32): the KV cache is in the model's dtype on the
// device, the forward runs PagedForward's CUDA path and the draws run on the GPU with the same
// Philox streams (rollout/engine_cuda.h): only ids and log-probabilities come back, one host
// synchronization per step; decode steps are replayed from CUDA graphs (cuda_graphs). The
// rollout runs on its own stream, after a device synchronization (the weights may have just
// been updated on another stream). With keep_device_state, the packed weights, step buffers
// and graphs stay between generate() calls while the weights keep their addresses (a trainer
// updating them in place): a later rollout refreshes the packed copy (one device copy) and
// re-captures a graph only if the new KV cache landed at other addresses.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/transformer.h"
#include "rollout/sampler.h"
#include "tokenizer/tokenizer.h"

namespace opd {

struct GenerationRequest {
  std::vector<int32_t> prompt;         // token ids, non-empty, each < vocab (validated)
  SamplingParams sampling;
  int64_t n = 1;                       // samples of this prompt
  int64_t max_new_tokens = 16;         // >= 1
  std::vector<std::string> stop;       // stop strings (need a tokenizer)
  std::vector<int32_t> stop_token_ids; // extra stop tokens besides the engine's EOS ids
  bool ignore_eos = false;             // keep generating past EOS (benchmarks, W1)
  std::optional<uint64_t> stream_key;  // default prompt_stream_key(prompt)
};

enum class FinishReason { Eos, Stop, Length };
const char* finish_reason_name(FinishReason reason);  // "eos", "stop", "length"

struct SampleOutput {
  std::vector<int32_t> ids;              // generated tokens (EOS / stop token included)
  std::vector<double> sampling_logprobs; // log p of each token under the sampling distribution
  std::vector<double> model_logprobs;    // log softmax(logits)[token]: model at T=1, unfiltered
  FinishReason finish_reason = FinishReason::Length;
  std::string stop;                      // the stop string (or "<id>" stop token) that matched
  std::optional<std::string> text;       // decoded completion when the engine has a tokenizer
};

struct RequestOutput {
  std::vector<SampleOutput> samples;  // index = sample index
};

// Where a generate() call stands (EngineOptions::on_progress).
struct GenerationProgress {
  int64_t finished_samples = 0, total_samples = 0;
  int64_t generated_tokens = 0;  // sampled so far, finished samples and running ones
  int64_t steps = 0;
};

struct EngineOptions {
  int64_t kv_cache_bytes = int64_t{1} << 30;
  int64_t block_size = 16;        // tokens per KV block
  int64_t max_step_tokens = 512;  // tokens per forward step (the prefill chunk budget)
  int64_t max_running = 256;      // sequences in the running batch
  // CUDA models: capture decode steps in CUDA graphs per batch-size bucket (rollout/engine_cuda.h);
  // false runs the same padded decode steps eagerly (same results, for tests and timing).
  bool cuda_graphs = true;
  // CUDA models: the fused layer path of PagedForward (packed q/k/v and gate/up GEMMs, one
  // norm + RoPE + K/V-store kernel: 10 kernels per layer instead of 18); false runs the plain
  // op sequence (the reference the fused path is tested against).
  bool cuda_fused = true;
  // CUDA models: decode-shaped GEMMs (steps of <= 256 tokens) choose their cuBLASLt algorithm
  // by timing the candidates once per shape (kernels/cuda/gemm.h GemmArgs::tune). Off by
  // default: on the H200 at W1 only the lm_head gained (~6 us of ~100 per step), the rollout
  // did not measurably (docs/rollout.md), and a timed choice can differ between processes.
  bool cuda_tuned_gemm = false;
  // CUDA models: decode steps launch opd's kernels that follow a kernel with programmatic
  // dependent launch (PagedForward::set_pdl, kernels/cuda/pdl.cuh): same results, shorter gaps
  // between kernels. On: W1 decode forward 1.096 -> 1.080 s per rollout on the H200
  // (docs/perf.md, session 5).
  bool cuda_pdl = true;
  // CUDA bf16 models: decode steps (<= 64 tokens) run some per-layer GEMMs on opd's decode
  // linear (PagedForward::set_decode_linear, kernels/cuda/decode_linear.h), which streams its
  // weights under the PDL wait, instead of cuBLASLt: those named in cuda_decode_linear_gemms
  // (PagedForward::kDecodeLinear* bits: 1 q|k|v, 2 o, 4 gate|up, 8 down). Default q|k|v, o
  // and down (11): session 10 took o and down (H200, W1: decode forward 2.091 -> 2.056 ms per
  // step; q|k|v on par then, gate|up slower); since the decode attention loads K/V before its
  // PDL wait (session 12), q|k|v on it gains too (docs/rollout.md). Off: cuBLASLt for all four.
  bool cuda_decode_linear = true;
  unsigned cuda_decode_linear_gemms = 11;
  // Measurement only (`opd bench rollout --skip-stages`): decode steps leave out the per-layer
  // kernels named by these PagedForward::kStage* bits (PagedForward::set_skip_stages); the
  // samples are then not the model's. 0 everywhere else.
  unsigned cuda_skip_stages = 0;
  // CUDA models: sampling splits each row over a thread-block cluster of up to 8 CTAs
  // (rollout/sampler_cuda.h); false: one CTA per row, the kernel before issue 6 (same
  // distribution; for A/B measurements). On: W1 sampling 0.074 -> 0.051 s per rollout on the
  // H200 (docs/perf.md, session 5).
  bool cuda_cluster_sampler = true;
  // CUDA bf16 models (head_dim 64/128): prompt chunks that start at position 0 attend with the
  // tensor-core varlen attention instead of the paged kernel (PagedForward::set_fresh_prefill);
  // false: every row through the paged kernel.
  bool cuda_fresh_prefill = true;
  // CUDA bf16 models (head_dim 64/128), with cuda_fresh_prefill: prompt chunks over cached
  // context (later chunks of a prompt longer than max_step_tokens) also attend on the
  // tensor-core kernel, over their context K/V gathered from the cache
  // (PagedForward::set_context_prefill). On: the H200 (session 7, docs/perf.md) gave 16 prompts
  // of 4096 tokens x 128 new 3.467 -> 0.795 s, W1 with --max-step-tokens 128 1.906 -> 1.648 s.
  bool cuda_context_prefill = true;
  // CUDA models: keep the packed decode weights, the step buffers (activations, logits, io)
  // and the CUDA graphs between generate() calls of this engine (W1: ~0.75 GB held between
  // rollouts: packed weights 577 MB, workspace ~120 MB at 2048 step tokens, logits 39 MB).
  // They are reused while every weight keeps its device address (else rebuilt); the packed
  // weights are refreshed from the live weights at each call. The KV cache is never kept.
  // Off by default: measured on the H200 at W1 (docs/rollout.md, "Fixed costs per rollout"),
  // the kept state saved no fixed cost (the new KV cache lands elsewhere, so the graphs are
  // re-captured anyway, ~6-18 ms either way) and its decode steps were ~4% slower.
  bool keep_device_state = false;
  // CUDA models: after generate(), hand the rollout stream's cached blocks (the KV cache, the
  // packed weights, the step buffers) back to the device (cudaFree), so that another stream
  // can allocate them. False keeps them cached for the next rollout on the same stream (no
  // cudaFree / cudaMalloc per rollout; W1: ~6 GB stays reserved, not in use, through the
  // training phase; the allocator still releases it if another stream runs out of memory).
  // The trainer keeps them when its memory plan plus the cache fits the device.
  bool release_device_memory = true;
  // CUDA models: the stream (a cudaStream_t) the rollout runs on; null = the process's rollout
  // stream. A stream of one group of a cuda::SmPartition keeps the rollout on that group's SMs
  // (`opd bench overlap`).
  void* cuda_stream = nullptr;
  // Polled once per step: returning true stops generate() with a Cancelled error (a training
  // run's stop signal must not wait for a long rollout to finish).
  std::function<bool()> should_cancel;
  // Called after every step with the samples finished so far (the caller throttles what it
  // shows: `opd generate` / `opd eval` draw a progress bar or log a line every 10 s).
  std::function<void(const GenerationProgress&)> on_progress;
  void validate() const;
};

struct EngineStats {
  int64_t steps = 0, prefill_tokens = 0, decode_tokens = 0;
  int64_t preemptions = 0, recomputed_tokens = 0;
  // num_blocks: KV blocks allocated (the budget, or less when the requests cannot use it all).
  int64_t num_blocks = 0, peak_blocks_used = 0, max_batch = 0;
  double seconds = 0;
  // Where the time went. CUDA models: device time from CUDA events around each step; CPU: wall
  // time. host_seconds: wall time outside the step calls (scheduling, forks, stops, text).
  double prefill_seconds = 0;         // steps with a prefill chunk: forward + sampling
  double decode_forward_seconds = 0;  // decode steps (one token per sequence): forward
  double sample_seconds = 0;          // decode steps: sampling (CUDA: and the id read-back)
  double host_seconds = 0;
  int64_t decode_steps = 0, graph_steps = 0, graph_captures = 0;  // graphs: CUDA only
  // CUDA: the fixed costs of one generate() call (wall time; each phase synchronized).
  double sync_wait_seconds = 0;  // the device synchronization before the rollout
  double kv_alloc_seconds = 0;   // allocating the KV cache
  double pack_seconds = 0;       // packing (or refreshing) the fused decode weights
  double runner_seconds = 0;     // creating (or re-arming) the step runner: buffers, pinned io
  double capture_seconds = 0;    // graph captures (+ instantiation or in-place update)
  double teardown_seconds = 0;   // freeing the cache and returning the stream's memory
  int64_t graph_updates = 0;     // captures that updated an existing graph in place
  bool reused_device_state = false;  // packed weights, buffers and graphs came from a previous call
};

class RolloutEngine {
 public:
  // eos_ids: tokens that end a sample (see generation_eos_ids); tokenizer: optional, needed for
  // text and stop strings. The model and tokenizer must outlive the engine.
  RolloutEngine(const Transformer& model, EngineOptions options, std::vector<int32_t> eos_ids,
                const Tokenizer* tokenizer = nullptr);
  ~RolloutEngine();
  RolloutEngine(RolloutEngine&&) noexcept;
  RolloutEngine& operator=(RolloutEngine&&) noexcept;

  // Generates every request to completion. Errors (InvalidData / InvalidArgument /
  // OutOfMemory) name the request and the value; a request that cannot fit the KV budget even
  // alone is an OutOfMemory error before anything runs.
  std::vector<RequestOutput> generate(const std::vector<GenerationRequest>& requests);

  const EngineStats& stats() const { return stats_; }
  int64_t num_blocks() const;  // blocks the budget buys
  // Drops what keep_device_state holds (packed weights, buffers, graphs).
  void release_device_state();

 private:
  struct DeviceState;  // engine.cpp
  const Transformer* model_;
  EngineOptions options_;
  std::vector<int32_t> eos_ids_;
  const Tokenizer* tokenizer_;
  EngineStats stats_;
  std::unique_ptr<DeviceState> device_;
};

// EOS ids for generation: the union of config.json eos_token_id, generation_config.json
// eos_token_id (int or list) in model_dir when present, and the tokenizer's eos token (skipped
// with a warning when outside the model's vocabulary). Ids from the model's own files must be
// in the vocabulary (InvalidData naming the file otherwise).
std::vector<int32_t> generation_eos_ids(const std::string& model_dir, const ModelConfig& config,
                                        const Tokenizer* tokenizer);

}  // namespace opd
