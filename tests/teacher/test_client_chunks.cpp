// Chunked score requests (teacher/client.h, issue 7) on loopback: a TeacherServer over the CPU
// scorer, reached through a Scorer wrapper that can fail or damage the answer to one chunk.
// - plan_score_chunks: contiguous whole-sequence ranges covering the request once, about
//   rows / n rows each, cut between prompts where it can, one range for small requests;
// - the chunked call returns what one request returns (ids equal, logprobs within f32 rounding:
//   the server batches the sequences differently), validated dense rows included;
// - a chunk whose first attempt fails (HTTP 500) is retried alone, and the caller still gets
//   every row exactly once, in order;
// - a chunk answered with a malformed response fails the call with the validation error naming
//   the chunk (no partial result).
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>

#include "common/test_util.h"
#include "core/philox.h"
#include "teacher/client.h"
#include "teacher/scorer.h"
#include "teacher/server.h"

namespace opd {
namespace {

std::vector<int32_t> random_ids(uint64_t seed, int64_t len, int64_t V) {
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < len; ++i)
    ids.push_back(static_cast<int32_t>(philox_u32(seed, 5, static_cast<uint64_t>(i)) % V));
  return ids;
}

// 10 sequences: 3 prompts with 3, 4 and 2 completions, and one sequence alone.
ScoreRequest request(int64_t k) {
  ScoreRequest q;
  q.k = k;
  q.temperature = 0.9;
  uint64_t seed = 100;
  for (int64_t group : {3, 4, 2}) {
    const auto prompt = random_ids(seed++, 12 + group, 96);
    for (int64_t c = 0; c < group; ++c) {
      auto ids = prompt;
      for (int32_t id : random_ids(seed++, 20 + 3 * c, 96)) ids.push_back(id);
      q.sequences.push_back({ids, static_cast<int64_t>(prompt.size()),
                             static_cast<int64_t>(ids.size())});
    }
  }
  q.sequences.push_back({random_ids(seed, 40, 96), 3, 37});
  return q;
}

// The CPU scorer, with one chunk (the call whose first sequence is `target`) failing on its
// first `fail_times` attempts or answered with a NaN logprob.
class WrappedScorer : public Scorer {
 public:
  explicit WrappedScorer(const std::string& dir) : inner_(dir) {}
  const TeacherInfo& info() const override { return inner_.info(); }
  ScoreResponse score(const ScoreRequest& q) override {
    ++calls_;
    ScoreResponse r = inner_.score(q);
    std::lock_guard<std::mutex> lock(mu_);
    if (!q.sequences.empty() && q.sequences[0].ids == target_) {
      if (fail_times_ > 0) {
        --fail_times_;
        OPD_FAIL(Internal, "injected failure");
      }
      if (poison_ && !r.logprobs.empty()) r.logprobs[1] = std::numeric_limits<float>::quiet_NaN();
    }
    return r;
  }
  void fail(const std::vector<int32_t>& target, int times, bool poison) {
    std::lock_guard<std::mutex> lock(mu_);
    target_ = target;
    fail_times_ = times;
    poison_ = poison;
  }
  int calls() const { return calls_.load(); }

 private:
  CpuScorer inner_;
  std::mutex mu_;
  std::vector<int32_t> target_;
  int fail_times_ = 0;
  bool poison_ = false;
  std::atomic<int> calls_{0};
};

class ChunkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    scorer_ = std::make_unique<WrappedScorer>(test::fixture_path("models/qwen3"));
    ServerOptions o;
    o.port = 0;
    o.threads = 8;
    server_ = std::make_unique<TeacherServer>(*scorer_, o);
    server_->start();
  }
  ClientOptions client_options(int chunks) const {
    ClientOptions co;
    co.url = cat("http://127.0.0.1:", server_->port());
    co.student_vocab = 96;
    co.student_fingerprint = scorer_->info().fingerprint;
    co.loss.temperature = 0.9;  // the request's: the teacher applies it exactly
    co.chunks = chunks;
    co.min_chunk_rows = 1;
    co.max_attempts = 3;
    co.backoff_initial_s = 0.01;
    return co;
  }
  std::unique_ptr<WrappedScorer> scorer_;
  std::unique_ptr<TeacherServer> server_;
};

void expect_same_scores(const TeacherClient::Validated& got, const TeacherClient::Validated& want) {
  const ScoreResponse &a = got.response, &b = want.response;
  ASSERT_EQ(a.seq_begin, b.seq_begin);
  ASSERT_EQ(a.row_offsets, b.row_offsets);
  ASSERT_EQ(a.ids, b.ids);
  ASSERT_EQ(a.logprobs.size(), b.logprobs.size());
  ASSERT_EQ(a.actual_logprobs.size(), b.actual_logprobs.size());
  for (size_t i = 0; i < a.logprobs.size(); ++i)
    ASSERT_LE(std::fabs(a.logprobs[i] - b.logprobs[i]), 1e-5 + 1e-5 * std::fabs(b.logprobs[i]))
        << "entry " << i;
  for (size_t i = 0; i < a.actual_logprobs.size(); ++i)
    ASSERT_LE(std::fabs(a.actual_logprobs[i] - b.actual_logprobs[i]),
              1e-5 + 1e-5 * std::fabs(b.actual_logprobs[i]))
        << "row " << i;
  // The dense validated rows line up with the response rows.
  ASSERT_EQ(got.topk.rows, a.num_rows());
  ASSERT_EQ(got.topk.k, a.k);
  ASSERT_EQ(got.stats.rows, want.stats.rows);
  const int32_t* ids = got.topk.ids.data<int32_t>();
  for (int64_t i = 0; i < a.num_rows() * a.k; ++i) ASSERT_EQ(ids[i], a.ids[static_cast<size_t>(i)]);
  const int32_t* valid = got.topk.valid.data<int32_t>();
  for (int64_t r = 0; r < a.num_rows(); ++r) ASSERT_EQ(valid[r], 1) << "row " << r;
  const float* act = got.topk.actual_logprobs.data<float>();
  for (int64_t r = 0; r < a.num_rows(); ++r)
    ASSERT_EQ(act[r], a.actual_logprobs[static_cast<size_t>(r)]) << "row " << r;
}

