// Validation of a teacher's top-K scores at the boundary (DESIGN.md invariant 1, "no index is
// trusted"): the ragged payload as it arrives (per completion position K (id, logprob) pairs and
// the logprob of the actual token) is checked against the completion it scores and the student
// vocabulary, and turned into the dense [rows, K] form the fused loss consumes. Every rejection
// is an InvalidData error naming sequence, position, value and limit; nothing reaches a kernel
// unchecked (the kernels guard again and report through an error flag).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "loss/loss_config.h"

namespace opd {

// A teacher response for a batch of sequences, as received (before validation). Ragged CSR
// layout: positions of sequence s are rows [seq_row_offsets[s], seq_row_offsets[s+1]); entries of
// row r are [entry_offsets[r], entry_offsets[r+1]) of ids/logprobs. ids are int64 so a huge
// value on the wire is seen as huge, not truncated.
struct TeacherPayload {
  int64_t k = 0;               // entries per position the teacher promised (0: actual token only)
  int64_t teacher_vocab = 0;   // the teacher model's vocabulary size
  // Temperature the teacher applied before its softmax (opd's teacher: the distillation T; a
  // plain vLLM server: 1). See validate_teacher_payload for what a mismatch means.
  double temperature = 1.0;
  std::vector<int64_t> seq_first_position;  // per sequence: position of its first scored token
  std::vector<int64_t> seq_row_offsets;     // [num_sequences + 1]
  std::vector<int64_t> entry_offsets;       // [rows + 1]
  std::vector<int64_t> ids;                 // teacher top-K token ids
  std::vector<double> logprobs;             // a_k = log p(id) at the distillation temperature
  std::vector<double> actual_logprobs;      // [rows]: log p(y) of the completion token y
};

// The completion the payload must line up with (from the rollout / dataset, already trusted).
struct CompletionLayout {
  std::vector<int64_t> first_position;  // per sequence: position of its first completion token
  std::vector<int64_t> length;          // per sequence: completion tokens (= loss rows)
  std::vector<uint8_t> padding;         // per row (sum of length): 1 = padding, not in the loss;
                                        // empty = no padding rows
};

// Marks an empty slot of TeacherTopK::ids (an id dropped by VocabPolicy::ClipToStudent).
inline constexpr int32_t kEmptySlot = -1;

// Validated teacher scores, dense. Padding rows have every slot empty (ids kEmptySlot,
// logprobs -inf) and valid = 0, so no kernel ever reads their payload.
struct TeacherTopK {
  int64_t rows = 0;
  int64_t k = 0;
  // i32 [rows, k]: in [0, student vocab) or kEmptySlot; each row in the canonical order of
  // validate_teacher_payload (logprob descending, ties by smaller id)
  Tensor ids;
  Tensor logprobs;         // f32|f64 [rows, k]: a_k (renormalized after clipping); -inf if empty
  Tensor actual_logprobs;  // f32|f64 [rows]
  Tensor valid;            // i32 [rows]: 1 = a real completion row, 0 = padding
};

struct PayloadStats {
  int64_t rows = 0;
  int64_t padding_rows = 0;
  int64_t clipped_ids = 0;      // ClipToStudent: ids >= student vocab dropped
  int64_t clipped_rows = 0;     // rows with at least one dropped id
  double max_clipped_mass = 0;  // largest teacher probability mass dropped from one row
  int64_t reordered_rows = 0;   // rows whose entries arrived out of the canonical order
};

// Checks, in this order, each with its own message:
//  structure: sequence count, seq_row_offsets / entry_offsets monotone and covering the arrays;
//  alignment: per sequence the position count and first position equal the completion's;
//  vocabulary: teacher_vocab > student_vocab unless VocabPolicy::ClipToStudent;
//  per row: exactly K entries; each id in [0, student vocab) (ClipToStudent: ids in
//  [student vocab, teacher vocab) are dropped, anything else outside [0, teacher vocab) is an
//  error); no repeated id; no NaN or +inf logprob, -inf only in padding rows; sum_k exp(a_k) <=
//  1 + payload_sum_tolerance; the actual token's logprob finite and <= log(1 + tolerance).
// Clipping renormalizes the kept entries to the mass that stays in the student's vocabulary:
// a_k -= log1p(-dropped), likewise the actual token's logprob (the unseen tail is assumed to lie
// inside the student vocabulary). A row whose every entry is dropped is an error.
// Temperature: logprobs at the payload's temperature T_p cannot give exact values at the
// distillation temperature T != T_p, so topk+tail and sampled are refused with a message naming
// both; topk is exact after rescaling a_k * T_p / T (the teacher's LSE cancels when topk
// renormalizes over the K ids), which validation applies (DESIGN.md: "renormalize a_k / T over
// the K ids, i.e. topk").
// Order: a teacher may send a row's K entries in any order (the protocol orders them, but a
// vLLM server's prompt_logprobs is a JSON dict, and nothing on the wire can be trusted to be
// sorted). The returned rows are canonical: entry j is the j-th of the row by logprob
// descending, ties by smaller id (the protocol's order, so an opd teacher's rows are copied
// unchanged; a clipped entry keeps its place as an empty slot). Nothing downstream assumes an
// order (the loss, the trainer's metrics), and canonical rows make the loss of a permuted
// payload bitwise that of the sorted one (its sums run in one order): a run does not depend on
// how a teacher happened to order its answer. PayloadStats::reordered_rows counts the rows
// that arrived otherwise.
// The canonical order of a row's entries (the protocol's): entry a comes before entry b when its
// logprob is larger, or equal with a smaller id. The one rule validate_teacher_payload and the
// client's sort_response_rows (teacher/scorer.h) both apply.
inline bool canonical_entry_before(double logprob_a, int64_t id_a, double logprob_b, int64_t id_b) {
  return logprob_a > logprob_b || (logprob_a == logprob_b && id_a < id_b);
}

// `dtype` (F32 or F64) is the dtype of the returned logprobs. Throws InvalidData / InvalidArgument.
TeacherTopK validate_teacher_payload(const TeacherPayload& payload, const CompletionLayout& layout,
                                     int64_t student_vocab, const LossConfig& config, DType dtype,
                                     PayloadStats* stats = nullptr);

}  // namespace opd
