// The local-rank supervisor behind `opd launch` (policy in launcher.h). One thread, one poll()
// loop over the ranks' output pipes and a self-pipe that the signal handlers write to (the
// handlers only write one byte: async-signal-safe). The environment of each rank is built
// before fork(), so the child only calls async-signal-safe functions until exec.
#include "dist/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <map>
#include <thread>
#include <set>

#include "core/error.h"
#include "dist/tcp_store.h"  // pick_free_port

extern char** environ;

namespace opd::dist {

namespace {

using Clock = std::chrono::steady_clock;

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  if (g_signal_pipe[1] >= 0) (void)!::write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGABRT: return "SIGABRT";
    case SIGKILL: return "SIGKILL";
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGHUP: return "SIGHUP";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGPIPE: return "SIGPIPE";
    case SIGQUIT: return "SIGQUIT";
    case SIGSTOP: return "SIGSTOP";
    case SIGTSTP: return "SIGTSTP";
    case SIGTTIN: return "SIGTTIN";
    case SIGTTOU: return "SIGTTOU";
    default: return "signal";
  }
}

// Writes everything, ignoring failures: a closed terminal (EIO) or reader (EPIPE) must not
// stop the launcher, which keeps draining the ranks' pipes so they never block on a write.
void write_quietly(int fd, const std::string& s) {
  const char* p = s.data();
  size_t n = s.size();
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    p += w;
    n -= static_cast<size_t>(w);
  }
}

struct Stream {
  int fd = -1;
  int out_fd = 1;  // where its lines go
  std::string partial;
};

struct Rank {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  bool alive = false;
  Stream out, err;
  int stop_signal = 0;  // > 0 while stopped
  std::chrono::steady_clock::time_point stopped_at;
  int killed_stopped_by = 0;  // the launcher SIGKILLed it after this stop signal
  double killed_stopped_s = 0;
};

class SignalScope {
 public:
  SignalScope() {
    OPD_CHECK(::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) == 0, Io,
              "opd launch: pipe2 failed: ", std::strerror(errno));
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGCHLD}) {
      struct sigaction flags = sa;
      if (sig == SIGCHLD) flags.sa_flags |= SA_NOCLDSTOP;
      ::sigaction(sig, &flags, &old_[sig]);
    }
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    ::sigaction(SIGPIPE, &ign, &old_[SIGPIPE]);
  }
  ~SignalScope() {
    for (auto& [sig, act] : old_) ::sigaction(sig, &act, nullptr);
    ::close(g_signal_pipe[0]);
    ::close(g_signal_pipe[1]);
    g_signal_pipe[0] = g_signal_pipe[1] = -1;
  }

 private:
  std::map<int, struct sigaction> old_;
};

std::vector<std::string> rank_environment(const LaunchOptions& o, int port, int rank,
                                          int local_rank) {
  const std::map<std::string, std::string> set = {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(o.nnodes * o.nproc_per_node)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
      {"GROUP_RANK", std::to_string(o.node_rank)},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(port)},
      {"OPD_LAUNCH", "1"}};
  std::vector<std::string> env;
  std::set<std::string> present;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string kv(*e);
    const std::string key = kv.substr(0, kv.find('='));
    present.insert(key);
    if (set.count(key) == 0) env.push_back(kv);
  }
  for (const auto& [k, v] : set) env.push_back(k + "=" + v);
  // The node's cores divided among its ranks, unless the user chose: every rank would otherwise
  // size its thread pool and OpenBLAS to all cores (torchrun sets OMP_NUM_THREADS=1 for the same
  // reason), and the oversubscribed pools slow the ranks' host loops down.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const std::string per_rank =
      std::to_string(std::max<unsigned>(1, cores / static_cast<unsigned>(std::max(1, o.nproc_per_node))));
  for (const char* k : {"OPD_NUM_THREADS", "OPENBLAS_NUM_THREADS"})
    if (present.count(k) == 0) env.push_back(std::string(k) + "=" + per_rank);
  return env;
}

