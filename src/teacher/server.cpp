// Teacher HTTP service (server.h): routes, request parsing, error mapping and the
// vLLM-compatible /v1/completions response.
#include "teacher/server.h"

#include <httplib.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <limits>
#include <list>
#include <new>

#include "core/error.h"
#include "core/log.h"
#include "teacher/protocol.h"

namespace opd {


// The connection policy of ServerOptions::threads. httplib serves a connection on one thread
// from its first byte to its close, blocking in recv() on a client that sends slowly or stops
// (its read timeout restarts at every byte): with its fixed pool, `threads` such clients froze
// the server and delayed stop() for as long as they kept dripping. Here every connection is
// registered with its phase (waiting for / receiving a request, or handling one); a connection
// that needs room, or the server stopping, cuts a waiting one with shutdown(SHUT_RD), which
// wakes its blocked recv() at once and closes it without an answer (httplib writes nothing to a
// socket whose input ended; a partial request is not in flight, and clients retry a closed
// connection). Requests being handled are never cut.
//
// httplib (Debian's compiled 0.11) does not hand the accepted socket to any hook, so the task
// queue finds it when the listener enqueues it: the one connected socket on the server's port
// that is not registered yet (/proc/self/fd, matched by socket inode: a registered connection
// keeps a dup() of its socket until it is deregistered, so an inode is never reused meanwhile).
class HttpConnections final : public httplib::Server {
 public:
  struct Conn {
    int fd = -1;  // a dup() of the socket, -1 when it was not found (never cut then)
    unsigned long inode = 0;
    bool receiving = true;
    bool cut = false;
    bool close_after = false;
    bool running = false;  // on a thread (a queued connection holds none: cutting it frees nothing)
    std::chrono::steady_clock::time_point since;
  };

  // The connection served by this thread (guard, error handler, logger run on it).
  static thread_local Conn* t_conn;

  void set_port(int port) { port_ = port; }

  // Listener thread, right after accept(): the new connection's record (its socket found).
  std::unique_ptr<Conn> register_new() {
    auto c = std::make_unique<Conn>();
    c->since = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(mu_);
    int found = -1;
    unsigned long found_inode = 0;
    int count = 0;
    if (DIR* d = opendir("/proc/self/fd")) {
      while (dirent* e = readdir(d)) {
        if (e->d_name[0] == '.') continue;
        char link[64];
        const std::string path = cat("/proc/self/fd/", e->d_name);
        const ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
        if (n <= 8) continue;
        link[n] = '\0';
        unsigned long inode = 0;
        if (std::sscanf(link, "socket:[%lu]", &inode) != 1) continue;
        bool known = false;
        for (const Conn* k : conns_) known = known || k->inode == inode;
        if (known) continue;
        const int fd = std::atoi(e->d_name);
        sockaddr_storage local{}, peer{};
        socklen_t ll = sizeof(local), pl = sizeof(peer);
        if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0 ||
            getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0)
          continue;
        int lport = -1;
        if (local.ss_family == AF_INET) lport = ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port);
        if (local.ss_family == AF_INET6) lport = ntohs(reinterpret_cast<sockaddr_in6*>(&local)->sin6_port);
        if (lport != port_) continue;
        found = fd;
        found_inode = inode;
        ++count;
      }
      closedir(d);
    }
    if (count == 1) {
      c->fd = ::dup(found);
      c->inode = found_inode;
    }
    conns_.push_back(c.get());
    if (stopping_) cut_locked(*c);
    return c;
  }
  void deregister(std::unique_ptr<Conn> c) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      conns_.remove(c.get());
    }
    // httplib has written its answer and closed its descriptor; the socket lives on in the
    // dup. Input the server did not read (a cut request, a body refused half-way) would make
    // close() send a reset, and a reset makes the client's kernel drop the answer it has not
    // read yet: what already arrived is read away first.
    if (c->fd >= 0) {
      char buf[4096];
      for (int i = 0; i < 4096 && ::recv(c->fd, buf, sizeof(buf), MSG_DONTWAIT) > 0; ++i) {
      }
      ::close(c->fd);
    }
  }

  // The current connection has a whole request and is handling it: never cut.
  void mark_handling() {
    if (!t_conn) return;
    std::lock_guard<std::mutex> lock(mu_);
    t_conn->receiving = false;
  }
  // The current connection answered and waits for its next request.
  void mark_receiving() {
    if (!t_conn) return;
    std::lock_guard<std::mutex> lock(mu_);
    t_conn->receiving = true;
    t_conn->since = std::chrono::steady_clock::now();
    if (stopping_ || t_conn->close_after) cut_locked(*t_conn);
  }
  // The current connection's input is out of step (a body not read to its end): it ends after
  // this answer. (Not shutdown() now: httplib writes nothing to a socket whose input ended.)
  void close_after_response() {
    if (!t_conn) return;
    std::lock_guard<std::mutex> lock(mu_);
    t_conn->close_after = true;
  }

  // A thread starts serving the connection.
  void mark_running(Conn& c) {
    std::lock_guard<std::mutex> lock(mu_);
    c.running = true;
    c.since = std::chrono::steady_clock::now();
  }

  // Cuts the connection on a thread that has waited longest (over a second) for its request;
  // false when none does (every thread is handling a request or just got its connection).
  bool cut_oldest_receiving() {
    std::lock_guard<std::mutex> lock(mu_);
    const auto limit = std::chrono::steady_clock::now() - std::chrono::seconds(1);
    Conn* oldest = nullptr;
    for (Conn* c : conns_)
      if (c->running && c->receiving && !c->cut && c->fd >= 0 && c->since < limit &&
          (!oldest || c->since < oldest->since))
        oldest = c;
    if (!oldest) return false;
    cut_locked(*oldest);
    return true;
  }

  // stop(): no new requests; the connections waiting for one are cut, those handling one finish.
  void begin_stop() {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (Conn* c : conns_)
      if (c->receiving) cut_locked(*c);
  }

 private:
  void cut_locked(Conn& c) {
    c.cut = true;
    if (c.fd >= 0) ::shutdown(c.fd, SHUT_RD);
  }

  std::mutex mu_;
  std::list<Conn*> conns_;
  bool stopping_ = false;
  int port_ = 0;
};

