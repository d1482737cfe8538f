// In-process teacher scorer on CUDA: the Scorer contract of teacher/scorer.h (same request
// checks, same prefix sharing and packing -- teacher/score_plan.h --, same ScoreResponse, same
// ordering: logprob descending, ties by smaller id) with the teacher as a CUDA Transformer
// (bf16 by default, or f32):
//   per packed batch of <= max_batch_tokens tokens: h = forward_hidden(batch)   [T_b, H] device
//   the scored rows of h gathered on the device (ops::gather_rows) into one [rows, H] tensor
//   shared-prompt groups (teacher/score_plan.h): prompt K/V once in a paged KV cache, the
//   completions' rows from PagedForward::step_hidden, gathered the same way
//   top-K / LSE / actual logprob / rank over vocabulary tiles (topk_lm_head_device, cuBLASLt
//   tiles + per-row online LSE and running top-K: teacher/topk_lm_head_cuda.h)
// Only the [rows x K] outputs come back to the host. Rows are gathered batch by batch; the
// host puts them back in request order (a permutation of [rows x K] entries, nothing more).
//
// Device memory beyond the weights: one batch's forward activations (O(max_batch_tokens x
// max(H, I)), no cache kept), the gathered hidden rows rows x H (model dtype), the top-K
// workspace min(rows, row_chunk) x min(V, vocab_tile) x 4 + rows x (32 + 8 K) and the outputs
// rows x (8 K + 8). Never [tokens x V]. With a shared-prompt group also its KV cache, (prompt +
// max_batch_tokens + a block per suffix) tokens x 2 x layers x Hkv x D x dtype bytes, freed
// after the call.
//
// next_tokens() is Unsupported on CUDA (the CUDA top-K pass does not sample; `opd serve
// --device cuda` answers /v1/completions generation requests with that error; scoring through
// /v1/completions with max_tokens = 0 works).
// score() is thread-safe: calls are serialized (one GPU stream, the GPU is busy anyway).
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "core/dtype.h"
#include "teacher/scorer.h"

namespace opd {

class Transformer;

class CudaScorer : public Scorer {
 public:
  struct Options {
    int64_t max_batch_tokens = 16384;
    int64_t vocab_tile = 16384;   // ids per cuBLASLt logit tile
    int64_t row_chunk = 2048;     // scored rows per logit tile
    DType dtype = DType::BF16;    // BF16 or F32: the model directory's weights are converted to it
    ScoreLimits limits;
    // Shared prompts (teacher/score_plan.h). paged_attention_cost 63, measured on the H200
    // (2026-11-30, `opd bench score --no-server --shared-prompt always|never`, Qwen3-1.7B shape):
    // solving the cost model for the measured times gives 60 (64 x (256 + 512), 4 per prompt:
    // shared 0.810 s vs dense 0.336 s) and 66 (32 x (2048 + 64), 8 per prompt: 0.433 vs 0.406 s).
    // The paged prefill attention runs on CUDA cores, so Auto shares only where the prompt is
    // long and the completions short enough to beat that (neither measured shape qualifies).
    SharedPromptOptions shared_prompt = {SharedPromptMode::Auto, 64, 16, 63.0};
    // Shared-prompt steps: completions attend over their cached prompt with the tensor-core
    // kernel (PagedForward::set_context_prefill; bf16 head_dim 64/128) instead of the paged
    // kernel. Where it applies, Auto's cost model uses context_attention_cost instead of
    // shared_prompt.paged_attention_cost.
    bool context_prefill = true;
    // Auto's cost factor with context prefill (H200, session 7, `opd bench score --no-server
    // --shared-prompt always --context-prefill` vs never): the cost model solved for the
    // measured times gives 11 (64 x (256 + 512), 4 per prompt: shared 0.3505 s vs dense
    // 0.3400 s) and 7 (32 x (2048 + 64), 8 per prompt: 0.0922 vs 0.3887 s). 11, the larger, so
    // that Auto shares the second shape and not the first.
    double context_attention_cost = 11.0;
  };
  // Loads the model directory (f32 on the host), converts it to CUDA `options.dtype`. Throws
  // Unsupported in builds without CUDA or without a usable device.
  CudaScorer(const std::string& model_dir, Options options);
  explicit CudaScorer(const std::string& model_dir);
  // Reuses a model already on the GPU (bf16 or f32 CUDA weights), e.g. the trainer's teacher.
  // info.vocab_size must be 0 (taken from the config) or the model's vocabulary.
  CudaScorer(std::shared_ptr<const Transformer> cuda_model, TeacherInfo info, Options options);
  ~CudaScorer() override;

  const TeacherInfo& info() const override { return info_; }
  ScoreResponse score(const ScoreRequest& request) override;
  const Options& options() const { return opts_; }
  // What Auto plans with: options().shared_prompt, its cost factor replaced by
  // context_attention_cost where context prefill applies (bf16, head_dim 64/128).
  SharedPromptOptions shared_prompt_options() const;
  const Transformer& model() const { return *model_; }

 private:
  void check_setup() const;

  Options opts_;
  std::shared_ptr<const Transformer> model_;
  TeacherInfo info_;
  std::mutex mutex_;
};

}  // namespace opd
