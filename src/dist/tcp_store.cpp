// TCP store: the server (one thread per connection, one exchange table under a mutex) and the
// client (blocking socket I/O bounded by poll() deadlines). Wire format, native byte order
// (a job runs on one architecture):
//   request: u8 op | u64 seq | f64 timeout_s | u64 n | n payload bytes
//   reply:   u8 status | u64 n | n payload bytes
// HELLO carries the rank in seq and (magic, version, world size) as payload; EXCHANGE carries
// the collective number and [u32 descriptor length | descriptor | data]; its reply is, per
// rank, u64 n | n bytes. Lengths are checked against a cap before anything is allocated.
#include "dist/tcp_store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "core/log.h"

namespace opd::dist {

namespace {

using Clock = std::chrono::steady_clock;

enum Op : uint8_t { kHello = 1, kExchange = 2, kAbort = 3, kBye = 4 };
enum Status : uint8_t { kOk = 0, kTimeout = 1, kPeerLost = 2, kAborted = 3, kInvalid = 4 };

Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

constexpr uint32_t kMagic = 0x5344504f;  // "OPDS"
constexpr uint32_t kVersion = 1;
constexpr uint64_t kMaxPayload = uint64_t{16} << 30;  // 16 GiB: far above any real use

// Writes all of buf or returns false (peer gone). MSG_NOSIGNAL: a closed peer is an error
// value, not a SIGPIPE.
bool write_all(int fd, const void* buf, size_t n) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

enum class ReadResult { Ok, Closed, Timeout, Error };

// Reads exactly n bytes before `deadline` (Clock::time_point::max(): no deadline).
ReadResult read_all(int fd, void* buf, size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    int wait_ms = -1;
    if (deadline != Clock::time_point::max()) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return ReadResult::Timeout;
      wait_ms = static_cast<int>(std::min<int64_t>(left.count(), 1000));
    } else {
      wait_ms = 1000;
    }
    pollfd pfd{fd, POLLIN, 0};
    int pr = ::poll(&pfd, 1, wait_ms);
    if (pr < 0 && errno == EINTR) continue;
    if (pr < 0) return ReadResult::Error;
    if (pr == 0) continue;
    ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (r == 0) return ReadResult::Closed;
    if (r < 0) return ReadResult::Error;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return ReadResult::Ok;
}

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size() && i < 16; ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > 16) s += cat(" and ", ranks.size() - 16, " more");
  return s;
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Server

struct Exchange {
  std::vector<std::string> parts;
  std::vector<bool> arrived;
  int count = 0;
  int readers_left = 0;
};

struct StoreServer::State {
  int world_size = 1;
  int listen_fd = -1;
  int port = 0;
  double grace_s = 30;
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::map<uint64_t, Exchange> exchanges;
  std::vector<bool> connected;  // rank has said hello and not goodbye
  std::vector<bool> departed;   // rank said goodbye: it will never contribute again
  std::vector<bool> told;       // rank was sent `failure` (so it has the job's story)
  std::string failure;          // first lost/aborted rank's story; waits fail with it
  std::vector<int> fds;         // open connections (closed on shutdown)
  std::vector<std::thread> threads;
  std::thread acceptor;

  void serve(int fd);
  void accept_loop();
};

void StoreServer::State::accept_loop() {
  while (true) {
    int fd = ::accept(listen_fd, nullptr, nullptr);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return;  // listen socket shut down
    }
    std::lock_guard<std::mutex> lock(mu);
    if (stopping) {
      ::close(fd);
      return;
    }
    set_nodelay(fd);
    fds.push_back(fd);
    threads.emplace_back([this, fd] { serve(fd); });
  }
}