TEST(ScoreChunks, PlanCoversTheRequestAndKeepsPromptsTogether) {
  const ScoreRequest q = request(3);
  const int64_t rows = q.num_rows();
  for (int chunks : {1, 2, 3, 4, 8, 100}) {
    SCOPED_TRACE(chunks);
    const auto r = plan_score_chunks(q, chunks, 1);
    ASSERT_FALSE(r.empty());
    EXPECT_LE(r.size(), static_cast<size_t>(std::min<int>(chunks, 10)));
    EXPECT_EQ(r.front().first, 0u);
    EXPECT_EQ(r.back().second, q.sequences.size());
    for (size_t i = 0; i < r.size(); ++i) {
      EXPECT_LT(r[i].first, r[i].second);
      if (i > 0) EXPECT_EQ(r[i].first, r[i - 1].second);
    }
  }
  // Three parts: each prompt's completions stay together (sequences 0-2, 3-6, 7-9).
  const auto three = plan_score_chunks(q, 3, 1);
  ASSERT_EQ(three.size(), 3u);
  EXPECT_EQ(three[0], (std::pair<size_t, size_t>{0, 3}));
  EXPECT_EQ(three[1], (std::pair<size_t, size_t>{3, 7}));
  EXPECT_EQ(three[2], (std::pair<size_t, size_t>{7, 10}));
  // Small requests (and chunks = 1) go whole.
  EXPECT_EQ(plan_score_chunks(q, 8, rows).size(), 1u);
  EXPECT_EQ(plan_score_chunks(q, 8, rows / 2 + 1).size(), 1u);
  EXPECT_EQ(plan_score_chunks(q, 8, rows / 2).size(), 2u);
  EXPECT_EQ(plan_score_chunks(q, 1, 1).size(), 1u);
  ScoreRequest empty;
  EXPECT_EQ(plan_score_chunks(empty, 8, 1), (std::vector<std::pair<size_t, size_t>>{{0, 0}}));
}

TEST_F(ChunkTest, ChunkedEqualsOneRequest) {
  for (int64_t k : {int64_t{0}, int64_t{5}}) {
    SCOPED_TRACE(k);
    const ScoreRequest q = request(k);
    TeacherClient whole(client_options(1)), chunked(client_options(4));
    const TeacherClient::Validated want = whole.score_validated(q);
    const TeacherClient::Validated got = chunked.score_validated(q);
    EXPECT_EQ(whole.stats().chunks, 1);
    EXPECT_EQ(chunked.stats().chunks, 4);
    EXPECT_EQ(chunked.stats().requests, 1);
    expect_same_scores(got, want);
  }
}

TEST_F(ChunkTest, FailedChunkIsRetriedAndEachRowReturnedOnce) {
  const ScoreRequest q = request(4);
  TeacherClient whole(client_options(1)), chunked(client_options(4));
  const TeacherClient::Validated want = whole.score_validated(q);
  const auto ranges = plan_score_chunks(q, 4, 1);
  ASSERT_EQ(ranges.size(), 4u);
  scorer_->fail(q.sequences[ranges[2].first].ids, /*times=*/2, /*poison=*/false);
  const int calls = scorer_->calls();
  const TeacherClient::Validated got = chunked.score_validated(q);
  EXPECT_EQ(scorer_->calls() - calls, 4 + 2);  // 4 chunks, the third one twice more
  EXPECT_EQ(chunked.stats().retries, 2);
  EXPECT_EQ(chunked.stats().chunks, 4);
  expect_same_scores(got, want);
  // Past max_attempts the call fails as a whole, naming the chunk.
  scorer_->fail(q.sequences[ranges[1].first].ids, /*times=*/3, /*poison=*/false);
  try {
    chunked.score(q);
    ADD_FAILURE() << "a chunk failed on every attempt but the call returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Io) << e.what();
    EXPECT_NE(std::string(e.what()).find("chunk 2 of 4"), std::string::npos) << e.what();
  }
}

TEST_F(ChunkTest, MalformedChunkIsANamedError) {
  const ScoreRequest q = request(4);
  TeacherClient chunked(client_options(4));
  const auto ranges = plan_score_chunks(q, 4, 1);
  scorer_->fail(q.sequences[ranges[2].first].ids, /*times=*/0, /*poison=*/true);
  try {
    chunked.score(q);
    ADD_FAILURE() << "a NaN logprob in chunk 3 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData) << e.what();
    const std::string what = e.what();
    EXPECT_NE(what.find("chunk 3 of 4"), std::string::npos) << what;
    EXPECT_NE(what.find("is NaN"), std::string::npos) << what;
  }
  EXPECT_EQ(chunked.stats().requests, 0);
}

}  // namespace
}  // namespace opd
