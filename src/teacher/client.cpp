// Remote teacher client (client.h): connection pool, retries with backoff, connect-time
// compatibility check, and validation of every response before it is returned.
#include "teacher/client.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "core/text_io.h"
#include "core/log.h"
#include "core/philox.h"
#include "teacher/protocol.h"

namespace opd {

std::string_view teacher_api_name(TeacherApi api) {
  switch (api) {
    case TeacherApi::Auto: return "auto";
    case TeacherApi::Opd: return "opd";
    case TeacherApi::Vllm: return "vllm";
  }
  return "?";
}

TeacherApi parse_teacher_api(std::string_view name) {
  if (name == "auto") return TeacherApi::Auto;
  if (name == "opd") return TeacherApi::Opd;
  if (name == "vllm") return TeacherApi::Vllm;
  OPD_FAIL(InvalidArgument, "teacher api '", name, "' is not one of auto, opd, vllm");
}

namespace {

// A failure worth another attempt (transport, 5xx, 429, corrupted body).
struct Retryable {
  std::string what;
};

void parse_url(const std::string& url, std::string& host, int& port) {
  std::string rest = url;
  OPD_CHECK(rest.rfind("https://", 0) != 0, InvalidArgument, "teacher url '", url,
            "': https is not supported (opd speaks plain HTTP on trusted networks)");
  if (rest.rfind("http://", 0) == 0) rest = rest.substr(7);
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  OPD_CHECK(rest.find('/') == std::string::npos, InvalidArgument, "teacher url '", url,
            "': give only scheme, host and port (http://host:port)");
  const size_t colon = rest.rfind(':');
  OPD_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < rest.size(), InvalidArgument,
            "teacher url '", url, "': expected http://host:port");
  host = rest.substr(0, colon);
  const std::string p = rest.substr(colon + 1);
  OPD_CHECK(std::all_of(p.begin(), p.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
                p.size() <= 5 && std::stoi(p) > 0 && std::stoi(p) < 65536,
            InvalidArgument, "teacher url '", url, "': port '", p, "' is not in [1, 65535]");
  port = std::stoi(p);
}

// A JSON reply's body; text that does not parse was damaged in transit (or cut short): retry.
nlohmann::json reply_json(const std::string& body, const char* what) {
  try {
    return parse_json(body, what);
  } catch (const Error& e) {
    throw Retryable{cat("undecodable response: ", e.what())};
  }
}

// httplib names its errors in one word ("Connection"); say what each means to someone
// looking at a run that waits for its teacher.
const char* transport_hint(httplib::Error err) {
  switch (err) {
    case httplib::Error::Connection:
      return " (could not connect: nothing listens there, the host is unreachable or its name "
             "does not resolve)";
    case httplib::Error::Read: return " (the connection closed or timed out while reading)";
    case httplib::Error::Write: return " (the connection closed while sending)";
    case httplib::Error::ConnectionTimeout: return " (no connection within the connect timeout)";
    default: return "";
  }
}

std::string error_message_of(const std::string& body) {
  // {"error": {"message": ...}} (opd, vLLM) or {"message": ...} (older vLLM); else the raw text.
  try {
    if (json_nesting_depth(body) > kMaxJsonDepth) return body.substr(0, 300);
    auto j = nlohmann::json::parse(body);
    if (j.contains("error") && j["error"].is_object() && j["error"].contains("message"))
      return j["error"]["message"].dump();
    if (j.contains("message")) return j["message"].dump();
  } catch (const std::exception&) {
  }
  return body.substr(0, 500);
}

// How often should_cancel is asked while a call waits on the network.
constexpr std::chrono::milliseconds kCancelPoll{20};

// Sleeps `seconds`, or less when should_cancel says stop first (then returns false).
bool sleep_unless_cancelled(double seconds, const std::function<bool()>& should_cancel) {
  using Clock = std::chrono::steady_clock;
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(seconds));
  for (;;) {
    if (should_cancel && should_cancel()) return false;
    const auto now = Clock::now();
    if (now >= end) return true;
    std::this_thread::sleep_for(should_cancel ? std::min<Clock::duration>(end - now, kCancelPoll)
                                              : end - now);
  }
}

// While alive (one attempt's send): asks should_cancel every kCancelPoll on a helper thread and,
// once it says stop, shuts the client's socket down with Client::stop() so the blocked send()
// returns at once. stop() is repeated at every poll after that: httplib forgets a stop() that
// lands before send() has registered its request (while it connects), so one is not enough.
class CancelWatch {
 public:
  CancelWatch(const std::function<bool()>& should_cancel, httplib::Client& cli) {
    if (!should_cancel) return;
    thread_ = std::thread([this, &should_cancel, &cli] {
      std::unique_lock<std::mutex> lock(mu_);
      while (!done_) {
        cv_.wait_for(lock, kCancelPoll);
        if (done_) break;
        if (fired_ || should_cancel()) {
          fired_ = true;
          cli.stop();
        }
      }
    });
  }
  ~CancelWatch() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }
  CancelWatch(const CancelWatch&) = delete;
  CancelWatch& operator=(const CancelWatch&) = delete;
  bool fired() const { return fired_; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::atomic<bool> fired_{false};
  std::thread thread_;
};

}  // namespace

