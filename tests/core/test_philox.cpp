// Philox4x32-10 against the Random123 known-answer vectors, and stream properties.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "core/philox.h"

namespace opd {
namespace {

TEST(Philox, KnownAnswerVectors) {
  // Random123 kat_vectors, philox4x32 with 10 rounds.
  Philox4 r = philox4x32({{0, 0, 0, 0}}, 0, 0);
  EXPECT_EQ(r.v[0], 0x6627e8d5u);
  EXPECT_EQ(r.v[1], 0xe169c58du);
  EXPECT_EQ(r.v[2], 0xbc57ac4cu);
  EXPECT_EQ(r.v[3], 0x9b00dbd8u);
  r = philox4x32({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu);
  EXPECT_EQ(r.v[0], 0x408f276du);
  EXPECT_EQ(r.v[1], 0x41c83b0eu);
  EXPECT_EQ(r.v[2], 0xa20bc7c6u);
  EXPECT_EQ(r.v[3], 0x6d5451fdu);
  r = philox4x32({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(r.v[0], 0xd16cfe09u);
  EXPECT_EQ(r.v[1], 0x94fdccebu);
  EXPECT_EQ(r.v[2], 0x5001e420u);
  EXPECT_EQ(r.v[3], 0x24126ea1u);
}

TEST(Philox, UniformIsInRangeWithMeanNearHalf) {
  double sum = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    float u = philox_uniform(42, 3, static_cast<uint64_t>(i));
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    sum += u;
  }
  EXPECT_NEAR(sum / n, 0.5, 0.005);  // 5 sigma of 1/sqrt(12 n)
}

TEST(Philox, StreamsAndSeedsDiffer) {
  std::set<uint32_t> seen;
  for (uint64_t s = 0; s < 4; ++s)
    for (uint64_t seed = 0; seed < 4; ++seed) seen.insert(philox_u32(seed, s, 0));
  EXPECT_EQ(seen.size(), 16u);
  EXPECT_EQ(philox_u32(9, 1, 12345), philox_u32(9, 1, 12345));  // pure function
}

}  // namespace
}  // namespace opd
