// TeacherClient's cancel (ClientOptions::should_cancel, a training run's stop signal) against a
// loopback fake teacher that takes requests and never answers: a call blocked in an attempt
// (/v1/score, /v1/models at connect, chunks waiting for a pooled connection) or in the backoff
// between attempts ends with ErrorKind::Cancelled within a second of the cancel, without another
// attempt; without a cancel the attempt waits its read timeout as before.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>

#include "core/error.h"
#include "teacher/client.h"
#include "teacher/protocol.h"

namespace opd {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// What the fake does with a request: answer (/v1/models: a 96-token opd teacher; /v1/score:
// `score_status` with an error body), or hang (read the request, never answer until it goes).
class HangingTeacher {
 public:
  HangingTeacher() {
    http_.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      ++models_calls_;
      if (hang_models_) hang();
      res.set_content(R"({"object":"list","data":[{"id":"fake","object":"model","opd":{"vocab_size":96,"tokenizer_fingerprint":"fp96","eos_token_ids":[2]}}]})",
                      "application/json");
    });
    http_.Post("/v1/score", [this](const httplib::Request&, httplib::Response& res) {
      ++score_calls_;
      if (hang_score_) hang();
      res.status = score_status_;
      res.set_content(R"({"error":{"message":"fake: injected"}})", "application/json");
    });
    port_ = http_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { http_.listen_after_bind(); });
    while (!http_.is_running()) std::this_thread::sleep_for(1ms);
  }
  ~HangingTeacher() {
    stopping_ = true;
    http_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

  std::atomic<bool> hang_models_{false}, hang_score_{true};
  std::atomic<int> score_status_{400};
  std::atomic<int> models_calls_{0}, score_calls_{0};

 private:
  void hang() const {
    while (!stopping_) std::this_thread::sleep_for(10ms);
  }
  httplib::Server http_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
};

ScoreRequest small_request() {  // 3 sequences of 18 + 8 + 24 scored rows
  ScoreRequest q;
  q.k = 2;
  q.temperature = 1.0;
  std::vector<int32_t> ids(50);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((7 * i + 3) % 96);
  q.sequences.push_back({std::vector<int32_t>(ids.begin(), ids.begin() + 30), 12, 30});
  q.sequences.push_back({std::vector<int32_t>(ids.begin(), ids.begin() + 9), 1, 9});
  q.sequences.push_back({ids, 20, 44});
  return q;
}

// A client of `t` whose attempts would each wait 60 s for an answer, cancelled by `cancel`.
ClientOptions options(const HangingTeacher& t, const std::atomic<bool>& cancel) {
  ClientOptions co;
  co.url = t.url();
  co.student_vocab = 96;
  co.student_fingerprint = "fp96";
  co.request_timeout_s = 60;
  co.max_attempts = 3;
  co.backoff_initial_s = 0.01;
  co.should_cancel = [&cancel] { return cancel.load(); };
  return co;
}

// Sets `cancel` after `delay`; the time it did so.
struct CancelLater {
  CancelLater(std::atomic<bool>& cancel, std::chrono::milliseconds delay)
      : thread([&cancel, delay, this] {
          std::this_thread::sleep_for(delay);
          at = Clock::now();
          cancel = true;
        }) {}
  ~CancelLater() {
    if (thread.joinable()) thread.join();
  }
  double since() {  // seconds from the cancel to now
    if (thread.joinable()) thread.join();
    return seconds_since(at);
  }
  Clock::time_point at;
  std::thread thread;
};

// Runs `call`, which must throw Cancelled; returns its message.
std::string expect_cancelled(const std::function<void()>& call) {
  try {
    call();
    ADD_FAILURE() << "not cancelled";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Cancelled) << e.what();
    EXPECT_NE(std::string(e.what()).find("a stop was requested"), std::string::npos) << e.what();
    return e.what();
  }
  return "";
}