struct TeacherClient::Http {
  Http(const std::string& host, int port, const ClientOptions& o) : cli(host, port) {
    const auto us = [](double s) { return static_cast<time_t>(s * 1e6); };
    cli.set_connection_timeout(us(o.connect_timeout_s) / 1000000, us(o.connect_timeout_s) % 1000000);
    cli.set_read_timeout(us(o.request_timeout_s) / 1000000, us(o.request_timeout_s) % 1000000);
    cli.set_write_timeout(us(o.request_timeout_s) / 1000000, us(o.request_timeout_s) % 1000000);
    cli.set_keep_alive(true);
    cli.set_tcp_nodelay(true);
  }
  httplib::Client cli;
};

std::unique_ptr<TeacherClient::Http> TeacherClient::acquire() {
  std::unique_lock<std::mutex> lock(pool_mu_);
  const auto available = [&] { return !idle_.empty() || open_ < opts_.connections; };
  if (opts_.should_cancel) {
    for (;;) {  // asked again when a connection frees up: a cancelled call sends nothing
      if (opts_.should_cancel()) return nullptr;
      if (available()) break;
      pool_cv_.wait_for(lock, kCancelPoll);
    }
  } else {
    pool_cv_.wait(lock, available);
  }
  if (!idle_.empty()) {
    auto h = std::move(idle_.back());
    idle_.pop_back();
    return h;
  }
  ++open_;
  lock.unlock();
  return std::make_unique<Http>(host_, port_, opts_);
}

void TeacherClient::release(std::unique_ptr<Http> h) {
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    if (h) idle_.push_back(std::move(h));
    else --open_;
  }
  pool_cv_.notify_one();
}