thread_local HttpConnections::Conn* HttpConnections::t_conn = nullptr;

namespace {

// httplib's TaskQueue for HttpConnections: a thread per connection up to `max_threads`; past
// that, the connection waiting longest for a request is cut and the new one queued (the freed
// thread takes it), or, with none to cut, queued up to 4 x max_threads; beyond, 503 at once.
class ConnectionThreads final : public httplib::TaskQueue {
 public:
  ConnectionThreads(HttpConnections& server, size_t max_threads)
      : server_(server), max_threads_(max_threads), st_(std::make_shared<State>()) {
    // While connections wait in the queue, a thread held by a connection that has waited over
    // a second for its request is freed for them (one that was too young at enqueue time).
    reaper_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(st_->mu);
      while (!st_->closing) {
        st_->cv.wait_for(lock, std::chrono::milliseconds(250));
        const size_t want = st_->pending.size();
        lock.unlock();
        for (size_t i = 0; i < want && server_.cut_oldest_receiving(); ++i) {
        }
        lock.lock();
      }
    });
  }
  ~ConnectionThreads() override {
    {
      std::lock_guard<std::mutex> lock(st_->mu);
      st_->closing = true;
      st_->cv.notify_all();
    }
    reaper_.join();
  }

  void enqueue(std::function<void()> fn) override {
    auto conn = server_.register_new();
    std::unique_lock<std::mutex> lock(st_->mu);
    if (st_->active < max_threads_) {
      ++st_->active;
      std::thread([this, st = st_, conn = std::move(conn), fn = std::move(fn)]() mutable {
        run(st, std::move(conn), std::move(fn));
      }).detach();
      return;
    }
    const bool made_room = server_.cut_oldest_receiving();
    if (made_room || st_->pending.size() < 4 * max_threads_) {
      st_->pending.push_back({std::move(conn), std::move(fn)});
      return;
    }
    lock.unlock();
    // Refused: 503 written without blocking, then httplib's own close (fn) on this thread, its
    // read cut short. The client may see the 503 or a reset; both are retried by clients.
    static const std::string body =
        R"({"error":{"message":"server busy: every connection is handling a request and the queue is full; retry","type":"ServiceUnavailableError","code":503}})";
    const std::string msg = cat("HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
                                "application/json\r\nConnection: close\r\nContent-Length: ",
                                body.size(), "\r\n\r\n", body);
    if (conn->fd >= 0) {
      [[maybe_unused]] ssize_t n = ::send(conn->fd, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      ::shutdown(conn->fd, SHUT_RDWR);
    }
    HttpConnections::t_conn = conn.get();
    fn();
    HttpConnections::t_conn = nullptr;
    server_.deregister(std::move(conn));
  }

  void shutdown() override {
    std::unique_lock<std::mutex> lock(st_->mu);
    st_->cv.wait(lock, [&] { return st_->active == 0; });
  }

 private:
  using Conn = HttpConnections::Conn;
  struct Job {
    std::unique_ptr<Conn> conn;
    std::function<void()> fn;
  };
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    size_t active = 0;
    bool closing = false;
    std::deque<Job> pending;
  };
  // `this` outlives every worker: shutdown() waits for them (httplib calls it before deleting).
  void run(std::shared_ptr<State> st, std::unique_ptr<Conn> conn, std::function<void()> fn) {
    for (;;) {
      server_.mark_running(*conn);
      HttpConnections::t_conn = conn.get();
      fn();
      HttpConnections::t_conn = nullptr;
      fn = nullptr;
      server_.deregister(std::move(conn));
      std::lock_guard<std::mutex> lock(st->mu);
      if (st->pending.empty()) {
        --st->active;
        st->cv.notify_all();
        return;
      }
      conn = std::move(st->pending.front().conn);
      fn = std::move(st->pending.front().fn);
      st->pending.pop_front();
    }
  }

  HttpConnections& server_;
  size_t max_threads_;
  std::shared_ptr<State> st_;
  std::thread reaper_;
};

using nlohmann::json;

// An HTTP status decided by a handler (404 / 409 / 415 / 501 ...).
struct HttpError {
  int status;
  std::string message;
};

