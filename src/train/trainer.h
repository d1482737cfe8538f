// The on-policy distillation loop (DESIGN.md "Data flow of one optimizer step"), and SFT as the
// same loop with a one-hot teacher. One optimizer step:
//   1. draw `batch_size` prompts (data/sampler: seeded, resumable);
//   2. completions: with probability lmbda (a Philox draw keyed by (seed, step), so a resumed
//      run makes the same draws) the student samples `num_generations` per prompt
//      (rollout/engine); otherwise the dataset's completion (seq_kd: the teacher samples);
//   3. the teacher scores every completion token: top-K (id, logprob) at the distillation
//      temperature + the logprob of the token (teacher/scorer: in-process or remote), validated
//      against the student vocabulary (loss/teacher_payload) before anything reads it;
//   4. micro-batches of `micro_batch_size` sequences: forward_hidden, the fused lm_head + loss
//      normalized by n_total = completion tokens of the whole step (so accumulation gives the
//      mean over the step's tokens), backward into f32 gradients;
//   5. a non-finite loss or gradient norm skips the step (counted; the batch is saved under
//      RUN/bad_batches/), else AdamW with the LR schedule and global-norm clipping;
//   6. metrics (RUN/metrics.jsonl, TensorBoard), checkpoints (every save_steps steps and every
//      save_minutes minutes, at the end, and on SIGTERM/SIGINT), evaluation every eval_steps.
// SFT (`opd sft`): lmbda = 0, no teacher; the "teacher" of each dataset token is one-hot on it
// (K = 1, logprob 0) with beta = 0 and topk+tail, i.e. forward KL to a point mass = cross-
// entropy, computed by the same fused O(tokens x K) loss.
//
// Data parallel (WORLD_SIZE > 1): every rank draws the same global batch and keeps prompts
// rank, rank + world, ...; the rollout stream of a prompt is keyed by its global index, so the
// sequences do not depend on the number of ranks. Token counts, the loss and the gradient norm
// are global (the loss is normalized by all ranks' completion tokens; gradients are summed),
// every rank agrees on stopping and on time-based checkpoints, rank 0 writes metrics and one
// complete checkpoint (the gathered full state: resumable on any number of ranks).
//
// Resume (`resume = "auto"`): the newest checkpoint under RUN/checkpoints that verifies is
// loaded (weights, AdamW moments and step, data cursor, counters); every random draw is a
// function of (seed, step, ...), so the resumed run computes the same steps as an
// uninterrupted one (bit for bit on the CPU backend at a fixed thread count).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace opd {

// The URLs of a --teacher-url pool (comma-separated, spaces around entries ignored); throws
// InvalidArgument naming an empty entry.
std::vector<std::string> split_teacher_urls(const std::string& pool);

struct TrainOptions {
  // Models and data.
  std::string student;                // model directory (HF layout)
  std::string teacher;                // in-process teacher directory
  // Remote teacher (opd serve / vLLM): one URL, or a comma-separated pool; under data parallel
  // rank r scores with entry r mod (pool size), so each rank can have its own server.
  std::string teacher_url;
  // A vLLM teacher reports neither vocabulary nor tokenizer: a directory with the served
  // model's config.json and tokenizer files stands in (its vocabulary, tokenizer fingerprint,
  // EOS and special tokens; an opd server's own report must agree with it).
  std::string teacher_config;
  std::vector<std::string> data;      // JSONL files
  std::vector<std::string> eval_data; // JSONL files with reference completions
  std::string out = "runs/opd";
  bool sft = false;                   // cross-entropy on dataset completions, no teacher

  // Distillation.
  double lmbda = 0.5;                 // probability that a step's completions are on-policy
  bool seq_kd = false;                // off-policy steps: the teacher writes the completions
  double beta = 0.5;                  // 0 forward KL, 1 reverse KL, in between JSD(beta)
  std::string loss_support = "topk+tail";
  double kd_temperature = 1.0;        // distillation temperature T
  double sft_alpha = 0.0;             // + sft_alpha * CE on dataset completions
  int64_t teacher_top_k = 64;         // K (clamped to the vocabulary)
  std::string vocab_policy = "error";
  double teacher_timeout_s = 1800;    // remote teacher unreachable this long -> the run fails

