// Faults and load against a real `opd serve` child process on loopback:
// - the server is killed with SIGKILL while clients have requests in flight and restarted on the
//   same port; the clients retry and every caller gets each result exactly once, equal to the
//   in-process scores;
// - SIGTERM stops the server cleanly (exit status 0);
// - load: C concurrent clients x R requests each, zero errors, the server's peak RSS (VmHWM)
//   bounded, p50/p99 latency printed (never asserted: tests do not assert on wall time).
//   Default C = 16, R = 25 to keep the suite fast on 2 cores; OPD_TEACHER_LOAD_FULL=1 runs the
//   full 64 x 100.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "common/test_util.h"
#include "core/philox.h"
#include <nlohmann/json.hpp>

#include "teacher/client.h"
#include "teacher/scorer.h"

namespace opd {
namespace {

// `opd serve` as a child process; SIGKILLed and reaped in the destructor if still running.
class ChildServer {
 public:
  ChildServer(const std::string& model, int port) {
    int out[2];
    if (pipe(out) != 0) throw std::runtime_error("pipe");
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], 1);
      close(out[0]);
      close(out[1]);
      const std::string bin = test::opd_binary(), p = std::to_string(port);
      execl(bin.c_str(), bin.c_str(), "serve", "--model", model.c_str(), "--port", p.c_str(),
            "--threads", "16", static_cast<char*>(nullptr));
      _exit(127);
    }
    close(out[1]);
    out_fd_ = out[0];
    // Wait (up to 60 s) for "opd serve: port N".
    std::string text;
    for (int waited = 0; waited < 600 && text.find('\n') == std::string::npos; ++waited) {
      pollfd pfd{out_fd_, POLLIN, 0};
      if (poll(&pfd, 1, 100) > 0) {
        char buf[256];
        const ssize_t n = read(out_fd_, buf, sizeof(buf));
        if (n <= 0) break;
        text.append(buf, static_cast<size_t>(n));
      }
    }
    const size_t at = text.find("port ");
    if (at == std::string::npos) {  // the destructor will not run: reap the child here
      kill9();
      close(out_fd_);
      throw std::runtime_error("opd serve did not report a port: " + text);
    }
    port_ = std::stoi(text.substr(at + 5));
  }
  ~ChildServer() {
    if (pid_ > 0) kill9();
    if (out_fd_ >= 0) close(out_fd_);
  }
  int port() const { return port_; }
  void kill9() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  int terminate() {  // SIGTERM, returns the exit status (or -signal)
    kill(pid_, SIGTERM);
    int st = 0;
    waitpid(pid_, &st, 0);
    pid_ = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
  }
  // A field of /proc/<pid>/status in kB (VmRSS, VmHWM).
  int64_t status_kb(const std::string& field) const {
    std::ifstream f(cat("/proc/", pid_, "/status"));
    std::string line;
    while (std::getline(f, line))
      if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
    return -1;
  }

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1;
  int port_ = 0;
};

std::string model_dir() { return test::fixture_path("models/qwen3"); }

ScoreRequest request_for(int64_t client, int64_t i) {
  ScoreRequest q;
  q.k = 4;
  q.temperature = 1.0;
  for (int s = 0; s < 2; ++s) {
    const uint64_t seed = static_cast<uint64_t>(client * 100000 + i * 10 + s);
    const int64_t len = 8 + philox_u32(seed, 1, 0) % 40;
    std::vector<int32_t> ids;
    for (int64_t p = 0; p < len; ++p) ids.push_back(static_cast<int32_t>(philox_u32(seed, 2, p) % 96));
    q.sequences.push_back({ids, 1 + static_cast<int64_t>(philox_u32(seed, 3, 0) % (len - 1)), len});
  }
  return q;
}

ClientOptions client_options(int port, const std::string& fingerprint) {
  ClientOptions co;
  co.url = cat("http://127.0.0.1:", port);
  co.student_vocab = 96;
  co.student_fingerprint = fingerprint;
  co.connections = 1;
  co.max_attempts = 40;
  co.backoff_initial_s = 0.02;
  co.backoff_max_s = 0.5;
  co.request_timeout_s = 60;
  return co;
}

