// `opd train` (CPU, tiny models, in-process teacher, --save-steps 1, --eval-steps) under signals
// sent at random moments (start-up, rollout, scoring, training, a save in progress, evaluation,
// the end-of-run save), with the signal policy's promises (train/signals.h) checked after every
// trial: SIGTERM or one SIGINT exits 0 within 60 s with a checkpoint of the last completed step;
// two SIGINTs exit at once leaving every complete checkpoint loadable; SIGHUP never stops a run;
// `--resume auto` with the same command then finishes; no .tmp-/.old- folder survives a later
// save; metrics.jsonl stays readable with each training step at most once.
// OPD_SIGNAL_TRIALS=N runs a longer soak (default 6 trials, ~30 s).
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include "common/child_process.h"
#include "common/run_dir_test.h"
#include "train/checkpoint.h"
#include "train/metrics.h"

namespace opd {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using test::spawn;
using Clock = std::chrono::steady_clock;

class TrainSignals : public test::TinyDistillationTest {
 protected:
  TrainSignals() : TinyDistillationTest("opd_train_signals_", 64) {}

  static constexpr int kSteps = 6;
  std::vector<std::string> args(const std::string& out) const {
    std::vector<std::string> a = tiny_train_args(out, kSteps, 4);
    a.insert(a.end(), {"--save-steps", "1", "--eval-steps", "2", "--eval-data",
                       path("train.jsonl"), "--eval-limit", "8", "--resume", "auto"});
    return a;
  }
  // Training steps (lines with a loss or a skip) per step number in RUN/metrics.jsonl.
  std::map<int64_t, int> train_steps(const std::string& out, std::string* problem) const {
    std::map<int64_t, int> seen;
    const std::string p = path(out) + "/metrics.jsonl";
    if (!fs::exists(p)) return seen;
    int64_t torn = 0;
    for (const auto& j : MetricsLog::read(p, &torn)) {
      if (!j.contains("step")) {
        *problem += "a metrics line without a step: " + j.dump() + "\n";
        continue;
      }
      if (j.contains("loss") || j.contains("skipped")) ++seen[j["step"].get<int64_t>()];
    }
    if (torn) *problem += std::to_string(torn) + " torn metrics lines\n";
    return seen;
  }
  std::vector<std::string> leftovers(const std::string& out) const {
    std::vector<std::string> left;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(path(out) + "/checkpoints", ec)) {
      const std::string n = e.path().filename().string();
      if (n.find(".tmp-") != std::string::npos || n.find(".old-") != std::string::npos)
        left.push_back(n);
    }
    return left;
  }
};

// Whether PID catches SIGTERM yet (/proc/PID/status SigCgt). Before that the process is still
// being exec'ed and its libraries mapped: no code of opd's has run, nothing can be promised.
bool catches_sigterm(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("SigCgt:", 0) == 0)
      return (std::stoull(line.substr(7), nullptr, 16) >> (SIGTERM - 1)) & 1;
  return false;
}

enum class Kind { Term, Int, IntTwice, Hup };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Term: return "SIGTERM";
    case Kind::Int: return "SIGINT";
    case Kind::IntTwice: return "SIGINT x2";
    default: return "SIGHUP x3";
  }
}

