// The score request the scorer tests run on the CPU scorer (tests/teacher/test_scorer.cpp) and
// the CUDA scorer (tests/cuda/test_cuda_scorer.cpp): a batch with everything the dedupe and
// packing must get right: different lengths, an exact duplicate, a prefix of another sequence,
// the same prompt with different completions, an empty scored range, and a range ending before
// the sequence does. Ids are Philox-random below V (stream 7).
#pragma once

#include <cstdint>
#include <vector>

#include "common/philox_ids.h"
#include "teacher/scorer.h"

namespace opd::test {

inline ScoreRequest mixed_score_request(int64_t V, int64_t k, double T, bool with_ranks) {
  ScoreRequest q;
  q.k = k;
  q.temperature = T;
  q.with_ranks = with_ranks;
  auto a = philox_ids(1, 7, 40, V), b = philox_ids(2, 7, 17, V), c = philox_ids(3, 7, 63, V);
  q.sequences.push_back({a, 10, 40});
  q.sequences.push_back({b, 1, 17});
  q.sequences.push_back({a, 10, 40});                                              // duplicate
  q.sequences.push_back({std::vector<int32_t>(a.begin(), a.begin() + 25), 5, 25});  // prefix
  auto a2 = a;
  for (size_t i = 20; i < a2.size(); ++i) a2[i] = static_cast<int32_t>((a2[i] + 1) % V);
  q.sequences.push_back({a2, 20, 40});  // same prompt, another completion
  q.sequences.push_back({b, 9, 9});     // nothing scored
  q.sequences.push_back({c, 30, 50});   // ends early
  return q;
}

}  // namespace opd::test
