// `opd train` as a process, under the faults DESIGN.md invariant 2 and issue 8 name: SIGKILL at a
// random step then resume gives the uninterrupted run's weights bit for bit; SIGTERM writes a
// checkpoint and exits 0; SIGHUP does not stop the run; a second SIGINT exits at once leaving the
// last checkpoint intact; a remote teacher killed and restarted mid-run costs no step.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "common/child_process.h"
#include "common/run_dir_test.h"
#include "common/test_util.h"
#include "model/init.h"
#include "train/checkpoint.h"
#include "train/metrics.h"

namespace opd {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using test::Child;
using test::spawn;

class TrainCli : public test::TinyDistillationTest {
 protected:
  TrainCli() : TinyDistillationTest("opd_train_cli_", 64) {}

  std::vector<std::string> train_args(const std::string& out, int steps) const {
    return tiny_train_args(out, steps, 4);
  }
  // Completed steps seen in RUN/metrics.jsonl.
  int64_t steps_done(const std::string& out) const {
    const std::string p = path(out) + "/metrics.jsonl";
    if (!fs::exists(p)) return 0;
    int64_t torn = 0;
    return static_cast<int64_t>(MetricsLog::read(p, &torn).size());
  }
  bool wait_steps(const std::string& out, int64_t n, Child& c, std::chrono::seconds limit = 120s) {
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - t0 < limit) {
      if (steps_done(out) >= n) return true;
      int status = 0;
      if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
        c.pid = -1;
        return false;
      }
      std::this_thread::sleep_for(2ms);
    }
    return false;
  }
  // `opd serve` of the playground's teacher on `port` (0: a free one, read back from its log
  // into *bound, 0 when it did not say within 30 s).
  std::unique_ptr<Child> serve_teacher(int port, const std::string& log, int* bound) const {
    auto server = spawn({"serve", "--model", path("teacher"), "--port", std::to_string(port),
                         "--threads", "4"},
                        path(log));
    *bound = 0;
    for (int i = 0; i < 3000 && *bound == 0; ++i) {
      std::this_thread::sleep_for(10ms);
      const std::string out = server->output();
      auto pos = out.find("opd serve: port ");
      if (pos != std::string::npos) *bound = std::atoi(out.c_str() + pos + 16);
    }
    return server;
  }
  std::string final_weights_sha(const std::string& out) const {
    auto list = list_checkpoints(path(out) + "/checkpoints");
    if (list.empty()) return "";
    auto m = nlohmann::json::parse(std::ifstream(list.back() + "/MANIFEST.json"));
    return m["files"]["model.safetensors"]["sha256"].get<std::string>() + "@" +
           fs::path(list.back()).filename().string();
  }

};

