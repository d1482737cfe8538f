// The teacher HTTP service behind `opd serve` (endpoints and formats in
// docs/teacher_protocol.md): POST /v1/score (our binary or JSON protocol), POST /v1/completions
// (vLLM's OpenAI-compatible API: token-id prompts, prompt_logprobs, echo, logprobs, max_tokens
// 0 or 1), GET /health, GET /v1/models (vocab size, tokenizer fingerprint, EOS ids).
//
// A server never crashes on input: every handler catches, bad requests get a 4xx with a JSON
// error naming the problem ({"error": {"message", "type", "code"}}), bodies are bounded
// (max_body_bytes, 413 above), and the scorer's own limits bound the work. Scoring runs one
// request at a time (the forward is already parallel inside), so memory is bounded by one
// request's working set plus `threads` bodies in flight.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "teacher/scorer.h"

namespace httplib { class Server; }

namespace opd {

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
  int threads = 16;                              // connection worker threads
  std::string model_name;                        // "" = the scorer's info().model_name
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
  // 400 (HttpError) when a JSON answer would hold more than max_json_entries entries.
  void check_json_entries(const char* what, int64_t rows, int64_t k) const;

  Scorer& scorer_;
  ServerOptions opts_;
  std::unique_ptr<httplib::Server> http_;
  std::thread listener_;
  std::mutex score_mu_;   // one scoring call at a time
  std::mutex stop_mu_;
  int port_ = 0;
  std::atomic<int64_t> served_{0}, rejected_{0};
};

}  // namespace opd