TeacherClient::Reply TeacherClient::call(const std::string& method, const std::string& path,
                                         const std::string& body, const std::string& content_type,
                                         const std::string& accept,
                                         const std::function<void(const Reply&)>& decode_check) {
  const int64_t id = ++seq_;
  std::string last;
  const auto t0 = std::chrono::steady_clock::now();
  // Seconds left of deadline_s (infinity without one).
  auto left = [&] {
    if (opts_.deadline_s <= 0) return std::numeric_limits<double>::infinity();
    return opts_.deadline_s -
           std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  int attempt = 0;
  // A cancelled call ends here: no result, no further attempt (the caller was asked to stop).
  auto cancelled = [&](const char* where) {
    OPD_FAIL(Cancelled, "teacher client: ", method, " ", opts_.url, path, " cancelled ", where,
             " (a stop was requested) after ",
             std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
             " s, attempt ", attempt + 1, " of at most ", opts_.max_attempts);
  };
  for (; attempt < opts_.max_attempts; ++attempt) {
    if (opts_.should_cancel && opts_.should_cancel()) cancelled("before its attempt");
    if (attempt > 0) {
      if (left() <= 0.01) break;  // the deadline is spent: no retry to announce
      ++retries_;
      const double base = std::min(opts_.backoff_max_s,
                                   opts_.backoff_initial_s * std::pow(2.0, attempt - 1));
      const double jitter = 0.5 + 0.5 * philox_uniform(static_cast<uint64_t>(id), 99,
                                                       static_cast<uint64_t>(attempt));
      const double delay = std::min(base * jitter, std::max(0.0, left()));
      log_warn("teacher client: ", method, " ", path, " attempt ", attempt, " failed (", last,
               "); retrying in ", delay, " s");
      if (!sleep_unless_cancelled(delay, opts_.should_cancel)) cancelled("during the backoff");
    }
    const double remaining = left();
    if (remaining <= 0.01) break;
    std::unique_ptr<Http> h = acquire();
    if (!h) cancelled("waiting for a connection");
    ++attempts_;
    {  // this attempt's wait for an answer: the read timeout, cut to what the deadline leaves
      const double wait_s = std::min(opts_.request_timeout_s, remaining);
      const auto us = static_cast<int64_t>(wait_s * 1e6);
      h->cli.set_read_timeout(static_cast<time_t>(us / 1000000), static_cast<time_t>(us % 1000000));
      h->cli.set_write_timeout(static_cast<time_t>(us / 1000000), static_cast<time_t>(us % 1000000));
    }
    httplib::Request req;
    req.method = method;
    req.path = path;
    req.body = body;
    if (!content_type.empty()) req.set_header("Content-Type", content_type);
    if (!accept.empty()) req.set_header("Accept", accept);
    req.set_header("X-Opd-Request-Id", std::to_string(id));
    Reply reply;
    bool too_big = false;
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      if (reply.body.size() + n > opts_.max_response_bytes) {
        too_big = true;
        return false;
      }
      reply.body.append(data, n);
      return true;
    };
    httplib::Response res;
    httplib::Error err = httplib::Error::Success;
    bool ok = false, stopped = false;
    {
      CancelWatch watch(opts_.should_cancel, h->cli);
      ok = h->cli.send(req, res, err);
      stopped = watch.fired();
    }
    // (An answer that arrived whole although a stop came meanwhile is kept: it is complete.)
    if (!ok) {
      // The connection may be half-dead: drop it, the next attempt opens a fresh one.
      h->cli.stop();
      h.reset();
      release(nullptr);
      if (stopped) cancelled("while waiting for the answer");
      OPD_CHECK(!too_big, Io, "teacher client: response to ", method, " ", path, " exceeds ",
                opts_.max_response_bytes, " bytes (max_response_bytes)");
      last = cat("transport error: ", httplib::to_string(err), transport_hint(err));
      continue;
    }
    release(std::move(h));
    reply.status = res.status;
    reply.content_type = res.get_header_value("Content-Type");
    if (res.status == 429 || res.status >= 500) {
      last = cat("HTTP ", res.status, ": ", error_message_of(reply.body));
      continue;
    }
    if (res.status == 409)
      OPD_FAIL(InvalidArgument, "teacher at ", opts_.url, " refused ", path,
               " (409, teacher changed since connect?): ", error_message_of(reply.body));
    if (res.status >= 400 || res.status < 200)
      OPD_FAIL(InvalidArgument, "teacher at ", opts_.url, " rejected ", method, " ", path,
               " with HTTP ", res.status, ": ", error_message_of(reply.body));
    if (decode_check) {
      try {
        decode_check(reply);
      } catch (const Retryable& r) {
        last = r.what;
        continue;
      }
    }
    return reply;
  }
  OPD_CHECK(attempt < opts_.max_attempts, Io, "teacher client: ", method, " ", opts_.url, path,
            " failed after ", opts_.max_attempts, " attempts; last error: ", last);
  OPD_FAIL(Io, "teacher client: ", method, " ", opts_.url, path, " failed: no answer within ",
           opts_.deadline_s, " s (", attempt, " attempts, each waiting at most ",
           opts_.request_timeout_s, " s); last error: ", last);
}

