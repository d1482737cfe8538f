// `opd serve` through raw POSIX sockets (docs/robustness.md, session 16): clients that stall or
// drip a request, partial and chunked bodies, pipelining, HTTP/1.0, clients gone mid-answer,
// concurrent scoring, and signals to a child `opd serve`. Every bound on time is generous (a
// slow 2-core CI machine): a failure means "never", not "slow".
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "common/test_util.h"
#include "core/philox.h"
#include "teacher/protocol.h"
#include "teacher/scorer.h"
#include "teacher/server.h"
#include "teacher/server_test_util.h"

namespace opd {
namespace {

using Clock = std::chrono::steady_clock;

int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << strerror(errno);
  return fd;
}

bool send_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

// Reads until `done(text)` or the peer closes or `seconds` pass.
std::string read_until(int fd, double seconds, const std::function<bool(const std::string&)>& done) {
  std::string out;
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  while (!done(out)) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    char buf[65536];
    const ssize_t n = ::read(fd, buf, sizeof(buf));  // sockets and the child's stdout pipe
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// Complete responses in `s` (Content-Length framed).
size_t count_responses(const std::string& s, std::vector<std::string>* bodies = nullptr) {
  size_t pos = 0, count = 0;
  for (;;) {
    const size_t h = s.find("\r\n\r\n", pos);
    if (h == std::string::npos) return count;
    const size_t cl = s.find("Content-Length: ", pos);
    if (cl == std::string::npos || cl > h) return count;
    const size_t len = std::stoul(s.substr(cl + 16, 20));
    if (s.size() < h + 4 + len) return count;
    if (bodies) bodies->push_back(s.substr(h + 4, len));
    pos = h + 4 + len;
    ++count;
  }
}

std::string one_response(int fd, double seconds = 60) {
  return read_until(fd, seconds, [](const std::string& s) { return count_responses(s) >= 1; });
}

std::string hex(size_t n) {
  char b[32];
  std::snprintf(b, sizeof(b), "%zx", n);
  return b;
}

int status_of(const std::string& response) {
  if (response.rfind("HTTP/1.", 0) != 0 || response.size() < 12) return -1;
  return std::stoi(response.substr(9, 3));
}

std::string post(const std::string& path, const std::string& type, const std::string& body,
                 const std::string& extra = "") {
  return cat("POST ", path, " HTTP/1.1\r\nHost: x\r\nContent-Type: ", type,
             "\r\nContent-Length: ", body.size(), "\r\n", extra, "\r\n", body);
}

ScoreRequest request(uint64_t seed) {
  ScoreRequest q;
  q.k = 4;
  q.temperature = 1.0;
  std::vector<int32_t> ids;
  for (int i = 0; i < 24; ++i) ids.push_back(static_cast<int32_t>(philox_u32(seed, 5, i) % 96));
  q.sequences.push_back({ids, 3, 24});
  return q;
}

void expect_identical(const ScoreResponse& a, const ScoreResponse& b) {
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.logprobs, b.logprobs);
  EXPECT_EQ(a.actual_logprobs, b.actual_logprobs);
  EXPECT_EQ(a.row_offsets, b.row_offsets);
}

// Clients that keep a connection busy without finishing a request: half drip header lines,
// half declare a body and drip it, one byte a second each, for up to `seconds`.
class Stallers {
 public:
  Stallers(int port, int n, double seconds) {
    for (int i = 0; i < n; ++i) {
      const int fd = connect_to(port);
      send_all(fd, i % 2 ? "GET /health HTTP/1.1\r\nHost: x\r\n"
                         : "POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: "
                           "application/json\r\nContent-Length: 100000\r\n\r\n{\"k\"");
      fds_.push_back(fd);
    }
    drip_ = std::thread([this, seconds, n] {
      const auto end = Clock::now() + std::chrono::duration<double>(seconds);
      while (!stop_ && Clock::now() < end) {
        for (int i = 0; i < n; ++i) send_all(fds_[i], i % 2 ? "X-a: b\r\n" : " ");
        for (int t = 0; t < 10 && !stop_; ++t) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
  }
  ~Stallers() {
    pause();
    for (int fd : fds_) ::close(fd);
  }
  void pause() {
    stop_ = true;
    if (drip_.joinable()) drip_.join();
  }
  const std::vector<int>& fds() const { return fds_; }

 private:
  std::vector<int> fds_;
  std::atomic<bool> stop_{false};
  std::thread drip_;
};

class ServerSockets : public ::testing::Test {
 protected:
  void SetUp() override {
    scorer_ = std::make_unique<CpuScorer>(test::fixture_path("models/qwen3"));
    server_ = test::start_test_server(*scorer_);
    port_ = server_->port();
  }
  // A binary /v1/score on a fresh connection: the answer, checked against in-process scoring.
  void expect_scores(uint64_t seed, double seconds) {
    const ScoreRequest q = request(seed);
    const int fd = connect_to(port_);
    ASSERT_TRUE(send_all(fd, post("/v1/score", kBinaryContentType, encode_score_request(q))));
    const auto t0 = Clock::now();
    const std::string r = one_response(fd, seconds);
    ::close(fd);
    ASSERT_EQ(status_of(r), 200) << "no answer after "
                                 << std::chrono::duration<double>(Clock::now() - t0).count()
                                 << " s: '" << r.substr(0, 200) << "'";
    std::vector<std::string> bodies;
    count_responses(r, &bodies);
    expect_identical(decode_score_response(bodies.at(0)), scorer_->score(q));
  }

  std::unique_ptr<CpuScorer> scorer_;
  std::unique_ptr<TeacherServer> server_;
  int port_ = 0;
};

// Before: 4 threads, 12 dripping connections: the well-behaved request waited for as long as
// they dripped (a read timeout restarts at every byte), /health included.
TEST_F(ServerSockets, ClientsThatDripRequestsDoNotLockOutAWellBehavedOne) {
  Stallers stallers(port_, 12, 60);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  for (uint64_t seed = 1; seed <= 3; ++seed) expect_scores(seed, 30);
  const int fd = connect_to(port_);
  send_all(fd, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(status_of(one_response(fd, 30)), 200);
  ::close(fd);
}

// Before: stop() waited for every dripping client (38 s in the probe, unbounded in general).
// A request being scored when stop() comes is answered (ServeSignals below).
TEST_F(ServerSockets, StopIsPromptWithDrippingClientsAndClosesThem) {
  Stallers stallers(port_, 3, 60);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const auto t0 = Clock::now();
  server_->stop();
  server_->wait();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 20.0);
  // The clients mid-request are closed (no request of theirs was in flight).
  for (int fd : stallers.fds()) {
    pollfd p{fd, POLLIN, 0};
    EXPECT_EQ(::poll(&p, 1, 5000), 1);
  }
}

// Before: a chunked body was not held to --max-request-mb (200 MB accepted over a 1 MB limit).
TEST_F(ServerSockets, ChunkedBodiesAreServedAndBoundedByTheLimit) {
  const ScoreRequest q = request(9);
  const std::string body = score_request_to_json(q).dump();
  {  // valid, in two chunks
    const int fd = connect_to(port_);
    const size_t half = body.size() / 2;
    send_all(fd, cat("POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n",
                     hex(half), "\r\n", body.substr(0, half), "\r\n",
                     hex(body.size() - half), "\r\n", body.substr(half), "\r\n0\r\n\r\n"));
    const std::string r = one_response(fd);
    ::close(fd);
    ASSERT_EQ(status_of(r), 200) << r.substr(0, 300);
    std::vector<std::string> bodies;
    count_responses(r, &bodies);
    expect_identical(score_response_from_json(nlohmann::json::parse(bodies.at(0))), scorer_->score(q));
  }
  {  // 3 MB in 64 KB chunks over a 1 MB limit: 413 (or the connection cut while still sending)
    const int fd = connect_to(port_);
    send_all(fd, "POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n");
    const std::string chunk = hex(65536) + "\r\n" + std::string(65536, ' ') + "\r\n";
    bool sent_all = true;
    for (int i = 0; i < 48 && sent_all; ++i) sent_all = send_all(fd, chunk);
    if (sent_all) send_all(fd, "0\r\n\r\n");
    const std::string r = one_response(fd);
    ::close(fd);
    if (!r.empty()) {
      EXPECT_EQ(status_of(r), 413) << r.substr(0, 300);
    } else {
      EXPECT_FALSE(sent_all) << "no answer to a chunked body over the limit";
    }
  }
  for (const char* bad : {"zz\r\n{}\r\n0\r\n\r\n", "ffffffffffffffff\r\n{}\r\n0\r\n\r\n",
                          "2\r\n{}XX0\r\n\r\n"}) {
    const int fd = connect_to(port_);
    send_all(fd, cat("POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n", bad));
    const std::string r = one_response(fd);
    ::close(fd);
    const int st = status_of(r);
    EXPECT_TRUE(st == 400 || st == 413) << bad << " -> " << r.substr(0, 300);
  }
  expect_scores(10, 30);
}

// Before: "HTTP error 400" after the read timeout (10 s); now the message names what was
// missing. (A client that half-closes gets no answer at all: httplib writes nothing to a
// socket whose input ended.)
TEST_F(ServerSockets, AnIncompleteBodyIsNamed) {
  const int fd = connect_to(port_);
  send_all(fd, "POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               "Content-Length: 1000\r\n\r\n{\"k\"");
  const std::string r = one_response(fd);
  ::close(fd);
  EXPECT_EQ(status_of(r), 400) << r;
  EXPECT_NE(r.find("4 bytes received of the Content-Length 1000"), std::string::npos) << r;
  expect_scores(11, 30);
}

TEST_F(ServerSockets, ProtocolEdgesKeepTheServerServing) {
  {  // sequential keep-alive requests on one connection, answered in order
    const int fd = connect_to(port_);
    const ScoreRequest q = request(12);
    std::vector<std::string> bodies;
    send_all(fd, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    count_responses(one_response(fd), &bodies);
    send_all(fd, post("/v1/score", kBinaryContentType, encode_score_request(q)));
    count_responses(one_response(fd), &bodies);
    send_all(fd, "GET /nope HTTP/1.1\r\nHost: x\r\n\r\n");
    count_responses(one_response(fd), &bodies);
    ::close(fd);
    ASSERT_EQ(bodies.size(), 3u);
    EXPECT_EQ(bodies[0], R"({"status":"ok"})");
    expect_identical(decode_score_response(bodies[1]), scorer_->score(q));
    EXPECT_NE(bodies[2].find("no route GET /nope"), std::string::npos) << bodies[2];
  }
  {  // pipelined: httplib 0.11 answers the first request and drops the rest of what it read
     // (its read buffer lives one request), then closes after the keep-alive timeout (5 s).
     // Known, left as is (docs/robustness.md): the first answer must be right and the server
     // must go on serving.
    const int fd = connect_to(port_);
    send_all(fd, "GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /nope HTTP/1.1\r\nHost: x\r\n\r\n");
    std::vector<std::string> bodies;
    count_responses(read_until(fd, 30, [](const std::string&) { return false; }), &bodies);
    ::close(fd);
    ASSERT_GE(bodies.size(), 1u);
    EXPECT_EQ(bodies[0], R"({"status":"ok"})");
  }
  {  // HTTP/1.0: answered, then closed by the server
    const int fd = connect_to(port_);
    send_all(fd, "GET /health HTTP/1.0\r\n\r\n");
    const std::string r = read_until(fd, 30, [](const std::string&) { return false; });
    ::close(fd);
    EXPECT_EQ(r.rfind("HTTP/1.1 200", 0), 0u) << r;
    EXPECT_EQ(count_responses(r), 1u);
  }
  for (const char* raw : {"BREW /v1/score HTTP/1.1\r\nHost: x\r\n\r\n",
                          "GET /v1/score HTTP/1.1\r\nHost: x\r\n\r\n",
                          "garbage\r\n\r\n",
                          "POST /v1/score HTTP/1.1\r\nContent-Length: 99999999999999999\r\n\r\n{}",
                          "POST /v1/score HTTP/1.1\r\nContent-Length: -5\r\n\r\n{}"}) {
    const int fd = connect_to(port_);
    send_all(fd, raw);
    const std::string r = one_response(fd, 30);
    ::close(fd);
    const int st = status_of(r);
    EXPECT_TRUE(r.empty() || (st >= 400 && st < 500)) << raw << " -> " << r.substr(0, 200);
  }
  {  // a client gone mid-answer (a reset while a 1 MB JSON answer is written): no SIGPIPE
    nlohmann::json j;
    j["k"] = 96;
    std::vector<int32_t> ids(400);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % 96);
    j["sequences"] = nlohmann::json::array({{{"ids", ids}}});
    for (int i = 0; i < 3; ++i) {
      const int fd = connect_to(port_);
      int small = 4096;
      setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
      send_all(fd, post("/v1/score", "application/json", j.dump()));
      read_until(fd, 30, [](const std::string& s) { return s.size() > 100; });
      linger l{1, 0};
      setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
      ::close(fd);
    }
  }
  expect_scores(13, 30);
}

int open_fds() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// Many requests on one keep-alive connection and many connections: no fds or threads left.
TEST_F(ServerSockets, ManyRequestsLeaveNoConnectionsBehind) {
  expect_scores(20, 30);
  const int fds_before = open_fds();
  const int fd = connect_to(port_);
  const ScoreRequest q = request(21);
  const ScoreResponse want = scorer_->score(q);
  for (int i = 0; i < 99; ++i) {  // keep_alive_max_count is 100
    ASSERT_TRUE(send_all(fd, post("/v1/score", kBinaryContentType, encode_score_request(q))));
    const std::string r = one_response(fd);
    std::vector<std::string> bodies;
    ASSERT_EQ(count_responses(r, &bodies), 1u) << "request " << i;
    expect_identical(decode_score_response(bodies[0]), want);
  }
  ::close(fd);
  for (int i = 0; i < 50; ++i) {
    const int c = connect_to(port_);
    send_all(c, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    read_until(c, 30, [](const std::string&) { return false; });
    ::close(c);
  }
  const auto end = Clock::now() + std::chrono::seconds(30);
  while (open_fds() > fds_before && Clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_LE(open_fds(), fds_before);
}

TEST_F(ServerSockets, ConcurrentScoresEqualTheSameRequestsAlone) {
  std::vector<std::thread> clients;
  std::atomic<int> ok{0};
  for (int t = 0; t < 8; ++t)
    clients.emplace_back([&, t] {
      for (int i = 0; i < 4; ++i) {
        const ScoreRequest q = request(100 + t * 10 + i);
        const int fd = connect_to(port_);
        send_all(fd, post("/v1/score", kBinaryContentType, encode_score_request(q)));
        const std::string r = one_response(fd, 120);
        ::close(fd);
        std::vector<std::string> bodies;
        if (status_of(r) != 200 || count_responses(r, &bodies) != 1) continue;
        const ScoreResponse got = decode_score_response(bodies[0]);
        const ScoreResponse want = scorer_->score(q);
        if (got.ids == want.ids && got.logprobs == want.logprobs &&
            got.actual_logprobs == want.actual_logprobs)
          ++ok;
      }
    });
  for (auto& c : clients) c.join();
  EXPECT_EQ(ok.load(), 32);
}

// The binary: SIGHUP is ignored (it killed the server); SIGTERM with a dripping client and a
// request in flight exits 0 promptly.
TEST(ServeSignals, SighupIsIgnoredAndSigtermWithDrippingClientsExitsPromptly) {
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  const std::string model = cat(OPD_SOURCE_DIR, "/demo/teacher");
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], 1);
    close(out[0]);
    execl(OPD_BINARY, OPD_BINARY, "serve", "--model", model.c_str(), "--port", "0", "--threads",
          "2", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  // Whatever fails below, the child does not outlive the test.
  struct Reap {
    pid_t pid;
    bool done = false;
    ~Reap() {
      if (done) return;
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  } reap{pid};
  const std::string line = read_until(out[0], 120, [](const std::string& s) {
    return s.find('\n') != std::string::npos;
  });
  const size_t at = line.find("port ");
  ASSERT_NE(at, std::string::npos) << line;
  const int port = std::stoi(line.substr(at + 5));
  auto health = [&] {
    const int fd = connect_to(port);
    send_all(fd, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    const int st = status_of(one_response(fd, 30));
    ::close(fd);
    return st;
  };
  ASSERT_EQ(health(), 200);
  ASSERT_EQ(kill(pid, SIGHUP), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(health(), 200) << "SIGHUP stopped the server";
  {
    Stallers stallers(port, 4, 90);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_EQ(health(), 200);
    const auto t0 = Clock::now();
    ASSERT_EQ(kill(pid, SIGTERM), 0);
    int status = 0;
    pid_t done = 0;
    while ((done = waitpid(pid, &status, WNOHANG)) == 0 && Clock::now() - t0 < std::chrono::seconds(60))
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (done == 0) {
      ADD_FAILURE() << "opd serve did not exit within 60 s of SIGTERM";
    } else {
      reap.done = true;
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
    }
  }
  close(out[0]);
}

}  // namespace
}  // namespace opd
