// Helpers shared by the loss tests: a well-formed teacher payload built from dense top-K data
// (so tests go through validate_teacher_payload like production code does), rows of dense top-K
// data reordered (permuted or sorted) as a teacher may send them, and error-message assertions
// for opd::Error.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/philox.h"
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

// Reorders the K entries of every row of dense top-K data (host tensors [rows, k]: ids i32 or
// i64, logprobs f32 or f64), in place. seed != 0: a Philox permutation per row that moves at
// least one entry of every row with k > 1; seed == 0: sorted by logprob descending, ties by
// smaller id (the protocol's order).
inline void reorder_rows(Tensor& ids, Tensor& logprobs, uint64_t seed) {
  const int64_t rows = ids.dim(0), k = ids.dim(1);
  auto id_at = [&](int64_t i) -> int64_t {
    return ids.dtype() == DType::I32 ? ids.data<int32_t>()[i] : ids.data<int64_t>()[i];
  };
  auto lp_at = [&](int64_t i) -> double {
    return logprobs.dtype() == DType::F32 ? logprobs.data<float>()[i] : logprobs.data<double>()[i];
  };
  std::vector<int64_t> perm(static_cast<size_t>(k));
  std::vector<int64_t> id_row(static_cast<size_t>(k));
  std::vector<double> lp_row(static_cast<size_t>(k));
  for (int64_t r = 0; r < rows; ++r) {
    std::iota(perm.begin(), perm.end(), int64_t{0});
    if (seed == 0) {
      std::sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) {
        const double la = lp_at(r * k + a), lb = lp_at(r * k + b);
        return la > lb || (la == lb && id_at(r * k + a) < id_at(r * k + b));
      });
    } else {
      for (int64_t i = k - 1; i > 0; --i)  // Fisher-Yates
        std::swap(perm[static_cast<size_t>(i)],
                  perm[philox_u32(seed, static_cast<uint64_t>(r), static_cast<uint64_t>(i)) %
                       static_cast<uint64_t>(i + 1)]);
      bool identity = true;
      for (int64_t i = 0; i < k; ++i) identity = identity && perm[static_cast<size_t>(i)] == i;
      if (identity && k > 1) std::rotate(perm.begin(), perm.begin() + 1, perm.end());
    }
    for (int64_t j = 0; j < k; ++j) {
      id_row[static_cast<size_t>(j)] = id_at(r * k + perm[static_cast<size_t>(j)]);
      lp_row[static_cast<size_t>(j)] = lp_at(r * k + perm[static_cast<size_t>(j)]);
    }
    for (int64_t j = 0; j < k; ++j) {
      if (ids.dtype() == DType::I32) ids.data<int32_t>()[r * k + j] = static_cast<int32_t>(id_row[j]);
      else ids.data<int64_t>()[r * k + j] = id_row[j];
      if (logprobs.dtype() == DType::F32) logprobs.data<float>()[r * k + j] = static_cast<float>(lp_row[j]);
      else logprobs.data<double>()[r * k + j] = lp_row[j];
    }
  }
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