void flush_lines(Stream& s, const std::string& prefix, bool final) {
  size_t start = 0;
  std::string out;
  while (true) {
    size_t nl = s.partial.find('\n', start);
    if (nl == std::string::npos) break;
    out += prefix;
    out.append(s.partial, start, nl + 1 - start);
    start = nl + 1;
  }
  s.partial.erase(0, start);
  // A very long line without a newline is passed on in pieces rather than held forever.
  if ((final || s.partial.size() > (1u << 16)) && !s.partial.empty()) {
    out += prefix + s.partial + "\n";
    s.partial.clear();
  }
  if (!out.empty()) write_quietly(s.out_fd, out);
}

}  // namespace

std::string RankExit::describe() const {
  std::string who = cat("rank ", rank, " (local ", local_rank, ", pid ", pid, ")");
  if (stopped_by > 0)
    return cat(who, " was stopped by signal ", stopped_by, " (", signal_name(stopped_by), ") for ",
               static_cast<int>(stopped_s), " s and killed: a stopped rank holds the other ranks in ",
               "their next collective");
  if (signaled) return cat(who, " was killed by signal ", signal, " (", signal_name(signal), ")");
  return cat(who, " exited with status ", code);
}

LaunchResult launch(const LaunchOptions& o, const std::vector<std::string>& command) {
  OPD_CHECK(o.nproc_per_node >= 1 && o.nproc_per_node <= 1024, InvalidArgument,
            "opd launch: --nproc-per-node ", o.nproc_per_node, " is outside [1, 1024]");
  OPD_CHECK(o.nnodes >= 1 && o.nnodes <= 65536, InvalidArgument, "opd launch: --nnodes ",
            o.nnodes, " is outside [1, 65536]");
  OPD_CHECK(o.node_rank >= 0 && o.node_rank < o.nnodes, InvalidArgument,
            "opd launch: --node-rank ", o.node_rank, " is outside [0, --nnodes=", o.nnodes, ")");
  OPD_CHECK(o.master_port >= 0 && o.master_port <= 65535, InvalidArgument,
            "opd launch: --master-port ", o.master_port, " is outside [0, 65535]");
  OPD_CHECK(o.master_port != 0 || o.nnodes == 1, InvalidArgument,
            "opd launch: --master-port 0 (pick a free port) works on one node only");
  OPD_CHECK(!o.master_addr.empty(), InvalidArgument, "opd launch: --master-addr is empty");
  OPD_CHECK(o.kill_after_s > 0 && o.kill_after_s <= 3600, InvalidArgument,
            "opd launch: --kill-after ", o.kill_after_s, " is outside (0, 3600] s");
  OPD_CHECK(o.stopped_timeout_s > 0 && o.stopped_timeout_s <= 86400, InvalidArgument,
            "opd launch: --stopped-timeout ", o.stopped_timeout_s, " is outside (0, 86400] s");
  OPD_CHECK(!command.empty() && !command[0].empty(), InvalidArgument,
            "opd launch: no command (usage: opd launch --nproc-per-node N -- opd train ...)");

  const int port = o.master_port == 0 ? pick_free_port() : o.master_port;
  const auto t0 = Clock::now();
  auto since_start = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  SignalScope signals;

  std::vector<char*> argv;
  for (const std::string& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);

  std::vector<Rank> ranks(o.nproc_per_node);
  const pid_t launcher_pid = ::getpid();
  for (int lr = 0; lr < o.nproc_per_node; ++lr) {
    Rank& r = ranks[lr];
    r.local_rank = lr;
    r.rank = o.node_rank * o.nproc_per_node + lr;
    std::vector<std::string> env = rank_environment(o, port, r.rank, lr);
    std::vector<char*> envp;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    int out[2], err[2];
    OPD_CHECK(::pipe2(out, O_CLOEXEC) == 0 && ::pipe2(err, O_CLOEXEC) == 0, Io,
              "opd launch: pipe2 failed: ", std::strerror(errno));
    const pid_t pid = ::fork();
    OPD_CHECK(pid >= 0, Io, "opd launch: fork failed: ", std::strerror(errno));
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != launcher_pid) ::_exit(1);  // the launcher died before prctl
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGCHLD, SIGPIPE}) ::sigaction(sig, &dfl, nullptr);
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      int devnull = ::open("/dev/null", O_RDONLY);
      if (devnull >= 0) ::dup2(devnull, 0);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      ::execvpe(argv[0], argv.data(), envp.data());
      const char* msg = "opd launch: cannot execute the command: ";
      (void)!::write(2, msg, std::strlen(msg));
      const char* e = std::strerror(errno);
      (void)!::write(2, e, std::strlen(e));
      (void)!::write(2, "\n", 1);
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here: no race with a signal sent before the child ran
    ::close(out[1]);
    ::close(err[1]);
    r.pid = pid;
    r.alive = true;
    r.out = {out[0], 1, {}};
    r.err = {err[0], 2, {}};
  }

  LaunchResult result;
  bool stopping = false;
  bool killed = false;
  Clock::time_point kill_deadline = Clock::time_point::max();
  Clock::time_point all_exited_at = Clock::time_point::max();
  const RankExit* first_failure = nullptr;
  int first_failure_index = -1;

  auto signal_alive = [&](int sig) {
    for (Rank& r : ranks)
      if (r.alive) ::kill(-r.pid, sig);
  };
  auto start_stopping = [&](const std::string& why) {
    if (stopping) return;
    stopping = true;
    kill_deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(o.kill_after_s));
    write_quietly(2, cat("opd launch: ", why, "; stopping the other ranks (SIGTERM now, SIGKILL after ",
                         o.kill_after_s, " s)\n"));
  };
  auto reap = [&] {
    // Only our ranks' pids: the caller (a test, say) may have children of its own.
    for (Rank& r : ranks) {
      if (!r.alive) continue;
      int status = 0;
      const pid_t pid = ::waitpid(r.pid, &status, WNOHANG | WUNTRACED | WCONTINUED);
      if (pid != r.pid) continue;
      if (WIFSTOPPED(status)) {
        r.stop_signal = WSTOPSIG(status);
        r.stopped_at = Clock::now();
        write_quietly(2, cat("opd launch: rank ", r.rank, " (local ", r.local_rank, ", pid ", r.pid,
                             ") was stopped by signal ", r.stop_signal, " (",
                             signal_name(r.stop_signal), "); it is killed unless it continues within ",
                             o.stopped_timeout_s, " s\n"));
        continue;
      }
      if (WIFCONTINUED(status)) {
        if (r.stop_signal > 0)
          write_quietly(2, cat("opd launch: rank ", r.rank, " continued\n"));
        r.stop_signal = 0;
        continue;
      }
      {
        r.alive = false;
        RankExit e;
        e.rank = r.rank;
        e.local_rank = r.local_rank;
        e.pid = pid;
        e.signaled = WIFSIGNALED(status);
        e.code = WIFEXITED(status) ? WEXITSTATUS(status) : 0;
        e.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
        e.seconds = since_start();
        e.stopped_by = r.killed_stopped_by;
        e.stopped_s = r.killed_stopped_s;
        result.exits.push_back(e);
        const bool failed = e.signaled || e.code != 0;
        if (failed && first_failure_index < 0) {
          first_failure_index = static_cast<int>(result.exits.size()) - 1;
          if (!stopping) {
            start_stopping(e.describe());
            signal_alive(SIGTERM);
          }
        }
      }
    }
  };

  while (true) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Stream*, const Rank*>> owners;
    fds.push_back({g_signal_pipe[0], POLLIN, 0});
    owners.push_back({nullptr, nullptr});
    for (Rank& r : ranks)
      for (Stream* s : {&r.out, &r.err})
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          owners.push_back({s, &r});
        }
    const bool any_alive = std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.alive; });
    if (!any_alive) {
      if (all_exited_at == Clock::time_point::max()) all_exited_at = Clock::now();
      // Output still open after every rank ended belongs to a rank's own children: give it a
      // moment, then stop listening.
      if (fds.size() == 1 || Clock::now() - all_exited_at > std::chrono::seconds(2)) break;
    }
    int pr = ::poll(fds.data(), fds.size(), 100);
    if (pr < 0 && errno != EINTR) break;
    for (size_t i = 1; pr > 0 && i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Stream& s = *owners[i].first;
      const std::string prefix = o.prefix_output ? cat("[rank ", owners[i].second->rank, "] ") : "";
      char buf[65536];
      ssize_t n = ::read(s.fd, buf, sizeof(buf));
      if (n > 0) {
        s.partial.append(buf, static_cast<size_t>(n));
        flush_lines(s, prefix, false);
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        flush_lines(s, prefix, true);
        ::close(s.fd);
        s.fd = -1;
      }
    }
    if (fds[0].revents & POLLIN) {
      unsigned char sigs[64];
      ssize_t n = ::read(g_signal_pipe[0], sigs, sizeof(sigs));
      for (ssize_t i = 0; i < n; ++i) {
        const int sig = sigs[i];
        if (sig == SIGHUP) {
          write_quietly(2, "opd launch: SIGHUP ignored (the ranks keep running; it is not forwarded)\n");
        } else if (sig == SIGTERM || sig == SIGINT) {
          start_stopping(cat("received ", signal_name(sig), ", forwarded to every rank"));
          signal_alive(sig);
        }
      }
    }
    reap();
    // A rank stopped too long while another local rank runs: that one waits for it in a
    // collective (until OPD_DIST_TIMEOUT), so the stopped rank is the job's failure. SIGKILL is
    // the one signal a stopped process acts on; its store connection then drops and the others
    // fail at once. (Every local rank stopped: a paused job, left alone.)
    const bool any_running = std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) {
      return r.alive && r.stop_signal == 0;
    });
    for (Rank& r : ranks) {
      if (!r.alive || r.stop_signal == 0 || r.killed_stopped_by > 0 || !any_running) continue;
      const double stopped_s = std::chrono::duration<double>(Clock::now() - r.stopped_at).count();
      if (stopped_s < o.stopped_timeout_s) continue;
      r.killed_stopped_by = r.stop_signal;
      r.killed_stopped_s = stopped_s;
      ::kill(-r.pid, SIGKILL);
    }
    if (stopping && !killed && Clock::now() >= kill_deadline) {
      killed = true;
      write_quietly(2, cat("opd launch: ranks still running ", o.kill_after_s,
                           " s after SIGTERM: sending SIGKILL\n"));
      signal_alive(SIGKILL);
    }
  }
  for (Rank& r : ranks) {
    for (Stream* s : {&r.out, &r.err})
      if (s->fd >= 0) {
        flush_lines(*s, o.prefix_output ? cat("[rank ", r.rank, "] ") : "", true);
        ::close(s->fd);
        s->fd = -1;
      }
    // Anything a rank left behind in its process group goes with the job.
    if (stopping) ::kill(-r.pid, SIGKILL);
  }

  if (first_failure_index >= 0) {
    first_failure = &result.exits[first_failure_index];
    result.failed_rank = first_failure->rank;
    result.exit_code = first_failure->signaled ? 128 + first_failure->signal : first_failure->code;
    int others = static_cast<int>(result.exits.size()) - 1;
    result.message = cat("rank ", first_failure->rank, " failed first: ", first_failure->describe(),
                         " after ", static_cast<int>(first_failure->seconds * 10) / 10.0, " s; ",
                         others, " other local rank(s) stopped",
                         killed ? " (some needed SIGKILL)" : "", "; job down after ",
                         static_cast<int>(since_start() * 10) / 10.0, " s");
  } else {
    result.message = stopping ? "every rank exited cleanly after the forwarded signal"
                              : "every rank exited with status 0";
  }
  if (!o.error_file.empty()) {
    nlohmann::json j = nlohmann::json::object();
    if (first_failure != nullptr) {
      j = {{"rank", first_failure->rank},     {"local_rank", first_failure->local_rank},
           {"pid", first_failure->pid},       {"signaled", first_failure->signaled},
           {"exit_code", first_failure->code}, {"signal", first_failure->signal},
           {"seconds", first_failure->seconds}, {"message", result.message}};
    }
    std::ofstream f(o.error_file);
    f << j.dump(2) << "\n";
    OPD_CHECK(f.good(), Io, "opd launch: cannot write --error-file ", o.error_file);
  }
  return result;
}

}  // namespace opd::dist