  // Rollout.
  double temperature = 1.0;           // student (and seq_kd teacher) sampling temperature
  double top_p = 1.0;
  int64_t top_k = 0;
  double min_p = 0.0;
  int64_t num_generations = 1;        // samples per prompt on on-policy steps
  int64_t max_completion_length = 256;
  int64_t max_prompt_length = 0;      // 0 = no limit
  std::string truncation = "left";    // long prompts: left | error | skip
  double kv_cache_gb = 1.0;
  bool ignore_eos = false;            // rollouts run to max_completion_length (benchmarks)

  // Device. cpu: f32 everywhere (the reference backend). cuda: the student computes in `dtype`
  // (bf16 or f32) on the GPU with f32 master weights, f32 gradients and AdamW on the GPU; the
  // in-process teacher, the rollout and the loss run there too.
  std::string device = "cpu";         // cpu | cuda
  std::string dtype = "bf16";         // cuda compute dtype: bf16 | f32
  bool recompute = false;             // = recompute_granularity "layer"
  // Activation recompute of the student (model/transformer.h): none | elementwise (CUDA: the
  // norm outputs, normed q/k and SwiGLU product are rebuilt in the backward, 36% fewer
  // activations at the Qwen3 shapes, no extra GEMM) | layer (only each layer's input is kept,
  // +1 forward).
  std::string recompute_granularity = "none";
  // cuda, in-process teacher: its weights live in pinned host memory and are uploaded for the
  // scoring (and a --seq-kd rollout) of each step and released before the rollout and training
  // phases (less device memory for one host-to-device copy of the teacher per step).
  bool offload_teacher = false;
  // cuda: a device memory budget in GiB (0 = none). The trainer picks the cheapest memory
  // setting whose planned peak fits it (train/doctor.h fit_memory_budget: elementwise
  // recompute, then the teacher's offload, ...), keeping any recompute or offload given above;
  // a budget nothing fits stops the run at start-up with the smallest plan.
  double device_memory_budget_gb = 0;
  // Data parallel (launched by `opd launch` / torchrun / srun: WORLD_SIZE > 1): batch_size is the
  // global number of prompts per step, split round-robin over the ranks; ZeRO-1 shards the f32
  // master weights and AdamW moments, ZeRO-2 also the reduced gradients (reduce-scattered
  // after each micro-batch). NCCL with --device cuda (GPU = LOCAL_RANK), the store's CPU
  // collectives with --device cpu.
  int64_t zero_stage = 1;             // 1 | 2

  // Optimization.
  int64_t batch_size = 8;             // prompts per optimizer step
  int64_t micro_batch_size = 8;       // sequences per forward/backward
  double learning_rate = 1e-5;
  std::string lr_scheduler_type = "cosine";
  int64_t warmup_steps = 0;
  double warmup_ratio = 0.0;          // used when warmup_steps == 0
  double min_lr_ratio = 0.0;
  double weight_decay = 0.0;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_epsilon = 1e-8;
  double max_grad_norm = 1.0;         // 0 = no clipping
  int64_t max_steps = 0;              // 0: num_train_epochs over the dataset
  double num_train_epochs = 1.0;
  uint64_t seed = 42;

  // Checkpoints, evaluation, faults, output.
  int64_t save_steps = 0;             // 0 = only by time, at the end and on a stop signal
  double save_minutes = 10;           // 0 = off
  int64_t save_total_limit = 3;       // checkpoints kept (0 = all)
  std::string resume = "auto";        // auto | never | PATH of a checkpoint folder
  int64_t eval_steps = 0;             // 0 = evaluate only before and after training
  int64_t eval_limit = 0;             // evaluate on the first N samples (0 = all)
  int64_t max_bad_steps = 10;         // skipped non-finite steps before the run aborts
  int64_t logging_steps = 1;
  bool tensorboard = true;
  bool eval_before = true;            // evaluate the initial weights (needs eval_data)
  bool save_at_end = true;            // final checkpoint (benchmarks turn it off; not a flag)

  nlohmann::json to_json() const;
  void validate() const;              // InvalidArgument naming the flag, value and range
};

struct TrainResult {
  int64_t first_step = 0;             // step the run started at (> 0 after a resume)
  int64_t steps = 0;                  // step reached
  bool stopped_by_signal = false;
  std::string last_checkpoint;        // path ("" if none was written)
  double last_loss = 0;
  int64_t bad_steps = 0;
  double eval_before = -1, eval_after = -1;  // exact-match accuracy (-1: not evaluated)
};

// Runs the loop; throws on errors (data, teacher, I/O) after logging them. Installs the
// training signal handlers (train/signals.h).
TrainResult train(const TrainOptions& options);

}  // namespace opd