// `--config FILE` (cli/flags_file.h): a TOML file's flags reach the run (its config.json), with
// underscores or dashes, under an optional [train] header; a flag also on the command line keeps
// the command line's value; a .json object works the same. (CLI11's own config support ignored
// a config option on a subcommand: until session 14 every key was silently dropped.)
TEST_F(TrainCli, FlagsFileSetsFlagsAndTheCommandLineWins) {
  {
    std::ofstream f(path("run.toml"));
    f << "# a run's flags\n[train]\nlmbda = 0.25  # on-policy share\nseed = 1_007\n"
         "learning_rate = 0.5\nsave-total-limit = 3\nno-tensorboard = false\nignore_eos = true\n"
         "lr-scheduler-type = \"linear\"\n";
  }
  // train_args holds --learning-rate 0.01 and --no-tensorboard.
  std::vector<std::string> args = train_args("toml", 1);
  args.insert(args.end(), {"--config", path("run.toml")});
  auto c = spawn(args, path("toml.log"));
  ASSERT_EQ(c->wait_exit(120s), 0) << c->output();
  auto cfg = nlohmann::json::parse(std::ifstream(path("toml") + "/config.json"));
  EXPECT_EQ(cfg["lmbda"].get<double>(), 0.25);
  EXPECT_EQ(cfg["seed"].get<int64_t>(), 1007);
  EXPECT_EQ(cfg["learning_rate"].get<double>(), 0.01) << "the command line's value wins";
  EXPECT_EQ(cfg["save_total_limit"].get<int64_t>(), 3);
  EXPECT_EQ(cfg["lr_scheduler_type"].get<std::string>(), "linear");
  EXPECT_TRUE(cfg["ignore_eos"].get<bool>());
  EXPECT_FALSE(cfg["tensorboard"].get<bool>()) << "the command line's --no-tensorboard wins";

  {
    std::ofstream f(path("run.json"));
    f << R"({"lmbda": 0.75, "seed": 5, "ignore_eos": false, "save_total_limit": 2})";
  }
  args = train_args("json", 1);
  args.insert(args.end(), {"--config", path("run.json")});
  auto j = spawn(args, path("json.log"));
  ASSERT_EQ(j->wait_exit(120s), 0) << j->output();
  cfg = nlohmann::json::parse(std::ifstream(path("json") + "/config.json"));
  EXPECT_EQ(cfg["lmbda"].get<double>(), 0.75);
  EXPECT_EQ(cfg["seed"].get<int64_t>(), 5);
  EXPECT_FALSE(cfg["ignore_eos"].get<bool>());
  EXPECT_EQ(cfg["save_total_limit"].get<int64_t>(), 2);
}

// A flags file's mistakes stop the run before anything starts, naming the file, the line and
// the key: an unknown key (with the closest flag), an unquoted word, an array for a one-value
// flag, a number for a switch, another command's section, a key set twice, a missing file.
TEST_F(TrainCli, FlagsFileMistakesNameTheFileLineAndKey) {
  const std::string base = "train --student " + path("student") + " --teacher " +
                           path("teacher") + " --data " + path("train.jsonl") + " --out " +
                           path("never") + " --max-steps 1 --config " + path("bad.toml");
  const struct {
    const char* text;
    const char* expect;  // in the error, after "bad.toml:"
  } cases[] = {
      {"lmbda = 0.5\nlearnin_rate = 0.1\n", "2: `learnin_rate` is not a flag of `opd train` (did you mean `learning-rate`?)"},
      {"lr-scheduler-type = cosine\n", "1: `cosine` is not a value"},
      {"seed = [1, 2]\n", "1: `seed` takes one value, not an array"},
      {"\n\nseq-kd = 1\n", "3: `seq-kd` is a switch of `opd train`: true or false"},
      {"[sft]\nlmbda = 0\n", "1: section [sft]"},
      {"lmbda = 0.5\nlmbda = 0.25\n", "2: `lmbda` is set twice"},
      {"beta = \"0.5\n", "1: unterminated string"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    {
      std::ofstream f(path("bad.toml"));
      f << c.text;
    }
    const test::OpdResult r = test::run_opd(base, test::Stderr::Merge);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_NE(r.out.find(std::string("bad.toml:") + c.expect), std::string::npos) << r.out;
    EXPECT_FALSE(fs::exists(path("never"))) << "nothing may start";
  }
  fs::remove(path("bad.toml"));
  const test::OpdResult r = test::run_opd(base, test::Stderr::Merge);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("bad.toml: cannot be read"), std::string::npos) << r.out;
}

// Sequences longer than the models' max_position_embeddings (64 in the playground) are said at
// start-up with the numbers; the playground's own runs (prompt + 5 tokens) are not.
TEST_F(TrainCli, SequencesPastTheContextLengthAreCalledOut) {
  auto command = [&](const std::string& out, const std::string& completion) {
    std::vector<std::string> args = train_args(out, 1);
    std::string cmd;
    for (size_t i = 0; i < args.size(); ++i)
      cmd += (i > 0 && args[i - 1] == "--max-completion-length" ? completion : args[i]) + " ";
    return cmd;
  };
  test::OpdResult r = test::run_opd(command("short", "5"), test::Stderr::Merge);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("context:"), std::string::npos) << r.out;
  r = test::run_opd(command("long", "70"), test::Stderr::Merge);
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* who : {"the student", "the teacher"})
    EXPECT_NE(r.out.find(std::string("+ --max-completion-length 70) exceed ") + who),
              std::string::npos)
        << r.out;
  EXPECT_NE(r.out.find("max_position_embeddings 64"), std::string::npos) << r.out;
}