std::string dump(const json& j) {
  // replace: a message quoting bytes of a malformed request must not make dump() throw.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

const char* error_type(int status) {
  switch (status) {
    case 400: return "BadRequestError";
    case 404: return "NotFoundError";
    case 409: return "ConflictError";
    case 413: return "PayloadTooLargeError";
    case 415: return "UnsupportedMediaTypeError";
    case 501: return "NotImplementedError";
    case 503: return "ServiceUnavailableError";
    default: return "InternalServerError";
  }
}

void send_error(httplib::Response& res, int status, const std::string& message) {
  res.status = status;
  json j;
  j["error"] = {{"message", message}, {"type", error_type(status)}, {"code", status}};
  res.set_content(dump(j), "application/json");
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

std::string token_str(int32_t id) { return cat("token_id:", id); }

double clamp_logprob(float lp) {  // vLLM reports -inf as -9999.0
  return std::isinf(lp) && lp < 0 ? -9999.0 : static_cast<double>(lp);
}

// Optional integer field: absent or null -> fallback.
int64_t opt_int(const json& j, const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return fallback;
  OPD_CHECK(it->is_number_integer(), InvalidData, "completions request: '", name,
            "' must be an integer, got ", it->type_name());
  OPD_CHECK(!(it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(hi)) &&
                it->get<int64_t>() >= lo && it->get<int64_t>() <= hi,
            InvalidData, "completions request: '", name, "' = ", it->dump(), " is outside [", lo,
            ", ", hi, "]");
  return it->get<int64_t>();
}

// Whether a request field is absent, null or equal to its vLLM default (numbers compared by
// value, so 1 and 1.0 agree; empty strings, lists and objects count as unset).
bool is_default(const json& j, const char* name, const json& dflt) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return true;
  if (it->is_number() && dflt.is_number()) return it->get<double>() == dflt.get<double>();
  if ((it->is_string() || it->is_array() || it->is_object()) && it->empty()) return true;
  return *it == dflt;
}

// vLLM/OpenAI fields that change the answer and that opd serve does not implement: a non-default
// value gets 400 naming the field instead of being ignored (docs/teacher_protocol.md).
void refuse_unsupported_fields(const json& j) {
  static const std::pair<const char*, json> unsupported[] = {
      {"best_of", 1},           {"presence_penalty", 0}, {"frequency_penalty", 0},
      {"repetition_penalty", 1}, {"length_penalty", 1},  {"min_tokens", 0},
      {"logit_bias", nullptr},  {"suffix", nullptr},     {"use_beam_search", false},
      {"allowed_token_ids", nullptr}, {"bad_words", nullptr}, {"truncate_prompt_tokens", nullptr},
      {"guided_json", nullptr}, {"guided_regex", nullptr}, {"guided_choice", nullptr},
      {"guided_grammar", nullptr}, {"response_format", nullptr}, {"structured_outputs", nullptr},
      {"prompt_embeds", nullptr}};
  for (const auto& [name, dflt] : unsupported)
    if (!is_default(j, name, dflt))
      throw HttpError{400, cat("completions request: '", name, "' = ", j[name].dump().substr(0, 80),
                               " is not supported by opd serve (only ", dflt.dump(),
                               " or unset is accepted)")};
  // vLLM coerces "true" to true and streams; anything but false/null is refused, not ignored.
  if (!is_default(j, "stream", false))
    throw HttpError{400, cat("completions request: 'stream' = ", j["stream"].dump().substr(0, 80),
                             " is not supported by opd serve (streaming responses are not "
                             "implemented; send stream: false or leave it out)")};
}

// The first rollout-only sampling field set to a non-default value (top_p, top_k, min_p,
// stop_token_ids, opd_stream_keys), or nullptr. The scorer's single-token path (max_tokens 1)
// samples with temperature and seed only, so such a request must go to the generator or be
// refused.
const char* rollout_only_field(const json& j) {
  if (!is_default(j, "top_p", 1)) return "top_p";
  if (!is_default(j, "top_k", -1) && !is_default(j, "top_k", 0)) return "top_k";
  if (!is_default(j, "min_p", 0)) return "min_p";
  if (!is_default(j, "stop_token_ids", nullptr)) return "stop_token_ids";
  if (!is_default(j, "opd_stream_keys", nullptr)) return "opd_stream_keys";
  return nullptr;
}

}  // namespace

TeacherServer::TeacherServer(Scorer& scorer, ServerOptions options)
    : scorer_(scorer), opts_(std::move(options)) {
  auto conns = std::make_unique<HttpConnections>();
  conns_ = conns.get();
  http_ = std::move(conns);
  if (opts_.model_name.empty()) opts_.model_name = scorer_.info().model_name;
  OPD_CHECK(opts_.threads > 0, InvalidArgument, "server: threads = ", opts_.threads,
            " must be > 0");
  const size_t threads = static_cast<size_t>(opts_.threads);
  http_->new_task_queue = [this, threads] { return new ConnectionThreads(*conns_, threads); };
  http_->set_payload_max_length(opts_.max_body_bytes);
  // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, which let a second `opd serve`
  // bind the same port and take half of the requests (two teachers behind one URL).
  http_->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<const void*>(&yes), sizeof(yes));
  });
  // A client that stops sending (a POST without Content-Length waits for the connection to
  // close) holds a worker thread and delays stop() until this read timeout: 10 s, not 60.
  http_->set_read_timeout(10);
  http_->set_write_timeout(60);
  http_->set_keep_alive_max_count(100);
  http_->set_tcp_nodelay(true);
  install_routes();
}

TeacherServer::~TeacherServer() {
  stop();
  if (listener_.joinable()) listener_.join();
}