TEST(TeacherFaults, KilledMidRequestRestartedEachResultExactlyOnce) {
  CpuScorer local(model_dir());
  auto server = std::make_unique<ChildServer>(model_dir(), 0);
  const int port = server->port();
  constexpr int kClients = 4, kRequests = 40;
  std::mutex mu;
  std::map<std::pair<int, int>, int> delivered;  // (client, i) -> times returned to the caller
  std::map<std::pair<int, int>, ScoreResponse> results;
  std::atomic<int> done{0}, errors{0};
  std::vector<std::unique_ptr<TeacherClient>> clients;
  for (int c = 0; c < kClients; ++c)
    clients.push_back(std::make_unique<TeacherClient>(client_options(port, local.info().fingerprint)));
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      for (int i = 0; i < kRequests; ++i) {
        try {
          ScoreResponse r = clients[c]->score(request_for(c, i));
          std::lock_guard<std::mutex> lock(mu);
          ++delivered[{c, i}];
          results[{c, i}] = std::move(r);
        } catch (const std::exception& e) {
          ++errors;
          ADD_FAILURE() << "client " << c << " request " << i << ": " << e.what();
        }
        ++done;
      }
    });
  }
  // Kill while requests are flowing, keep it down a moment (clients see refused connections
  // and back off), restart on the same port.
  while (done.load() < kClients * kRequests / 4) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  server->kill9();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  server = std::make_unique<ChildServer>(model_dir(), port);
  ASSERT_EQ(server->port(), port);
  for (auto& t : threads) t.join();

  EXPECT_EQ(errors.load(), 0);
  int64_t retries = 0;
  for (auto& c : clients) retries += c->stats().retries;
  EXPECT_GE(retries, 1) << "the kill did not hit any request";
  std::printf("[ faults   ] %d x %d requests, server killed at ~25%%, %lld retries\n", kClients,
              kRequests, static_cast<long long>(retries));
  for (int c = 0; c < kClients; ++c)
    for (int i = 0; i < kRequests; ++i) {
      ASSERT_EQ((delivered[{c, i}]), 1) << "client " << c << " request " << i;
      const ScoreResponse want = local.score(request_for(c, i));
      EXPECT_EQ((results[{c, i}].ids), want.ids);
      EXPECT_EQ((results[{c, i}].logprobs), want.logprobs);
      EXPECT_EQ((results[{c, i}].actual_logprobs), want.actual_logprobs);
    }
  EXPECT_EQ(server->terminate(), 0);  // SIGTERM: clean stop, exit 0
}

TEST(TeacherLoad, ConcurrentClientsZeroErrorsBoundedMemory) {
  const bool full = std::getenv("OPD_TEACHER_LOAD_FULL") != nullptr;
  const int kClients = full ? 64 : 16, kRequests = full ? 100 : 25;
  CpuScorer local(model_dir());
  ChildServer server(model_dir(), 0);
  {  // warm up, then the baseline RSS
    TeacherClient warm(client_options(server.port(), local.info().fingerprint));
    for (int i = 0; i < 5; ++i) warm.score(request_for(999, i));
  }
  const int64_t rss0 = server.status_kb("VmRSS");
  std::atomic<int> errors{0};
  std::mutex mu;
  std::vector<double> latency_ms;
  std::vector<std::thread> threads;
  const auto t0 = std::chrono::steady_clock::now();
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      try {
        TeacherClient client(client_options(server.port(), local.info().fingerprint));
        std::vector<double> mine;
        for (int i = 0; i < kRequests; ++i) {
          const auto a = std::chrono::steady_clock::now();
          ScoreResponse r = client.score(request_for(c, i));
          mine.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
          if (r.num_rows() != request_for(c, i).num_rows()) ++errors;
        }
        std::lock_guard<std::mutex> lock(mu);
        latency_ms.insert(latency_ms.end(), mine.begin(), mine.end());
      } catch (const std::exception& e) {
        ++errors;
        std::lock_guard<std::mutex> lock(mu);
        ADD_FAILURE() << "client " << c << ": " << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t hwm = server.status_kb("VmHWM"), rss1 = server.status_kb("VmRSS");
  EXPECT_EQ(errors.load(), 0);
  ASSERT_EQ(latency_ms.size(), static_cast<size_t>(kClients * kRequests));
  std::sort(latency_ms.begin(), latency_ms.end());
  const double p50 = latency_ms[latency_ms.size() / 2], p99 = latency_ms[latency_ms.size() * 99 / 100];
  std::printf("[ load     ] %d clients x %d requests: %.1f req/s, latency p50 %.2f ms, p99 %.2f ms; "
              "server RSS %lld kB before, %lld kB after, peak %lld kB\n",
              kClients, kRequests, kClients * kRequests / secs, p50, p99,
              static_cast<long long>(rss0), static_cast<long long>(rss1), static_cast<long long>(hwm));
  // Bounded memory: 16 connection threads, requests of a few KB: the peak stays within 256 MB of
  // the warm baseline (a leak of one response per request would not, at the full size).
  EXPECT_LT(hwm - rss0, 256 * 1024);
  EXPECT_LT(rss1 - rss0, 128 * 1024);
  EXPECT_EQ(server.terminate(), 0);
}

}  // namespace
}  // namespace opd