TEST_F(TrainCli, SigkillAtARandomStepThenResumeIsBitwiseExact) {
  auto full = spawn(train_args("full", 24), path("full.log"));
  ASSERT_EQ(full->wait_exit(300s), 0) << full->output();

  std::random_device rd;
  const unsigned seed = rd();
  const int64_t kill_at = 2 + static_cast<int64_t>(seed % 20);
  SCOPED_TRACE("SIGKILL after step " + std::to_string(kill_at) + " (seed " + std::to_string(seed) + ")");
  std::vector<std::string> args = train_args("part", 24);
  args.insert(args.end(), {"--save-steps", "1"});
  auto part = spawn(args, path("part1.log"));
  ASSERT_TRUE(wait_steps("part", kill_at, *part)) << part->output();
  kill(part->pid, SIGKILL);
  EXPECT_EQ(part->wait_exit(30s), 128 + SIGKILL);
  auto resumed = spawn(args, path("part2.log"));
  ASSERT_EQ(resumed->wait_exit(300s), 0) << resumed->output();
  EXPECT_NE(resumed->output().find("resumed from checkpoint step"), std::string::npos)
      << resumed->output();
  EXPECT_EQ(final_weights_sha("full"), final_weights_sha("part"));
}

TEST_F(TrainCli, SigtermWritesACheckpointAndExitsZero) {
  auto c = spawn(train_args("run", 100000), path("run.log"));
  ASSERT_TRUE(wait_steps("run", 3, *c)) << c->output();
  kill(c->pid, SIGTERM);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(c->wait_exit(60s), 0) << c->output();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 60s);
  auto ck = load_latest_checkpoint(path("run") + "/checkpoints");
  ASSERT_TRUE(ck.has_value()) << "no checkpoint after SIGTERM";
  EXPECT_GE(ck->step, 3);
  EXPECT_EQ(ck->step, steps_done("run")) << "the checkpoint holds every completed step";
}

// A full disk (OPD_TEST_WRITE_FAULT, core/file_write.h) at a periodic save does not stop the run:
// it warns naming the file and the cause, trains on, and SIGTERM still saves every completed
// step (exit 0). Before session 16 the first failed save ended the run with exit 1.
TEST_F(TrainCli, APeriodicSaveOnAFullDiskDoesNotStopTheRunAndSigtermStillSaves) {
  std::vector<std::string> args = train_args("run", 100000);
  args.insert(args.end(), {"--save-steps", "2"});
  ::setenv("OPD_TEST_WRITE_FAULT", "step-00000002.tmp", 1);
  auto c = spawn(args, path("run.log"));
  ::unsetenv("OPD_TEST_WRITE_FAULT");
  ASSERT_TRUE(wait_steps("run", 5, *c)) << c->output();
  kill(c->pid, SIGTERM);
  EXPECT_EQ(c->wait_exit(60s), 0) << c->output();
  EXPECT_NE(c->output().find("CHECKPOINT FAILED at step 2"), std::string::npos) << c->output();
  EXPECT_NE(c->output().find("step-00000002.tmp-"), std::string::npos) << c->output();
  auto ck = load_latest_checkpoint(path("run") + "/checkpoints");
  ASSERT_TRUE(ck.has_value());
  EXPECT_EQ(ck->step, steps_done("run")) << "the stop checkpoint holds every completed step";
  EXPECT_FALSE(fs::exists(path("run") + "/checkpoints/step-00000002"));
}

