// A small, hand-checked ScoreResponse (2 sequences, 4 rows, k = 2, vocabulary 96) shared by the
// protocol round-trip tests and the JSON fuzzer as their base value.
#pragma once

#include "teacher/protocol.h"

namespace opd::test {

inline ScoreResponse sample_response() {
  ScoreResponse r;
  r.k = 2;
  r.temperature = 0.75;
  r.vocab_size = 96;
  r.seq_begin = {2, 1};
  r.row_offsets = {0, 3, 4};
  r.ids = {1, 2, 3, 4, 5, 6, 95, 0};
  r.logprobs = {-0.5f, -1.25f, -0.1f, -3.f, -2.f, -2.5f, -0.01f, -7.f};
  r.actual_logprobs = {-4.f, -0.1f, -2.5f, -9.f};
  return r;
}

}  // namespace opd::test
