// `opd bench score`: the teacher-scoring phase of W1 (shared/BENCHMARKS.md) on one GPU, in
// process and through a loopback `opd serve --device cuda`:
//   teacher Qwen3-1.7B shape (model/presets.h: vocab 151936, hidden 2048, 28 layers, 16 q / 8 kv
//   heads x 128, intermediate 6144, tied embeddings, rope_theta 1e6, eps 1e-6, q/k norm), random
//   init (model/init.h, seeded, normal std 0.02) written to a temporary model directory;
//   64 sequences x 768 random token ids (seeded): 256 prompt + 512 scored completion positions;
//   top-K 64 at T = 1 (plus each actual token's logprob).
// Variants: --num-generations N (N consecutive sequences share their prompt ids: the GKD
// setting) with --shared-prompt auto|always|never (the scorers' shared-prompt path,
// teacher/score_plan.h); --device cpu with a small shape (--layers --hidden --intermediate
// --heads --vocab) runs everything on the CPU scorer.
// In process: CudaScorer (teacher/cuda_scorer.h, bf16) or CpuScorer on that directory. Served:
// `opd serve --device D --port 0` started as a child process, waited for (its port line, then
// GET /v1/models), the same request sent by TeacherClient (binary protocol, every response
// validated) twice: as one request (chunks 1), then split into --chunks concurrent chunks
// (teacher/client.h); the answers compared with the in-process ones, the server stopped with
// SIGTERM. Each measurement: `--warmup` untimed calls, then the median wall time of `--iters`
// calls of score() (request in, validated [rows x K] results on the host out).
// Reported: seconds, scored tokens/s (completion positions / s, the measure), processed
// tokens/s (every forwarded token / s, BENCHMARKS.md's teacher-scoring figure), model TFLOP/s
// and its fraction of the measured 776 TFLOP/s bf16 GEMM rate, peak device memory (in process).
// Model FLOPs = 2 x (decoder-layer matmul parameters) x forwarded tokens + 2 V H x scored rows
// (lm_head) + causal attention 2 x 2 x heads x head_dim x S (S + 1) / 2 per layer and sequence
// (the dense work of the request, also when a shared prompt saves part of it).
#include <CLI/CLI.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "cli/bench_util.h"  // median
#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "core/philox.h"
#include "core/tensor.h"  // memory_stats, device_hooks::cuda_device_count
#include "model/init.h"
#include "model/presets.h"
#include "teacher/client.h"
#include "teacher/cuda_scorer.h"