// Every save fails (the disk stays full): the periodic ones warn, and the stop-signal save, the
// last chance, fails the run (exit 1) saying that no checkpoint is complete.
TEST_F(TrainCli, AStopSignalSaveThatCannotBeWrittenExitsNonZeroNamingTheCause) {
  std::vector<std::string> args = train_args("run", 100000);
  args.insert(args.end(), {"--save-steps", "2"});
  ::setenv("OPD_TEST_WRITE_FAULT", "/checkpoints/step-", 1);
  auto c = spawn(args, path("run.log"));
  ::unsetenv("OPD_TEST_WRITE_FAULT");
  ASSERT_TRUE(wait_steps("run", 5, *c)) << c->output();
  kill(c->pid, SIGTERM);
  EXPECT_EQ(c->wait_exit(60s), 1) << c->output();
  const std::string out = c->output();
  EXPECT_NE(out.find("(stop signal) could not be written"), std::string::npos) << out;
  EXPECT_NE(out.find("No space left on device"), std::string::npos) << out;
  EXPECT_NE(out.find("no checkpoint of this run is complete yet"), std::string::npos) << out;
  EXPECT_TRUE(list_checkpoints(path("run") + "/checkpoints").empty());
}

TEST_F(TrainCli, SighupDoesNotStopTheRun) {
  auto c = spawn(train_args("run", 30), path("run.log"));
  ASSERT_TRUE(wait_steps("run", 3, *c)) << c->output();
  kill(c->pid, SIGHUP);
  std::this_thread::sleep_for(20ms);
  kill(c->pid, SIGHUP);
  EXPECT_EQ(c->wait_exit(300s), 0) << c->output();
  EXPECT_EQ(steps_done("run"), 30);
  std::ifstream f(path("run") + "/train.log");
  const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_NE(log.find("SIGHUP"), std::string::npos) << "the hangup is logged to train.log";
}

TEST_F(TrainCli, SecondSigintExitsAtOnceAndKeepsTheLastCheckpoint) {
  std::vector<std::string> args = train_args("run", 100000);
  args.insert(args.end(), {"--save-steps", "2"});
  auto c = spawn(args, path("run.log"));
  ASSERT_TRUE(wait_steps("run", 5, *c)) << c->output();
  kill(c->pid, SIGINT);
  kill(c->pid, SIGINT);
  const int code = c->wait_exit(60s);
  EXPECT_TRUE(code == 130 || code == 0) << code << "\n" << c->output();
  auto ck = load_latest_checkpoint(path("run") + "/checkpoints");
  ASSERT_TRUE(ck.has_value());
  EXPECT_GE(ck->step, 4);
}

TEST_F(TrainCli, TeacherServerKilledAndRestartedCostsNoStep) {
  int port = 0;
  auto server = serve_teacher(0, "serve1.log", &port);
  ASSERT_GT(port, 0) << server->output();
  const std::string url = "http://127.0.0.1:" + std::to_string(port);
  std::vector<std::string> args = train_args("run", 30);
  args[3] = "--teacher-url";
  args[4] = url;
  auto c = spawn(args, path("run.log"));
  ASSERT_TRUE(wait_steps("run", 5, *c)) << c->output();
  kill(server->pid, SIGKILL);
  server->wait_exit(10s);
  std::this_thread::sleep_for(1500ms);
  auto server2 = spawn({"serve", "--model", path("teacher"), "--port", std::to_string(port),
                        "--threads", "4"},
                       path("serve2.log"));  // not waited for: the run retries until it is up
  EXPECT_EQ(c->wait_exit(300s), 0) << c->output();
  EXPECT_EQ(steps_done("run"), 30) << "every step exactly once";
  std::set<int64_t> steps;
  double longest_score = 0;
  for (const auto& l : MetricsLog::read(path("run") + "/metrics.jsonl")) {
    EXPECT_TRUE(steps.insert(l.at("step").get<int64_t>()).second) << "step logged twice";
    longest_score = std::max(longest_score, l.at("time/score_s").get<double>());
  }
  // One step's scoring waited through the outage (the run did hit it, not race past it).
  EXPECT_GE(longest_score, 1.0) << c->output();
  kill(server2->pid, SIGTERM);
  server2->wait_exit(10s);
}

