// The score request the shared-prompt tests run on the CPU scorer (tests/teacher/
// test_shared_prompt.cpp) and the CUDA scorer (tests/cuda/test_cuda_scorer_shared.cpp): three
// completions of prompt A (30 tokens; begin 30 -> a shared prompt of 28 tokens with blocks of 4),
// one of them duplicated and one an exact prefix of another; two completions of prompt B (45
// tokens, longer than 20-token batches: prefilled in chunks), one scored from a later position;
// an unrelated sequence; a sequence with nothing scored. Ids are Philox-random below V.
#pragma once

#include <cstdint>
#include <vector>

#include "common/philox_ids.h"
#include "teacher/scorer.h"

namespace opd::test {

inline std::vector<int32_t> shared_prompt_random_ids(uint64_t seed, int64_t len, int64_t V) {
  return philox_ids(seed, 11, len, V);
}

inline ScoreRequest shared_prompt_request(int64_t V, int64_t k, double T, bool with_ranks) {
  auto with_completion = [&](const std::vector<int32_t>& prompt, uint64_t c, int64_t len) {
    std::vector<int32_t> ids = prompt;  // prompt ++ the c-th random completion of len tokens
    for (int32_t id : shared_prompt_random_ids(1000 + c, len, V)) ids.push_back(id);
    return ids;
  };
  ScoreRequest q;
  q.k = k;
  q.temperature = T;
  q.with_ranks = with_ranks;
  const auto A = shared_prompt_random_ids(1, 30, V), B = shared_prompt_random_ids(2, 45, V);
  const auto a0 = with_completion(A, 0, 25), a1 = with_completion(A, 1, 33);
  const auto a2 = with_completion(A, 2, 12);
  q.sequences.push_back({a0, 30, 55});
  q.sequences.push_back({a1, 30, 63});
  q.sequences.push_back({a0, 30, 55});  // duplicate of a0
  q.sequences.push_back({std::vector<int32_t>(a1.begin(), a1.begin() + 50), 30, 50});  // prefix
  q.sequences.push_back({a2, 30, 42});
  const auto b0 = with_completion(B, 3, 15), b1 = with_completion(B, 4, 19);
  q.sequences.push_back({b0, 45, 60});
  q.sequences.push_back({b1, 50, 64});  // scored from a later position: same 44-token prompt
  q.sequences.push_back({shared_prompt_random_ids(9, 40, V), 5, 40});
  q.sequences.push_back({b0, 20, 20});  // nothing scored
  return q;
}

}  // namespace opd::test
