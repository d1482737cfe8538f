// Multi-process test harness for dist/: run_ranks forks `world` processes, rank 0 hosting the
// TCP store on a free port, runs fn(rank) in each and collects what went wrong. A child never
// returns into GoogleTest: it reports through a pipe and _exit()s (0 = pass), so assertions
// live in the parent. Children that outlive the deadline are killed and reported.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "dist/tcp_store.h"

namespace opd::test {

struct RankOutcome {
  int status = -1;      // raw wait status
  std::string message;  // what the child reported ("" = ok)
  bool ok() const { return WIFEXITED(status) && WEXITSTATUS(status) == 0 && message.empty(); }
};

// fn returns "" on success or a description of the failure; exceptions are caught and reported.
using RankFn = std::function<std::string(int rank)>;

inline std::vector<RankOutcome> run_ranks(int world, const RankFn& fn, double timeout_s = 90) {
  std::vector<pid_t> pids(world);
  std::vector<int> fds(world);
  for (int r = 0; r < world; ++r) {
    int p[2];
    if (::pipe(p) != 0) throw std::runtime_error("pipe");
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(p[0]);
      std::string msg;
      try {
        msg = fn(r);
      } catch (const std::exception& e) {
        msg = std::string("exception: ") + e.what();
      }
      if (!msg.empty()) (void)!::write(p[1], msg.data(), msg.size());
      ::close(p[1]);
      ::_exit(msg.empty() ? 0 : 1);
    }
    ::close(p[1]);
    pids[r] = pid;
    fds[r] = p[0];
  }
  std::vector<RankOutcome> out(world);
  std::vector<bool> done(world, false);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int left = world;
  while (left > 0) {
    for (int r = 0; r < world; ++r) {
      if (done[r]) continue;
      char buf[4096];
      ssize_t n;
      while ((n = ::read(fds[r], buf, sizeof(buf))) > 0) out[r].message.append(buf, n);
      int st = 0;
      if (::waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        while ((n = ::read(fds[r], buf, sizeof(buf))) > 0) out[r].message.append(buf, n);
        out[r].status = st;
        done[r] = true;
        ::close(fds[r]);
        --left;
      }
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < world; ++r)
        if (!done[r]) {
          ::kill(pids[r], SIGKILL);
          int st = 0;
          ::waitpid(pids[r], &st, 0);
          out[r].status = st;
          out[r].message += " [killed by the test harness after the deadline]";
          ::close(fds[r]);
          done[r] = true;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return out;
}

// Every rank passed; otherwise a readable list of what each failing rank said.
inline ::testing::AssertionResult all_ok(const std::vector<RankOutcome>& out) {
  std::string bad;
  for (size_t r = 0; r < out.size(); ++r)
    if (!out[r].ok())
      bad += cat("\n  rank ", r, " (status ", out[r].status, "): ", out[r].message);
  if (bad.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad;
}

// The placement of rank r in a local job whose store is on `port`.
inline dist::DistEnv local_env(int rank, int world, int port) {
  dist::DistEnv e;
  e.source = dist::LaunchSource::Torchrun;
  e.rank = rank;
  e.world_size = world;
  e.local_rank = rank;
  e.local_world_size = world;
  e.master_addr = "127.0.0.1";
  e.master_port = port;
  return e;
}

// A string check usable in children: "" when ok.
inline std::string expect(bool cond, const std::string& what) { return cond ? "" : what + "; "; }

}  // namespace opd::test