// A teacher server that comes up after the run started (launched beside it, still loading) is
// waited for (--teacher-timeout), as one that disappears mid-run is; until session 14 the run
// gave up after the client's 8 connection attempts (~9 s) whatever --teacher-timeout said.
TEST_F(TrainCli, TeacherServerThatStartsLateIsWaitedFor) {
  int port = 0;
  auto probe = serve_teacher(0, "probe.log", &port);
  ASSERT_GT(port, 0) << probe->output();
  kill(probe->pid, SIGKILL);  // a port that was free a moment ago, now closed
  probe->wait_exit(10s);
  std::vector<std::string> args = train_args("run", 3);
  args[3] = "--teacher-url";
  args[4] = "http://127.0.0.1:" + std::to_string(port);
  args.insert(args.end(), {"--teacher-timeout", "120"});
  auto c = spawn(args, path("run.log"));
  std::this_thread::sleep_for(12s);  // past the client's own ~9 s of attempts
  int status = 0;
  const pid_t reaped = waitpid(c->pid, &status, WNOHANG);
  if (reaped == c->pid) c->pid = -1;
  ASSERT_EQ(reaped, 0) << "the run gave up:\n" << c->output();
  int bound = 0;
  auto server = serve_teacher(port, "serve.log", &bound);
  EXPECT_EQ(bound, port) << server->output();
  EXPECT_EQ(c->wait_exit(300s), 0) << c->output();
  EXPECT_EQ(steps_done("run"), 3);
  EXPECT_NE(c->output().find("teacher unreachable"), std::string::npos) << c->output();
  kill(server->pid, SIGTERM);
  server->wait_exit(10s);
}

// --seq-kd with --teacher-url: the teacher generates the off-policy completions through
// `opd serve`'s /v1/completions (the rollout engine behind it; the trainer sends its in-process
// seed and stream keys), so a remote teacher's run ends with the weights of the in-process
// teacher's run, bit for bit, and not with those of the dataset's completions. Until session 15
// the combination was refused at start-up.
TEST_F(TrainCli, SeqKdWithARemoteTeacherTrainsOnWhatAnInProcessOneSamples) {
  int port = 0;
  auto server = serve_teacher(0, "serve.log", &port);
  ASSERT_GT(port, 0) << server->output();
  const std::string url = "http://127.0.0.1:" + std::to_string(port);
  auto run = [&](const std::string& out, bool remote, bool seq_kd) {
    std::vector<std::string> args = train_args(out, 3);
    if (remote) {
      args[3] = "--teacher-url";
      args[4] = url;
    }
    args.insert(args.end(), {"--lmbda", "0"});
    if (seq_kd) args.push_back("--seq-kd");
    auto c = spawn(args, path(out + ".log"));
    EXPECT_EQ(c->wait_exit(120s), 0) << c->output();
  };
  run("local", false, true);
  run("remote", true, true);
  run("dataset", true, false);
  const std::string local = final_weights_sha("local");
  ASSERT_FALSE(local.empty());
  EXPECT_EQ(final_weights_sha("remote"), local);
  EXPECT_NE(final_weights_sha("dataset"), local) << "the teacher's samples made no difference";
  for (const auto& l : MetricsLog::read(path("remote") + "/metrics.jsonl"))
    EXPECT_EQ(l.at("source").get<std::string>(), "teacher");
  kill(server->pid, SIGTERM);
  EXPECT_EQ(server->wait_exit(10s), 0) << server->output();
}

}  // namespace
}  // namespace opd