namespace opd {
namespace {

std::string run_capture(const std::string& cmd, int* status) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  *status = pclose(p);
  return out;
}

// `opd score` in-process and through a served teacher: the same JSONL, and the values are the
// scorer's (itself checked against the dense reference in test_scorer.cpp).
TEST(ScoreCli, InProcessAndServedGiveTheSameJsonl) {
  const std::string in = testing::TempDir() + "opd_score_in_" + std::to_string(::getpid()) + ".jsonl";
  {
    std::ofstream f(in);
    f << R"({"ids": [5, 17, 3, 42, 9, 11], "completion_start": 3})" << "\n\n"
      << R"({"ids": [1, 2], "completion_start": 1})" << "\n";
  }
  int st = 0;
  const std::string bin = test::opd_binary();
  const std::string local = run_capture(bin + " score --model " + model_dir() + " --input " + in +
                                            " --top-k 3 --temperature 0.8 2>/dev/null", &st);
  ASSERT_EQ(st, 0);
  ChildServer server(model_dir(), 0);
  const std::string served =
      run_capture(bin + " score --teacher-url http://127.0.0.1:" + std::to_string(server.port()) +
                      " --input " + in + " --top-k 3 --temperature 0.8 2>/dev/null", &st);
  ASSERT_EQ(st, 0);
  EXPECT_EQ(local, served);
  // Line 1 holds positions 3..5 with 3 entries each, equal to CpuScorer's.
  const size_t nl = local.find('\n');
  ASSERT_NE(nl, std::string::npos);
  auto j = nlohmann::json::parse(local.substr(0, nl));
  CpuScorer scorer(model_dir());
  ScoreRequest q;
  q.k = 3;
  q.temperature = 0.8;
  q.sequences.push_back({{5, 17, 3, 42, 9, 11}, 3, 6});
  q.sequences.push_back({{1, 2}, 1, 2});  // the same batch as the CLI's (same GEMM rows: bit-equal)
  ScoreResponse r = scorer.score(q);
  ASSERT_EQ(j["ids"].size(), 3u);
  for (int row = 0; row < 3; ++row)
    for (int e = 0; e < 3; ++e) {
      EXPECT_EQ(j["ids"][row][e].get<int32_t>(), r.ids[row * 3 + e]);
      EXPECT_EQ(j["logprobs"][row][e].get<float>(), r.logprobs[row * 3 + e]);
    }
  EXPECT_EQ(j["completion_start"].get<int>(), 3);
  // A bad line is reported with file:line, exit status non-zero.
  {
    std::ofstream f(in);
    f << R"({"ids": [5, 17, 3], "completion_start": 1})" << "\n"
      << R"({"ids": [5, 17, 3], "completion_start": 9})" << "\n";
  }
  const std::string err = run_capture(bin + " score --model " + model_dir() + " --input " + in +
                                          " --top-k 2 2>&1 >/dev/null", &st);
  EXPECT_NE(st, 0);
  EXPECT_NE(err.find(".jsonl:2: completion_start 9"), std::string::npos) << err;
}

}  // namespace
}  // namespace opd
