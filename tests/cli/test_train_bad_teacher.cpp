// `opd train --teacher-url` against a teacher that answers wrongly (robustness.md session 16,
// "a teacher that answers wrongly"): an in-process fake of `opd serve` (/v1/models, /v1/score in
// binary or JSON) scores with the real CpuScorer and corrupts chosen answers: values (NaN, +inf,
// positive logprobs, duplicated / out-of-vocabulary / negative ids, rows summing above 1),
// shapes (rows, K), bytes (CRC, truncation), HTTP (5xx, non-JSON, empty 200), sockets (no answer,
// a reset half-way) and identity (/v1/models). Each run is the whole `opd train` loop as a process.
#include <gtest/gtest.h>

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include <signal.h>

#include "common/child_process.h"
#include "common/run_dir_test.h"
#include "common/test_util.h"
#include "teacher/protocol.h"
#include "teacher/scorer.h"
#include "train/checkpoint.h"
#include "train/metrics.h"

namespace opd {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using test::spawn;

// What the fake teacher does with one /v1/score request.
struct Answer {
  int status = 200;                                // 5xx etc.: an error body is sent
  std::function<void(ScoreResponse&)> edit;        // applied to the correct response
  std::function<void(std::string&)> bytes;        // applied to the encoded body
  std::optional<std::string> raw;                 // sent instead (with raw_type)
  std::string raw_type = "application/json";
  bool hang = false;  // read the request, never answer (until the fake stops)
  bool cut = false;   // send the first half of the body, then close the connection
};

// A fake `opd serve`: the real scorer's answers, corrupted by `plan(n)` for the n-th (1-based)
// /v1/score request. /v1/models reports the teacher's own identity unless `models_edit` changes it.
class FakeTeacher {
 public:
  explicit FakeTeacher(const std::string& model_dir) : scorer_(model_dir) {
    server_.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      ++models_requests_;
      if (hang_models)
        while (!stopping_) std::this_thread::sleep_for(10ms);
      const TeacherInfo& info = scorer_.info();
      nlohmann::json m = {{"id", "fake"}, {"object", "model"}, {"max_model_len", info.max_model_len}};
      m["opd"] = {{"vocab_size", info.vocab_size},
                  {"tokenizer_fingerprint", info.fingerprint},
                  {"has_tokenizer", info.has_tokenizer},
                  {"eos_token_ids", info.eos_token_ids},
                  {"max_generation_tokens", 0},
                  {"protocol_version", 1}};
      if (models_edit) models_edit(m["opd"]);
      res.set_content(nlohmann::json({{"object", "list"}, {"data", {m}}}).dump(), "application/json");
    });
    server_.Post("/v1/score", [this](const httplib::Request& req, httplib::Response& res) {
      const int64_t n = ++requests_;
      const Answer a = plan ? plan(n) : Answer{};
      const bool bin = req.get_header_value("Content-Type").rfind(kBinaryContentType, 0) == 0;
      if (a.hang) {
        while (!stopping_) std::this_thread::sleep_for(10ms);
        return;
      }
      if (a.status != 200) {
        res.status = a.status;
        res.set_content(R"({"error": {"message": "fake teacher: injected error", "code": )" +
                            std::to_string(a.status) + "}}",
                        "application/json");
        return;
      }
      if (a.raw) {
        res.set_content(*a.raw, a.raw_type);
        return;
      }
      const ScoreRequest q = bin ? decode_score_request(req.body)
                                 : score_request_from_json(nlohmann::json::parse(req.body));
      ScoreResponse r = scorer_.score(q);
      if (a.edit) a.edit(r);
      std::string body = bin ? encode_score_response(r) : score_response_to_json(r).dump();
      if (a.bytes) a.bytes(body);
      const std::string type = bin ? kBinaryContentType : "application/json";
      if (a.cut) {
        auto shared = std::make_shared<std::string>(std::move(body));
        res.set_content_provider(shared->size(), type,
                                 [shared](size_t offset, size_t, httplib::DataSink& sink) {
                                   if (offset > 0) return false;  // half sent: close
                                   sink.write(shared->data(), shared->size() / 2);
                                   return true;
                                 });
        return;
      }
      res.set_content(body, type);
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(1ms);
  }
  ~FakeTeacher() {
    stopping_ = true;
    server_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int64_t requests() const { return requests_; }
  int64_t models_requests() const { return models_requests_; }

  std::function<Answer(int64_t)> plan;
  std::function<void(nlohmann::json&)> models_edit;
  std::atomic<bool> hang_models{false};  // read /v1/models requests, never answer them

 private:
  CpuScorer scorer_;
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  std::atomic<int64_t> requests_{0}, models_requests_{0};
  std::atomic<bool> stopping_{false};
};

class BadTeacher : public test::TinyDistillationTest {
 protected:
  BadTeacher() : TinyDistillationTest("opd_bad_teacher_", 24) {}

  // `opd train` of `steps` steps against `url`, a checkpoint after every step.
  std::vector<std::string> args(const std::string& out, int steps, const std::string& url) const {
    std::vector<std::string> a = tiny_train_args(out, steps, 2);
    a[3] = "--teacher-url";
    a[4] = url;
    a.insert(a.end(), {"--save-steps", "1", "--lmbda", "0"});
    return a;
  }
  std::vector<int64_t> steps_logged(const std::string& out) const {
    std::vector<int64_t> steps;
    const std::string p = path(out) + "/metrics.jsonl";
    if (!fs::exists(p)) return steps;
    for (const auto& l : MetricsLog::read(p)) steps.push_back(l.at("step").get<int64_t>());
    return steps;
  }
  std::string newest_checkpoint(const std::string& out) const {
    auto list = list_checkpoints(path(out) + "/checkpoints");
    return list.empty() ? "" : fs::path(list.back()).filename().string();
  }
  // The final weights' SHA-256 of a `steps`-step run into `out` against a teacher that never
  // fails (the reference a disturbed run must end at); empty when the run failed.
  std::string undisturbed_run_sha(const std::string& out, int steps) const {
    FakeTeacher t(path("teacher"));
    auto run = spawn(args(out, steps, t.url()), path(out + ".log"));
    EXPECT_EQ(run->wait_exit(60s), 0) << run->output();
    return final_weights_sha(out);
  }
  // `train_args` as two CPU ranks under `opd launch`.
  static std::vector<std::string> launched(const std::vector<std::string>& train_args) {
    std::vector<std::string> a = {"launch", "--nproc-per-node", "2", "--master-port", "0", "--",
                                  test::opd_binary()};
    a.insert(a.end(), train_args.begin(), train_args.end());
    return a;
  }
  std::string final_weights_sha(const std::string& out) const {
    auto list = list_checkpoints(path(out) + "/checkpoints");
    if (list.empty()) return "";
    auto m = nlohmann::json::parse(std::ifstream(list.back() + "/MANIFEST.json"));
    return m["files"]["model.safetensors"]["sha256"].get<std::string>();
  }
};

// Request 2 (step 2) answers with a bad value or shape: the run stops with a named error (the
// row, the value, the limit), before any update from it: step 1 and its checkpoint stay, no
// step 2 is logged or saved.
TEST_F(BadTeacher, InvalidAnswersStopTheRunBeforeAnyUpdateNamingRowAndValue) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const struct {
    const char* name;
    std::function<void(ScoreResponse&)> edit;
    const char* expect;
  } cases[] = {
      {"nan", [&](ScoreResponse& r) { r.logprobs[3] = nan; }, "is NaN"},
      {"inf", [&](ScoreResponse& r) { r.logprobs[0] = inf; }, "is +inf"},
      {"positive", [](ScoreResponse& r) { r.logprobs[0] = 0.7f; }, "sum to"},
      {"positive_actual", [](ScoreResponse& r) { r.actual_logprobs[1] = 0.5f; }, "actual-token logprob 0.5"},
      {"duplicate", [](ScoreResponse& r) { r.ids[1] = r.ids[0]; }, "is repeated"},
      {"out_of_vocab", [](ScoreResponse& r) { r.ids[2] = 272; }, "id 272 (entry 2) is outside"},
      {"negative", [](ScoreResponse& r) { r.ids[2] = -3; }, "id -3 (entry 2) is outside"},
      {"sum_above_one", [](ScoreResponse& r) {
         for (int j = 0; j < r.k; ++j) r.logprobs[j] = std::log(0.2f);
       }, "sum to 1.6"},
      {"fewer_rows", [](ScoreResponse& r) {
         r.row_offsets.back() -= 1;
         r.ids.resize(r.ids.size() - r.k);
         r.logprobs.resize(r.logprobs.size() - r.k);
         r.actual_logprobs.pop_back();
       }, "rows, requested"},
      {"other_k", [](ScoreResponse& r) {
         const int64_t rows = r.num_rows();
         std::vector<int32_t> ids;
         std::vector<float> lp;
         for (int64_t i = 0; i < rows; ++i)
           for (int64_t j = 0; j < 4; ++j) {
             ids.push_back(r.ids[i * r.k + j]);
             lp.push_back(r.logprobs[i * r.k + j]);
           }
         r.k = 4;
         r.ids = ids;
         r.logprobs = lp;
       }, "k = 4, requested 8"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    FakeTeacher t(path("teacher"));
    t.plan = [&](int64_t n) {
      Answer a;
      if (n == 2) a.edit = c.edit;
      return a;
    };
    const std::string out = std::string("run_") + c.name;
    auto run = spawn(args(out, 3, t.url()), path(out + ".log"));
    const int rc = run->wait_exit(60s);
    const std::string log = run->output();
    EXPECT_NE(rc, 0) << log;
    EXPECT_NE(log.find(c.expect), std::string::npos) << log;
    // Which request: the step and the teacher, and what the run did about it.
    EXPECT_NE(log.find("step 2: scoring by the teacher at " + t.url() +
                       " failed; nothing of this step was applied"),
              std::string::npos)
        << log;
    EXPECT_EQ(steps_logged(out), std::vector<int64_t>{1}) << log;
    EXPECT_EQ(newest_checkpoint(out), "step-00000001") << log;
    EXPECT_EQ(t.requests(), 2) << "a refused answer is not asked again\n" << log;
  }
}

// A teacher may send a position's K entries in any order (the protocol orders them, but a vLLM
// server's prompt_logprobs is a JSON dict, and a server may be another program; robustness.md
// session 17): every answer's rows shuffled trains the weights of the ordered run bit for bit,
// since the client puts each row in the protocol's order before the loss sums over it (before,
// the sums ran in the teacher's order: the same step to rounding, not the same run).
TEST_F(BadTeacher, ShuffledTopKEntriesTrainTheWeightsOfOrderedOnes) {
  const std::string ordered = undisturbed_run_sha("ordered", 4);
  ASSERT_FALSE(ordered.empty());
  FakeTeacher t(path("teacher"));
  std::atomic<int64_t> moved{0};
  t.plan = [&](int64_t n) {
    Answer a;
    a.edit = [&, n](ScoreResponse& r) {
      std::mt19937_64 rng(static_cast<uint64_t>(n));
      std::vector<std::pair<int32_t, float>> row;
      for (int64_t i = 0; i < r.num_rows(); ++i) {
        row.clear();
        for (int64_t j = 0; j < r.k; ++j) row.emplace_back(r.ids[i * r.k + j], r.logprobs[i * r.k + j]);
        std::shuffle(row.begin(), row.end(), rng);
        for (int64_t j = 0; j < r.k; ++j) {
          moved += r.ids[i * r.k + j] != row[j].first;
          r.ids[i * r.k + j] = row[j].first;
          r.logprobs[i * r.k + j] = row[j].second;
        }
      }
    };
    return a;
  };
  auto run = spawn(args("shuffled", 4, t.url()), path("shuffled.log"));
  ASSERT_EQ(run->wait_exit(60s), 0) << run->output();
  EXPECT_GT(moved.load(), 100) << "the answers were not shuffled";
  EXPECT_EQ(steps_logged("shuffled"), (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(final_weights_sha("shuffled"), ordered) << run->output();
}

// Transient faults (5xx, a 200 that is not JSON, an empty 200, a bad CRC, a truncated body, a
// connection reset half-way through the answer) are retried with backoff: every step is trained
// once, from the good answer, and the run ends with the weights of a run whose teacher never
// failed, bit for bit.
TEST_F(BadTeacher, TransientFaultsAreRetriedAndNoStepIsLostOrCountedTwice) {
  const std::string clean = undisturbed_run_sha("clean", 4);
  ASSERT_FALSE(clean.empty());
  FakeTeacher t(path("teacher"));
  t.plan = [](int64_t n) {
    Answer a;
    switch (n) {
      case 2: a.status = 500; break;
      case 3: a.status = 503; break;
      case 4: a.raw = "<html>502 Bad Gateway</html>"; a.raw_type = "text/html"; break;
      case 6: a.raw = ""; a.raw_type = kBinaryContentType; break;
      case 7: a.bytes = [](std::string& b) { b[b.size() - 5] ^= 0x40; }; break;  // CRC
      case 8: a.bytes = [](std::string& b) { b.resize(b.size() - 7); }; break;
      case 10: a.cut = true; break;
      default: break;
    }
    return a;
  };
  auto run = spawn(args("faulty", 4, t.url()), path("faulty.log"));
  const int rc = run->wait_exit(60s);
  ASSERT_EQ(rc, 0) << run->output();
  EXPECT_EQ(steps_logged("faulty"), (std::vector<int64_t>{1, 2, 3, 4})) << run->output();
  EXPECT_EQ(final_weights_sha("faulty"), clean) << run->output();
  EXPECT_EQ(t.requests(), 11);  // 4 good answers + 7 faults
  EXPECT_NE(run->output().find("HTTP 503"), std::string::npos) << run->output();
  EXPECT_NE(run->output().find("CRC"), std::string::npos) << run->output();
}

// A teacher that accepts the request and never answers is given up on within --teacher-timeout
// (the client's per-answer wait and its attempts together), naming the timeout; the run keeps
// its last checkpoint. Before: each of the client's 8 attempts waited the 600 s read timeout,
// whatever --teacher-timeout said (80 minutes for a 3 s timeout).
TEST_F(BadTeacher, ATeacherThatNeverAnswersIsBoundedByTheTeacherTimeout) {
  FakeTeacher t(path("teacher"));
  t.plan = [](int64_t n) {
    Answer a;
    a.hang = n >= 2;
    return a;
  };
  std::vector<std::string> a = args("run", 3, t.url());
  a.insert(a.end(), {"--teacher-timeout", "3"});
  auto run = spawn(a, path("run.log"));
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = run->wait_exit(60s);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_NE(rc, -1) << "still waiting after 60 s\n" << run->output();
  EXPECT_NE(rc, 0) << run->output();
  EXPECT_LT(took, 20) << run->output();
  EXPECT_NE(run->output().find("--teacher-timeout 3"), std::string::npos) << run->output();
  EXPECT_EQ(steps_logged("run"), std::vector<int64_t>{1});
  EXPECT_EQ(newest_checkpoint("run"), "step-00000001");
}

// One hung answer is retried (a fresh connection) once the per-answer wait is over, and the run
// goes on: the step is trained once.
TEST_F(BadTeacher, OneHungAnswerIsRetriedWithinTheTeacherTimeout) {
  FakeTeacher t(path("teacher"));
  t.plan = [](int64_t n) {
    Answer a;
    a.hang = n == 2;
    return a;
  };
  std::vector<std::string> a = args("run", 3, t.url());
  a.insert(a.end(), {"--teacher-timeout", "4"});
  auto run = spawn(a, path("run.log"));
  ASSERT_EQ(run->wait_exit(60s), 0) << run->output();
  EXPECT_EQ(steps_logged("run"), (std::vector<int64_t>{1, 2, 3})) << run->output();
}

// Waits (up to 60 s) until `count()` reaches `n`; false if it never did.
bool wait_until(const std::function<int64_t()>& count, int64_t n) {
  for (int i = 0; i < 6000 && count() < n; ++i) std::this_thread::sleep_for(10ms);
  return count() >= n;
}

// DESIGN.md invariant 2 against a teacher that takes step 3's score request and never answers,
// with --teacher-timeout 3600 (each attempt would wait 600 s for its answer): SIGTERM abandons
// the step at once (the client's call is cancelled), saves step 2 and exits 0; the same command
// against an answering teacher resumes and ends with the weights of an undisturbed run. Before:
// the signal waited out the attempt, no exit within the 20 s limit.
TEST_F(BadTeacher, AStopSignalDuringAHungAnswerAbandonsTheStepSavesAndExits0) {
  const std::string clean = undisturbed_run_sha("clean", 4);
  ASSERT_FALSE(clean.empty());
  {
    FakeTeacher t(path("teacher"));
    t.plan = [](int64_t n) {
      Answer a;
      a.hang = n >= 3;
      return a;
    };
    std::vector<std::string> a = args("run", 4, t.url());
    a.insert(a.end(), {"--teacher-timeout", "3600"});
    auto run = spawn(a, path("run.log"));
    ASSERT_TRUE(wait_until([&] { return t.requests(); }, 3)) << run->output();
    std::this_thread::sleep_for(300ms);  // the client is inside its attempt's wait
    const auto t0 = std::chrono::steady_clock::now();
    kill(run->pid, SIGTERM);
    const int rc = run->wait_exit(20s);
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("SIGTERM during the hung answer: exit %d after %.2f s\n", rc, took);
    ASSERT_EQ(rc, 0) << (rc == -1 ? "still running 20 s after SIGTERM\n" : "") << run->output();
    const std::string log = run->output();
    EXPECT_NE(log.find("step 3 abandoned (nothing of it applied): stop requested while the "
                       "teacher scored it"),
              std::string::npos)
        << log;
    EXPECT_NE(log.find("cancelled while waiting for the answer (a stop was requested)"),
              std::string::npos)
        << log;
    EXPECT_NE(log.find("saving step 2 and exiting"), std::string::npos) << log;
    EXPECT_EQ(steps_logged("run"), (std::vector<int64_t>{1, 2})) << log;
    EXPECT_EQ(newest_checkpoint("run"), "step-00000002") << log;
    EXPECT_EQ(t.requests(), 3) << "the hung request is not asked again\n" << log;
  }
  FakeTeacher t(path("teacher"));
  std::vector<std::string> a = args("run", 4, t.url());
  a.insert(a.end(), {"--teacher-timeout", "3600"});
  auto resumed = spawn(a, path("resume.log"));
  ASSERT_EQ(resumed->wait_exit(60s), 0) << resumed->output();
  EXPECT_NE(resumed->output().find("resumed from checkpoint step 2"), std::string::npos)
      << resumed->output();
  EXPECT_EQ(steps_logged("run"), (std::vector<int64_t>{1, 2, 3, 4})) << resumed->output();
  EXPECT_EQ(newest_checkpoint("run"), "step-00000004");
  EXPECT_EQ(final_weights_sha("run"), clean) << "the abandoned step left a trace";
}

// The same at start-up: the teacher's /v1/models takes the request and never answers. SIGTERM
// abandons the connect, saves step 0 and exits 0; the same command then trains every step.
TEST_F(BadTeacher, AStopSignalWhileTheTeacherNeverAnswersAtConnectExits0) {
  {
    FakeTeacher t(path("teacher"));
    t.hang_models = true;
    std::vector<std::string> a = args("run", 3, t.url());
    a.insert(a.end(), {"--teacher-timeout", "3600"});
    auto run = spawn(a, path("run.log"));
    ASSERT_TRUE(wait_until([&] { return t.models_requests(); }, 1)) << run->output();
    std::this_thread::sleep_for(300ms);
    const auto t0 = std::chrono::steady_clock::now();
    kill(run->pid, SIGTERM);
    const int rc = run->wait_exit(20s);
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("SIGTERM during the hung connect: exit %d after %.2f s\n", rc, took);
    ASSERT_EQ(rc, 0) << (rc == -1 ? "still running 20 s after SIGTERM\n" : "") << run->output();
    const std::string log = run->output();
    EXPECT_NE(log.find("connecting to the teacher abandoned: stop requested"), std::string::npos)
        << log;
    EXPECT_EQ(steps_logged("run"), std::vector<int64_t>{}) << log;
    EXPECT_EQ(newest_checkpoint("run"), "step-00000000") << log;
    EXPECT_EQ(t.requests(), 0) << log;
  }
  FakeTeacher t(path("teacher"));
  std::vector<std::string> a = args("run", 3, t.url());
  a.insert(a.end(), {"--teacher-timeout", "3600"});
  auto resumed = spawn(a, path("resume.log"));
  ASSERT_EQ(resumed->wait_exit(60s), 0) << resumed->output();
  EXPECT_EQ(steps_logged("run"), (std::vector<int64_t>{1, 2, 3})) << resumed->output();
  EXPECT_EQ(newest_checkpoint("run"), "step-00000003");
}

// Data parallel (two CPU ranks under `opd launch`): one rank's step-3 answer never comes, the
// other rank's does (it waits for the first where the ranks agree after scoring). SIGTERM to the
// launcher (forwarded to both ranks): the hung call is cancelled, both ranks abandon step 3,
// save step 2 together and the job exits 0 at once (before: the hung rank waited out its
// attempt, min(600 s, --teacher-timeout / 2), and the other rank with it).
TEST_F(BadTeacher, DataParallelAStopSignalDuringOneRanksHungAnswerSavesEveryRankAndExits0) {
  FakeTeacher t(path("teacher"));
  t.plan = [](int64_t n) {
    Answer a;
    a.hang = n == 5;  // steps 1-2 are requests 1-4 (one per rank and step); step 3's first
    return a;
  };
  std::vector<std::string> a = args("dp", 4, t.url());
  a.insert(a.end(), {"--teacher-timeout", "3600"});
  a = launched(a);
  auto run = spawn(a, path("dp.log"));
  ASSERT_TRUE(wait_until([&] { return t.requests(); }, 6)) << run->output();
  std::this_thread::sleep_for(300ms);  // one rank inside its attempt, the other at the agreement
  const auto t0 = std::chrono::steady_clock::now();
  kill(run->pid, SIGTERM);
  const int rc = run->wait_exit(30s);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("SIGTERM during one rank's hung answer: exit %d after %.2f s\n", rc, took);
  ASSERT_EQ(rc, 0) << (rc == -1 ? "still running 30 s after SIGTERM\n" : "") << run->output();
  const std::string log = run->output();
  EXPECT_NE(log.find("stop requested while the teacher scored it"), std::string::npos) << log;
  EXPECT_NE(log.find("another rank's teacher call was cancelled by a stop request"),
            std::string::npos)
      << log;
  EXPECT_EQ(steps_logged("dp"), (std::vector<int64_t>{1, 2})) << log;
  EXPECT_EQ(newest_checkpoint("dp"), "step-00000002") << log;
  EXPECT_EQ(t.requests(), 6) << log;
}

// The same at start-up, data parallel: both ranks' /v1/models never answer; SIGTERM: both
// abandon the connect, agree, save step 0 together and exit 0.
TEST_F(BadTeacher, DataParallelAStopSignalWhileTheTeacherNeverAnswersAtConnectExits0) {
  FakeTeacher t(path("teacher"));
  t.hang_models = true;
  std::vector<std::string> a = args("dpc", 3, t.url());
  a.insert(a.end(), {"--teacher-timeout", "3600"});
  a = launched(a);
  auto run = spawn(a, path("dpc.log"));
  ASSERT_TRUE(wait_until([&] { return t.models_requests(); }, 2)) << run->output();
  std::this_thread::sleep_for(300ms);
  kill(run->pid, SIGTERM);
  const int rc = run->wait_exit(30s);
  ASSERT_EQ(rc, 0) << (rc == -1 ? "still running 30 s after SIGTERM\n" : "") << run->output();
  EXPECT_NE(run->output().find("connecting to the teacher abandoned: stop requested"),
            std::string::npos)
      << run->output();
  EXPECT_EQ(steps_logged("dpc"), std::vector<int64_t>{}) << run->output();
  EXPECT_EQ(newest_checkpoint("dpc"), "step-00000000") << run->output();
  EXPECT_EQ(t.requests(), 0);
}

// /v1/models that misreports the vocabulary: one that differs from the student's is refused at
// connect; answers that carry another vocabulary than /v1/models reported are refused at the
// first such answer, naming both (before: only the answer's own vocabulary was checked, so an
// answer claiming a smaller vocabulary than the connect-time one passed).
TEST_F(BadTeacher, AVocabularyThatDiffersFromWhatModelsReportedIsRefused) {
  {
    FakeTeacher t(path("teacher"));
    t.models_edit = [](nlohmann::json& o) { o["vocab_size"] = 300; };
    auto run = spawn(args("larger", 2, t.url()), path("larger.log"));
    EXPECT_NE(run->wait_exit(60s), 0) << run->output();
    EXPECT_NE(run->output().find("has vocabulary 300 > the student's 272"), std::string::npos)
        << run->output();
    EXPECT_EQ(t.requests(), 0);
  }
  FakeTeacher t(path("teacher"));
  t.plan = [](int64_t n) {
    Answer a;
    if (n == 2) a.edit = [](ScoreResponse& r) { r.vocab_size = 260; };
    return a;
  };
  auto run = spawn(args("smaller", 3, t.url()), path("smaller.log"));
  EXPECT_NE(run->wait_exit(60s), 0) << run->output();
  EXPECT_NE(run->output().find("answered with vocabulary 260 but reported 272"), std::string::npos)
      << run->output();
  EXPECT_EQ(steps_logged("smaller"), std::vector<int64_t>{1});
}

}  // namespace
}  // namespace opd