TeacherClient::TeacherClient(ClientOptions options) : opts_(std::move(options)) {
  parse_url(opts_.url, host_, port_);
  OPD_CHECK(opts_.deadline_s >= 0 && opts_.request_timeout_s > 0, InvalidArgument,
            "teacher client: deadline ", opts_.deadline_s, " s must be >= 0 and request timeout ",
            opts_.request_timeout_s, " s > 0");
  OPD_CHECK(opts_.connections > 0 && opts_.max_attempts > 0, InvalidArgument,
            "teacher client: connections ", opts_.connections, " and max_attempts ",
            opts_.max_attempts, " must be > 0");
  OPD_CHECK(opts_.student_vocab >= 0, InvalidArgument, "teacher client: student vocabulary ",
            opts_.student_vocab, " must be >= 0 (0: no student, validate against the teacher's)");
  check_loss_config(opts_.loss);

  Reply models = call("GET", "/v1/models", "", "", "application/json", nullptr);
  nlohmann::json j = parse_json(models.body, "teacher /v1/models");
  OPD_CHECK(j.is_object() && j.contains("data") && j["data"].is_array() && !j["data"].empty() &&
                j["data"][0].is_object() && j["data"][0].contains("id") &&
                j["data"][0]["id"].is_string(),
            InvalidData, "teacher /v1/models at ", opts_.url, ": expected {\"data\": [{\"id\": ...}]}");
  const nlohmann::json& m = j["data"][0];
  info_.model_name = m["id"].get<std::string>();
  if (m.contains("max_model_len") && m["max_model_len"].is_number_integer())
    info_.max_model_len = m["max_model_len"].get<int64_t>();
  const bool is_opd = m.contains("opd") && m["opd"].is_object();
  api_ = opts_.api == TeacherApi::Auto ? (is_opd ? TeacherApi::Opd : TeacherApi::Vllm) : opts_.api;
  OPD_CHECK(api_ != TeacherApi::Opd || is_opd, InvalidArgument, "teacher at ", opts_.url,
            " is not an opd server (no 'opd' section in /v1/models); use the vllm api");
  if (is_opd) {
    const nlohmann::json& o = m["opd"];
    OPD_CHECK(o.contains("vocab_size") && o["vocab_size"].is_number_integer() &&
                  o.contains("tokenizer_fingerprint") && o["tokenizer_fingerprint"].is_string(),
              InvalidData, "teacher /v1/models at ", opts_.url,
              ": the opd section lacks vocab_size or tokenizer_fingerprint");
    info_.vocab_size = o["vocab_size"].get<int64_t>();
    info_.fingerprint = o["tokenizer_fingerprint"].get<std::string>();
    if (o.contains("has_tokenizer") && o["has_tokenizer"].is_boolean())
      info_.has_tokenizer = o["has_tokenizer"].get<bool>();
    if (o.contains("eos_token_ids") && o["eos_token_ids"].is_array())
      for (const auto& e : o["eos_token_ids"])
        if (e.is_number_integer()) info_.eos_token_ids.push_back(e.get<int64_t>());
    if (o.contains("weights_fingerprint") && o["weights_fingerprint"].is_string())
      info_.weights_fingerprint = o["weights_fingerprint"].get<std::string>();
    if (o.contains("max_generation_tokens") && o["max_generation_tokens"].is_number_integer())
      generation_limit_ = std::max<int64_t>(0, o["max_generation_tokens"].get<int64_t>());
  }
  if (opts_.assume_teacher_vocab) {
    OPD_CHECK(!is_opd || *opts_.assume_teacher_vocab == info_.vocab_size, InvalidArgument,
              "teacher at ", opts_.url, " reports vocabulary ", info_.vocab_size,
              ", the caller asserted ", *opts_.assume_teacher_vocab);
    info_.vocab_size = *opts_.assume_teacher_vocab;
  }
  if (!opts_.assume_teacher_fingerprint.empty()) {
    OPD_CHECK(!is_opd || opts_.assume_teacher_fingerprint == info_.fingerprint, InvalidArgument,
              "teacher at ", opts_.url, " reports fingerprint ", info_.fingerprint,
              ", the caller asserted ", opts_.assume_teacher_fingerprint);
    info_.fingerprint = opts_.assume_teacher_fingerprint;
  }
  if (api_ == TeacherApi::Vllm && !opts_.vllm_model.empty()) info_.model_name = opts_.vllm_model;

  // --- compatibility -------------------------------------------------------------------------
  if (opts_.student_vocab == 0) {  // no student (opd score): responses are checked against the
    opts_.student_vocab = info_.vocab_size;  // teacher's own vocabulary
    opts_.student_fingerprint.clear();
  }
  OPD_CHECK(info_.vocab_size > 0 && !info_.fingerprint.empty(), InvalidArgument, "teacher at ",
            opts_.url, " (", teacher_api_name(api_), ") does not report its vocabulary size and "
            "tokenizer fingerprint; assert them (opd train / opd score: --teacher-config DIR with "
            "the served model's config.json and tokenizer; ClientOptions::assume_teacher_vocab / "
            "assume_teacher_fingerprint) so the student compatibility check can run");
  const bool clip = opts_.loss.vocab_policy == VocabPolicy::ClipToStudent;
  if (!opts_.student_fingerprint.empty() && info_.fingerprint != opts_.student_fingerprint) {
    OPD_CHECK(clip, InvalidArgument, "teacher at ", opts_.url, " (", info_.model_name,
              ", vocab ", info_.vocab_size, ", fingerprint ", info_.fingerprint,
              ") does not share the student's tokenizer (vocab ", opts_.student_vocab,
              ", fingerprint ", opts_.student_fingerprint,
              "); vocab policy 'error' refuses this ('clip-to-student' accepts it)");
    log_warn("teacher client: tokenizer fingerprints differ (teacher ", info_.fingerprint,
             ", student ", opts_.student_fingerprint, "); vocab policy clip-to-student: teacher ids "
             ">= ", opts_.student_vocab, " are dropped");
  }
  OPD_CHECK(info_.vocab_size <= opts_.student_vocab || clip, InvalidArgument, "teacher at ",
            opts_.url, " has vocabulary ", info_.vocab_size, " > the student's ",
            opts_.student_vocab, " (vocab policy 'error')");
  log_info("teacher client: connected to ", opts_.url, " (", teacher_api_name(api_), ", model ",
           info_.model_name, ", vocab ", info_.vocab_size, ")");
}

