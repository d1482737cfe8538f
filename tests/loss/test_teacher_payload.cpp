// Teacher payload validation (loss/teacher_payload.h): every rejection path with its own
// message naming sequence, position, value and limit; the padding and ClipToStudent rules; and
// a randomized test of thousands of corrupted payloads, each either rejected with opd::Error or
// accepted and then giving a finite loss and gradients (never a crash; also run under ASan).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "core/philox.h"
#include "loss/fused_loss.h"
#include "loss/loss_test_util.h"
#include "loss/teacher_payload.h"

namespace opd {
namespace {

constexpr int64_t kVocab = 64;

// Two sequences (3 rows at position 5, 2 rows at position 9), K = 4 distinct ids per row with
// probabilities that sum below 1, drawn from `seed`.
TeacherPayload valid_payload(uint64_t seed, int64_t k = 4) {
  const std::vector<int64_t> lengths{3, 2};
  const int64_t rows = 5;
  Tensor ids = Tensor::empty({rows, k}, DType::I64);
  Tensor lp = Tensor::empty({rows, k}, DType::F64);
  Tensor actual = Tensor::empty({rows}, DType::F64);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t start = philox_u32(seed, 1, r) % kVocab;
    const int64_t stride = 1 + 2 * (philox_u32(seed, 2, r) % 7);  // odd: distinct mod 64
    for (int64_t j = 0; j < k; ++j) {
      ids.data<int64_t>()[r * k + j] = (start + j * stride) % kVocab;
      const double u = 0.05 + philox_uniform(seed, 3, r * k + j);
      lp.data<double>()[r * k + j] = std::log(u / (1.2 * k));
    }
    actual.data<double>()[r] = std::log(0.01 + 0.3 * philox_uniform(seed, 4, r));
  }
  return test::payload_from_dense({5, 9}, lengths, ids, lp, actual, kVocab);
}

TeacherTopK validate(const TeacherPayload& pl, const CompletionLayout& layout,
                     VocabPolicy policy = VocabPolicy::Error, PayloadStats* stats = nullptr) {
  LossConfig cfg;
  cfg.vocab_policy = policy;
  return validate_teacher_payload(pl, layout, kVocab, cfg, DType::F64, stats);
}

// The output slot of input entry e (its row's slot holding the same id; -1 if none).
int64_t slot_of(const TeacherTopK& t, const TeacherPayload& pl, int64_t e) {
  const int64_t r = e / pl.k;
  for (int64_t j = 0; j < t.k; ++j)
    if (t.ids.data<int32_t>()[r * t.k + j] == pl.ids[e]) return r * t.k + j;
  return -1;
}

TEST(TeacherPayload, ValidPayloadBecomesDenseTopK) {
  TeacherPayload pl = valid_payload(1);
  PayloadStats stats;
  TeacherTopK t = validate(pl, test::layout_of(pl), VocabPolicy::Error, &stats);
  ASSERT_EQ(t.rows, 5);
  ASSERT_EQ(t.k, 4);
  // Every entry lands in its row unchanged; the row in the canonical order (logprob
  // descending). valid_payload draws rows in no order, so some had to be reordered.
  for (int64_t i = 0; i < 20; ++i) {
    const int64_t o = slot_of(t, pl, i);
    ASSERT_GE(o, 0) << "entry " << i << " (id " << pl.ids[i] << ") is missing";
    EXPECT_EQ(o / 4, i / 4);
    EXPECT_EQ(t.logprobs.data<double>()[o], pl.logprobs[i]);
    if (i % 4 > 0) EXPECT_GE(t.logprobs.data<double>()[i - 1], t.logprobs.data<double>()[i]);
  }
  EXPECT_GT(stats.reordered_rows, 0);
  for (int64_t r = 0; r < 5; ++r) {
    EXPECT_EQ(t.valid.data<int32_t>()[r], 1);
    EXPECT_EQ(t.actual_logprobs.data<double>()[r], pl.actual_logprobs[r]);
  }
  // f32 output dtype: same values rounded.
  TeacherTopK t32 = validate_teacher_payload(pl, test::layout_of(pl), kVocab, LossConfig{}, DType::F32);
  EXPECT_EQ(t32.logprobs.data<float>()[slot_of(t32, pl, 7)], static_cast<float>(pl.logprobs[7]));
}

// One corruption per validation rule: its mutation, the phrases its message must contain
// (sequence, position, value, limit where they apply), and a key phrase no other message has.
struct Rule {
  const char* name;
  std::function<void(TeacherPayload&, CompletionLayout&)> mutate;
  std::vector<std::string> parts;  // parts[0] is the key phrase
  ErrorKind kind = ErrorKind::InvalidData;
  VocabPolicy policy = VocabPolicy::Error;
};

std::vector<Rule> rules() {
  // Row 3 is sequence 1, position 9 (rows 3, 4 at positions 9, 10); its entries are 12..15.
  return {
      {"id >= student vocab", [](TeacherPayload& p, CompletionLayout&) { p.ids[13] = 64; },
       {"outside the student vocabulary", "sequence 1, position 9 (row 3)", "id 64", "[0, 64)"}},
      {"negative id", [](TeacherPayload& p, CompletionLayout&) { p.ids[13] = -3; },
       {"outside the student vocabulary", "sequence 1, position 9", "id -3", "[0, 64)"}},
      {"id >= teacher vocab",
       [](TeacherPayload& p, CompletionLayout&) {
         for (size_t j = 0; j < p.ids.size(); ++j) p.ids[j] = static_cast<int64_t>(j);  // all < 50
         p.teacher_vocab = 50;
         p.ids[13] = 55;
       },
       {"outside the teacher vocabulary", "sequence 1, position 9", "id 55", "[0, 50)"}},
      {"huge id (clip)",
       [](TeacherPayload& p, CompletionLayout&) {
         p.teacher_vocab = 80;
         p.ids[13] = int64_t{1} << 40;
       },
       {"outside the teacher vocabulary", "id 1099511627776", "[0, 80)"},
       ErrorKind::InvalidData,
       VocabPolicy::ClipToStudent},
      {"repeated id", [](TeacherPayload& p, CompletionLayout&) { p.ids[14] = p.ids[12]; },
       {"is repeated", "sequence 1, position 9", "entries 0 and 2"}},
      {"fewer than K",
       [](TeacherPayload& p, CompletionLayout&) {
         p.ids.erase(p.ids.begin() + 13);
         p.logprobs.erase(p.logprobs.begin() + 13);
         for (size_t r = 4; r < p.entry_offsets.size(); ++r) p.entry_offsets[r] -= 1;
       },
       {"entries, expected K", "sequence 1, position 9", "has 3 entries", "K = 4"}},
      {"more than K",
       [](TeacherPayload& p, CompletionLayout&) {
         p.ids.insert(p.ids.begin() + 13, 63);
         p.logprobs.insert(p.logprobs.begin() + 13, -9.0);
         for (size_t r = 4; r < p.entry_offsets.size(); ++r) p.entry_offsets[r] += 1;
       },
       {"entries, expected K", "sequence 1, position 9", "has 5 entries", "K = 4"}},
      {"NaN logprob", [](TeacherPayload& p, CompletionLayout&) { p.logprobs[13] = NAN; },
       {"is NaN", "sequence 1, position 9", "entry 1"}},
      {"+inf logprob", [](TeacherPayload& p, CompletionLayout&) { p.logprobs[13] = INFINITY; },
       {"is +inf", "sequence 1, position 9", "<= 0"}},
      {"-inf logprob in a real row",
       [](TeacherPayload& p, CompletionLayout&) { p.logprobs[13] = -INFINITY; },
       {"-inf in a non-padding row", "sequence 1, position 9"}},
      {"not a sub-distribution", [](TeacherPayload& p, CompletionLayout&) { p.logprobs[13] = -0.01; },
       {"not a sub-distribution", "sequence 1, position 9", "> 1 + tolerance 0.001"}},
      {"huge logprob", [](TeacherPayload& p, CompletionLayout&) { p.logprobs[13] = 1e30; },
       {"not a sub-distribution", "sequence 1, position 9"}},
      {"actual logprob NaN", [](TeacherPayload& p, CompletionLayout&) { p.actual_logprobs[3] = NAN; },
       {"actual-token logprob nan", "sequence 1, position 9"}},
      {"actual logprob > 0", [](TeacherPayload& p, CompletionLayout&) { p.actual_logprobs[3] = 0.5; },
       {"actual-token logprob 0.5 is outside", "sequence 1, position 9"}},
      {"position count",
       [](TeacherPayload& p, CompletionLayout& l) { l.length = {2, 3}; },
       {"positions, the completion has", "sequence 0", "scored 3", "has 2"}},
      {"position offset",
       [](TeacherPayload& p, CompletionLayout&) { p.seq_first_position[1] = 10; },
       {"teacher positions start at", "sequence 1", "start at 10", "starts at position 9"}},
      {"sequence count",
       [](TeacherPayload& p, CompletionLayout&) { p.seq_first_position.push_back(20); },
       {"sequences, the completion batch has", "has 3", "has 2"}},
      {"row offsets not monotone",
       [](TeacherPayload& p, CompletionLayout&) { p.seq_row_offsets[1] = 7; },
       {"seq_row_offsets[1] = 7 is not in", "[0, 5]"}},
      {"entry offsets beyond the array",
       [](TeacherPayload& p, CompletionLayout&) { p.entry_offsets[2] = int64_t{1} << 50; },
       {"entry_offsets[2] = 1125899906842624 is not in", "[4, 20]"}},
      {"entry offsets size",
       [](TeacherPayload& p, CompletionLayout&) { p.entry_offsets.pop_back(); },
       {"entry_offsets has 5 entries, expected rows + 1 = 6"}},
      {"ids/logprobs size",
       [](TeacherPayload& p, CompletionLayout&) { p.logprobs.pop_back(); },
       {"20 ids but 19 logprobs"}},
      {"actual logprobs size",
       [](TeacherPayload& p, CompletionLayout&) { p.actual_logprobs.pop_back(); },
       {"actual_logprobs has 4 entries but seq_row_offsets covers 5 rows"}},
      {"teacher vocab larger",
       [](TeacherPayload& p, CompletionLayout&) { p.teacher_vocab = 65; },
       {"is larger than the student's", "teacher vocabulary 65", "64", "clip-to-student"}},
      {"k larger than vocab", [](TeacherPayload& p, CompletionLayout&) { p.k = 65; },
       {"k = 65 is outside", "[0, student vocabulary 64]"}},
      {"all ids clipped",
       [](TeacherPayload& p, CompletionLayout&) {
         p.teacher_vocab = 100;
         for (int j = 12; j < 16; ++j) p.ids[j] = 64 + j;
       },
       {"clip-to-student leaves no entry", "sequence 1, position 9", "all 4 ids"},
       ErrorKind::InvalidData,
       VocabPolicy::ClipToStudent},
  };
}

TEST(TeacherPayload, EveryRuleHasItsOwnNamedError) {
  std::vector<std::string> messages;
  const std::vector<Rule> all = rules();
  for (const Rule& rule : all) {
    SCOPED_TRACE(rule.name);
    TeacherPayload pl = valid_payload(7);
    CompletionLayout layout = test::layout_of(pl);
    // The unmodified payload passes under the rule's policy (so the error is the mutation's).
    EXPECT_NO_THROW(validate(pl, layout, rule.policy));
    rule.mutate(pl, layout);
    messages.push_back(test::expect_error([&] { validate(pl, layout, rule.policy); }, rule.kind,
                                          rule.parts));
  }
  // Distinct: a rule's key phrase appears only in messages of rules sharing that key phrase.
  for (size_t i = 0; i < all.size(); ++i)
    for (size_t j = 0; j < all.size(); ++j)
      if (all[i].parts[0] != all[j].parts[0])
        EXPECT_EQ(messages[j].find(all[i].parts[0]), std::string::npos)
            << all[i].name << " key phrase in the message of " << all[j].name;
}

TEST(TeacherPayload, PaddingRowsMayHoldMinusInfAndAreEmptied) {
  TeacherPayload pl = valid_payload(3);
  CompletionLayout layout = test::layout_of(pl);
  pl.logprobs[13] = -INFINITY;
  pl.actual_logprobs[3] = -INFINITY;
  pl.ids[14] = pl.ids[12];  // a repeated filler id is fine in padding
  layout.padding = {0, 0, 0, 1, 0};
  PayloadStats stats;
  TeacherTopK t = validate(pl, layout, VocabPolicy::Error, &stats);
  EXPECT_EQ(stats.padding_rows, 1);
  EXPECT_EQ(t.valid.data<int32_t>()[3], 0);
  EXPECT_EQ(t.valid.data<int32_t>()[4], 1);
  for (int j = 0; j < 4; ++j) EXPECT_EQ(t.ids.data<int32_t>()[12 + j], kEmptySlot);
  // Padding does not excuse NaN, +inf or an out-of-range id.
  for (int which = 0; which < 3; ++which) {
    TeacherPayload bad = pl;
    if (which == 0) bad.logprobs[12] = NAN;
    if (which == 1) bad.logprobs[12] = INFINITY;
    if (which == 2) bad.ids[12] = 1000;
    EXPECT_THROW(validate(bad, layout), Error) << which;
  }
  // Without the padding mark the same payload is rejected.
  layout.padding = {0, 0, 0, 0, 0};
  test::expect_error([&] { validate(pl, layout); }, ErrorKind::InvalidData, {"-inf in a non-padding row"});
}

TEST(TeacherPayload, ClipToStudentDropsAndRenormalizes) {
  TeacherPayload pl = valid_payload(4);
  pl.teacher_vocab = 80;
  pl.ids[13] = 70;   // row 3: one id beyond the student vocabulary
  pl.ids[2] = 79;    // row 0
  pl.ids[3] = 64;    // row 0
  CompletionLayout layout = test::layout_of(pl);
  test::expect_error([&] { validate(pl, layout, VocabPolicy::Error); }, ErrorKind::InvalidData,
                     {"teacher vocabulary 80 is larger than the student's 64"});
  PayloadStats stats;
  TeacherTopK t = validate(pl, layout, VocabPolicy::ClipToStudent, &stats);
  EXPECT_EQ(stats.clipped_ids, 3);
  EXPECT_EQ(stats.clipped_rows, 2);
  const double dropped3 = std::exp(pl.logprobs[13]);
  const double dropped0 = std::exp(pl.logprobs[2]) + std::exp(pl.logprobs[3]);
  EXPECT_DOUBLE_EQ(stats.max_clipped_mass, std::max(dropped0, dropped3));
  // The dropped entries are empty slots (row 3: one, row 0: two), the kept ones renormalized.
  auto empty_slots = [&](int64_t r) {
    int n = 0;
    for (int64_t j = 0; j < 4; ++j)
      if (t.ids.data<int32_t>()[r * 4 + j] == kEmptySlot) {
        ++n;
        EXPECT_EQ(t.logprobs.data<double>()[r * 4 + j], -INFINITY);
      }
    return n;
  };
  EXPECT_EQ(empty_slots(3), 1);
  EXPECT_EQ(empty_slots(0), 2);
  for (int j : {12, 14, 15}) {
    const int64_t o = slot_of(t, pl, j);
    ASSERT_GE(o, 0);
    // p'(i) = p(i) / (1 - dropped): the kept mass renormalized to the student's vocabulary.
    EXPECT_NEAR(std::exp(t.logprobs.data<double>()[o]), std::exp(pl.logprobs[j]) / (1 - dropped3), 1e-15);
  }
  EXPECT_NEAR(std::exp(t.actual_logprobs.data<double>()[3]),
              std::exp(pl.actual_logprobs[3]) / (1 - dropped3), 1e-15);
  EXPECT_NEAR(std::exp(t.logprobs.data<double>()[slot_of(t, pl, 0)]),
              std::exp(pl.logprobs[0]) / (1 - dropped0), 1e-15);
  // Rows without dropped ids are untouched.
  EXPECT_EQ(t.logprobs.data<double>()[slot_of(t, pl, 5)], pl.logprobs[5]);
  // The clipped payload computes (empty slots are skipped by the kernel).
  Tensor hidden = test::random_uniform({5, 8}, DType::F64, 11, -1, 1);
  Tensor lm_head = test::random_uniform({kVocab, 8}, DType::F64, 12, -1, 1);
  FusedLossArgs a;
  a.hidden = hidden;
  a.lm_head = lm_head;
  a.targets = test::random_ints({5}, 13, 0, kVocab);
  a.weights = test::random_uniform({5}, DType::F64, 14, 0.5, 1);
  a.teacher = &t;
  a.n_total = 5;
  for (SupportMode m : {SupportMode::TopK, SupportMode::TopKTail, SupportMode::Sampled}) {
    LossConfig cfg;
    cfg.mode = m;
    EXPECT_TRUE(std::isfinite(fused_lm_head_loss(cfg, a, nullptr, nullptr).loss));
  }
}

// ---- randomized corruptions ---------------------------------------------------------------
enum class Corruption {
  None, IdOutOfRange, IdNegative, IdHuge, IdRepeated, DropEntry, AddEntry, NanLogprob,
  PosInfLogprob, NegInfLogprob, HugeLogprob, TinyLogprob, ActualNan, ActualPositive, ShiftPosition,
  MoveRow, OffsetGarbage, WrongK, TeacherVocabLarger, PadRow, kCount
};

TEST(TeacherPayload, RandomCorruptionsAreRejectedOrComputeFinitely) {
  const int cases = 6000;  // ~0.4 s, ~1.3 s under ASan
  const int64_t h = 8;
  Tensor lm_head = test::random_uniform({kVocab, h}, DType::F64, 21, -2, 2);
  int accepted = 0, rejected = 0;
  for (int it = 0; it < cases; ++it) {
    const uint64_t seed = 1000 + it;
    auto rnd = [&, n = uint64_t{0}](uint64_t m) mutable {
      return static_cast<int64_t>(philox_u32(seed, 77, n++) % m);
    };
    const int64_t k = 1 + rnd(5);
    TeacherPayload pl = valid_payload(seed, k);
    CompletionLayout layout = test::layout_of(pl);
    const VocabPolicy policy = rnd(3) == 0 ? VocabPolicy::ClipToStudent : VocabPolicy::Error;
    if (policy == VocabPolicy::ClipToStudent && rnd(2)) pl.teacher_vocab = kVocab + 1 + rnd(40);
    bool must_reject = false;
    const int n_corrupt = static_cast<int>(rnd(4));
    for (int c = 0; c < n_corrupt; ++c) {
      const auto kind = static_cast<Corruption>(rnd(static_cast<uint64_t>(Corruption::kCount)));
      const int64_t e = rnd(pl.ids.size() ? pl.ids.size() : 1);
      const int64_t row = rnd(5);
      if (pl.ids.empty() && kind != Corruption::PadRow) continue;
      switch (kind) {
        case Corruption::None: break;
        case Corruption::IdOutOfRange: pl.ids[e] = kVocab + rnd(50); break;
        case Corruption::IdNegative: pl.ids[e] = -1 - rnd(1000000); break;
        case Corruption::IdHuge: pl.ids[e] = (int64_t{1} << 40) + rnd(1000); break;
        case Corruption::IdRepeated: pl.ids[e] = pl.ids[rnd(pl.ids.size())]; break;
        case Corruption::DropEntry:
          if (pl.ids.size() > 1 && e < pl.entry_offsets.back()) {
            pl.ids.erase(pl.ids.begin() + e);
            pl.logprobs.erase(pl.logprobs.begin() + e);
            for (auto& o : pl.entry_offsets) if (o > e) o -= 1;
          }
          break;
        case Corruption::AddEntry:
          pl.ids.insert(pl.ids.begin() + e, rnd(kVocab));
          pl.logprobs.insert(pl.logprobs.begin() + e, -5.0 - rnd(10));
          for (auto& o : pl.entry_offsets) if (o > e) o += 1;
          break;
        case Corruption::NanLogprob: pl.logprobs[e] = NAN; break;
        case Corruption::PosInfLogprob: pl.logprobs[e] = INFINITY; break;
        case Corruption::NegInfLogprob: pl.logprobs[e] = -INFINITY; break;
        case Corruption::HugeLogprob: pl.logprobs[e] = rnd(2) ? 1e30 : 700.0; break;
        case Corruption::TinyLogprob: pl.logprobs[e] = rnd(2) ? -1e30 : -745.0; break;
        case Corruption::ActualNan: pl.actual_logprobs[row] = NAN; break;
        case Corruption::ActualPositive: pl.actual_logprobs[row] = 0.1 + rnd(100); break;
        case Corruption::ShiftPosition:
          pl.seq_first_position[rnd(2)] += 1;
          must_reject = true;
          break;
        case Corruption::MoveRow:
          pl.seq_row_offsets[1] += 1;
          must_reject = true;
          break;
        case Corruption::OffsetGarbage:
          pl.entry_offsets[1 + rnd(4)] = rnd(2) ? -int64_t(1 + rnd(9)) : (int64_t{1} << 45);
          must_reject = true;
          break;
        case Corruption::WrongK: pl.k = rnd(2) ? k + 1 : k - 1; break;
        case Corruption::TeacherVocabLarger: pl.teacher_vocab = kVocab + 1 + rnd(100); break;
        case Corruption::PadRow:
          layout.padding.resize(5, 0);
          layout.padding[row] = 1;
          break;
        case Corruption::kCount: break;
      }
    }
    // Whatever the later corruptions did, a NaN / +inf logprob or a huge id left anywhere in the
    // payload must be rejected (padding rows do not excuse them).
    for (size_t i = 0; i < pl.logprobs.size(); ++i)
      must_reject |= std::isnan(pl.logprobs[i]) || pl.logprobs[i] == INFINITY;
    for (int64_t id : pl.ids) must_reject |= id >= (int64_t{1} << 40);
    for (double a : pl.actual_logprobs) must_reject |= std::isnan(a);
    TeacherTopK t;
    try {
      LossConfig cfg;
      cfg.vocab_policy = policy;
      t = validate_teacher_payload(pl, layout, kVocab, cfg, rnd(2) ? DType::F32 : DType::F64);
    } catch (const Error& err) {
      ++rejected;
      continue;
    }
    ASSERT_FALSE(must_reject) << "case " << it << " was accepted but carries a fatal corruption";
    ++accepted;
    // Accepted: the dense payload is in range and the loss and gradients are finite.
    for (int64_t i = 0; i < t.ids.numel(); ++i) {
      const int32_t id = t.ids.data<int32_t>()[i];
      ASSERT_TRUE(id == kEmptySlot || (id >= 0 && id < kVocab)) << "case " << it;
    }
    const DType dt = t.logprobs.dtype();
    FusedLossArgs a;
    a.hidden = test::random_uniform({5, h}, dt, seed, -1, 1);
    a.lm_head = dt == DType::F32 ? lm_head.to_dtype(DType::F32) : lm_head;
    a.targets = test::random_ints({5}, seed, 0, kVocab);
    a.weights = test::random_uniform({5}, dt, seed + 1, 0.1, 1);
    a.sft_rows = test::random_ints({5}, seed + 2, 0, 2);
    a.teacher = &t;
    a.n_total = 5;
    LossConfig cfg;
    const SupportMode modes[] = {SupportMode::TopK, SupportMode::TopKTail, SupportMode::Sampled};
    cfg.mode = modes[rnd(3)];
    cfg.beta = std::vector<double>{0, 0.1, 0.5, 0.9, 1}[rnd(5)];
    cfg.temperature = std::vector<double>{0.7, 1, 1.3}[rnd(3)];
    cfg.sft_alpha = rnd(2) ? 0.2 : 0.0;
    cfg.vocab_tile = 1 + rnd(80);
    if (t.k == 0 && cfg.mode != SupportMode::Sampled) cfg.mode = SupportMode::Sampled;
    Tensor dh = Tensor::poisoned({5, h}, dt);
    Tensor dw = Tensor::zeros({kVocab, h}, dt);
    LossResult res = fused_lm_head_loss(cfg, a, &dh, &dw);
    ASSERT_TRUE(std::isfinite(res.loss)) << "case " << it << " " << describe(cfg);
    ASSERT_FALSE(test::compare(dh, dh).has_nan) << "case " << it << " " << describe(cfg);
    ASSERT_FALSE(test::compare(dw, dw).has_nan) << "case " << it << " " << describe(cfg);
  }
  std::printf("%d random payloads: %d accepted (finite loss and gradients), %d rejected\n", cases,
              accepted, rejected);
  EXPECT_GT(accepted, cases / 10);
  EXPECT_GT(rejected, cases / 3);
}

}  // namespace
}  // namespace opd
