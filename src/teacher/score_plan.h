// The forward plan of a score request, shared by the in-process scorers (CpuScorer in
// teacher/scorer.cpp, CudaScorer in teacher/cuda_scorer.cpp), so both do the same work in the
// same order and return the same ScoreResponse:
// - position p of a sequence is predicted from hidden row p-1, so sequence s needs rows
//   [begin-1, end-1) of the forward over ids[0 .. end-2];
// - a sequence whose forward tokens are a prefix of (or equal to) another's takes its rows from
//   that "carrier" (causal attention: row p depends on ids[0..p] only), so each distinct
//   sequence is run once; carriers are found longest first;
// - carriers are packed, in that order, into batches of at most max_batch_tokens tokens (a longer
//   carrier runs alone).
// - shared prompts (issue 7): carriers whose forward tokens start with the same prompt (the
//   N completions of one prompt, --num-generations) can run that prompt once: its K/V go to a
//   paged KV cache (model/kv_cache.h) and each carrier's remaining tokens ("suffix") run over
//   [prompt K/V | own tokens], causal and bottom-right aligned, with PagedForward::step_hidden
//   (model/paged_forward.h, the rollout engine's mechanism). Row p of a suffix equals row p of
//   the dense forward (same causal attention), so the response is the same up to rounding.
//   A carrier can share ids[0 .. P) with P = the first hidden row any of its sequences needs
//   (those rows are K/V only); carriers whose such prompts have a common prefix of >=
//   min_prompt_tokens form a group sharing that prefix, cut down to whole cache blocks (so no
//   carrier ever writes into a shared block: the prompt's blocks are read-only). A group of >= 2
//   carriers is shared when the mode says Always, or (Auto) when the cost model below predicts
//   less work; the rest run dense.
// Also the request-level pieces both scorers share: the teacher's self-description and the
// response skeleton (k, temperature, vocabulary, per-sequence begin and row offsets).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.h"
#include "teacher/scorer.h"

namespace opd {

class KvCache;
class PagedForward;
class Tensor;

// Predicted work of one group, in dense-forward FLOPs: `prompt` shared tokens, one suffix of
// suffix_lengths[i] tokens per carrier. With lin = 2 x (decoder matmul parameters) per token and
// attn(q, c) = 4 Hq D layers x (q c + q (q + 1) / 2) for q queries after c cached positions:
//   dense  = sum_i lin (P + S_i) + attn(P + S_i, 0)
//   shared = lin P + a attn(P, 0) + sum_i lin S_i + a attn(S_i, P),  a = paged_attention_cost.
struct SharedPromptCost {
  double dense = 0, shared = 0;
};
SharedPromptCost shared_prompt_cost(const ModelConfig& config, int64_t prompt,
                                    const std::vector<int64_t>& suffix_lengths,
                                    double paged_attention_cost);

struct ScorePlan {
  // Rows of one sequence taken from a carrier's hidden states: rows [src_row, src_row + rows)
  // of the packed batch (the carrier's offset in the batch already added).
  struct Take {
    size_t seq = 0;
    int64_t src_row = 0;
    int64_t rows = 0;
  };
  struct ForwardBatch {
    std::vector<std::vector<int32_t>> sequences;  // carriers' forward tokens, packed in order
    std::vector<Take> takes;                       // every sequence served by these carriers
  };
  std::vector<ForwardBatch> batches;
  // Shared-prompt groups (run after the batches): the prompt's K/V in cache blocks
  // [0, prompt.size() / block_size), then steps of suffixes packed to <= max_batch_tokens tokens
  // (a longer suffix runs alone), suffix i of a step in the blocks after the prompt's.
  struct SharedGroup {
    std::vector<int32_t> prompt;  // K/V only (no hidden row of it is needed)
    struct Step {
      std::vector<std::vector<int32_t>> suffixes;  // carriers' forward tokens after the prompt
      std::vector<Take> takes;                      // src_row: row of the step's packed output
    };
    std::vector<Step> steps;
  };
  std::vector<SharedGroup> shared;
  int64_t block_size = 0;    // of the shared groups' cache
  int64_t cache_blocks = 0;  // blocks the largest shared step needs (0: no shared group)
  std::vector<std::vector<int32_t>> actual;  // per sequence: the token at each scored position
  int64_t rows = 0;                          // scored rows in all
};

// `fwd[s]` are the forward tokens of sequence s and `need[s]` = [first, last) the hidden rows
// it needs (empty ranges need nothing); `actual[s]` its scored tokens (copied into the plan).
ScorePlan plan_forwards(const std::vector<std::vector<int32_t>>& fwd,
                        const std::vector<std::pair<int64_t, int64_t>>& need,
                        int64_t max_batch_tokens);

// The plan of a (checked) score request: fwd = ids[0 .. end-2], need = [begin-1, end-1),
// actual = ids[begin .. end-1]. Without `config` no prompt is shared.
ScorePlan plan_score_request(const ScoreRequest& request, int64_t max_batch_tokens);
ScorePlan plan_score_request(const ScoreRequest& request, int64_t max_batch_tokens,
                             const ModelConfig& config, const SharedPromptOptions& shared);

// Runs plan.shared through `forward` over `cache` (>= plan.cache_blocks blocks of
// plan.block_size, the scorer's model dtype and device): per group, the prompt in chunks of
// <= max_batch_tokens tokens (K/V only), then each suffix step, calling
// consume(hidden [step tokens, H], step takes). KV memory: cache_blocks x
// KvCache::block_bytes(config, block_size, dtype).
using ConsumeHidden = std::function<void(const Tensor& hidden, const std::vector<ScorePlan::Take>&)>;
void run_shared_prompts(const ScorePlan& plan, const PagedForward& forward, KvCache& cache,
                        int64_t max_batch_tokens, const ConsumeHidden& consume);

// k, temperature, vocabulary, seq_begin and row_offsets of the response to `request`.
ScoreResponse response_skeleton(const ScoreRequest& request, int64_t vocab_size);

// Checks the request (check_score_request) and the fingerprint it expects against `info`.
void check_request_for(const ScoreRequest& request, const TeacherInfo& info,
                       const ScoreLimits& limits);

// What a teacher reports about itself, from its model directory and config.
TeacherInfo describe_teacher(const std::string& model_dir, const ModelConfig& config);

}  // namespace opd
