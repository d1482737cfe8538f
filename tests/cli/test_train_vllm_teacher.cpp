// `opd train --teacher-url` against a vLLM-compatible teacher, the whole loop as a process
// (robustness.md session 17): an in-process fake of a vLLM 0.x server (httplib; /v1/models
// without opd's section, /v1/completions answering prompt_logprobs the way vLLM does: a list
// with null first, then per position a dict "<id>" -> {logprob, rank, decoded_token} holding the
// top K, ranks 1..K, plus the prompt token with its vocabulary rank 1 + #{z_v > z_y} when it is
// not among them; the dict written in key order, so not by logprob; -inf as -9999.0) whose
// numbers are the real CpuScorer's at temperature 1.
#include <gtest/gtest.h>

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "common/checkpoint_weights.h"
#include "common/child_process.h"
#include "common/run_dir_test.h"
#include "common/test_util.h"
#include "teacher/scorer.h"
#include "train/checkpoint.h"
#include "train/metrics.h"

namespace opd {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using test::spawn;

class FakeVllm {
 public:
  explicit FakeVllm(const std::string& model_dir) : scorer_(model_dir) {
    server_.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      nlohmann::json m = {{"id", "fake/teacher"},        {"object", "model"},
                          {"created", 1764400000},        {"owned_by", "vllm"},
                          {"root", "fake/teacher"},       {"parent", nullptr},
                          {"max_model_len", scorer_.info().max_model_len},
                          {"permission", nlohmann::json::array()}};
      res.set_content(nlohmann::json({{"object", "list"}, {"data", {m}}}).dump(), "application/json");
    });
    server_.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      const nlohmann::json j = nlohmann::json::parse(req.body);
      {
        std::lock_guard<std::mutex> lock(mu_);
        requests_.push_back(j);
      }
      const int64_t k = j.at("prompt_logprobs").get<int64_t>();
      ScoreRequest q;
      q.k = k;
      q.temperature = 1.0;  // vLLM reports logprobs at temperature 1 whatever is sampled
      q.with_ranks = true;
      for (const auto& p : j.at("prompt"))
        q.sequences.push_back({p.get<std::vector<int32_t>>(), 1, static_cast<int64_t>(p.size())});
      const ScoreResponse r = scorer_.score(q);
      auto lp = [](float v) { return std::isinf(v) ? -9999.0 : static_cast<double>(v); };
      nlohmann::json choices = nlohmann::json::array();
      for (size_t i = 0; i < q.sequences.size(); ++i) {
        const auto& ids = q.sequences[i].ids;
        nlohmann::json plp = nlohmann::json::array({nullptr});
        for (size_t pos = 1; pos < ids.size(); ++pos) {
          const int64_t row = r.row_offsets[i] + static_cast<int64_t>(pos) - 1;
          nlohmann::json d = nlohmann::json::object();
          for (int64_t e = 0; e < k; ++e) {
            const int32_t id = r.ids[row * k + e];
            d[std::to_string(id)] = {{"logprob", lp(r.logprobs[row * k + e])},
                                     {"rank", e + 1},
                                     {"decoded_token", "t" + std::to_string(id)}};
          }
          const std::string y = std::to_string(ids[pos]);
          if (!d.contains(y)) {
            d[y] = {{"logprob", lp(r.actual_logprobs[row])},
                    {"rank", r.actual_ranks[row]},
                    {"decoded_token", "t" + y}};
            ++extra_entries_;
          }
          plp.push_back(std::move(d));
        }
        choices.push_back({{"index", i}, {"text", ""}, {"logprobs", nullptr},
                           {"finish_reason", "length"}, {"stop_reason", nullptr},
                           {"prompt_logprobs", std::move(plp)}});
      }
      nlohmann::json out = {{"id", "cmpl-fake"}, {"object", "text_completion"},
                            {"created", 1764400000}, {"model", "fake/teacher"},
                            {"choices", std::move(choices)}, {"usage", {{"prompt_tokens", 0}}}};
      res.set_content(out.dump(), "application/json");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(1ms);
  }
  ~FakeVllm() {
    server_.stop();
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  // Positions answered with K + 1 entries (the prompt token outside the top K).
  int64_t extra_entries() const { return extra_entries_; }
  std::vector<nlohmann::json> requests() {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_;
  }

 private:
  CpuScorer scorer_;
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  std::mutex mu_;
  std::vector<nlohmann::json> requests_;
  std::atomic<int64_t> extra_entries_{0};
};

class VllmTeacher : public test::TinyDistillationTest {
 protected:
  VllmTeacher() : TinyDistillationTest("opd_vllm_teacher_", 24) {}

  // `opd train` of `steps` steps of 2 prompts, on-policy and dataset steps mixed (--lmbda 0.5),
  // against the in-process teacher, or `url` with --teacher-config when given.
  std::vector<std::string> args(const std::string& out, int steps, const std::string& url = "") const {
    std::vector<std::string> a = tiny_train_args(out, steps, 2);
    if (!url.empty()) {
      a[3] = "--teacher-url";
      a[4] = url;
      a.insert(a.end(), {"--teacher-config", path("teacher")});
    }
    a.insert(a.end(), {"--lmbda", "0.5"});
    return a;
  }
  std::vector<nlohmann::json> metrics(const std::string& out) const {
    const std::string p = path(out) + "/metrics.jsonl";
    return fs::exists(p) ? MetricsLog::read(p) : std::vector<nlohmann::json>{};
  }
};

