// A child process running the built opd (test::opd_binary) with stdout+stderr to a file, in its
// own process group, killed (SIGKILL) if still running when the handle goes away. The process
// tests of the CLI (tests/cli) share it.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/test_util.h"

namespace opd::test {

// A child process running opd with stdout+stderr to a file.
struct Child {
  pid_t pid = -1;
  std::string log;
  int wait_exit(std::chrono::seconds limit) {  // exit code, 128+signal, or -1 on timeout
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - t0 < limit) {
      int status = 0;
      pid_t r = waitpid(pid, &status, WNOHANG);
      if (r == pid) {
        pid = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  std::string output() const {
    std::ifstream f(log);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  ~Child() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
};

inline std::unique_ptr<Child> spawn(const std::vector<std::string>& args, const std::string& log) {
  auto c = std::make_unique<Child>();
  c->log = log;
  std::vector<std::string> argv_s = {test::opd_binary()};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    setpgid(0, 0);  // its own group: signals sent to it do not reach the test runner
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  c->pid = pid;
  return c;
}

}  // namespace opd::test