void TeacherServer::start() {
  if (opts_.port == 0) {
    port_ = http_->bind_to_any_port(opts_.host);
    OPD_CHECK(port_ > 0, Io, "server: cannot bind an ephemeral port on ", opts_.host);
  } else {
    OPD_CHECK(http_->bind_to_port(opts_.host, opts_.port), Io, "server: cannot bind ", opts_.host,
              ":", opts_.port, " (in use, or not an address of this host)");
    port_ = opts_.port;
  }
  conns_->set_port(port_);
  listener_ = std::thread([this] { http_->listen_after_bind(); });
  log_info("opd serve: listening on http://", opts_.host, ":", port_, " (model ",
           opts_.model_name, ", vocab ", scorer_.info().vocab_size, ")");
}

void TeacherServer::stop() {
  stopping_ = true;
  std::lock_guard<std::mutex> lock(stop_mu_);
  conns_->begin_stop();
  http_->stop();
}

void TeacherServer::wait() {
  if (listener_.joinable()) listener_.join();
}

void TeacherServer::check_json_entries(const char* what, int64_t rows, int64_t k) const {
  const int64_t entries = std::max<int64_t>(rows, 0) * std::max<int64_t>(k, 1);
  if (entries > opts_.max_json_entries)
    throw HttpError{400, cat(what, ": ", rows, " scored positions x ", k, " entries = ", entries,
                             " JSON entries exceed this server's limit of ", opts_.max_json_entries,
                             " (ask for fewer logprobs, split the request, or use /v1/score with "
                             "the binary format, ", kBinaryContentType, ")")};
}

std::vector<GeneratedCompletion> TeacherServer::generate(
    const nlohmann::json& j, const std::vector<std::vector<int32_t>>& prompts, int64_t max_tokens,
    double temperature, int64_t seed) {
  const TeacherInfo& info = scorer_.info();
  GenerateRequest g;
  g.prompts = prompts;
  g.max_tokens = max_tokens;
  g.temperature = temperature;
  g.seed = static_cast<uint64_t>(seed);
  auto number = [&](const char* name, double fallback, double lo, double hi, bool lo_open) {
    auto it = j.find(name);
    if (it == j.end() || it->is_null()) return fallback;
    OPD_CHECK(it->is_number(), InvalidData, "completions request: '", name,
              "' must be a number, got ", it->type_name());
    const double v = it->get<double>();
    OPD_CHECK(std::isfinite(v) && (lo_open ? v > lo : v >= lo) && v <= hi, InvalidData,
              "completions request: '", name, "' = ", v, " is outside ", lo_open ? "(" : "[", lo,
              ", ", hi, "]");
    return v;
  };
  g.top_p = number("top_p", 1.0, 0.0, 1.0, true);
  g.min_p = number("min_p", 0.0, 0.0, 1.0, false);
  const int64_t top_k = opt_int(j, "top_k", -1, -1, info.vocab_size);
  g.top_k = top_k > 0 ? top_k : 0;  // -1 (vLLM) and 0 mean off
  if (j.contains("ignore_eos") && !j["ignore_eos"].is_null()) {
    OPD_CHECK(j["ignore_eos"].is_boolean(), InvalidData,
              "completions request: 'ignore_eos' must be a boolean");
    g.ignore_eos = j["ignore_eos"].get<bool>();
  }
  if (j.contains("stop") && !j["stop"].is_null()) {
    const json& st = j["stop"];
    const bool empty = (st.is_string() && st.get_ref<const std::string&>().empty()) ||
                       (st.is_array() && st.empty());
    if (!empty)
      throw HttpError{400, "completions request: stop strings need a tokenizer and opd serve does "
                           "not tokenize; use stop_token_ids"};
  }
  if (j.contains("stop_token_ids") && !j["stop_token_ids"].is_null()) {
    const json& st = j["stop_token_ids"];
    OPD_CHECK(st.is_array(), InvalidData, "completions request: 'stop_token_ids' must be a list");
    for (size_t i = 0; i < st.size(); ++i) {
      OPD_CHECK(st[i].is_number_integer() && !(st[i].is_number_unsigned() &&
                                               st[i].get<uint64_t>() > static_cast<uint64_t>(info.vocab_size)) &&
                    st[i].get<int64_t>() >= 0 && st[i].get<int64_t>() < info.vocab_size,
                InvalidData, "completions request: stop_token_ids[", i, "] = ",
                st[i].dump().substr(0, 40), " is outside the vocabulary [0, ", info.vocab_size, ")");
      g.stop_token_ids.push_back(static_cast<int32_t>(st[i].get<int64_t>()));
    }
  }
  if (j.contains("opd_stream_keys") && !j["opd_stream_keys"].is_null()) {
    const json& k = j["opd_stream_keys"];
    OPD_CHECK(k.is_array() && k.size() == prompts.size(), InvalidData,
              "completions request: 'opd_stream_keys' must be a list of one unsigned integer per "
              "prompt (", prompts.size(), ")");
    for (size_t i = 0; i < k.size(); ++i) {
      OPD_CHECK(k[i].is_number_unsigned() || (k[i].is_number_integer() && k[i].get<int64_t>() >= 0),
                InvalidData, "completions request: opd_stream_keys[", i,
                "] must be an unsigned integer, got ", k[i].dump().substr(0, 40));
      g.stream_keys.push_back(k[i].get<uint64_t>());
    }
  }
  // Bounds: positions within the model's context, work within the server's limit.
  int64_t total = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t len = static_cast<int64_t>(prompts[i].size());
    if (info.max_model_len > 0 && len + max_tokens > info.max_model_len)
      throw HttpError{400, cat("completions request: prompt ", i, " has ", len,
                               " tokens; with max_tokens = ", max_tokens, " that is ",
                               len + max_tokens, " positions, over this model's context length ",
                               info.max_model_len)};
    total += len + max_tokens;
  }
  if (total > opts_.max_generation_tokens)
    throw HttpError{400, cat("completions request: ", prompts.size(), " prompts with max_tokens = ",
                             max_tokens, " come to ", total, " tokens, over this server's limit of ",
                             opts_.max_generation_tokens, " per request; split the request")};
  std::vector<GeneratedCompletion> out;
  {
    std::lock_guard<std::mutex> lock(score_mu_);
    out = opts_.generator(g, [this] { return stopping_.load(); });
  }
  OPD_CHECK(out.size() == prompts.size(), Internal, "generator returned ", out.size(),
            " completions for ", prompts.size(), " prompts");
  for (const auto& c : out)
    OPD_CHECK(!c.ids.empty() && static_cast<int64_t>(c.ids.size()) <= max_tokens &&
                  c.logprobs.size() == c.ids.size(),
              Internal, "generator returned ", c.ids.size(), " tokens and ", c.logprobs.size(),
              " logprobs (max_tokens ", max_tokens, ")");
  return out;
}