TEST_F(TrainSignals, RandomSignalsKeepThePromises) {
  // An undisturbed run's duration sets the range of the delays.
  const auto t0 = Clock::now();
  auto base = spawn(args("base"), path("base.log"));
  ASSERT_EQ(base->wait_exit(300s), 0) << base->output();
  const double run_ms =
      std::chrono::duration<double, std::milli>(Clock::now() - t0).count();

  const char* env = std::getenv("OPD_SIGNAL_TRIALS");
  const int trials = env ? std::atoi(env) : 6;
  std::random_device rd;
  const unsigned seed = std::getenv("OPD_SIGNAL_SEED") ? std::atoi(std::getenv("OPD_SIGNAL_SEED")) : rd();
  std::mt19937 rng(seed);
  std::printf("seed %u, undisturbed run %.0f ms\n", seed, run_ms);
  for (int t = 0; t < trials; ++t) {
    const Kind kind = static_cast<Kind>(rng() % 4);
    // Early moments are short and matter most (start-up): half the trials land in the first
    // fifth of the run, the others anywhere up to a little past its end.
    const double frac = (rng() % 2) ? std::uniform_real_distribution<double>(0, 0.2)(rng)
                                    : std::uniform_real_distribution<double>(0, 1.05)(rng);
    const int delay_ms = static_cast<int>(frac * run_ms);
    const std::string out = "run" + std::to_string(t);
    SCOPED_TRACE(std::string("trial ") + std::to_string(t) + ": " + kind_name(kind) + " after " +
                 std::to_string(delay_ms) + " ms (seed " + std::to_string(seed) + ")");
    std::printf("trial %d: %s after %d ms\n", t, kind_name(kind), delay_ms);
    auto c = spawn(args(out), path(out + "_1.log"));
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    for (int i = 0; i < 5000 && !catches_sigterm(c->pid); ++i) std::this_thread::sleep_for(1ms);
    const auto sent = Clock::now();
    if (kind == Kind::Term) kill(c->pid, SIGTERM);
    if (kind == Kind::Int || kind == Kind::IntTwice) kill(c->pid, SIGINT);
    if (kind == Kind::IntTwice) {
      std::this_thread::sleep_for(5ms);
      kill(c->pid, SIGINT);
    }
    if (kind == Kind::Hup)
      for (int i = 0; i < 3; ++i, std::this_thread::sleep_for(3ms)) kill(c->pid, SIGHUP);
    const int code = c->wait_exit(kind == Kind::Hup ? 300s : 60s);
    const double exit_s = std::chrono::duration<double>(Clock::now() - sent).count();
    std::string problem;
    auto steps = train_steps(out, &problem);
    const int64_t done = static_cast<int64_t>(steps.size());
    auto ck = load_latest_checkpoint(path(out) + "/checkpoints");
    switch (kind) {
      case Kind::Term:
      case Kind::Int:
        EXPECT_EQ(code, 0) << c->output();
        EXPECT_LT(exit_s, 60);
        ASSERT_TRUE(ck.has_value()) << "no checkpoint after " << kind_name(kind) << "\n" << c->output();
        EXPECT_EQ(ck->step, done) << "the checkpoint holds every completed step\n" << c->output();
        break;
      case Kind::IntTwice:
        EXPECT_NE(code, -1) << "still running";
        EXPECT_LT(exit_s, 5) << "a second SIGINT exits at once";
        for (const auto& dir : list_checkpoints(path(out) + "/checkpoints"))
          EXPECT_NO_THROW(load_checkpoint(dir)) << dir;
        break;
      case Kind::Hup:
        EXPECT_EQ(code, 0) << c->output();
        EXPECT_EQ(done, kSteps) << c->output();
        break;
    }
    if (code == -1) kill(c->pid, SIGKILL), c->wait_exit(30s);
    // The same command resumes from the newest complete checkpoint and finishes.
    auto r = spawn(args(out), path(out + "_2.log"));
    EXPECT_EQ(r->wait_exit(300s), 0) << r->output();
    if (ck && ck->step < kSteps)
      EXPECT_NE(r->output().find("resumed from checkpoint step " + std::to_string(ck->step)),
                std::string::npos) << r->output();
    problem.clear();
    steps = train_steps(out, &problem);
    EXPECT_EQ(problem, "");
    for (const auto& [s, n] : steps) EXPECT_EQ(n, 1) << "step " << s << " in metrics.jsonl " << n << " times";
    EXPECT_EQ(steps.size(), static_cast<size_t>(kSteps));
    auto final_ck = load_latest_checkpoint(path(out) + "/checkpoints");
    ASSERT_TRUE(final_ck.has_value());
    EXPECT_EQ(final_ck->step, kSteps);
    EXPECT_EQ(leftovers(out), std::vector<std::string>{});
    if (::testing::Test::HasFailure()) {
      std::printf("--- first run ---\n%s\n--- resume ---\n%s\n", c->output().c_str(), r->output().c_str());
      break;
    }
    fs::remove_all(path(out));
  }
}

}  // namespace
}  // namespace opd
