// data/sampler: each epoch is a permutation, reproducible from (seed, epoch) alone, different
// across epochs and seeds, unbiased (chi-square over all orders of 4 items), sequential order
// when shuffling is off, and a cursor saved at any point and restored into a fresh sampler
// continues with exactly the indices an uninterrupted run produces, across epoch boundaries.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>

#include "core/error.h"
#include "data/sampler.h"

namespace opd {
namespace {

bool is_permutation_of_n(std::vector<uint64_t> p, uint64_t n) {
  if (p.size() != n) return false;
  std::sort(p.begin(), p.end());
  for (uint64_t k = 0; k < n; ++k) if (p[k] != k) return false;
  return true;
}

TEST(Sampler, EpochsArePermutationsReproducibleAndDistinct) {
  for (uint64_t n : {1ull, 2ull, 7ull, 1000ull}) {
    Sampler a(n, 1234, SampleOrder::Shuffled, "fp"), b(n, 1234, SampleOrder::Shuffled, "fp");
    for (uint64_t e = 0; e < 3; ++e) {
      auto p = a.permutation(e);
      EXPECT_TRUE(is_permutation_of_n(p, n)) << n;
      EXPECT_EQ(p, b.permutation(e));
    }
    if (n >= 7) {
      EXPECT_NE(a.permutation(0), a.permutation(1)) << n;
      Sampler c(n, 1235, SampleOrder::Shuffled, "fp");
      EXPECT_NE(a.permutation(0), c.permutation(0)) << n;
      std::vector<uint64_t> identity(n);
      std::iota(identity.begin(), identity.end(), 0);
      EXPECT_NE(a.permutation(0), identity);
    }
  }
}

TEST(Sampler, SequentialOrderWhenShufflingIsOff) {
  Sampler s(5, 99, SampleOrder::Sequential, "fp");
  std::vector<uint64_t> got;
  for (int k = 0; k < 12; ++k) got.push_back(s.next());
  EXPECT_EQ(got, (std::vector<uint64_t>{0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1}));
  EXPECT_EQ(s.cursor().epoch, 2u);
  EXPECT_EQ(s.cursor().index, 2u);
  EXPECT_EQ(s.cursor().consumed, 12u);
}

// All 24 orders of 4 items over 24,000 (seed, epoch) pairs: chi-square with 23 degrees of freedom
// stays under 60 (p ~ 4e-5) for a uniform shuffle; a biased one (e.g. j = r % n for all k, or an
// off-by-one range) lands in the hundreds.
TEST(Sampler, ShuffleIsUniform) {
  std::map<std::vector<uint64_t>, int> counts;
  const int trials = 24000;
  for (int t = 0; t < trials; ++t) {
    Sampler s(4, 7 + t / 8, SampleOrder::Shuffled, "fp");
    counts[s.permutation(t % 8)]++;
  }
  ASSERT_EQ(counts.size(), 24u);
  double chi2 = 0, expect = trials / 24.0;
  for (const auto& [p, c] : counts) chi2 += (c - expect) * (c - expect) / expect;
  EXPECT_LT(chi2, 60.0);
}

TEST(Sampler, ResumedRunSeesExactlyTheSameSamples) {
  const uint64_t n = 13;
  Sampler straight(n, 42, SampleOrder::Shuffled, "fp");
  std::vector<uint64_t> want;
  for (int k = 0; k < 50; ++k) want.push_back(straight.next());
  for (int stop : {0, 1, 12, 13, 14, 26, 49}) {
    Sampler first(n, 42, SampleOrder::Shuffled, "fp");
    std::vector<uint64_t> got;
    for (int k = 0; k < stop; ++k) got.push_back(first.next());
    const std::string saved = first.save().dump();  // through text, as in a checkpoint
    Sampler resumed(n, 42, SampleOrder::Shuffled, "fp");
    resumed.restore(nlohmann::json::parse(saved));
    EXPECT_EQ(resumed.cursor().consumed, static_cast<uint64_t>(stop));
    while (got.size() < want.size()) got.push_back(resumed.next());
    EXPECT_EQ(got, want) << "stopped after " << stop;
  }
  // Each epoch of the uninterrupted run covers every sample once.
  for (int e = 0; e < 3; ++e) {
    EXPECT_TRUE(is_permutation_of_n(std::vector<uint64_t>(want.begin() + e * n, want.begin() + (e + 1) * n), n));
  }
}

TEST(Sampler, RestoreRefusesAMismatchedCursor) {
  Sampler s(10, 5, SampleOrder::Shuffled, "abc");
  for (int k = 0; k < 3; ++k) s.next();
  nlohmann::json good = s.save();
  auto expect_error = [&](nlohmann::json j, const char* text, Sampler target) {
    try {
      target.restore(j);
      ADD_FAILURE() << "expected an error for " << j.dump();
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect_error(good, "seed 5, this run has seed 6", Sampler(10, 6, SampleOrder::Shuffled, "abc"));
  expect_error(good, "for 10 samples, this dataset has 11", Sampler(11, 5, SampleOrder::Shuffled, "abc"));
  expect_error(good, "order shuffled, this run uses sequential", Sampler(10, 5, SampleOrder::Sequential, "abc"));
  expect_error(good, "saved for dataset abc, this dataset is xyz", Sampler(10, 5, SampleOrder::Shuffled, "xyz"));
  auto j = good;
  j.erase("index");
  expect_error(j, "missing field \"index\"", Sampler(10, 5, SampleOrder::Shuffled, "abc"));
  j = good;
  j["index"] = 11;
  expect_error(j, "index 11 is past the 10 samples", Sampler(10, 5, SampleOrder::Shuffled, "abc"));
  j = good;
  j["consumed"] = 4;
  expect_error(j, "consumed 4 does not equal", Sampler(10, 5, SampleOrder::Shuffled, "abc"));
  j = good;
  j["epoch"] = -1;
  expect_error(j, "\"epoch\" must be a non-negative integer", Sampler(10, 5, SampleOrder::Shuffled, "abc"));
  Sampler ok(10, 5, SampleOrder::Shuffled, "abc");
  ok.restore(good);
  EXPECT_EQ(ok.cursor().index, 3u);
}

}  // namespace
}  // namespace opd