std::string TeacherServer::read_body(const httplib::Request& req, httplib::Response& res,
                                     const httplib::ContentReader& reader) {
  std::string body;
  bool over = false;
  const size_t max = opts_.max_body_bytes;
  // Chunked bodies have no Content-Length for httplib to check against the limit: counted here.
  const bool ok = reader([&](const char* data, size_t n) {
    if (n > max - body.size()) {
      over = true;
      return false;
    }
    body.append(data, n);
    return true;
  });
  if (ok) {
    conns_->mark_handling();
    return body;
  }
  conns_->close_after_response();  // the rest of the body is still on the wire
  if (over || res.status == 413)
    throw HttpError{413, cat("request body exceeds the server's limit of ", max,
                             " bytes (opd serve --max-request-mb)")};
  const std::string len = req.get_header_value("Content-Length");
  const bool chunked = req.has_header("Transfer-Encoding");
  if (len.empty() && !chunked)
    throw HttpError{400, "a POST needs a body with a Content-Length header (or chunked "
                         "encoding); none came before the read timeout"};
  throw HttpError{400, cat("request body incomplete: ", body.size(), " bytes received",
                           chunked ? std::string(" (chunked)")
                                       : cat(" of the Content-Length ", len.substr(0, 40)),
                           " before the client closed the connection, stopped sending for the "
                           "read timeout (10 s), or sent malformed chunked encoding")};
}