TeacherClient::~TeacherClient() = default;

ClientStats TeacherClient::stats() const {
  return {requests_.load(), chunks_.load(), attempts_.load(), retries_.load()};
}

std::vector<std::pair<size_t, size_t>> plan_score_chunks(const ScoreRequest& q, int max_chunks,
                                                         int64_t min_chunk_rows) {
  const size_t n = q.sequences.size();
  const int64_t rows = q.num_rows();
  int64_t parts = max_chunks;
  if (min_chunk_rows > 0) parts = std::min<int64_t>(parts, rows / min_chunk_rows);
  parts = std::min<int64_t>(parts, static_cast<int64_t>(n));
  if (parts <= 1) return {{0, n}};
  const double share = static_cast<double>(rows) / static_cast<double>(parts);
  auto rows_of = [&](size_t i) {
    return std::max<int64_t>(0, q.sequences[i].end - q.sequences[i].begin);
  };
  auto same_prompt = [&](const ScoreSequence& a, const ScoreSequence& b) {
    return a.begin == b.begin && std::equal(a.ids.begin(), a.ids.begin() + (a.begin - 1),
                                            b.ids.begin(), b.ids.begin() + (b.begin - 1));
  };
  // Units: runs of sequences sharing a prompt; a run over 1.5 shares is cut into pieces of
  // about one share.
  struct Unit {
    size_t first, last;
    int64_t rows;
  };
  std::vector<Unit> units;
  for (size_t i = 0; i < n;) {
    size_t j = i + 1;
    int64_t run = rows_of(i);
    while (j < n && same_prompt(q.sequences[j - 1], q.sequences[j])) run += rows_of(j++);
    if (static_cast<double>(run) <= 1.5 * share) {
      units.push_back({i, j, run});
    } else {
      size_t first = i;
      int64_t acc = 0;
      for (size_t t = i; t < j; ++t) {
        acc += rows_of(t);
        if (static_cast<double>(acc) >= share || t + 1 == j) {
          units.push_back({first, t + 1, acc});
          first = t + 1;
          acc = 0;
        }
      }
    }
    i = j;
  }
  // Greedy: a part ends before the unit whose middle would land past its share.
  std::vector<std::pair<size_t, size_t>> out;
  size_t first = 0;
  double acc = 0;
  for (const Unit& u : units) {
    const double r = static_cast<double>(u.rows);
    if (acc > 0 && acc + r / 2 > share && static_cast<int64_t>(out.size()) + 1 < parts) {
      out.emplace_back(first, u.first);
      first = u.first;
      acc = 0;
    }
    acc += r;
  }
  out.emplace_back(first, n);
  return out;
}

