// Remote teacher client (training's --teacher-url): speaks opd's /v1/score protocol (binary or
// JSON) or a vLLM server's /v1/completions with prompt_logprobs, and trusts nothing it receives.
//
// - Connect: GET /v1/models (retried while the server starts) gives the teacher's vocabulary
//   and tokenizer fingerprint (opd servers); a server that does not report them (vLLM) needs
//   them asserted by the caller (ClientOptions::assume_*). The fingerprint must equal the
//   student's under VocabPolicy::Error; ClipToStudent accepts a different tokenizer (warning)
//   and lets validation drop the teacher ids the student does not have.
// - Every score request carries the fingerprint seen at connect, so a server restarted with
//   another model answers 409 instead of wrong scores.
// - Every response is shape-checked against its request (check_response_matches) and then
//   validated with validate_teacher_payload (loss/teacher_payload.h) before score() returns:
//   ids in range, K entries, finite, sub-distribution, alignment with the completion.
// - Transport: a pool of `connections` keep-alive HTTP connections (score() is thread-safe);
//   connect / read timeouts; retries with exponential backoff and jitter on connection errors,
//   timeouts, 5xx, 429 and corrupted bodies (CRC / truncation); 4xx and validation failures are
//   not retried (they would fail again). Scoring is a pure function of the request, so a retry
//   after a server died mid-request is safe, and each score() call returns exactly one
//   response (or throws): the caller sees every result exactly once.
// - Chunking (issue 7): a large score request is split into up to `chunks` requests of whole
//   sequences (plan_score_chunks), sent concurrently over the pool, so the server scores chunk
//   i + 1 while chunk i is encoded, sent, decoded and validated (the GPU work no longer waits
//   for the whole ~17 MB answer of W1). Each chunk is its own request: retried on its own,
//   shape-checked against its own sub-request and validated like an unsplit response; a chunk
//   that fails after its attempts fails the call (no partial result), and the chunks' results
//   are placed by index, so every row is returned exactly once, in request order.
// - Cancelling (ClientOptions::should_cancel, e.g. a training run's stop signal): polled while
//   an attempt is in flight, during the backoff and while waiting for a pooled connection; once
//   it says stop, the attempt's socket is shut down (httplib's Client::stop(), the one call that
//   is safe from another thread) and the call throws ErrorKind::Cancelled at once, instead of
//   waiting out the attempt's read timeout (up to request_timeout_s) and the retries.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loss/loss_config.h"
#include "loss/teacher_payload.h"
#include "teacher/protocol.h"
#include "teacher/scorer.h"

namespace httplib { class Client; }

