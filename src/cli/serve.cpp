// `opd serve --model DIR --port P [--host H] [--max-batch-tokens N]`: the teacher service
// (teacher/server.h; protocol in docs/teacher_protocol.md) on the in-process scorer: CpuScorer,
// or with --device cuda the CudaScorer (bf16). /v1/completions generates more than one token
// with the rollout engine over the scorer's model (`generator` below: --seq-kd with a remote
// teacher).
// Logs where it listens; SIGTERM / SIGINT stop it cleanly (requests in flight finish, connections
// waiting for a request are closed), exit 0; SIGHUP is logged and ignored.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <thread>

#include "cli/commands.h"
#include "core/log.h"
#include "model/transformer.h"
#include "model/weights_fingerprint.h"
#include "rollout/engine.h"
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
  double kv_cache_gb = 1.0;
  int64_t max_generation_tokens = int64_t{1} << 22;
};

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Generation for /v1/completions with max_tokens > 1: one rollout engine per request over the
// scorer's model (same weights, same device), stopping at the model's EOS ids (config.json,
// generation_config.json, the tokenizer's when the directory has one) unless ignore_eos.
// Each prompt samples from its own stream: the request's opd_stream_keys when given (a trainer
// sends its in-process keys, so remote and in-process --seq-kd draw the same tokens), otherwise
// the prompt's key mixed with its index (the same prompt twice gets two samples).
ServerOptions::Generator make_generator(const Transformer& model, const std::string& dir,
                                        double kv_cache_gb) {
  std::optional<Tokenizer> tok;
  if (std::filesystem::exists(dir + "/tokenizer.json")) tok.emplace(Tokenizer::load(dir));
  std::vector<int32_t> eos = generation_eos_ids(dir, model.config(), tok ? &*tok : nullptr);
  log_info("opd serve: generation stops at EOS ids ", nlohmann::json(eos).dump());
  const int64_t kv_bytes = static_cast<int64_t>(kv_cache_gb * 1024.0 * 1024.0 * 1024.0);
  // The tokenizer decodes each completion into the answer's `text`, as vLLM fills it (special
  // tokens such as the EOS skipped, as vLLM's default skip_special_tokens does).
  auto shared_tok = tok ? std::make_shared<Tokenizer>(std::move(*tok)) : nullptr;
  return [&model, eos, kv_bytes, shared_tok](const GenerateRequest& g,
                                             const std::function<bool()>& cancelled) {
    std::vector<GenerationRequest> reqs;
    for (size_t i = 0; i < g.prompts.size(); ++i) {
      GenerationRequest r;
      r.prompt = g.prompts[i];
      r.sampling = SamplingParams{g.temperature, g.top_p, g.top_k, g.min_p, g.seed};
      r.max_new_tokens = g.max_tokens;
      r.stop_token_ids = g.stop_token_ids;
      r.ignore_eos = g.ignore_eos;
      r.stream_key = g.stream_keys.empty()
                         ? prompt_stream_key(r.prompt) ^ splitmix64(static_cast<uint64_t>(i) + 1)
                         : g.stream_keys[i];
      reqs.push_back(std::move(r));
    }
    EngineOptions eo;
    eo.kv_cache_bytes = kv_bytes;
    eo.max_step_tokens = 2048;  // as the trainer's rollout
    eo.should_cancel = cancelled;
    RolloutEngine engine(model, eo, eos);
    std::vector<RequestOutput> outs = engine.generate(reqs);
    std::vector<GeneratedCompletion> done(outs.size());
    for (size_t i = 0; i < outs.size(); ++i) {
      const SampleOutput& s = outs[i].samples.at(0);
      done[i].ids = s.ids;
      done[i].logprobs.assign(s.model_logprobs.begin(), s.model_logprobs.end());
      done[i].stopped = s.finish_reason != FinishReason::Length;
      // Best effort, after sampling: a model may emit ids its tokenizer lacks (padded
      // embeddings), which must not fail the generation; such a completion's text stays "".
      if (shared_tok) {
        try {
          done[i].text = shared_tok->decode(s.ids, /*skip_special_tokens=*/true);
        } catch (const Error&) {
          done[i].text.clear();
        }
      }
    }
    return done;
  };
}

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

