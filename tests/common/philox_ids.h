// Reproducible random token ids for tests: element i of Philox stream (seed, stream) modulo the
// vocabulary (core/philox.h). Each test family keeps its own stream number, so the ids its
// fixtures and tolerances were written against do not change.
#pragma once

#include <cstdint>
#include <vector>

#include "core/philox.h"

namespace opd::test {

// `len` ids in [0, vocab): philox_u32(seed, stream, i) % vocab for i = 0 .. len-1.
inline std::vector<int32_t> philox_ids(uint64_t seed, uint64_t stream, int64_t len,
                                       int64_t vocab) {
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < len; ++i)
    ids.push_back(
        static_cast<int32_t>(philox_u32(seed, stream, static_cast<uint64_t>(i)) % vocab));
  return ids;
}

}  // namespace opd::test
