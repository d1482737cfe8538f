// Helpers shared by the loss tests: a well-formed teacher payload built from dense top-K data
// (so tests go through validate_teacher_payload like production code does), and error-message
// assertions for opd::Error.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "loss/teacher_payload.h"

namespace opd::test {

// Payload for `lengths.size()` sequences (first positions `first`), rows in order, from dense
// ids [rows, k] (i32 or i64 tensor) and logprobs [rows, k], actual [rows] (f64 tensors).
inline TeacherPayload payload_from_dense(const std::vector<int64_t>& first,
                                         const std::vector<int64_t>& lengths, const Tensor& ids,
                                         const Tensor& logprobs, const Tensor& actual,
                                         int64_t teacher_vocab) {
  TeacherPayload pl;
  const int64_t rows = ids.dim(0), k = ids.dim(1);
  pl.k = k;
  pl.teacher_vocab = teacher_vocab;
  pl.seq_first_position = first;
  pl.seq_row_offsets = {0};
  for (int64_t len : lengths) pl.seq_row_offsets.push_back(pl.seq_row_offsets.back() + len);
  pl.entry_offsets = {0};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < k; ++j) {
      pl.ids.push_back(ids.dtype() == DType::I32 ? ids.data<int32_t>()[r * k + j]
                                                  : ids.data<int64_t>()[r * k + j]);
      pl.logprobs.push_back(logprobs.data<double>()[r * k + j]);
    }
    pl.entry_offsets.push_back(static_cast<int64_t>(pl.ids.size()));
    pl.actual_logprobs.push_back(actual.data<double>()[r]);
  }
  return pl;
}

inline CompletionLayout layout_of(const TeacherPayload& pl) {
  CompletionLayout l;
  l.first_position = pl.seq_first_position;
  for (size_t s = 0; s + 1 < pl.seq_row_offsets.size(); ++s)
    l.length.push_back(pl.seq_row_offsets[s + 1] - pl.seq_row_offsets[s]);
  return l;
}

// Runs fn, expects opd::Error of `kind` whose message contains every string of `parts`;
// returns the message ("" and a failure otherwise).
template <typename Fn>
std::string expect_error(Fn&& fn, ErrorKind kind, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(kind)) << e.what();
    std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    return msg;
  }
  ADD_FAILURE() << "no opd::Error thrown (expected one mentioning '" << (parts.empty() ? "" : parts[0]) << "')";
  return "";
}

}  // namespace opd::test