namespace opd::cli {
namespace {

struct BenchScoreOptions {
  std::string preset = "qwen3-1.7b";
  std::string device = "cuda";
  int64_t layers = 0;  // 0 = the preset's (also hidden, intermediate, heads, vocab)
  int64_t hidden = 0, intermediate = 0, heads = 0, vocab = 0;
  int64_t num_generations = 1;
  std::string shared_prompt = "auto";
  int chunks = 8;
  int64_t min_chunk_rows = 2048;
  int64_t sequences = 64, prompt = 256, completion = 512, k = 64;
  double temperature = 1.0;
  int64_t max_batch_tokens = 16384, vocab_tile = 16384, row_chunk = 2048;
  int warmup = 1, iters = 3;
  bool no_server = false, json = false, keep = false;
  bool context_prefill = CudaScorer::Options{}.context_prefill;  // in-process CUDA scorer only
  std::string work_dir, opd_binary;
  double server_timeout_s = 600;
  uint64_t seed = 1234;
};

constexpr double kMeasuredPeak = 776e12;  // bf16 GEMM 8192^3 on the lent H200 (BENCHMARKS.md)
constexpr double kGoalTokensPerS = 200000;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double model_flops(const ModelConfig& c, const ScoreRequest& q) {
  const double H = static_cast<double>(c.hidden_size), I = static_cast<double>(c.intermediate_size);
  const double qd = static_cast<double>(c.num_attention_heads * c.head_dim);
  const double kvd = static_cast<double>(c.num_key_value_heads * c.head_dim);
  const double layer_params = H * qd + 2 * H * kvd + qd * H + 3 * H * I;
  const double L = static_cast<double>(c.num_hidden_layers);
  double flops = 0;
  for (const ScoreSequence& s : q.sequences) {
    const double S = static_cast<double>(s.end - 1);  // tokens forwarded: ids[0 .. end-2]
    flops += 2 * L * layer_params * S;
    flops += L * 2 * 2 * qd * S * (S + 1) / 2;
    flops += 2 * static_cast<double>(c.vocab_size) * H * static_cast<double>(s.end - s.begin);
  }
  return flops;
}

struct Timing {
  double median_s = 0;
  std::vector<double> all_s;
};

template <typename Fn>
Timing time_calls(int warmup, int iters, Fn&& fn) {
  Timing t;
  for (int i = 0; i < warmup; ++i) fn();
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    t.all_s.push_back(seconds_since(t0));
  }
  t.median_s = median(t.all_s);
  return t;
}

// The served answer against the in-process one: fraction of equal ids, max |logprob diff|.
struct Agreement {
  double ids_equal = 0, max_abs_logprob_diff = 0;
};
Agreement compare(const ScoreResponse& a, const ScoreResponse& b) {
  Agreement g;
  OPD_CHECK(a.ids.size() == b.ids.size() && a.actual_logprobs.size() == b.actual_logprobs.size(),
            Internal, "bench score: the served answer has ", b.ids.size(), " entries, the "
            "in-process one ", a.ids.size());
  int64_t same = 0;
  for (size_t i = 0; i < a.ids.size(); ++i) {
    same += a.ids[i] == b.ids[i];
    g.max_abs_logprob_diff = std::max(g.max_abs_logprob_diff,
                                      std::fabs(static_cast<double>(a.logprobs[i]) - b.logprobs[i]));
  }
  for (size_t i = 0; i < a.actual_logprobs.size(); ++i)
    g.max_abs_logprob_diff = std::max(
        g.max_abs_logprob_diff, std::fabs(static_cast<double>(a.actual_logprobs[i]) - b.actual_logprobs[i]));
  g.ids_equal = a.ids.empty() ? 1.0 : static_cast<double>(same) / static_cast<double>(a.ids.size());
  return g;
}

// `opd serve --device cuda` as a child process; SIGTERM (then SIGKILL) when destroyed.
class ServerChild {
 public:
  ServerChild(const std::string& opd, const std::string& model_dir, const std::string& device,
              const std::string& shared_prompt, int64_t max_batch_tokens, double timeout_s) {
    int fds[2];
    OPD_CHECK(pipe(fds) == 0, Io, "bench score: pipe() failed");
    const std::string mbt = std::to_string(max_batch_tokens);
    pid_ = fork();
    OPD_CHECK(pid_ >= 0, Io, "bench score: fork() failed");
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      execl(opd.c_str(), opd.c_str(), "serve", "--model", model_dir.c_str(), "--device",
            device.c_str(), "--host", "127.0.0.1", "--port", "0", "--max-batch-tokens",
            mbt.c_str(), "--shared-prompt", shared_prompt.c_str(), static_cast<char*>(nullptr));
      std::perror("bench score: exec opd serve");
      _exit(127);
    }
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
    // The server prints "opd serve: port N" once it listens (after loading the model).
    const auto t0 = std::chrono::steady_clock::now();
    std::thread watchdog([this, t0, timeout_s] {
      while (port_ == 0 && !gave_up_) {
        if (seconds_since(t0) > timeout_s) {
          gave_up_ = true;
          kill(pid_, SIGKILL);  // unblocks the read below (EOF)
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
    char line[256];
    while (std::fgets(line, sizeof line, out_)) {
      int p = 0;
      if (std::sscanf(line, "opd serve: port %d", &p) == 1) {
        port_ = p;
        break;
      }
    }
    if (port_ == 0) gave_up_ = true;
    watchdog.join();
    if (port_ == 0) {
      stop();  // the destructor does not run when the constructor throws
      OPD_FAIL(Io, "bench score: `", opd, " serve` did not report a port within ", timeout_s,
               " s (see its log above)");
    }
  }
  ~ServerChild() { stop(); }
  int port() const { return port_; }
  // SIGTERM, wait up to 30 s, then SIGKILL. Returns the exit status (-1 if killed).
  int stop() {
    if (pid_ <= 0) return exit_status_;
    kill(pid_, SIGTERM);
    int status = 0;
    for (int i = 0; i < 300; ++i) {
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        pid_ = -1;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      pid_ = -1;
      exit_status_ = -1;
    }
    if (out_) std::fclose(out_);
    out_ = nullptr;
    return exit_status_;
  }

 private:
  pid_t pid_ = -1;
  std::FILE* out_ = nullptr;
  std::atomic<int> port_{0};
  std::atomic<bool> gave_up_{false};
  int exit_status_ = -1;
};

std::string self_binary() {
  std::error_code ec;
  const auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("opd") : p.string();
}

void run_bench_score(const BenchScoreOptions& o) {
  namespace fs = std::filesystem;
  OPD_CHECK(o.iters >= 1 && o.warmup >= 0, InvalidArgument, "--iters >= 1 and --warmup >= 0");
  OPD_CHECK(o.prompt >= 1 && o.completion >= 1 && o.sequences >= 1, InvalidArgument,
            "--sequences, --prompt and --completion must be >= 1");
  const bool cuda = o.device == "cuda";
  OPD_CHECK(!cuda || device_hooks::cuda_device_count() > 0, Unsupported,
            "opd bench score --device cuda needs a CUDA device (none is usable here; --device cpu "
            "with a small shape runs on the CPU)");
  OPD_CHECK(o.num_generations >= 1 && o.sequences % o.num_generations == 0, InvalidArgument,
            "--num-generations ", o.num_generations, " must divide --sequences ", o.sequences);
  ModelConfig c = model_preset(o.preset);
  if (o.layers > 0) c.num_hidden_layers = o.layers;
  if (o.hidden > 0) c.hidden_size = o.hidden;
  if (o.intermediate > 0) c.intermediate_size = o.intermediate;
  if (o.heads > 0) c.num_attention_heads = o.heads;
  if (o.vocab > 0) c.vocab_size = o.vocab;
  OPD_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, InvalidArgument, "--heads ",
            c.num_attention_heads, " must be a multiple of the ", c.num_key_value_heads, " kv heads");
  const Device device = cuda ? Device::CUDA : Device::CPU;
  const SharedPromptMode shared_mode = parse_shared_prompt_mode(o.shared_prompt);
  OPD_CHECK(o.k >= 0 && o.k <= c.vocab_size, InvalidArgument, "--k ", o.k, " outside [0, ",
            c.vocab_size, "]");
  const std::string work =
      o.work_dir.empty() ? cat(fs::temp_directory_path().string(), "/opd_bench_score_", ::getpid())
                         : o.work_dir;
  struct Cleanup {  // the random teacher (~7 GB of f32) goes away even when the run fails
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      if (!dir.empty()) fs::remove_all(dir, ec);
    }
  } cleanup{o.work_dir.empty() && !o.keep ? work : ""};
  const std::string model_dir = work + "/teacher";
  fs::create_directories(model_dir);
  auto t0 = std::chrono::steady_clock::now();
  save_model_dir(model_dir, c, init_weights(c, o.seed, 0.02));
  log_info("bench score: random ", c.num_parameters(), "-parameter teacher written to ", model_dir,
           " in ", seconds_since(t0), " s");

  ScoreRequest q;
  q.k = o.k;
  q.temperature = o.temperature;
  const int64_t len = o.prompt + o.completion;
  for (int64_t s = 0; s < o.sequences; ++s) {
    ScoreSequence seq;
    // --num-generations N: sequences s of one group (s / N) share the group's prompt ids.
    const uint64_t prompt_stream = static_cast<uint64_t>(s / o.num_generations * o.num_generations);
    for (int64_t i = 0; i < len; ++i)
      seq.ids.push_back(static_cast<int32_t>(
          philox_u32(o.seed, 0x5c0e0000ull + (i < o.prompt ? prompt_stream : static_cast<uint64_t>(s)),
                     static_cast<uint64_t>(i)) %
          static_cast<uint64_t>(c.vocab_size)));
    seq.begin = o.prompt;
    seq.end = len;
    q.sequences.push_back(std::move(seq));
  }
  const double scored = static_cast<double>(q.num_rows());
  double forwarded = 0;
  for (const auto& s : q.sequences) forwarded += static_cast<double>(s.end - 1);
  const double flops = model_flops(c, q);

  // ---- in process
  ScoreResponse local;
  Timing in_proc;
  int64_t peak_bytes = 0;
  {
    t0 = std::chrono::steady_clock::now();
    std::unique_ptr<Scorer> scorer;
    if (cuda) {
      CudaScorer::Options so;
      so.max_batch_tokens = o.max_batch_tokens;
      so.vocab_tile = o.vocab_tile;
      so.row_chunk = o.row_chunk;
      so.shared_prompt.mode = shared_mode;
      so.context_prefill = o.context_prefill;
      scorer = std::make_unique<CudaScorer>(model_dir, so);
    } else {
      CpuScorer::Options so;
      so.max_batch_tokens = o.max_batch_tokens;
      so.vocab_tile = o.vocab_tile;
      so.row_chunk = o.row_chunk;
      so.shared_prompt.mode = shared_mode;
      scorer = std::make_unique<CpuScorer>(model_dir, so);
    }
    log_info("bench score: in-process ", o.device, " scorer ready in ", seconds_since(t0), " s");
    reset_peak_memory(device);
    in_proc = time_calls(o.warmup, o.iters, [&] { local = scorer->score(q); });
    peak_bytes = memory_stats(device).peak;
  }

  // ---- through a loopback server: one request (chunks 1), then chunked (--chunks)
  Timing served, served_whole;
  Agreement agree, agree_whole;
  int server_exit = 0;
  int64_t chunks_sent = 1;
  bool have_server = false;
  if (!o.no_server) {
    const std::string opd = o.opd_binary.empty() ? self_binary() : o.opd_binary;
    t0 = std::chrono::steady_clock::now();
    ServerChild server(opd, model_dir, o.device, o.shared_prompt, o.max_batch_tokens,
                       o.server_timeout_s);
    ClientOptions co;
    co.url = cat("http://127.0.0.1:", server.port());
    co.api = TeacherApi::Opd;
    co.loss.temperature = o.temperature;
    co.loss.mode = SupportMode::TopKTail;
    co.chunks = 1;
    co.min_chunk_rows = o.min_chunk_rows;
    ScoreResponse remote;
    {
      TeacherClient whole(co);  // GET /v1/models: the server is up and answering
      log_info("bench score: server on port ", server.port(), " ready in ", seconds_since(t0), " s");
      served_whole = time_calls(o.warmup, o.iters, [&] { remote = whole.score(q); });
      agree_whole = compare(local, remote);
    }
    co.chunks = o.chunks;
    TeacherClient client(co);
    served = time_calls(o.warmup, o.iters, [&] { remote = client.score(q); });
    chunks_sent = client.stats().chunks / std::max<int64_t>(1, client.stats().requests);
    agree = compare(local, remote);
    server_exit = server.stop();
    have_server = true;
  }

  const double s_in = in_proc.median_s;
  nlohmann::json j;
  j["bench"] = "score";
  j["preset"] = o.preset;
  j["device"] = o.device;
  j["layers"] = c.num_hidden_layers;
  j["hidden"] = c.hidden_size;
  j["intermediate"] = c.intermediate_size;
  j["heads"] = c.num_attention_heads;
  j["vocab"] = c.vocab_size;
  j["num_generations"] = o.num_generations;
  j["shared_prompt"] = o.shared_prompt;
  j["context_prefill"] = o.context_prefill;
  j["sequences"] = o.sequences;
  j["prompt"] = o.prompt;
  j["completion"] = o.completion;
  j["k"] = o.k;
  j["temperature"] = o.temperature;
  j["max_batch_tokens"] = o.max_batch_tokens;
  j["scored_tokens"] = scored;
  j["forwarded_tokens"] = forwarded;
  j["model_flops"] = flops;
  j["inprocess"] = {{"median_s", s_in},
                    {"all_s", in_proc.all_s},
                    {"scored_tokens_per_s", scored / s_in},
                    {"forwarded_tokens_per_s", forwarded / s_in},
                    {"tflops", flops / s_in / 1e12},
                    {"fraction_of_776_tflops", flops / s_in / kMeasuredPeak},
                    {"peak_device_bytes", peak_bytes}};
  if (have_server) {
    const double s_whole = served_whole.median_s;
    j["server_one_request"] = {{"median_s", s_whole},
                               {"all_s", served_whole.all_s},
                               {"time_ratio_to_inprocess", s_whole / s_in},
                               {"ids_equal_fraction", agree_whole.ids_equal},
                               {"max_abs_logprob_diff", agree_whole.max_abs_logprob_diff}};
    const double s_srv = served.median_s;
    j["server"] = {{"median_s", s_srv},
                   {"chunks", chunks_sent},
                   {"all_s", served.all_s},
                   {"scored_tokens_per_s", scored / s_srv},
                   {"forwarded_tokens_per_s", forwarded / s_srv},
                   {"time_ratio_to_inprocess", s_srv / s_in},
                   {"ids_equal_fraction", agree.ids_equal},
                   {"max_abs_logprob_diff", agree.max_abs_logprob_diff},
                   {"exit_status_after_sigterm", server_exit}};
  }
  j["goal_scored_tokens_per_s"] = kGoalTokensPerS;
  j["goal_server_within"] = 0.10;
  if (o.json) {
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("opd bench score: %s %s (%lld layers, hidden %lld, vocab %lld), %lld x (%lld prompt "
                "+ %lld scored), %lld generations per prompt, shared prompt %s%s, K %lld, T %g\n",
                o.device.c_str(), o.preset.c_str(), static_cast<long long>(c.num_hidden_layers),
                static_cast<long long>(c.hidden_size), static_cast<long long>(c.vocab_size),
                static_cast<long long>(o.sequences), static_cast<long long>(o.prompt),
                static_cast<long long>(o.completion), static_cast<long long>(o.num_generations),
                o.shared_prompt.c_str(),
                o.device == "cuda" ? (o.context_prefill ? " (context prefill)" : " (paged kernel)") : "",
                static_cast<long long>(o.k), o.temperature);
    std::printf("  in-process: %.4f s  %.0f scored tok/s  %.0f forwarded tok/s  %.1f TFLOP/s "
                "(%.1f%% of 776)  peak %.2f GiB\n",
                s_in, scored / s_in, forwarded / s_in, flops / s_in / 1e12,
                100 * flops / s_in / kMeasuredPeak, peak_bytes / 1073741824.0);
    if (have_server) {
      const double s_whole = served_whole.median_s;
      std::printf("  served, one request: %.4f s  %.0f scored tok/s  (%.3fx the in-process time)  "
                  "ids equal %.4f, max |dlogprob| %.2g\n",
                  s_whole, scored / s_whole, s_whole / s_in, agree_whole.ids_equal,
                  agree_whole.max_abs_logprob_diff);
      const double s_srv = served.median_s;
      std::printf("  served, %lld chunks:  %.4f s  %.0f scored tok/s  (%.3fx the in-process time)  "
                  "ids equal %.4f, max |dlogprob| %.2g, exit %d after SIGTERM\n",
                  static_cast<long long>(chunks_sent), s_srv, scored / s_srv, s_srv / s_in,
                  agree.ids_equal, agree.max_abs_logprob_diff, server_exit);
    }
    std::printf("  goal: >= %.0f scored tok/s in process, server within 10%%\n", kGoalTokensPerS);
  }
}

}  // namespace

void register_bench_score(CLI::App& bench) {
  auto o = std::make_shared<BenchScoreOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "score", "W1 teacher scoring: in process and through a loopback `opd serve` (one request, "
               "then chunked)");
  cmd->add_option("--preset", o->preset, "teacher shape (model/presets.h)")->default_val("qwen3-1.7b");
  cmd->add_option("--device", o->device, "cuda (bf16, the W1 measurement) | cpu (f32; use a small shape)")
      ->default_val("cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--layers", o->layers, "decoder layers (0 = the preset's)")->default_val(0);
  cmd->add_option("--hidden", o->hidden, "hidden size (0 = the preset's)")->default_val(0);
  cmd->add_option("--intermediate", o->intermediate, "MLP size (0 = the preset's)")->default_val(0);
  cmd->add_option("--heads", o->heads, "query heads of 128 dims (0 = the preset's)")->default_val(0);
  cmd->add_option("--vocab", o->vocab, "vocabulary (0 = the preset's)")->default_val(0);
  cmd->add_option("--num-generations", o->num_generations,
                  "consecutive sequences sharing one prompt (divides --sequences)")
      ->default_val(1);
  cmd->add_option("--shared-prompt", o->shared_prompt,
                  "scorer's shared-prompt mode, in process and in the server: auto | always | never")
      ->default_val("auto")
      ->check(CLI::IsMember({"auto", "always", "never"}));
  cmd->add_flag("--context-prefill,!--no-context-prefill", o->context_prefill,
                "in-process CUDA scorer: shared-prompt completions attend over the cached prompt "
                "on the tensor-core kernel instead of the paged kernel (default on; "
                "--no-context-prefill: the paged kernel)");
  cmd->add_option("--chunks", o->chunks,
                  "client chunks for the second served run (the first sends one request)")
      ->default_val(8)
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--min-chunk-rows", o->min_chunk_rows, "client: scored rows per chunk at least")
      ->default_val(2048);
  cmd->add_option("--sequences", o->sequences, "sequences per request")->default_val(64);
  cmd->add_option("--prompt", o->prompt, "prompt tokens per sequence (not scored)")->default_val(256);
  cmd->add_option("--completion", o->completion, "scored positions per sequence")->default_val(512);
  cmd->add_option("--k", o->k, "top-K per position")->default_val(64);
  cmd->add_option("--temperature", o->temperature, "scoring temperature")->default_val(1.0);
  cmd->add_option("--max-batch-tokens", o->max_batch_tokens, "tokens per forward batch")
      ->default_val(16384);
  cmd->add_option("--vocab-tile", o->vocab_tile, "ids per lm_head logit tile")->default_val(16384);
  cmd->add_option("--row-chunk", o->row_chunk, "scored rows per lm_head logit tile")->default_val(2048);
  cmd->add_option("--warmup", o->warmup, "untimed calls first")->default_val(1);
  cmd->add_option("--iters", o->iters, "timed calls (the median is reported)")->default_val(3);
  cmd->add_flag("--no-server", o->no_server, "skip the loopback server run");
  cmd->add_option("--opd-binary", o->opd_binary, "opd binary for the server (default: this one)");
  cmd->add_option("--server-timeout", o->server_timeout_s, "seconds to wait for the server to listen")
      ->default_val(600.0);
  cmd->add_option("--work-dir", o->work_dir, "where the random teacher is written (default: a temp dir, removed)");
  cmd->add_flag("--keep", o->keep, "keep the temporary teacher directory");
  cmd->add_option("--seed", o->seed, "weights and token ids")->default_val(1234);
  cmd->add_flag("--json", o->json, "print one JSON object");
  cmd->callback([o] { run_bench_score(*o); });
}

}  // namespace opd::cli
