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
// Also the request-level pieces both scorers share: the teacher's self-description and the
// response skeleton (k, temperature, vocabulary, per-sequence begin and row offsets).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "teacher/scorer.h"

namespace opd {

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
  std::vector<std::vector<int32_t>> actual;  // per sequence: the token at each scored position
  int64_t rows = 0;                          // scored rows in all
};

// `fwd[s]` are the forward tokens of sequence s and `need[s]` = [first, last) the hidden rows
// it needs (empty ranges need nothing); `actual[s]` its scored tokens (copied into the plan).
ScorePlan plan_forwards(const std::vector<std::vector<int32_t>>& fwd,
                        const std::vector<std::pair<int64_t, int64_t>>& need,
                        int64_t max_batch_tokens);

// The plan of a (checked) score request: fwd = ids[0 .. end-2], need = [begin-1, end-1),
// actual = ids[begin .. end-1].
ScorePlan plan_score_request(const ScoreRequest& request, int64_t max_batch_tokens);

// k, temperature, vocabulary, seq_begin and row_offsets of the response to `request`.
ScoreResponse response_skeleton(const ScoreRequest& request, int64_t vocab_size);

// Checks the request (check_score_request) and the fingerprint it expects against `info`.
void check_request_for(const ScoreRequest& request, const TeacherInfo& info,
                       const ScoreLimits& limits);

// What a teacher reports about itself, from its model directory and config.
TeacherInfo describe_teacher(const std::string& model_dir, const ModelConfig& config);

}  // namespace opd
