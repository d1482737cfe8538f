// Teacher/student compatibility checks (train/doctor.h) on synthetic descriptions and on real
// directories, including the base-student / instruct-teacher EOS trap.
#include <gtest/gtest.h>

#include "common/test_util.h"
#include "train/doctor.h"

namespace opd {
namespace {

ModelSide side(int64_t vocab, std::string fp, std::vector<int64_t> eos) {
  ModelSide s;
  s.where = "x";
  s.vocab_size = vocab;
  s.fingerprint = std::move(fp);
  s.eos_ids = std::move(eos);
  s.eos_token = "<eos>";
  s.num_parameters = 1000;
  s.hidden_size = 8;
  s.num_layers = 2;
  s.intermediate_size = 16;
  return s;
}

Severity worst(const std::vector<DoctorFinding>& f, const std::string& check) {
  Severity w = Severity::Ok;
  bool seen = false;
  for (const auto& x : f)
    if (x.check == check) {
      seen = true;
      if (static_cast<int>(x.severity) > static_cast<int>(w)) w = x.severity;
    }
  EXPECT_TRUE(seen) << check;
  return w;
}

TEST(Doctor, IdenticalSidesAreAllOk) {
  auto f = check_pair(side(100, "aa", {2}), side(100, "aa", {2}), false);
  for (const auto& x : f) EXPECT_EQ(x.severity, Severity::Ok) << x.check << ": " << x.message;
}

TEST(Doctor, VocabularyMismatchIsAnErrorUnlessClipping) {
  EXPECT_EQ(worst(check_pair(side(100, "aa", {2}), side(120, "bb", {2}), false), "vocab_size"), Severity::Error);
  EXPECT_EQ(worst(check_pair(side(100, "aa", {2}), side(120, "bb", {2}), true), "vocab_size"), Severity::Warning);
  // A teacher smaller than the student can never score every student id.
  EXPECT_EQ(worst(check_pair(side(120, "aa", {2}), side(100, "bb", {2}), true), "vocab_size"), Severity::Error);
  EXPECT_EQ(worst(check_pair(side(100, "aa", {2}), side(100, "bb", {2}), false), "tokenizer"), Severity::Error);
}

TEST(Doctor, DisjointEosIsCalledOut) {
  auto f = check_pair(side(100, "aa", {2}), side(100, "aa", {7, 8}), false);
  EXPECT_EQ(worst(f, "eos"), Severity::Warning);
  bool named = false;
  for (const auto& x : f) named |= x.check == "eos" && x.message.find("max-completion-length") != std::string::npos;
  EXPECT_TRUE(named);
  EXPECT_EQ(worst(check_pair(side(100, "aa", {}), side(100, "aa", {2}), false), "eos"), Severity::Error);
}

TEST(Doctor, RealDirectoriesAndMemoryEstimate) {
  const std::string dir = test::fixture_path("models/qwen3");
  ModelSide s = describe_model_dir(dir);
  EXPECT_EQ(s.vocab_size, 96);
  EXPECT_EQ(s.fingerprint.size(), 64u);
  EXPECT_FALSE(s.eos_ids.empty());
  for (const auto& x : check_pair(s, s, false)) EXPECT_NE(x.severity, Severity::Error) << x.message;
  MemoryEstimate m = estimate_memory(s, &s, 1024, 0.5);
  EXPECT_EQ(m.weights, s.num_parameters * 4);
  EXPECT_EQ(m.optimizer, s.num_parameters * 8);
  EXPECT_EQ(m.kv_cache, int64_t{1} << 29);
  EXPECT_GT(m.activations, 0);
  EXPECT_GT(available_host_memory(), 0);
}

}  // namespace
}  // namespace opd
