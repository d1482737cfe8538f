// Start-up compatibility checks of a teacher/student pair (issue 8 item 2; DESIGN.md
// invariant 1): vocabulary sizes, tokenizer fingerprints, special tokens, EOS ids and chat
// templates, the known trap of a base student whose EOS differs from an instruct teacher's
// (the student never learns to stop: completions run to the length limit), and the memory a
// run needs against what the machine has. `opd doctor` prints them; `opd train` runs the same
// checks before its first step and refuses errors.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <algorithm>

#include "core/dtype.h"
#include "model/transformer.h"  // Recompute

namespace opd {

struct ModelSide {
  std::string where;               // directory or URL
  int64_t vocab_size = 0;
  std::string fingerprint;         // tokenizer fingerprint sha256 ("" unknown)
  int64_t tokenizer_vocab = 0;     // ids in tokenizer.json (0 unknown)
  std::vector<int64_t> eos_ids;    // generation EOS ids (config, generation_config, tokenizer)
  std::string bos_token, eos_token, pad_token;
  bool has_chat_template = false;
  std::string chat_template;       // the text (for comparison)
  int64_t num_parameters = 0;
  int64_t hidden_size = 0, num_layers = 0, intermediate_size = 0;
  int64_t num_attention_heads = 0, num_key_value_heads = 0, head_dim = 0;
};

enum class Severity { Ok, Warning, Error };

struct DoctorFinding {
  Severity severity = Severity::Ok;
  std::string check;    // "vocab_size", "tokenizer", "eos", ...
  std::string message;
};

// Reads a model directory (config.json, tokenizer files).
ModelSide describe_model_dir(const std::string& dir);
// The sizes of a config only (vocabulary, parameters, shape): what the memory plan needs.
ModelSide describe_config(const ModelConfig& config);

// Compares the two sides. policy_allows_clip: --vocab-policy clip-to-student was given (a
// vocabulary mismatch is then a warning, not an error).
std::vector<DoctorFinding> check_pair(const ModelSide& student, const ModelSide& teacher,
                                      bool policy_allows_clip);

struct MemoryEstimate {
  int64_t weights = 0, grads = 0, optimizer = 0, activations = 0, kv_cache = 0, teacher = 0;
  int64_t total() const { return weights + grads + optimizer + activations + kv_cache + teacher; }
};
// Bytes of a CPU (f32) training run: weights + grads + AdamW moments, activations of one
// micro-batch (tokens x (a per-layer constant x hidden + intermediate) x layers), the KV budget
// and an in-process teacher's weights.
MemoryEstimate estimate_memory(const ModelSide& student, const ModelSide* in_process_teacher,
                               int64_t micro_batch_tokens, double kv_cache_gb);
int64_t available_host_memory();  // MemAvailable of /proc/meminfo (0 when unknown)

// The memory plan of a GPU run, per GPU: what stays resident for the whole run, plus what each
// phase of a step adds (the phases never overlap; the rollout's KV cache is released before the
// teacher scores and the student trains). An upper bound of the caching allocator's peak per
// phase (trainer metrics memory/peak_<phase>_bytes); the coefficients below were fitted on the
// H200 at W1 (session 8, docs/perf.md: every phase of five memory settings measured, each plan
// 0-10% above its measurement):
//   always      model copy P x dtype;  f32 master 4P and AdamW moments 8P (divided by the ranks
//               under ZeRO);
//   gradients   f32 4P (+ the reduced shard 4P / ranks under ZeRO-2): only in the training phase
//               on one GPU (the trainer binds them when it starts and drops them after AdamW); for
//               the whole run under ZeRO (its buffers are fixed);
//   teacher     in-process Pt x dtype: for the whole run, or only while it scores with
//               --offload-teacher;
//   rollout:    the KV cache (the budget, or what the rollout needs when given) + the packed
//               decode weights (q|k|v and gate|up, ~P x dtype x 0.5);
//   scoring:    an in-process teacher's forward over one packed batch of scorer_batch_tokens,
//               B x (6 H + 2 (Hq + 2 Hkv) D + 4 I) x dtype at its widest point, + its top-K
//               logit tile (f32 scorer_row_chunk x scorer_vocab_tile); with shared prompts
//               also a step's K/V cache (prompt + max(B, completion) + one block per
//               completion, 2 x layers x Hkv x D x dtype per token) and the context gather
//               (2 x group x (prompt + completion) x Hkv x D x dtype): a bound from the
//               scorer's code, not measured;
//   training:   activations of one micro-batch, T x layers x (14 H + 3 I) x dtype without
//               recompute, T x layers x (9 H + 2 I) x dtype with elementwise recompute, or
//               T x H x dtype per layer + two layers' worth with per-layer recompute; + the
//               workspace: the loss head's scratch (its tile buffers, up to the trainer's
//               128 MiB budget, and O(T x K) rows), the f32 d_hidden and the cuBLAS
//               workspaces, T x 4 (H + 4 H) + 256 MiB;
//   full support (--loss-support full): no scoring phase (nothing is scored ahead); the
//               training phase also runs the teacher's forward over each micro-batch: one
//               teacher layer's activations at a time, T x (14 Ht + 3 It) x dtype, and its final
//               hidden rows, 2 x T x Ht x dtype (the loss's teacher logit tiles share the loss
//               head's tile budget). W1 measured +271 MiB in the training phase over topk+tail
//               (session 10); this term is +0.59 GiB: a bound read from the code.
struct MemoryPlanOptions {
  DType dtype = DType::BF16;   // compute dtype on the GPU
  Recompute recompute = Recompute::Off;
  bool offload_teacher = false;
  int world_size = 1;
  int zero_stage = 0;          // 0 = no ZeRO (one GPU), 1 or 2
  int64_t micro_batch_tokens = 8192;
  int64_t kv_cache_bytes = int64_t{1} << 30;
  // The in-process CUDA scorer's batch and top-K tile (teacher/cuda_scorer.h Options defaults).
  int64_t scorer_batch_tokens = 16384, scorer_row_chunk = 2048, scorer_vocab_tile = 16384;
  // Shared-prompt scoring (--num-generations > 1: the scorer may run a prompt's completions
  // over its cached K/V, teacher/score_plan.h): the longest prompt and completion and the
  // completions per prompt. 0 prompt tokens: no sharing planned for.
  int64_t shared_prompt_tokens = 0, shared_completion_tokens = 0, shared_group = 1;
  bool full_support = false;  // --loss-support full with an in-process teacher (see above)
};
struct MemoryPlan {
  int64_t model = 0, master = 0, optimizer = 0, grads = 0, teacher = 0;
  int64_t activations = 0, workspace = 0, rollout = 0, scoring = 0;
  bool grads_whole_run = false, teacher_whole_run = true;
  int64_t resident() const {
    return model + master + optimizer + (grads_whole_run ? grads : 0) +
           (teacher_whole_run ? teacher : 0);
  }
  int64_t rollout_phase() const { return resident() + rollout; }
  int64_t scoring_phase() const { return resident() + (teacher_whole_run ? 0 : teacher) + scoring; }
  int64_t training_phase() const {
    return resident() + (grads_whole_run ? 0 : grads) + activations + workspace;
  }
  int64_t peak() const {
    return std::max(rollout_phase(), std::max(scoring_phase(), training_phase()));
  }
};
MemoryPlan plan_gpu_memory(const ModelSide& student, const ModelSide* in_process_teacher,
                           const MemoryPlanOptions& options);

// A device memory budget (opd train --device-memory-budget): the cheapest memory setting whose
// planned peak fits `budget` bytes. Candidates in order of their measured cost at W1 (H200,
// session 8: elementwise recompute ~+1% step time, the teacher's offload ~+3%, both ~+3.5%,
// per-layer recompute ~+9%): none, elementwise, offload, elementwise + offload, layer, layer +
// offload; the offload only when can_offload (an in-process CUDA teacher, not --loss-support
// full), and never less than what `base` already asks (a recompute or offload the user chose
// stays). nullopt when nothing fits; `smallest` then receives the smallest plan's setting.
struct MemoryChoice {
  Recompute recompute = Recompute::Off;
  bool offload_teacher = false;
  MemoryPlan plan;
};
std::optional<MemoryChoice> fit_memory_budget(const ModelSide& student,
                                              const ModelSide* in_process_teacher,
                                              const MemoryPlanOptions& base, bool can_offload,
                                              int64_t budget, MemoryChoice* smallest = nullptr);

}  // namespace opd