void StoreServer::State::serve(int fd) {
  int rank = -1;
  bool said_bye = false;
  auto reply = [&](uint8_t status, const std::string& payload) {
    std::string msg;
    put<uint8_t>(msg, status);
    put<uint64_t>(msg, payload.size());
    msg += payload;
    return write_all(fd, msg.data(), msg.size());
  };
  while (true) {
    uint8_t op = 0;
    uint64_t seq = 0, n = 0;
    double timeout_s = 0;
    if (read_all(fd, &op, 1, Clock::time_point::max()) != ReadResult::Ok) break;
    if (read_all(fd, &seq, 8, Clock::time_point::max()) != ReadResult::Ok ||
        read_all(fd, &timeout_s, 8, Clock::time_point::max()) != ReadResult::Ok ||
        read_all(fd, &n, 8, Clock::time_point::max()) != ReadResult::Ok)
      break;
    if (n > kMaxPayload || !(timeout_s >= 0) || (rank < 0 && op != kHello)) {
      reply(kInvalid, "malformed request or no hello");
      break;
    }
    std::string payload(n, '\0');
    if (n && read_all(fd, payload.data(), n, Clock::time_point::max()) != ReadResult::Ok) break;

    if (op == kHello) {
      uint32_t magic = 0, version = 0;
      int32_t world = 0;
      if (n != 12) {
        reply(kInvalid, "malformed hello");
        break;
      }
      std::memcpy(&magic, payload.data(), 4);
      std::memcpy(&version, payload.data() + 4, 4);
      std::memcpy(&world, payload.data() + 8, 4);
      std::unique_lock<std::mutex> lock(mu);
      std::string err;
      if (magic != kMagic || version != kVersion) err = "not an opd store client (or another version)";
      else if (world != world_size) err = cat("world size ", world, " differs from the store's ", world_size);
      else if (seq >= static_cast<uint64_t>(world_size)) err = cat("rank ", seq, " is outside [0, ", world_size, ")");
      else if (connected[seq]) err = cat("rank ", seq, " is already connected (two processes with one RANK?)");
      if (!err.empty()) {
        lock.unlock();
        reply(kInvalid, err);
        break;
      }
      rank = static_cast<int>(seq);
      connected[rank] = true;
      lock.unlock();
      if (!reply(kOk, "")) break;
    } else if (op == kBye) {
      said_bye = true;
      reply(kOk, "");
      break;
    } else if (op == kAbort) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (failure.empty()) failure = cat("rank ", rank, " failed: ", payload);
      }
      cv.notify_all();
      reply(kOk, "");
    } else if (op == kExchange) {
      std::unique_lock<std::mutex> lock(mu);
      Exchange& ex = exchanges[seq];
      if (ex.parts.empty()) {
        ex.parts.resize(world_size);
        ex.arrived.assign(world_size, false);
        ex.readers_left = world_size;
      }
      if (ex.arrived[rank]) {
        lock.unlock();
        reply(kInvalid, cat("rank ", rank, " contributed twice to collective #", seq));
        break;
      }
      ex.parts[rank] = std::move(payload);
      ex.arrived[rank] = true;
      ++ex.count;
      if (ex.count == world_size) cv.notify_all();
      const auto deadline = deadline_after(timeout_s);
      auto someone_left = [&] {
        for (int r = 0; r < world_size; ++r)
          if (!ex.arrived[r] && departed[r]) return true;
        return false;
      };
      cv.wait_until(lock, deadline, [&] {
        return ex.count == world_size || !failure.empty() || stopping || someone_left();
      });
      if (ex.count == world_size) {
        std::string out;
        for (const std::string& p : ex.parts) {
          put<uint64_t>(out, p.size());
          out += p;
        }
        if (--ex.readers_left == 0) exchanges.erase(seq);
        lock.unlock();
        if (!reply(kOk, out)) break;
        continue;
      }
      std::vector<int> missing;
      for (int r = 0; r < world_size; ++r)
        if (!ex.arrived[r]) missing.push_back(r);
      std::string why;
      uint8_t status = kTimeout;
      const bool telling_failure = !failure.empty();
      if (telling_failure) {
        why = failure;
        status = kPeerLost;
      } else if (stopping) {
        why = "the store (rank 0) is shutting down";
        status = kPeerLost;
      } else if (someone_left()) {
        std::vector<int> gone;
        for (int r : missing)
          if (departed[r]) gone.push_back(r);
        why = cat("rank(s) ", rank_list(gone), " left the job (closed the store) without it");
        status = kPeerLost;
      } else {
        why = cat("rank(s) ", rank_list(missing), " did not reach it within ", timeout_s, " s");
      }
      lock.unlock();
      if (!reply(status, why)) break;
      if (telling_failure) {
        std::lock_guard<std::mutex> relock(mu);
        told[rank] = true;
        cv.notify_all();
      }
    } else {
      reply(kInvalid, cat("unknown store operation ", int(op)));
      break;
    }
  }
  std::lock_guard<std::mutex> lock(mu);
  if (rank >= 0) {
    connected[rank] = false;
    if (said_bye) departed[rank] = true;
    if (!said_bye && !stopping && failure.empty())
      failure = cat("rank ", rank,
                    " lost its connection to the store (the process exited or was killed)");
  }
  cv.notify_all();
}

