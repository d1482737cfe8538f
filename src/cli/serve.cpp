// `opd serve --model DIR --port P [--host H] [--max-batch-tokens N]`: the teacher service
// (teacher/server.h; protocol in docs/teacher_protocol.md) on the in-process scorer: CpuScorer,
// or with --device cuda the CudaScorer (bf16; generation through /v1/completions is CPU-only).
// Logs where it listens; SIGTERM / SIGINT stop it cleanly (requests in flight finish), exit 0.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <memory>
#include <thread>

#include "cli/commands.h"
#include "core/log.h"
#include "teacher/cuda_scorer.h"
#include "teacher/scorer.h"
#include "teacher/server.h"

namespace opd::cli {
namespace {

struct ServeOptions {
  std::string model;
  std::string device = "cpu";
  std::string host = "127.0.0.1";
  int port = 8000;
  int64_t max_batch_tokens = 16384;
  int64_t max_request_mb = 256;
  int64_t max_json_entries = int64_t{1} << 21;
  int threads = 16;
  std::string served_model_name;
  std::string shared_prompt = "auto";
};

// SIGTERM / SIGINT -> one byte on a self-pipe (write() is async-signal-safe); a watcher thread
// reads it and stops the server. A handler (not a signal mask) because library threads that
// exist before main (OpenBLAS) would otherwise take the default action and kill the process.
int g_stop_pipe[2] = {-1, -1};
volatile sig_atomic_t g_stop_signal = 0;

extern "C" void on_stop_signal(int sig) {
  g_stop_signal = sig;
  const char b = 1;
  [[maybe_unused]] ssize_t n = write(g_stop_pipe[1], &b, 1);
}

// Installs the handlers for the lifetime of the object and restores the previous ones.
class StopSignals {
 public:
  StopSignals() {
    OPD_CHECK(pipe(g_stop_pipe) == 0, Io, "opd serve: pipe() failed");
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, &old_term_);
    sigaction(SIGINT, &sa, &old_int_);
  }
  ~StopSignals() {
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGINT, &old_int_, nullptr);
    close(g_stop_pipe[0]);
    close(g_stop_pipe[1]);
  }
  // Blocks until a stop signal or wake() arrives.
  void wait() {
    char b;
    while (read(g_stop_pipe[0], &b, 1) < 0 && errno == EINTR) {
    }
  }
  void wake() { on_stop_signal(0); }

 private:
  struct sigaction old_term_ {}, old_int_ {};
};

void run_serve(const ServeOptions& o) {
  std::unique_ptr<Scorer> owned;
  if (o.device == "cuda") {
    CudaScorer::Options so;
    so.max_batch_tokens = o.max_batch_tokens;
    so.shared_prompt.mode = parse_shared_prompt_mode(o.shared_prompt);
    owned = std::make_unique<CudaScorer>(o.model, so);
  } else {
    CpuScorer::Options so;
    so.max_batch_tokens = o.max_batch_tokens;
    so.shared_prompt.mode = parse_shared_prompt_mode(o.shared_prompt);
    owned = std::make_unique<CpuScorer>(o.model, so);
  }
  Scorer& scorer = *owned;
  ServerOptions opts;
  opts.host = o.host;
  opts.port = o.port;
  opts.threads = o.threads;
  opts.max_body_bytes = static_cast<size_t>(o.max_request_mb) << 20;
  opts.max_json_entries = o.max_json_entries;
  opts.model_name = o.served_model_name;
  StopSignals signals;
  TeacherServer server(scorer, opts);
  server.start();
  // The port line is machine-readable for scripts and tests (with --port 0).
  std::printf("opd serve: port %d\n", server.port());
  std::fflush(stdout);

  std::thread waiter([&] {
    signals.wait();
    if (g_stop_signal != 0)
      log_info("opd serve: received ", g_stop_signal == SIGTERM ? "SIGTERM" : "SIGINT",
               ", stopping");
    server.stop();
  });
  server.wait();
  signals.wake();  // the listener may have ended on its own: release the waiter
  waiter.join();
  log_info("opd serve: stopped after ", server.requests_served(), " requests (",
           server.requests_rejected(), " rejected)");
}

}  // namespace

void register_serve(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "serve", "Serve a teacher model: /v1/score (opd protocol), /v1/completions (vLLM-compatible)");
  cmd->add_option("--model", o->model, "Hugging Face model directory")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--device", o->device,
                  "scorer: cpu (f32 reference) | cuda (bf16 on the GPU; no generation)")
      ->default_val("cpu")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--host", o->host, "address to bind")->default_val("127.0.0.1");
  cmd->add_option("--port", o->port, "port (0 = any free port, printed on stdout)")
      ->default_val(8000)
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--max-batch-tokens", o->max_batch_tokens, "tokens per forward batch")
      ->default_val(16384)
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--max-request-mb", o->max_request_mb, "largest request body (MiB)")
      ->default_val(256)
      ->check(CLI::Range(1, 65536));
  cmd->add_option("--max-json-entries", o->max_json_entries,
                  "largest JSON answer in (id, logprob) entries (rows x k; /v1/score with "
                  "Accept: application/json, /v1/completions logprobs); larger requests get 400 "
                  "(the binary /v1/score format is bounded by the scorer's output limit only)")
      ->default_val(int64_t{1} << 21)
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--threads", o->threads, "HTTP connection threads")
      ->default_val(16)
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--shared-prompt", o->shared_prompt,
                  "completions of one prompt share its K/V: auto (when the cost model predicts "
                  "less work) | always | never (docs/teacher.md)")
      ->default_val("auto")
      ->check(CLI::IsMember({"auto", "always", "never"}));
  cmd->add_option("--served-model-name", o->served_model_name,
                  "model id reported by /v1/models (default: the directory name)");
  cmd->callback([o] { run_serve(*o); });
}

}  // namespace opd::cli