extern "C" void on_hangup(int) {
  static const char msg[] = "opd serve: SIGHUP ignored (the server keeps serving; SIGTERM or SIGINT stop it)\n";
  [[maybe_unused]] ssize_t n = write(2, msg, sizeof(msg) - 1);
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
    // SIGHUP (the terminal closed) does not stop a teacher a training run depends on, as it
    // does not stop `opd train` or `opd launch`: logged and ignored. It used to kill the
    // server at once, requests in flight unanswered.
    struct sigaction hup {};
    hup.sa_handler = on_hangup;
    sigemptyset(&hup.sa_mask);
    sigaction(SIGHUP, &hup, &old_hup_);
    // A client gone mid-answer must be an error value, not a SIGPIPE (httplib's Server
    // constructor ignores it too; this does not depend on that).
    signal(SIGPIPE, SIG_IGN);
  }
  ~StopSignals() {
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGHUP, &old_hup_, nullptr);
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
  struct sigaction old_term_ {}, old_int_ {}, old_hup_ {};
};

void run_serve(const ServeOptions& o) {
  std::unique_ptr<Scorer> owned;
  const Transformer* model = nullptr;
  if (o.device == "cuda") {
    CudaScorer::Options so;
    so.max_batch_tokens = o.max_batch_tokens;
    so.shared_prompt.mode = parse_shared_prompt_mode(o.shared_prompt);
    auto cuda = std::make_unique<CudaScorer>(o.model, so);
    model = &cuda->model();
    owned = std::move(cuda);
  } else {
    CpuScorer::Options so;
    so.max_batch_tokens = o.max_batch_tokens;
    so.shared_prompt.mode = parse_shared_prompt_mode(o.shared_prompt);
    auto cpu = std::make_unique<CpuScorer>(o.model, so);
    model = &cpu->model();
    owned = std::move(cpu);
  }
  Scorer& scorer = *owned;
  ServerOptions opts;
  opts.generator = make_generator(*model, o.model, o.kv_cache_gb);
  opts.max_generation_tokens = o.max_generation_tokens;
  opts.host = o.host;
  opts.port = o.port;
  opts.threads = o.threads;
  opts.max_body_bytes = static_cast<size_t>(o.max_request_mb) << 20;
  opts.max_json_entries = o.max_json_entries;
  opts.model_name = o.served_model_name;
  opts.weights_fingerprint = weights_fingerprint(o.model).sha256;  // reported in /v1/models
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
                  "scorer and generator: cpu (f32 reference) | cuda (bf16 on the GPU)")
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
  cmd->add_option("--threads", o->threads, "connections served at once (a thread each; a stalled one makes room for a new one)")
      ->default_val(16)
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--shared-prompt", o->shared_prompt,
                  "completions of one prompt share its K/V: auto (when the cost model predicts "
                  "less work) | always | never (docs/teacher.md)")
      ->default_val("auto")
      ->check(CLI::IsMember({"auto", "always", "never"}));
  cmd->add_option("--kv-cache-gb", o->kv_cache_gb,
                  "KV cache of one generation request (/v1/completions with max_tokens > 1; "
                  "requests that need more run in turns)")
      ->default_val(1.0)
      ->check(CLI::Range(0.001, 1024.0));
  cmd->add_option("--max-generation-tokens", o->max_generation_tokens,
                  "largest generation request: prompt + max_tokens tokens summed over its "
                  "prompts (larger ones get 400)")
      ->default_val(int64_t{1} << 22)
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  cmd->add_option("--served-model-name", o->served_model_name,
                  "model id reported by /v1/models (default: the directory name)");
  cmd->callback([o] { run_serve(*o); });
}

}  // namespace opd::cli