namespace opd {

enum class TeacherApi : uint8_t {
  Auto,  // opd if /v1/models reports an "opd" section, else vLLM
  Opd,   // POST /v1/score
  Vllm,  // POST /v1/completions with prompt_logprobs
};
std::string_view teacher_api_name(TeacherApi api);
TeacherApi parse_teacher_api(std::string_view name);  // "auto", "opd", "vllm"

struct ClientOptions {
  std::string url;                 // http://host:port (no TLS)
  TeacherApi api = TeacherApi::Auto;
  bool binary = true;              // opd API: binary bodies (false: JSON)
  int connections = 4;             // pool size = concurrent requests in flight
  double connect_timeout_s = 5;
  double request_timeout_s = 600;  // read/write timeout of one attempt
  int max_attempts = 8;            // per request (and for the connect-time GET)
  // One call's attempts and backoff together, in seconds (0: only max_attempts bounds them).
  // No attempt waits past it: a server that accepts a request and never answers costs at most
  // this long (opd train: --teacher-timeout), not max_attempts x request_timeout_s.
  double deadline_s = 0;
  double backoff_initial_s = 0.1;  // delay before retry i: min(max, initial * 2^i) * U(0.5, 1)
  double backoff_max_s = 5;
  size_t max_response_bytes = size_t{2} << 30;
  // The student this teacher serves: every response is validated against it (0: no student,
  // as in `opd score`: validated against the teacher's own vocabulary, no fingerprint check).
  int64_t student_vocab = 0;
  std::string student_fingerprint;
  LossConfig loss;                 // vocab policy, distillation temperature, support mode
  // Teacher identity for servers that do not report one (vLLM): e.g. computed by the caller
  // with tokenizer_fingerprint(teacher_dir, vocab) from a local copy of the teacher's config.
  std::optional<int64_t> assume_teacher_vocab;
  std::string assume_teacher_fingerprint;
  std::string vllm_model;          // model id for vLLM requests ("" = the first of /v1/models)
  // Split a score request into at most `chunks` concurrent requests of >= min_chunk_rows scored
  // rows each (1: never split; a request under 2 x min_chunk_rows rows is sent whole). The
  // pool (`connections`) bounds how many are in flight.
  int chunks = 8;
  int64_t min_chunk_rows = 2048;
  // Polled (every ~20 ms, from helper threads too: it must be thread-safe) while a call waits on
  // the network; true abandons the call with ErrorKind::Cancelled (no result, nothing retried).
  // A connect in progress is not interrupted: the cancel lands within connect_timeout_s at
  // worst. Empty: never cancelled.
  std::function<bool()> should_cancel;
};

struct ClientStats {
  int64_t requests = 0;   // score() calls that returned a response
  int64_t chunks = 0;     // score requests sent for them (one per chunk; 1 per unsplit call)
  int64_t attempts = 0;   // HTTP attempts, including retries
  int64_t retries = 0;
};

// The sequence ranges [first, last) a request is sent as: n = min(max_chunks, rows /
// min_chunk_rows) (at least 1) ranges of about rows / n scored rows, in order, covering every
// sequence once, never splitting one. Ranges end between runs of sequences that share a prompt
// (same begin and ids before it), where a run's middle would pass the range's share of rows, so
// the server's prefix and shared-prompt reuse sees whole groups; only a run of more than 1.5
// shares is itself cut.
std::vector<std::pair<size_t, size_t>> plan_score_chunks(const ScoreRequest& request,
                                                         int max_chunks, int64_t min_chunk_rows);

class TeacherClient : public Scorer {
 public:
  // Connects and checks compatibility (throws InvalidArgument on a mismatch, Io when the
  // server cannot be reached after max_attempts, Cancelled when should_cancel stopped it).
  explicit TeacherClient(ClientOptions options);
  ~TeacherClient() override;

  const TeacherInfo& info() const override { return info_; }
  TeacherApi api() const { return api_; }
  // Validated scores (see above). Throws InvalidData for a response that fails validation,
  // InvalidArgument for a request the server rejected (4xx, with its message), Io when every
  // attempt failed, Cancelled when should_cancel stopped it.
  ScoreResponse score(const ScoreRequest& request) override;
  struct Validated {
    ScoreResponse response;
    TeacherTopK topk;    // the dense form the fused loss consumes
    PayloadStats stats;
  };
  Validated score_validated(const ScoreRequest& request);
  // Completions sampled by the teacher (--seq-kd): one /v1/completions request with
  // max_tokens > 1 (opd serve or vLLM), every generated id checked to be in both vocabularies
  // (the student's and the teacher's) and every length and finish reason against the request
  // (protocol.h parse_generation_response). Same errors and retries as score(). A request
  // larger than an opd server's stated max_generation_tokens goes as consecutive requests.
  std::vector<GeneratedCompletion> generate(const GenerateRequest& request);
  ClientStats stats() const;

 private:
  // One request (no chunking): send with retries, decode, check, validate.
  Validated score_one(const ScoreRequest& request);
  struct Http;  // one pooled connection
  struct Reply {
    int status = 0;
    std::string body;
    std::string content_type;
  };
  // One request with retries; returns the first 2xx reply (4xx: throws, no retry).
  Reply call(const std::string& method, const std::string& path, const std::string& body,
             const std::string& content_type, const std::string& accept,
             const std::function<void(const Reply&)>& decode_check);
  std::unique_ptr<Http> acquire();  // nullptr when should_cancel stopped the wait
  void release(std::unique_ptr<Http> h);

  ClientOptions opts_;
  TeacherApi api_ = TeacherApi::Auto;
  TeacherInfo info_;
  int64_t generation_limit_ = 0;  // an opd server's max_generation_tokens (0: none stated)
  std::string host_;
  int port_ = 0;
  std::mutex pool_mu_;
  std::condition_variable pool_cv_;
  std::vector<std::unique_ptr<Http>> idle_;
  int open_ = 0;
  std::atomic<int64_t> requests_{0}, chunks_{0}, attempts_{0}, retries_{0}, seq_{0};
};

}  // namespace opd
