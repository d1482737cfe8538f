// The launcher (dist/launcher.h), in process with /bin/sh ranks, and once through `opd launch`:
// torchrun variables per rank, prefixed output, a crashing rank taking the job down (well
// inside 60 s) with a result naming it, SIGKILL for a rank that ignores SIGTERM, SIGTERM
// forwarded, SIGHUP ignored, a stopped rank killed and named (all ranks stopped: paused), an
// unrunnable command, option errors.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/test_util.h"
#include "core/error.h"
#include "dist/launcher.h"

namespace opd::dist {
namespace {

std::vector<std::string> sh(const std::string& script) { return {"/bin/sh", "-c", script}; }

LaunchOptions options(int n) {
  LaunchOptions o;
  o.nproc_per_node = n;
  o.master_port = 0;
  o.kill_after_s = 5;
  return o;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST(Launcher, SetsTheTorchrunEnvironmentAndPrefixesOutput) {
  ::testing::internal::CaptureStdout();
  LaunchOptions o = options(3);
  o.master_port = 29999;
  LaunchResult r = launch(o, sh("echo \"env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE "
                                "$GROUP_RANK $MASTER_ADDR $MASTER_PORT\"; printf 'no newline'"));
  std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(r.exit_code, 0) << r.message;
  EXPECT_EQ(r.failed_rank, -1);
  EXPECT_EQ(r.exits.size(), 3u);
  for (int k = 0; k < 3; ++k) {
    EXPECT_NE(out.find(cat("[rank ", k, "] env ", k, " 3 ", k, " 3 0 127.0.0.1 29999\n")),
              std::string::npos) << out;
    EXPECT_NE(out.find(cat("[rank ", k, "] no newline\n")), std::string::npos) << out;
  }
}

// Each rank gets the node's cores divided by the ranks for its thread pool and OpenBLAS, unless
// the caller's environment already says (then that value passes through unchanged).
TEST(Launcher, DividesTheCoresAmongTheRanksUnlessTheUserChose) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const std::string per_rank = std::to_string(std::max(1u, cores / 2));
  ::unsetenv("OPD_NUM_THREADS");
  ::setenv("OPENBLAS_NUM_THREADS", "3", 1);
  ::testing::internal::CaptureStdout();
  LaunchOptions o = options(2);
  o.master_port = 29997;
  LaunchResult r = launch(o, sh("echo \"threads $OPD_NUM_THREADS $OPENBLAS_NUM_THREADS\""));
  std::string out = ::testing::internal::GetCapturedStdout();
  ::unsetenv("OPENBLAS_NUM_THREADS");
  EXPECT_EQ(r.exit_code, 0) << r.message;
  for (int k = 0; k < 2; ++k)
    EXPECT_NE(out.find(cat("[rank ", k, "] threads ", per_rank, " 3\n")), std::string::npos) << out;
}

TEST(Launcher, MultiNodeRanksAndNoPrefix) {
  ::testing::internal::CaptureStdout();
  LaunchOptions o = options(2);
  o.nnodes = 3;
  o.node_rank = 2;
  o.master_port = 29998;
  o.master_addr = "head-node";
  o.prefix_output = false;
  LaunchResult r = launch(o, sh("echo \"$RANK/$WORLD_SIZE local $LOCAL_RANK at $MASTER_ADDR\""));
  std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(r.exit_code, 0) << r.message;
  EXPECT_NE(out.find("4/6 local 0 at head-node\n"), std::string::npos) << out;
  EXPECT_NE(out.find("5/6 local 1 at head-node\n"), std::string::npos) << out;
  EXPECT_EQ(out.find("[rank"), std::string::npos) << out;
}

TEST(Launcher, CrashingRankTakesTheJobDown) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string err_file = cat(::testing::TempDir(), "/opd_launch_err_", ::getpid(), ".json");
  LaunchOptions o = options(4);
  o.error_file = err_file;
  // Rank 2 segfaults after a moment; the others would run for five minutes.
  LaunchResult r = launch(o, sh("if [ \"$RANK\" = 2 ]; then sleep 0.3; kill -SEGV $$; fi; sleep 300"));
  const double s = seconds_since(t0);
  EXPECT_LT(s, 60.0);  // the bound, not a speed measurement
  EXPECT_EQ(r.failed_rank, 2);
  EXPECT_EQ(r.exit_code, 128 + SIGSEGV);
  EXPECT_NE(r.message.find("rank 2 failed first"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("killed by signal 11 (SIGSEGV)"), std::string::npos) << r.message;
  ASSERT_EQ(r.exits.size(), 4u);
  EXPECT_EQ(r.exits[0].rank, 2);
  for (size_t k = 1; k < 4; ++k) {
    EXPECT_TRUE(r.exits[k].signaled) << r.exits[k].describe();
    EXPECT_EQ(r.exits[k].signal, SIGTERM) << r.exits[k].describe();
  }
  std::ifstream f(err_file);
  std::stringstream ss;
  ss << f.rdbuf();
  EXPECT_NE(ss.str().find("\"rank\": 2"), std::string::npos) << ss.str();
  EXPECT_NE(ss.str().find("\"signal\": 11"), std::string::npos) << ss.str();
  std::remove(err_file.c_str());
}

TEST(Launcher, RankIgnoringSigtermIsKilled) {
  LaunchOptions o = options(2);
  o.kill_after_s = 1;
  LaunchResult r = launch(o, sh("if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 3; fi; "
                                "trap '' TERM; while :; do sleep 0.05; done"));
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_NE(r.message.find("rank 1 failed first: rank 1 (local 1, pid"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("exited with status 3"), std::string::npos) << r.message;
  ASSERT_EQ(r.exits.size(), 2u);
  EXPECT_TRUE(r.exits[1].signaled);
  EXPECT_EQ(r.exits[1].signal, SIGKILL);
}

// A rank stopped (SIGSTOP) while the others run holds them in their next collective until
// OPD_DIST_TIMEOUT (600 s): after --stopped-timeout the launcher kills it and names it as the
// failure. (Before: the job sat until the other ranks' collective timeout; a SIGTERM to the
// launcher then needed --kill-after and blamed "rank 1 ... killed by signal 9 (SIGKILL)".)
TEST(Launcher, AStoppedRankIsKilledAndNamedAfterTheStoppedTimeout) {
  const auto t0 = std::chrono::steady_clock::now();
  LaunchOptions o = options(3);
  o.stopped_timeout_s = 1;
  const std::string pid_file = cat(::testing::TempDir(), "/opd_launch_stopped_", ::getpid());
  std::remove(pid_file.c_str());
  // Without the launcher's check the stopped rank would hold launch() forever: after 90 s this
  // thread continues it, so the test fails on the bounds below instead of hanging.
  std::atomic<bool> done{false};
  std::thread guard([&] {
    for (int i = 0; i < 900 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::ifstream f(pid_file);
    pid_t p = 0;
    if (!done && (f >> p) && p > 0) ::kill(p, SIGCONT);
  });
  LaunchResult r = launch(o, sh(cat("if [ \"$RANK\" = 1 ]; then echo $$ > ", pid_file,
                                    "; sleep 0.2; kill -STOP $$; exit 0; fi; sleep 120")));
  done = true;
  guard.join();
  std::remove(pid_file.c_str());
  EXPECT_LT(seconds_since(t0), 60.0) << r.message;  // the product's bound, not a speed test
  EXPECT_EQ(r.failed_rank, 1) << r.message;
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.message;
  EXPECT_NE(r.message.find("rank 1 failed first: rank 1 (local 1, pid"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("was stopped by signal 19 (SIGSTOP) for"), std::string::npos) << r.message;
  ASSERT_EQ(r.exits.size(), 3u);
  EXPECT_EQ(r.exits[0].rank, 1);
  EXPECT_EQ(r.exits[0].stopped_by, SIGSTOP);
}

// Every local rank stopped is a paused job, not a hang: nobody waits for anybody, and the job
// goes on after SIGCONT (the other side of --stopped-timeout).
TEST(Launcher, AJobWhoseRanksAreAllStoppedIsPausedNotKilled) {
  LaunchOptions o = options(2);
  o.stopped_timeout_s = 3;  // longer than the moment between the two ranks stopping
  std::atomic<bool> done{false};
  const std::string flag = cat(::testing::TempDir(), "/opd_launch_paused_", ::getpid());
  std::remove(flag.c_str());
  // Each rank writes its pid, stops itself, and ends 0 once continued.
  std::thread resumer([&] {
    // Wait until both ranks are stopped (state T in /proc), hold them 5 s (> the timeout),
    // then continue them.
    std::vector<pid_t> pids;
    for (int i = 0; i < 6000 && !done; ++i) {
      pids.clear();
      for (int rank = 0; rank < 2; ++rank) {
        std::ifstream f(cat(flag, ".", rank));
        pid_t p = 0;
        if (f >> p) pids.push_back(p);
      }
      int stopped = 0;
      for (pid_t p : pids) {
        std::ifstream st(cat("/proc/", p, "/stat"));
        std::string line;
        std::getline(st, line);
        const auto close = line.rfind(')');
        if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'T') ++stopped;
      }
      if (stopped == 2) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::this_thread::sleep_for(std::chrono::seconds(5));
    for (pid_t p : pids) ::kill(p, SIGCONT);
  });
  LaunchResult r = launch(o, sh(cat("echo $$ > ", flag, ".$RANK; kill -STOP $$; exit 0")));
  done = true;
  resumer.join();
  std::remove(cat(flag, ".0").c_str());
  std::remove(cat(flag, ".1").c_str());
  EXPECT_EQ(r.exit_code, 0) << r.message;
  EXPECT_EQ(r.failed_rank, -1) << r.message;
}

TEST(Launcher, ForwardsSigtermAndIgnoresSighup) {
  ::testing::internal::CaptureStdout();
  const pid_t self = ::getpid();
  std::thread sender([self] {
    std::this_thread::sleep_for(std::chrono::milliseconds(700));
    ::kill(self, SIGHUP);
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ::kill(self, SIGTERM);
  });
  LaunchOptions o = options(2);
  o.kill_after_s = 20;
  // A rank that checkpoints on SIGTERM and exits 0; it would say so if a SIGHUP reached it.
  LaunchResult r = launch(o, sh("trap 'echo got HUP' HUP; trap 'echo saved; exit 0' TERM; "
                                "echo up; while :; do sleep 0.05; done"));
  sender.join();
  std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(r.exit_code, 0) << r.message;
  EXPECT_EQ(r.failed_rank, -1);
  EXPECT_NE(out.find("[rank 0] saved"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 1] saved"), std::string::npos) << out;
  EXPECT_EQ(out.find("got HUP"), std::string::npos) << out;
  for (const RankExit& e : r.exits) EXPECT_FALSE(e.signaled) << e.describe();
}

TEST(Launcher, UnrunnableCommand) {
  ::testing::internal::CaptureStderr();
  LaunchResult r = launch(options(2), {"/nonexistent/opd-no-such-binary"});
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_GE(r.failed_rank, 0);
  EXPECT_NE(err.find("cannot execute the command"), std::string::npos) << err;
}

TEST(Launcher, OptionErrors) {
  auto msg = [](LaunchOptions o, std::vector<std::string> cmd) -> std::string {
    try {
      launch(o, cmd);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
      return e.what();
    }
    return "(no error)";
  };
  auto cmd = sh("true");
  LaunchOptions o = options(1);
  o.nproc_per_node = 0;
  EXPECT_NE(msg(o, cmd).find("--nproc-per-node 0"), std::string::npos);
  o = options(1);
  o.node_rank = 1;
  EXPECT_NE(msg(o, cmd).find("--node-rank 1 is outside [0, --nnodes=1)"), std::string::npos);
  o = options(1);
  o.nnodes = 2;
  o.node_rank = 0;
  EXPECT_NE(msg(o, cmd).find("--master-port 0"), std::string::npos);
  o = options(1);
  o.master_port = 70000;
  EXPECT_NE(msg(o, cmd).find("--master-port 70000"), std::string::npos);
  o = options(1);
  o.kill_after_s = 0;
  EXPECT_NE(msg(o, cmd).find("--kill-after"), std::string::npos);
  EXPECT_NE(msg(options(1), {}).find("no command"), std::string::npos);
}

// The CLI end to end: exit status and the stderr line that names the rank.
TEST(Launcher, OpdLaunchCommandLine) {
  const std::string out = cat(::testing::TempDir(), "/opd_launch_cli_", ::getpid(), ".txt");
  const std::string cmd =
      cat(test::opd_binary(), " launch --nproc-per-node 3 --master-port 0 --kill-after 5 -- "
          "/bin/sh -c 'echo hi; if [ $RANK = 1 ]; then exit 9; fi; sleep 300' > ", out, " 2>&1");
  const auto t0 = std::chrono::steady_clock::now();
  int status = std::system(cmd.c_str());
  EXPECT_LT(seconds_since(t0), 60.0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 9);
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  EXPECT_NE(ss.str().find("[rank 1] hi"), std::string::npos) << ss.str();
  EXPECT_NE(ss.str().find("rank 1 failed first: rank 1 (local 1, pid"), std::string::npos) << ss.str();
  EXPECT_NE(ss.str().find("exited with status 9"), std::string::npos) << ss.str();
  std::remove(out.c_str());
}

}  // namespace
}  // namespace opd::dist