// The whole loop against the vLLM fake gives the in-process teacher's weights bit for bit: at
// T = 1 vLLM's numbers are the scorer's (float32 logprobs written as JSON doubles that
// round-trip exactly), the client puts each dict in the protocol's order and drops the prompt
// token's extra entry, so the validated payload equals the in-process one entry by entry.
TEST_F(VllmTeacher, TrainsTheWeightsOfTheInProcessTeacher) {
  auto local = spawn(args("local", 4), path("local.log"));
  ASSERT_EQ(local->wait_exit(60s), 0) << local->output();
  FakeVllm t(path("teacher"));
  auto run = spawn(args("vllm", 4, t.url()), path("vllm.log"));
  ASSERT_EQ(run->wait_exit(60s), 0) << run->output();
  EXPECT_NE(run->output().find("(vllm, model fake/teacher, vocab 272)"), std::string::npos)
      << run->output();
  ASSERT_EQ(metrics("vllm").size(), 4u);
  ASSERT_EQ(metrics("local").size(), 4u);
  for (size_t i = 0; i < 4; ++i)
    EXPECT_EQ(metrics("vllm")[i].at("loss"), metrics("local")[i].at("loss")) << "step " << i + 1;
  test::expect_bitwise_equal(test::final_weights(path("vllm")), test::final_weights(path("local")));
  const auto reqs = t.requests();
  ASSERT_EQ(reqs.size(), 4u);  // one request per step (a tiny step is not chunked)
  for (const auto& r : reqs) {
    EXPECT_EQ(r.at("prompt_logprobs"), 8);
    EXPECT_EQ(r.at("max_tokens"), 1);
    EXPECT_EQ(r.at("model"), "fake/teacher");
  }
  EXPECT_GT(t.extra_entries(), 0) << "no position had the prompt token outside the top K";
  // Without --teacher-config the server's vocabulary is unknown: refused at connect, named.
  std::vector<std::string> a = args("bare", 1, t.url());
  a.resize(a.size() - 4);  // drop --teacher-config DIR (and --lmbda 0.5)
  auto bare = spawn(a, path("bare.log"));
  EXPECT_NE(bare->wait_exit(60s), 0);
  EXPECT_NE(bare->output().find("does not report its vocabulary size and tokenizer fingerprint; "
                                "assert them (opd train / opd score: --teacher-config DIR"),
            std::string::npos)
      << bare->output();
}

// `opd doctor` runs opd train's start-up checks against a vLLM teacher with the same
// --teacher-config (vocabulary, tokenizer, EOS and special tokens from the directory).
TEST_F(VllmTeacher, DoctorChecksAVllmTeacherDescribedByItsConfig) {
  FakeVllm t(path("teacher"));
  auto run = spawn({"doctor", "--student", path("student"), "--teacher-url", t.url(),
                    "--teacher-config", path("teacher")},
                   path("doctor.log"));
  ASSERT_EQ(run->wait_exit(60s), 0) << run->output();
  EXPECT_NE(run->output().find("teacher  " + t.url() + ": vocab 272"), std::string::npos)
      << run->output();
  EXPECT_EQ(run->output().find("ERROR"), std::string::npos) << run->output();
}

// DESIGN.md "Loss": a teacher that reports log-probabilities at temperature 1 only cannot give
// topk+tail at T != 1: refused at start-up, before any rollout or request, naming both
// temperatures and the way out; --loss-support topk accepts the approximation (renormalizes
// a_k / T over the K ids) and trains. Its first loss equals the in-process teacher's topk loss at
// the same T to 1e-5: the student's weights are the same at step 1 and topk's renormalization
// cancels the teacher's log-sum-exp, so only the float32 rounding of the T = 1 logprobs
// (~1e-7 relative, times 1 / T) separates them.
TEST_F(VllmTeacher, TopKTailAtAnotherTemperatureIsRefusedUnlessTopKIsAccepted) {
  FakeVllm t(path("teacher"));
  std::vector<std::string> a = args("tail", 2, t.url());
  a.insert(a.end(), {"--kd-temperature", "0.7"});
  auto tail = spawn(a, path("tail.log"));
  EXPECT_NE(tail->wait_exit(60s), 0);
  EXPECT_NE(tail->output().find("is a vLLM server (no opd section in /v1/models): its "
                                "log-probabilities at temperature 1 cannot give exact values at "
                                "the distillation temperature 0.7 (--kd-temperature) for "
                                "--loss-support topk+tail; accept the approximation with "
                                "--loss-support topk"),
            std::string::npos)
      << tail->output();
  EXPECT_TRUE(t.requests().empty());
  EXPECT_TRUE(metrics("tail").empty());

  a = args("topk", 2, t.url());
  a.insert(a.end(), {"--kd-temperature", "0.7", "--loss-support", "topk"});
  auto topk = spawn(a, path("topk.log"));
  ASSERT_EQ(topk->wait_exit(60s), 0) << topk->output();
  a = args("local_topk", 2);
  a.insert(a.end(), {"--kd-temperature", "0.7", "--loss-support", "topk"});
  auto local = spawn(a, path("local_topk.log"));
  ASSERT_EQ(local->wait_exit(60s), 0) << local->output();
  ASSERT_EQ(metrics("topk").size(), 2u);
  const double got = metrics("topk")[0].at("loss").get<double>();
  const double want = metrics("local_topk")[0].at("loss").get<double>();
  EXPECT_NE(want, 0.0);
  EXPECT_LE(std::fabs(got - want), 1e-5 * std::fabs(want)) << got << " vs " << want;
  std::printf("topk at T 0.7, step 1 loss: vLLM teacher %.17g, in-process %.17g (rel. diff %.2g)\n",
              got, want, std::fabs(got - want) / std::fabs(want));
}

}  // namespace
}  // namespace opd