TEST(ClientCancel, AHungScoreAttemptEndsWithinASecondOfTheCancel) {
  HangingTeacher t;
  std::atomic<bool> cancel{false};
  ClientOptions co = options(t, cancel);
  co.connections = 1;  // a connection the cancel leaked would block the next call
  TeacherClient client(co);
  const ScoreRequest q = small_request();
  {
    CancelLater later(cancel, 300ms);
    const std::string what = expect_cancelled([&] { client.score(q); });
    const double after = later.since();
    EXPECT_LT(after, 1.0) << "the cancel took " << after << " s (the attempt waits 60 s)";
    EXPECT_NE(what.find("while waiting for the answer"), std::string::npos) << what;
  }
  EXPECT_EQ(t.score_calls_.load(), 1) << "a cancelled call is not retried";
  // The client stays usable: cleared, the next call reaches the server (a 400 here: no retry).
  cancel = false;
  t.hang_score_ = false;
  EXPECT_THROW(
      {
        try {
          client.score(q);
        } catch (const Error& e) {
          EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument) << e.what();
          throw;
        }
      },
      Error);
  EXPECT_EQ(t.score_calls_.load(), 2);
  // Already cancelled: nothing is sent.
  cancel = true;
  expect_cancelled([&] { client.score(q); });
  EXPECT_EQ(t.score_calls_.load(), 2);
}

TEST(ClientCancel, AHungModelsRequestAtConnectIsCancelled) {
  HangingTeacher t;
  t.hang_models_ = true;
  std::atomic<bool> cancel{false};
  CancelLater later(cancel, 300ms);
  expect_cancelled([&] { TeacherClient c(options(t, cancel)); });
  const double after = later.since();
  EXPECT_LT(after, 1.0) << "the cancel took " << after << " s";
  EXPECT_EQ(t.models_calls_.load(), 1);
}

// Chunks in flight and a chunk waiting for a pooled connection (3 chunks, 2 connections) all end.
TEST(ClientCancel, ChunksInFlightAndWaitingForAConnectionAreCancelled) {
  HangingTeacher t;
  std::atomic<bool> cancel{false};
  ClientOptions co = options(t, cancel);
  co.connections = 2;
  co.chunks = 3;
  co.min_chunk_rows = 1;
  TeacherClient client(co);
  CancelLater later(cancel, 300ms);
  expect_cancelled([&] { client.score(small_request()); });
  const double after = later.since();
  EXPECT_LT(after, 1.0) << "the cancel took " << after << " s";
  EXPECT_EQ(t.score_calls_.load(), 2) << "the third chunk never had a connection";
}

TEST(ClientCancel, TheBackoffBetweenAttemptsIsCancelled) {
  HangingTeacher t;
  t.hang_score_ = false;
  t.score_status_ = 503;  // retried after a 20-40 s backoff
  std::atomic<bool> cancel{false};
  ClientOptions co = options(t, cancel);
  co.backoff_initial_s = 40;
  co.backoff_max_s = 40;
  TeacherClient client(co);
  CancelLater later(cancel, 300ms);
  const std::string what = expect_cancelled([&] { client.score(small_request()); });
  const double after = later.since();
  EXPECT_LT(after, 1.0) << "the cancel took " << after << " s";
  EXPECT_NE(what.find("during the backoff"), std::string::npos) << what;
  EXPECT_EQ(t.score_calls_.load(), 1);
}

// The other side of the option: a predicate that never says stop, or none, leaves a hung attempt
// to its read timeout (Io), as before.
TEST(ClientCancel, WithoutACancelTheHungAttemptWaitsItsReadTimeout) {
  HangingTeacher t;
  std::atomic<bool> never{false};
  for (const bool with_predicate : {true, false}) {
    SCOPED_TRACE(with_predicate ? "predicate never true" : "no predicate");
    ClientOptions co = options(t, never);
    if (!with_predicate) co.should_cancel = nullptr;
    co.request_timeout_s = 1.0;
    co.max_attempts = 1;
    TeacherClient client(co);
    const auto t0 = Clock::now();
    try {
      client.score(small_request());
      ADD_FAILURE() << "a hung attempt answered";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Io) << e.what();
    }
    EXPECT_GE(seconds_since(t0), 0.9);
  }
}

}  // namespace
}  // namespace opd