namespace {

// Rows [first, first + rows) of `dst` <- all of `src` (host tensors of the same row width).
void copy_rows(Tensor& dst, int64_t first, const Tensor& src) {
  if (src.nbytes() == 0) return;
  const size_t row_bytes = dst.nbytes() / static_cast<size_t>(std::max<int64_t>(dst.shape()[0], 1));
  std::memcpy(static_cast<char*>(dst.raw()) + static_cast<size_t>(first) * row_bytes, src.raw(),
              src.nbytes());
}

Tensor empty_like_rows(const Tensor& t, int64_t rows) {
  Shape shape = t.shape();
  shape[0] = rows;
  return Tensor::empty(shape, t.dtype());
}

}  // namespace

TeacherClient::Validated TeacherClient::score_validated(const ScoreRequest& request) {
  const auto ranges = plan_score_chunks(request, opts_.chunks, opts_.min_chunk_rows);
  if (ranges.size() <= 1) {
    Validated v = score_one(request);
    ++requests_;
    return v;
  }
  const size_t m = ranges.size();
  std::vector<ScoreRequest> parts(m);
  for (size_t c = 0; c < m; ++c) {
    parts[c].k = request.k;
    parts[c].temperature = request.temperature;
    parts[c].model_fingerprint = request.model_fingerprint;
    parts[c].with_ranks = request.with_ranks;
    parts[c].sequences.assign(request.sequences.begin() + static_cast<int64_t>(ranges[c].first),
                              request.sequences.begin() + static_cast<int64_t>(ranges[c].second));
  }
  // One thread per chunk; the pool bounds how many requests are in flight. Each chunk's result
  // lands in its own slot, so a retried chunk still contributes its rows once.
  std::vector<std::optional<Validated>> got(m);
  std::vector<std::exception_ptr> failed(m);
  {
    std::vector<std::thread> threads;
    threads.reserve(m);
    for (size_t c = 0; c < m; ++c) {
      threads.emplace_back([&, c] {
        try {
          got[c] = score_one(parts[c]);
        } catch (const Error& e) {
          failed[c] = std::make_exception_ptr(Error(
              e.kind(), cat("teacher client: chunk ", c + 1, " of ", m, " (sequences ",
                            ranges[c].first, "..", ranges[c].second - 1, "): ", e.what())));
        } catch (...) {
          failed[c] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  for (size_t c = 0; c < m; ++c)
    if (failed[c]) std::rethrow_exception(failed[c]);

  // Reassemble in request order.
  Validated out;
  ScoreResponse& r = out.response;
  const ScoreResponse& r0 = got[0]->response;
  r.k = r0.k;
  r.temperature = r0.temperature;
  r.vocab_size = r0.vocab_size;
  r.row_offsets.push_back(0);
  int64_t rows = 0;
  for (size_t c = 0; c < m; ++c) {
    const ScoreResponse& p = got[c]->response;
    OPD_CHECK(p.k == r.k && p.temperature == r.temperature && p.vocab_size == r.vocab_size,
              InvalidData, "teacher client: chunk ", c + 1, " of ", m, " answered k ", p.k,
              ", temperature ", p.temperature, ", vocabulary ", p.vocab_size, "; chunk 1 k ", r.k,
              ", temperature ", r.temperature, ", vocabulary ", r.vocab_size);
    r.seq_begin.insert(r.seq_begin.end(), p.seq_begin.begin(), p.seq_begin.end());
    for (size_t s = 1; s < p.row_offsets.size(); ++s) r.row_offsets.push_back(rows + p.row_offsets[s]);
    rows += p.num_rows();
    r.ids.insert(r.ids.end(), p.ids.begin(), p.ids.end());
    r.logprobs.insert(r.logprobs.end(), p.logprobs.begin(), p.logprobs.end());
    r.actual_logprobs.insert(r.actual_logprobs.end(), p.actual_logprobs.begin(),
                             p.actual_logprobs.end());
    r.actual_ranks.insert(r.actual_ranks.end(), p.actual_ranks.begin(), p.actual_ranks.end());
    const PayloadStats& st = got[c]->stats;
    out.stats.rows += st.rows;
    out.stats.padding_rows += st.padding_rows;
    out.stats.clipped_ids += st.clipped_ids;
    out.stats.clipped_rows += st.clipped_rows;
    out.stats.max_clipped_mass = std::max(out.stats.max_clipped_mass, st.max_clipped_mass);
    out.stats.reordered_rows += st.reordered_rows;
  }
  ScoreRequest whole_shape;  // the full request's layout, for the final shape check
  whole_shape.k = request.k;
  whole_shape.sequences = request.sequences;
  check_response_matches(r, whole_shape);
  // The validated dense rows, concatenated.
  const TeacherTopK& t0 = got[0]->topk;
  TeacherTopK& t = out.topk;
  t.rows = rows;
  t.k = t0.k;
  t.ids = empty_like_rows(t0.ids, rows);
  t.logprobs = empty_like_rows(t0.logprobs, rows);
  t.actual_logprobs = empty_like_rows(t0.actual_logprobs, rows);
  t.valid = empty_like_rows(t0.valid, rows);
  int64_t at = 0;
  for (size_t c = 0; c < m; ++c) {
    const TeacherTopK& p = got[c]->topk;
    OPD_CHECK(p.k == t.k && p.rows == got[c]->response.num_rows(), Internal,
              "teacher client: chunk ", c + 1, " validated ", p.rows, " rows x ", p.k);
    copy_rows(t.ids, at, p.ids);
    copy_rows(t.logprobs, at, p.logprobs);
    copy_rows(t.actual_logprobs, at, p.actual_logprobs);
    copy_rows(t.valid, at, p.valid);
    at += p.rows;
  }
  ++requests_;
  return out;
}

TeacherClient::Validated TeacherClient::score_one(const ScoreRequest& request) {
  ++chunks_;
  ScoreRequest q = request;
  if (q.model_fingerprint.empty()) q.model_fingerprint = info_.fingerprint;
  ScoreResponse r;
  if (api_ == TeacherApi::Opd) {
    const bool bin = opts_.binary;
    const std::string body = bin ? encode_score_request(q) : score_request_to_json(q).dump();
    const std::string ct = bin ? kBinaryContentType : "application/json";
    call("POST", "/v1/score", body, ct, ct, [&](const Reply& rep) {
      try {
        r = rep.content_type.rfind(kBinaryContentType, 0) == 0
                ? decode_score_response(rep.body)
                : score_response_from_json(parse_json(rep.body, "score response"));
      } catch (const Error& e) {
        // A body that does not decode (CRC, truncation) was damaged in transit: retry.
        throw Retryable{cat("undecodable response: ", e.what())};
      }
    });
  } else {
    const std::string body = vllm_score_request(q, info_.model_name).dump();
    call("POST", "/v1/completions", body, "application/json", "application/json",
         [&](const Reply& rep) {
           r = parse_vllm_prompt_logprobs(reply_json(rep.body, "vLLM completions response"), q,
                                          info_.vocab_size);
         });
  }
  // Nothing is used before it is checked: shapes against the request, values by the loss's
  // boundary validation against the student.
  check_response_matches(r, q);
  const int64_t reordered = sort_response_rows(r);  // any order becomes the protocol's (scorer.h)
  // The vocabulary every answer is checked against is the one /v1/models reported at connect
  // (and the student compatibility check passed on): an answer of another is refused.
  OPD_CHECK(r.vocab_size == info_.vocab_size, InvalidData, "teacher at ", opts_.url,
            " answered with vocabulary ", r.vocab_size, " but reported ", info_.vocab_size,
            " at connect (/v1/models); the server misreports its model or was replaced");
  Validated v;
  v.topk = validate_teacher_payload(to_teacher_payload(r), completion_layout(q),
                                    opts_.student_vocab, opts_.loss, DType::F32, &v.stats);
  v.stats.reordered_rows += reordered;
  v.response = std::move(r);
  return v;
}

ScoreResponse TeacherClient::score(const ScoreRequest& request) {
  return score_validated(request).response;
}

std::vector<GeneratedCompletion> TeacherClient::generate(const GenerateRequest& request) {
  OPD_CHECK(!request.prompts.empty() && request.max_tokens >= 1, InvalidArgument,
            "generate: ", request.prompts.size(), " prompts, max_tokens ", request.max_tokens,
            " (need >= 1 of each)");
  // Generated ids become the student's training input: each must be a token of both models.
  const int64_t vocab = opts_.student_vocab > 0 ? std::min(opts_.student_vocab, info_.vocab_size)
                                                : info_.vocab_size;
  // An opd server states its largest generation request (prompt + max_tokens summed over the
  // prompts): a larger one goes as consecutive requests that fit, each prompt with its own
  // stream key, so the samples are the same as in one request. (A single prompt over the limit
  // is sent alone and refused by the server with its message.)
  std::vector<GeneratedCompletion> out;
  GenerateRequest part = request;
  size_t begin = 0;
  while (begin < request.prompts.size()) {
    size_t end = begin;
    int64_t tokens = 0;
    while (end < request.prompts.size()) {
      const int64_t t = static_cast<int64_t>(request.prompts[end].size()) + request.max_tokens;
      if (end > begin && generation_limit_ > 0 && tokens + t > generation_limit_) break;
      tokens += t;
      ++end;
    }
    part.prompts.assign(request.prompts.begin() + static_cast<std::ptrdiff_t>(begin),
                        request.prompts.begin() + static_cast<std::ptrdiff_t>(end));
    if (!request.stream_keys.empty())
      part.stream_keys.assign(request.stream_keys.begin() + static_cast<std::ptrdiff_t>(begin),
                              request.stream_keys.begin() + static_cast<std::ptrdiff_t>(end));
    const std::string body = generate_request_to_json(part, info_.model_name).dump();
    call("POST", "/v1/completions", body, "application/json", "application/json",
         [&](const Reply& rep) {
           std::vector<GeneratedCompletion> got = parse_generation_response(
               reply_json(rep.body, "completions (generation) response"), part, vocab);
           out.insert(out.end(), std::make_move_iterator(got.begin()),
                      std::make_move_iterator(got.end()));
         });
    begin = end;
  }
  return out;
}

}  // namespace opd