StoreServer::StoreServer(int port, int world_size) : state_(std::make_shared<State>()) {
  OPD_CHECK(world_size >= 1, InvalidArgument, "store: world size must be >= 1, got ", world_size);
  OPD_CHECK(port >= 0 && port <= 65535, InvalidArgument, "store: port ", port,
            " is outside [0, 65535]");
  State& s = *state_;
  s.world_size = world_size;
  s.connected.assign(world_size, false);
  s.departed.assign(world_size, false);
  s.told.assign(world_size, false);
  s.listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  OPD_CHECK(s.listen_fd >= 0, Io, "store: socket() failed: ", std::strerror(errno));
  int one = 1;
  ::setsockopt(s.listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(s.listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(s.listen_fd, 1024) != 0) {
    int err = errno;
    ::close(s.listen_fd);
    OPD_FAIL(Io, "store: cannot listen on port ", port, ": ", std::strerror(err),
             err == EADDRINUSE ? " (another job uses it: pick another MASTER_PORT / --master-port)"
                               : "");
  }
  socklen_t len = sizeof(addr);
  ::getsockname(s.listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
  s.port = ntohs(addr.sin_port);
  s.acceptor = std::thread([st = state_] { st->accept_loop(); });
}

int StoreServer::port() const { return state_->port; }
void StoreServer::set_shutdown_grace(double seconds) { state_->grace_s = seconds; }

StoreServer::~StoreServer() {
  State& s = *state_;
  {
    std::unique_lock<std::mutex> lock(s.mu);
    // Ranks still connected may be reading their last reply: give them time to say goodbye,
    // unless the job has already failed (then nobody is waiting for anything useful).
    s.cv.wait_for(lock, std::chrono::duration<double>(s.grace_s), [&] {
      return !s.failure.empty() ||
             std::none_of(s.connected.begin(), s.connected.end(), [](bool c) { return c; });
    });
    // After a failure, a rank still connected may be about to ask (or be reading the answer):
    // let it hear the job's story from the store, not just "rank 0 exited", for a few seconds
    // at most (a rank busy computing is not waited for longer; CI 2026-11-30 under ASan).
    if (!s.failure.empty()) {
      s.cv.wait_for(lock, std::chrono::duration<double>(std::min(s.grace_s, 5.0)), [&] {
        for (int r = 0; r < s.world_size; ++r)
          if (s.connected[r] && !s.told[r]) return false;
        return true;
      });
    }
    s.stopping = true;
    for (int fd : s.fds) ::shutdown(fd, SHUT_RDWR);
  }
  s.cv.notify_all();
  ::shutdown(s.listen_fd, SHUT_RDWR);
  ::close(s.listen_fd);
  if (s.acceptor.joinable()) s.acceptor.join();
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    threads.swap(s.threads);
  }
  for (std::thread& t : threads) t.join();
  for (int fd : s.fds) ::close(fd);
}

// ---------------------------------------------------------------------------------------------
// Client

Store::Store(const std::string& host, int port, int rank, int world_size, double timeout_s)
    : rank_(rank), world_size_(world_size), timeout_s_(timeout_s),
      uncaught_at_start_(std::uncaught_exceptions()) {
  OPD_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, InvalidArgument, "store: rank ",
            rank, " is outside [0, ", world_size, ")");
  OPD_CHECK(port >= 1 && port <= 65535, InvalidArgument, "store: port ", port,
            " is outside [1, 65535]");
  OPD_CHECK(timeout_s > 0, InvalidArgument, "store: timeout must be > 0 s, got ", timeout_s);
  endpoint_ = cat(host, ":", port);
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  const auto deadline = deadline_after(timeout_s);
  std::string last_error;
  int backoff_ms = 20;
  while (true) {
    addrinfo* res = nullptr;
    int gai = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (gai == 0) {
      for (addrinfo* a = res; a != nullptr && fd_ < 0; a = a->ai_next) {
        int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          fd_ = fd;
        } else {
          last_error = std::strerror(errno);
          ::close(fd);
        }
      }
      ::freeaddrinfo(res);
    } else {
      last_error = cat("cannot resolve host '", host, "': ", ::gai_strerror(gai));
    }
    if (fd_ >= 0) break;
    // Rank 0 may not be listening yet (ranks start in any order): retry with backoff.
    OPD_CHECK(Clock::now() < deadline, Io, "store: rank ", rank, " could not connect to ",
              endpoint_, " within ", timeout_s, " s (", last_error,
              "); is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?");
    std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
    backoff_ms = std::min(backoff_ms * 2, 1000);
  }
  set_nodelay(fd_);
  std::string hello;
  put<uint32_t>(hello, kMagic);
  put<uint32_t>(hello, kVersion);
  put<int32_t>(hello, world_size);
  try {
    send_request(kHello, static_cast<uint64_t>(rank), timeout_s, hello);
    receive_reply("hello", timeout_s);
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

Store::~Store() {
  if (fd_ >= 0) {
    // Destroyed while an exception unwinds the stack: this rank is failing, so let the others
    // fail at once instead of waiting for it until their timeout.
    if (std::uncaught_exceptions() > uncaught_at_start_) abort("exited with an error");
    try {
      send_request(kBye, 0, 0, "");
      receive_reply("goodbye", 5.0);
    } catch (const Error&) {
      // The server may be gone already (rank 0 exited): nothing to say goodbye to.
    }
    ::close(fd_);
  }
}

std::shared_ptr<Store> Store::connect(const DistEnv& env, double timeout_s) {
  std::unique_ptr<StoreServer> server;
  if (env.rank == 0) server = std::make_unique<StoreServer>(env.master_port, env.world_size);
  // Rank 0 talks to its own server over loopback: MASTER_ADDR may name an interface of this
  // host that is not reachable from itself in odd network set-ups.
  const std::string host = env.rank == 0 ? "127.0.0.1" : env.master_addr;
  auto store = std::make_shared<Store>(host, env.master_port, env.rank, env.world_size, timeout_s);
  store->server_ = std::move(server);
  return store;
}

void Store::send_request(uint8_t op, uint64_t seq, double timeout_s, std::string_view payload) {
  OPD_CHECK(fd_ >= 0, Io, "store: rank ", rank_, " is not connected");
  std::string msg;
  put<uint8_t>(msg, op);
  put<uint64_t>(msg, seq);
  put<double>(msg, timeout_s);
  put<uint64_t>(msg, payload.size());
  msg.append(payload);
  OPD_CHECK(write_all(fd_, msg.data(), msg.size()), Io, "store: rank ", rank_,
            " lost its connection to the store at ", endpoint_, " (rank 0 exited?)");
}

std::string Store::receive_reply(const std::string& what, double timeout_s) {
  // The server answers a wait by its own deadline; the slack covers the network.
  const auto deadline = deadline_after(timeout_s + 30.0);
  uint8_t status = 0;
  uint64_t n = 0;
  auto check = [&](ReadResult r) {
    OPD_CHECK(r != ReadResult::Closed && r != ReadResult::Error, Io, "store: rank ", rank_,
              " lost its connection to the store at ", endpoint_, " during ", what,
              " (rank 0 exited or was killed?)");
    OPD_CHECK(r != ReadResult::Timeout, Io, "store: rank ", rank_, " got no answer from ",
              endpoint_, " to ", what, " within ", timeout_s, " s");
  };
  check(read_all(fd_, &status, 1, deadline));
  check(read_all(fd_, &n, 8, deadline));
  OPD_CHECK(n <= kMaxPayload, Io, "store: malformed reply (", n, " bytes) to ", what);
  std::string payload(n, '\0');
  if (n) check(read_all(fd_, payload.data(), n, deadline));
  switch (status) {
    case kOk: return payload;
    case kTimeout:
      OPD_FAIL(Io, "store: ", what, " on rank ", rank_, " timed out: ", payload);
    case kPeerLost:
    case kAborted:
      OPD_FAIL(Io, "store: ", what, " on rank ", rank_, " failed: ", payload);
    default:
      OPD_FAIL(Io, "store: ", what, " on rank ", rank_, " was refused: ", payload);
  }
}

std::vector<std::string> Store::exchange(std::string_view what, std::string_view data) {
  const uint64_t seq = seq_++;
  std::string label = cat("collective #", seq, " (", what, ")");
  std::string payload;
  put<uint32_t>(payload, static_cast<uint32_t>(what.size()));
  payload.append(what);
  payload.append(data);
  send_request(kExchange, seq, timeout_s_, payload);
  std::string reply = receive_reply(label, timeout_s_);
  std::vector<std::string> parts;
  parts.reserve(world_size_);
  size_t pos = 0;
  for (int r = 0; r < world_size_; ++r) {
    uint64_t n = 0;
    OPD_CHECK(pos + 8 <= reply.size(), Io, "store: truncated reply to ", label);
    std::memcpy(&n, reply.data() + pos, 8);
    pos += 8;
    OPD_CHECK(n >= 4 && n <= reply.size() - pos, Io, "store: truncated reply to ", label);
    uint32_t dn = 0;
    std::memcpy(&dn, reply.data() + pos, 4);
    OPD_CHECK(dn <= n - 4, Io, "store: malformed reply to ", label);
    std::string_view desc(reply.data() + pos + 4, dn);
    OPD_CHECK(desc == what, InvalidArgument, "collective mismatch at #", seq, ": rank ", rank_,
              " called '", what, "' but rank ", r, " called '", desc,
              "' (every rank must call the same collectives in the same order)");
    parts.emplace_back(reply.data() + pos + 4 + dn, n - 4 - dn);
    pos += n;
  }
  return parts;
}

void Store::barrier(std::string_view what) { exchange(what, ""); }

std::vector<double> Store::all_reduce(std::vector<double> values, HostReduce op,
                                      std::string_view what) {
  const char* op_name = op == HostReduce::Sum ? "sum" : op == HostReduce::Max ? "max" : "min";
  std::string desc = cat(what, " f64[", values.size(), "] ", op_name);
  auto parts = exchange(desc, std::string_view(reinterpret_cast<const char*>(values.data()),
                                               values.size() * sizeof(double)));
  std::vector<double> out(values.size());
  for (int r = 0; r < world_size_; ++r) {
    OPD_CHECK(parts[r].size() == values.size() * sizeof(double), Io,
              "store: rank ", r, " sent ", parts[r].size(), " bytes to ", desc);
    const double* v = reinterpret_cast<const double*>(parts[r].data());
    for (size_t i = 0; i < out.size(); ++i) {
      double x;
      std::memcpy(&x, v + i, sizeof(double));
      if (r == 0) out[i] = x;
      else if (op == HostReduce::Sum) out[i] += x;
      else if (op == HostReduce::Max) out[i] = std::isnan(x) || x > out[i] ? x : out[i];
      else out[i] = std::isnan(x) || x < out[i] ? x : out[i];
    }
  }
  return out;
}

std::string Store::broadcast(std::string_view value, int root, std::string_view what) {
  OPD_CHECK(root >= 0 && root < world_size_, InvalidArgument, "broadcast: root ", root,
            " is outside [0, ", world_size_, ")");
  auto parts = exchange(cat(what, " from rank ", root), rank_ == root ? value : std::string_view());
  return parts[root];
}

void Store::abort(std::string_view message) noexcept {
  try {
    send_request(kAbort, 0, 0, message);
    receive_reply("abort", 5.0);
  } catch (...) {
  }
}

int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  OPD_CHECK(fd >= 0, Io, "socket() failed: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    int err = errno;
    ::close(fd);
    OPD_FAIL(Io, "cannot find a free port: ", std::strerror(err));
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace opd::dist
