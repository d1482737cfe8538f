// The teacher HTTP service behind `opd serve` (endpoints and formats in
// docs/teacher_protocol.md): POST /v1/score (our binary or JSON protocol), POST /v1/completions
// (vLLM's OpenAI-compatible API: token-id prompts, prompt_logprobs, echo, logprobs; max_tokens
// 0, or 1 with no sampling field but temperature and seed, from the scorer; longer ones and a
// token sampled with top_p / top_k / min_p / stop_token_ids through ServerOptions::generator;
// fields that would change the answer and are not supported get 400), GET /health,
// GET /v1/models (vocab size, tokenizer fingerprint, EOS ids).
//
// A server never crashes on input: every handler catches, bad requests get a 4xx with a JSON
// error naming the problem ({"error": {"message", "type", "code"}}), bodies are bounded
// (max_body_bytes, 413 above), and the scorer's own limits bound the work. Scoring runs one
// request at a time (the forward is already parallel inside), so memory is bounded by one
// request's working set plus `threads` bodies in flight.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "teacher/protocol.h"
#include "teacher/scorer.h"

namespace httplib {
class Server;
struct Request;
struct Response;
class ContentReader;
}  // namespace httplib

namespace opd {

class HttpConnections;  // server.cpp: httplib::Server with the connection policy above

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                               // 0: an ephemeral port (see TeacherServer::port)
  size_t max_body_bytes = size_t{256} << 20;     // request bodies above this get 413
  // JSON answers (/v1/score with Accept: application/json, /v1/completions logprobs) hold at
  // most this many (id, logprob) entries (rows x k): a JSON entry costs ~10-50x its 8 binary
  // bytes in memory, so a request the binary path serves (up to the scorer's
  // max_output_entries) could exhaust the server's memory as JSON; larger ones get 400 and are
  // pointed at the binary format. 2^21 covers W1 as JSON (32,768 rows x 64).
  int64_t max_json_entries = int64_t{1} << 21;
  // Connections served at once, one thread each. When all are taken, a new connection takes the
  // place of the one that has waited longest for its request (a stalled, slow or idle client:
  // its connection is closed), so clients that stall cannot lock well-behaved ones out; when every
  // connection is busy with a request, new ones wait in a queue of 4 x threads, beyond which
  // they get 503. stop() closes the connections waiting for a request at once and finishes
  // the requests in flight.
  int threads = 16;
  std::string model_name;                        // "" = the scorer's info().model_name
  // Reported in /v1/models as opd.weights_fingerprint when not empty (`opd serve`: of --model,
  // model/weights_fingerprint.h), so a client can tell a teacher whose weights changed.
  std::string weights_fingerprint;
  // Generation for /v1/completions with max_tokens > 1, or 1 with sampling filters (--seq-kd
  // with a remote teacher). The
  // teacher module does not generate (the rollout engine is its sibling): `opd serve` binds
  // one here. `cancelled` turns true when the server stops (a long generation may end early
  // with a Cancelled error, answered 503). Empty: such requests get 501.
  using Generator = std::function<std::vector<GeneratedCompletion>(
      const GenerateRequest&, const std::function<bool()>& cancelled)>;
  Generator generator;
  // One generation request's prompt + completion tokens (prompts x max_tokens counted whole);
  // larger ones get 400.
  int64_t max_generation_tokens = int64_t{1} << 22;
};

class TeacherServer {
 public:
  TeacherServer(Scorer& scorer, ServerOptions options);
  ~TeacherServer();  // stops and joins
  TeacherServer(const TeacherServer&) = delete;
  TeacherServer& operator=(const TeacherServer&) = delete;

  // Binds (Io error naming host:port when it cannot) and serves on a background thread.
  void start();
  int port() const { return port_; }
  // Stops accepting, finishes the requests in flight, joins. Idempotent; callable from any
  // thread (e.g. the one that received SIGTERM).
  void stop();
  // Blocks until stop() has been called and the listener has returned.
  void wait();

  int64_t requests_served() const { return served_.load(); }
  int64_t requests_rejected() const { return rejected_.load(); }

 private:
  void install_routes();
  // /v1/completions through the generator: the sampling fields of `j` (vLLM names), checked and
  // bounded, run through opts_.generator under the scoring lock.
  std::vector<GeneratedCompletion> generate(const nlohmann::json& j,
                                            const std::vector<std::vector<int32_t>>& prompts,
                                            int64_t max_tokens, double temperature, int64_t seed);
  // The request body, at most max_body_bytes (chunked ones included; 413 above), or an
  // HttpError naming what was missing. Marks the connection as handling a request.
  std::string read_body(const httplib::Request& req, httplib::Response& res,
                        const httplib::ContentReader& reader);
  // 400 (HttpError) when a JSON answer would hold more than max_json_entries entries.
  void check_json_entries(const char* what, int64_t rows, int64_t k) const;

  Scorer& scorer_;
  ServerOptions opts_;
  std::unique_ptr<httplib::Server> http_;
  HttpConnections* conns_ = nullptr;  // the same object as http_
  std::thread listener_;
  std::mutex score_mu_;   // one scoring call at a time
  std::mutex stop_mu_;
  std::atomic<bool> stopping_{false};
  int port_ = 0;
  std::atomic<int64_t> served_{0}, rejected_{0};
};

}  // namespace opd