void TeacherServer::install_routes() {
  // Every handler body runs inside `guard`: typed errors become 4xx/5xx JSON, nothing escapes.
  auto guard = [this](httplib::Response& res, const std::function<void()>& fn) {
    try {
      fn();
      ++served_;
      return;
    } catch (const HttpError& e) {
      send_error(res, e.status, e.message);
    } catch (const Error& e) {
      int status = 500;
      switch (e.kind()) {
        case ErrorKind::InvalidArgument:
        case ErrorKind::InvalidData: status = 400; break;
        case ErrorKind::Unsupported: status = 501; break;
        case ErrorKind::OutOfMemory:
        case ErrorKind::Cancelled: status = 503; break;
        default: status = 500;
      }
      send_error(res, status, e.what());
    } catch (const std::bad_alloc&) {
      send_error(res, 503, "server: out of memory for this request");
    } catch (const std::exception& e) {
      send_error(res, 500, cat("server: unexpected error: ", e.what()));
    }
    ++rejected_;
    log_warn("opd serve: rejected request (", res.status, "): ", res.body.substr(0, 300));
  };

  http_->set_exception_handler([](const httplib::Request&, httplib::Response& res,
                                  std::exception_ptr) {
    send_error(res, 500, "server: unexpected error");
  });
  // Answered (or failed): the connection waits for its next request and may be cut again.
  http_->set_logger([this](const httplib::Request&, const httplib::Response&) {
    conns_->mark_receiving();
  });
  http_->set_error_handler([this, max_body = opts_.max_body_bytes](const httplib::Request& req,
                                                                httplib::Response& res) {
    if (!res.body.empty()) return;  // a handler already wrote the error
    if (res.status == 413)
      send_error(res, 413,
                 req.get_header_value("Content-Type").rfind("application/x-www-form-urlencoded", 0) == 0
                     ? cat("a form-encoded body (Content-Type application/x-www-form-urlencoded, "
                           "curl's default for --data) is limited to ",
                           CPPHTTPLIB_FORM_URL_ENCODED_PAYLOAD_MAX_LENGTH,
                           " bytes; send Content-Type: application/json (or ", kBinaryContentType,
                           ")")
                     : cat("request body exceeds the server's limit of ", max_body,
                           " bytes (opd serve --max-request-mb)"));
    else if (res.status == 404)
      send_error(res, 404, cat("no route ", req.method, " ", req.path));
    else if (res.status == 400 && req.method == "POST" && !req.has_header("Content-Length") &&
             !req.has_header("Transfer-Encoding"))
      send_error(res, 400, "a POST needs a body with a Content-Length header (or chunked "
                           "encoding); none came before the read timeout");
    else
      send_error(res, res.status, cat("HTTP error ", res.status));
  });

  http_->Get("/health", [this, guard](const httplib::Request&, httplib::Response& res) {
    guard(res, [&] { res.set_content(R"({"status":"ok"})", "application/json"); });
  });

  http_->Get("/v1/models", [this, guard](const httplib::Request&, httplib::Response& res) {
    guard(res, [&] {
      const TeacherInfo& info = scorer_.info();
      json m;
      m["id"] = opts_.model_name;
      m["object"] = "model";
      m["created"] = 0;
      m["owned_by"] = "opd";
      m["root"] = opts_.model_name;
      m["max_model_len"] = info.max_model_len;
      m["opd"] = {{"vocab_size", info.vocab_size},
                  {"tokenizer_fingerprint", info.fingerprint},
                  {"has_tokenizer", info.has_tokenizer},
                  {"eos_token_ids", info.eos_token_ids},
                  {"max_generation_tokens", opts_.generator ? opts_.max_generation_tokens : 0},
                  {"protocol_version", kTeacherProtocolVersion}};
      if (!opts_.weights_fingerprint.empty())
        m["opd"]["weights_fingerprint"] = opts_.weights_fingerprint;
      json j;
      j["object"] = "list";
      j["data"] = json::array({m});
      res.set_content(dump(j), "application/json");
    });
  });

  http_->Post("/v1/score", [this, guard](const httplib::Request& req, httplib::Response& res,
                                         const httplib::ContentReader& reader) {
    guard(res, [&] {
      const std::string body = read_body(req, res, reader);
      const std::string ct = req.get_header_value("Content-Type");
      const bool bin_in = starts_with(ct, kBinaryContentType) ||
                          starts_with(ct, "application/octet-stream");
      const bool json_in = starts_with(ct, "application/json");
      if (!bin_in && !json_in)
        throw HttpError{415, cat("/v1/score: Content-Type '", ct.substr(0, 80), "' is neither ",
                                 kBinaryContentType, " nor application/json")};
      ScoreRequest q = bin_in ? decode_score_request(body)
                              : score_request_from_json(parse_json(body, "score request"));
      const std::string accept = req.get_header_value("Accept");
      bool bin_out = bin_in;
      if (accept.find(kBinaryContentType) != std::string::npos ||
          accept.find("application/octet-stream") != std::string::npos)
        bin_out = true;
      else if (accept.find("application/json") != std::string::npos)
        bin_out = false;
      const TeacherInfo& info = scorer_.info();
      if (!q.model_fingerprint.empty() && q.model_fingerprint != info.fingerprint)
        throw HttpError{409, cat("/v1/score: request expects teacher fingerprint '",
                                 q.model_fingerprint.substr(0, 80), "', this server's model (",
                                 opts_.model_name, ") is '", info.fingerprint, "'")};
      if (!bin_out) check_json_entries("/v1/score", q.num_rows(), q.k);
      ScoreResponse r;
      {
        std::lock_guard<std::mutex> lock(score_mu_);
        r = scorer_.score(q);
      }
      if (bin_out)
        res.set_content(encode_score_response(r), kBinaryContentType);
      else
        res.set_content(dump(score_response_to_json(r)), "application/json");
    });
  });

  http_->Post("/v1/completions", [this, guard](const httplib::Request& req,
                                               httplib::Response& res,
                                               const httplib::ContentReader& reader) {
    guard(res, [&] {
      const json j = parse_json(read_body(req, res, reader), "completions request");
      OPD_CHECK(j.is_object(), InvalidData, "completions request: expected a JSON object, got ",
                j.type_name());
      const TeacherInfo& info = scorer_.info();
      const int64_t V = info.vocab_size;
      if (j.contains("model") && !j["model"].is_null()) {
        OPD_CHECK(j["model"].is_string(), InvalidData, "completions request: 'model' must be a string");
        if (j["model"].get<std::string>() != opts_.model_name)
          throw HttpError{404, cat("The model `", j["model"].get<std::string>().substr(0, 200),
                                   "` does not exist (this server serves `", opts_.model_name,
                                   "`).")};
      }
      // prompt: token ids, one list or a list of lists.
      OPD_CHECK(j.contains("prompt") && !j["prompt"].is_null(), InvalidData,
                "completions request: 'prompt' is required");
      const json& pj = j["prompt"];
      std::vector<std::vector<int32_t>> prompts;
      auto parse_ids = [&](const json& a, size_t which) {
        OPD_CHECK(a.is_array(), InvalidData, "completions request: prompt ", which,
                  " must be a list of token ids");
        std::vector<int32_t> ids;
        for (size_t p = 0; p < a.size(); ++p) {
          OPD_CHECK(a[p].is_number_integer() && !(a[p].is_number_unsigned() &&
                                                  a[p].get<uint64_t>() > uint64_t(INT32_MAX)) &&
                        a[p].get<int64_t>() >= 0 && a[p].get<int64_t>() < V,
                    InvalidData, "completions request: prompt ", which, ", position ", p,
                    ": token id ", a[p].dump().substr(0, 40), " is outside the vocabulary [0, ",
                    V, ")");
          ids.push_back(static_cast<int32_t>(a[p].get<int64_t>()));
        }
        OPD_CHECK(!ids.empty(), InvalidData, "completions request: prompt ", which, " is empty");
        return ids;
      };
      if (pj.is_string() || (pj.is_array() && !pj.empty() && pj[0].is_string()))
        throw HttpError{400, "completions request: text prompts are not supported by opd serve "
                             "(it does not tokenize); send token ids"};
      OPD_CHECK(pj.is_array() && !pj.empty(), InvalidData,
                "completions request: 'prompt' must be a non-empty list of token ids or of lists");
      if (pj[0].is_array()) {
        for (size_t i = 0; i < pj.size(); ++i) prompts.push_back(parse_ids(pj[i], i));
      } else {
        prompts.push_back(parse_ids(pj, 0));
      }
      (void)opt_int(j, "n", 1, 1, 1);  // only n = 1 (the range check names the value)
      refuse_unsupported_fields(j);
      const int64_t max_tokens = opt_int(j, "max_tokens", 16, 0, std::numeric_limits<int32_t>::max());
      if (max_tokens > 1 && !opts_.generator)
        throw HttpError{501, cat("completions request: max_tokens = ", max_tokens,
                                 ": this server cannot generate more than one token (no "
                                 "generator bound); use max_tokens 0 or 1 with prompt_logprobs "
                                 "for scoring")};
      bool echo = false;
      if (j.contains("echo") && !j["echo"].is_null()) {
        OPD_CHECK(j["echo"].is_boolean(), InvalidData, "completions request: 'echo' must be a boolean");
        echo = j["echo"].get<bool>();
      }
      int64_t logprobs = opt_int(j, "logprobs", -2, -1, V);
      int64_t prompt_logprobs = opt_int(j, "prompt_logprobs", -2, -1, V);
      if (logprobs == -1) logprobs = V;  // vLLM: -1 = the whole vocabulary
      if (prompt_logprobs == -1) prompt_logprobs = V;
      if (prompt_logprobs == -2 && echo && logprobs >= 0) prompt_logprobs = logprobs;  // as vLLM
      double temperature = 1.0;
      if (j.contains("temperature") && !j["temperature"].is_null()) {
        OPD_CHECK(j["temperature"].is_number(), InvalidData,
                  "completions request: 'temperature' must be a number");
        temperature = j["temperature"].get<double>();
        OPD_CHECK(std::isfinite(temperature) && temperature >= 0, InvalidData,
                  "completions request: temperature ", temperature, " must be finite and >= 0");
      }
      const int64_t seed = opt_int(j, "seed", 0, std::numeric_limits<int64_t>::min(),
                                   std::numeric_limits<int64_t>::max());
      // max_tokens 1 goes to the scorer's single-token path (top-N logprobs; temperature and
      // seed only) unless a rollout-only sampling field is set: then to the generator, as a
      // longer generation would, or 400 naming the field where none is bound.
      const char* rollout_field = max_tokens == 1 ? rollout_only_field(j) : nullptr;
      if (rollout_field && !opts_.generator)
        throw HttpError{400, cat("completions request: '", rollout_field, "' = ",
                                 j[rollout_field].dump().substr(0, 80), " with max_tokens = 1: "
                                 "this server samples one token with temperature and seed only "
                                 "(no generator bound)")};
      const bool use_generator = max_tokens > 1 || rollout_field != nullptr;
      const bool next_token = max_tokens == 1 && !use_generator;
      bool ignore_eos = false;
      if (j.contains("ignore_eos") && !j["ignore_eos"].is_null()) {
        OPD_CHECK(j["ignore_eos"].is_boolean(), InvalidData,
                  "completions request: 'ignore_eos' must be a boolean");
        ignore_eos = j["ignore_eos"].get<bool>();
      }
      std::vector<GeneratedCompletion> generated;
      if (use_generator) {
        if (logprobs > 0)
          throw HttpError{400, cat("completions request: logprobs = ", logprobs, " with max_tokens = ",
                                   max_tokens, rollout_field ? cat(" and '", rollout_field, "' set") : "",
                                   ": only the sampled token's logprob (logprobs 0) "
                                   "is reported for generated tokens; score the completions with "
                                   "/v1/score for top-K")};
        if (logprobs == 0)
          check_json_entries("completions request (logprobs of generated tokens)",
                             max_tokens * static_cast<int64_t>(prompts.size()), 1);
        generated = generate(j, prompts, max_tokens, temperature, seed);
      }

      // Scores of the prompt positions (temperature 1, as vLLM reports logprobs).
      const bool echo_logprobs = echo && logprobs >= 0;
      const int64_t k_prompt = std::max(prompt_logprobs, echo_logprobs ? logprobs : int64_t{-2});
      if (k_prompt >= 0) {
        int64_t rows = 0;
        for (const auto& p : prompts) rows += static_cast<int64_t>(p.size()) - 1;
        check_json_entries("completions request (prompt_logprobs / echo logprobs)", rows,
                           k_prompt + 1);  // + the actual token's entry
      }
      ScoreResponse sr;
      if (k_prompt >= 0) {
        ScoreRequest q;
        q.k = k_prompt;
        q.temperature = 1.0;
        q.with_ranks = true;
        for (const auto& p : prompts)
          q.sequences.push_back({p, 1, static_cast<int64_t>(p.size())});
        std::lock_guard<std::mutex> lock(score_mu_);
        sr = scorer_.score(q);
      }
      std::vector<NextToken> gen;
      if (next_token) {
        NextTokenRequest nq;
        nq.prompts = prompts;
        nq.k = std::max<int64_t>(logprobs, 0);
        nq.sample_temperature = temperature;
        nq.seed = static_cast<uint64_t>(seed);
        std::lock_guard<std::mutex> lock(score_mu_);
        gen = scorer_.next_tokens(nq);
      }

      json choices = json::array();
      int64_t prompt_tokens = 0;
      for (size_t i = 0; i < prompts.size(); ++i) {
        const auto& p = prompts[i];
        prompt_tokens += static_cast<int64_t>(p.size());
        json c;
        c["index"] = i;
        c["text"] = use_generator ? generated[i].text : std::string();
        // vLLM checks EOS before the length limit: a single token that is an EOS id "stop"s.
        const bool stopped =
            use_generator ? generated[i].stopped
                          : next_token && !ignore_eos &&
                                std::find(info.eos_token_ids.begin(), info.eos_token_ids.end(),
                                          int64_t{gen[i].id}) != info.eos_token_ids.end();
        c["finish_reason"] = stopped ? "stop" : "length";
        c["stop_reason"] = nullptr;
        c["prompt_token_ids"] = p;
        c["token_ids"] = next_token      ? json::array({gen[i].id})
                         : use_generator ? json(generated[i].ids)
                                         : json::array();
        auto row_of = [&](size_t pos) { return sr.row_offsets[i] + static_cast<int64_t>(pos) - 1; };
        if (prompt_logprobs >= 0) {
          json plp = json::array({nullptr});
          for (size_t pos = 1; pos < p.size(); ++pos) {
            const int64_t r = row_of(pos);
            json d = json::object();
            for (int64_t e = 0; e < prompt_logprobs; ++e)
              d[std::to_string(sr.ids[r * sr.k + e])] = {
                  {"logprob", clamp_logprob(sr.logprobs[r * sr.k + e])},
                  {"rank", e + 1},
                  {"decoded_token", token_str(sr.ids[r * sr.k + e])}};
            const std::string key = std::to_string(p[pos]);
            if (!d.contains(key))
              d[key] = {{"logprob", clamp_logprob(sr.actual_logprobs[r])},
                        {"rank", sr.actual_ranks[r]},
                        {"decoded_token", token_str(p[pos])}};
            plp.push_back(std::move(d));
          }
          c["prompt_logprobs"] = std::move(plp);
        } else {
          c["prompt_logprobs"] = nullptr;
        }
        if (logprobs >= 0) {
          json lp;
          lp["tokens"] = json::array();
          lp["token_logprobs"] = json::array();
          lp["top_logprobs"] = json::array();
          lp["text_offset"] = json::array();
          auto add = [&](int32_t tok, json token_lp, json top) {
            lp["tokens"].push_back(token_str(tok));
            lp["token_logprobs"].push_back(std::move(token_lp));
            lp["top_logprobs"].push_back(std::move(top));
            lp["text_offset"].push_back(0);
          };
          if (echo) {
            add(p[0], nullptr, nullptr);
            for (size_t pos = 1; pos < p.size(); ++pos) {
              const int64_t r = row_of(pos);
              json top = json::object();
              for (int64_t e = 0; e < logprobs; ++e)
                top[token_str(sr.ids[r * sr.k + e])] = clamp_logprob(sr.logprobs[r * sr.k + e]);
              top[token_str(p[pos])] = clamp_logprob(sr.actual_logprobs[r]);
              add(p[pos], clamp_logprob(sr.actual_logprobs[r]), std::move(top));
            }
          }
          if (next_token) {
            json top = json::object();
            for (size_t e = 0; e < gen[i].top_ids.size(); ++e)
              top[token_str(gen[i].top_ids[e])] = clamp_logprob(gen[i].top_logprobs[e]);
            top[token_str(gen[i].id)] = clamp_logprob(gen[i].logprob);
            add(gen[i].id, clamp_logprob(gen[i].logprob), std::move(top));
          }
          if (use_generator) {
            const GeneratedCompletion& g = generated[i];
            for (size_t t = 0; t < g.ids.size(); ++t) {
              const double l = clamp_logprob(g.logprobs[t]);
              add(g.ids[t], l, json::object({{token_str(g.ids[t]), l}}));
            }
          }
          c["logprobs"] = std::move(lp);
        } else {
          c["logprobs"] = nullptr;
        }
        choices.push_back(std::move(c));
      }
      json out;
      out["id"] = cat("cmpl-opd-", served_.load());
      out["object"] = "text_completion";
      out["created"] = std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch()).count();
      out["model"] = opts_.model_name;
      out["choices"] = std::move(choices);
      int64_t completion_tokens = max_tokens * static_cast<int64_t>(prompts.size());
      if (use_generator) {
        completion_tokens = 0;
        for (const auto& g : generated) completion_tokens += static_cast<int64_t>(g.ids.size());
      }
      out["usage"] = {{"prompt_tokens", prompt_tokens},
                      {"completion_tokens", completion_tokens},
                      {"total_tokens", prompt_tokens + completion_tokens}};
      res.set_content(dump(out), "application/json");
    });
  });
}

}  // namespace opd
