// `opd bench w1`: the whole W1 optimizer step of BENCHMARKS.md, measured through the real
// trainer (train/trainer.h), not a re-implementation of it:
//   student Qwen3-0.6B shape, teacher Qwen3-1.7B shape (model/presets.h), random init (seeded,
//   normal std 0.02, written as model directories with the demo tokenizer), bf16 on one GPU;
//   64 prompts of 256 random token ids (a pre-tokenized JSONL, data/dataset.h `prompt_ids`);
//   lmbda 1: 512 completion tokens per prompt sampled from the student at T 1 (EOS ignored);
//   teacher top-K 64 on every completion position (in-process CUDA scorer); JSD beta 0.5, T 1,
//   topk+tail; micro-batches of 8; one AdamW step (lr 1e-5) per 64 sequences.
// The first `--warmup` steps are not counted; the per-phase times of the following `--steps`
// steps (the trainer's own metrics.jsonl: rollout, teacher scoring, student train, whole step)
// are reported as medians, with tokens/s, the training phase's MFU (6 N tokens + attention,
// against the measured 776 TFLOP/s bf16 GEMM rate) and the peak device memory of the run.
// The HF transformers anchor (tools/bench_w1_torch.py: TRL GKDTrainer's way) runs afterwards in
// the same command with --with-torch.
// Under `opd launch` (WORLD_SIZE > 1) it is a data-parallel run: rank 0 writes the models and
// prompts, the others wait for them; `--prompts` is the global batch; rank 0 prints.
// `opd bench w2` runs W1 on one GPU and then W1 per GPU on N GPUs (N x 64 prompts) under
// `opd launch`, and reports the scaling efficiency W1 step / W2 step (goal >= 95%).
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <map>
#include <string>
#include <vector>

#include "cli/bench_util.h"  // median
#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "core/philox.h"
#include "core/tensor.h"  // device_hooks::cuda_device_count
#include "model/init.h"
#include "model/presets.h"
#include "train/trainer.h"

namespace opd::cli {
namespace {

struct BenchW1Options {
  std::string student = "qwen3-0.6b", teacher = "qwen3-1.7b";
  int64_t layers = 0, teacher_layers = 0;  // 0 = the preset's
  int64_t prompts = 64, prompt_len = 256, completion_len = 512, k = 64, micro_batch = 8;
  int64_t num_generations = 1;  // opd train --num-generations (sequences = prompts x this)
  int warmup = 1, steps = 2;
  double kv_cache_gb = 8;
  bool recompute = false, offload_teacher = false;
  std::string recompute_granularity = "none";
  std::string loss_support = "topk+tail";  // W1's loss; full = the dense teacher in the loss
  double device_memory_budget_gb = 0;  // opd train --device-memory-budget
  int zero_stage = 1;  // under opd launch (data parallel)
  std::string tokenizer = "demo/tokenizer";
  std::string work_dir;
  bool keep = false, json = false, with_torch = false;
  std::string python = "python3", torch_script = "tools/bench_w1_torch.py";
  uint64_t seed = 1234;
};

constexpr double kMeasuredPeak = 776e12;  // bf16 GEMM 8192^3 on the lent H200 (BENCHMARKS.md)

// Writes a random model directory unless one with the same config is already there (a re-run
// with --work-dir reuses it).
void make_model(const std::string& dir, const ModelConfig& c, uint64_t seed,
                const std::string& tokenizer) {
  namespace fs = std::filesystem;
  if (fs::exists(dir + "/model.safetensors") && fs::exists(dir + "/config.json")) {
    std::ifstream f(dir + "/config.json");
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (text == model_config_to_json(c) + "\n") return;
  }
  log_info("bench w1: writing a random ", c.num_parameters(), "-parameter model to ", dir);
  save_model_dir(dir, c, init_weights(c, seed, 0.02), tokenizer);
}

void run_bench_w1(const BenchW1Options& o) {
  namespace fs = std::filesystem;
  OPD_CHECK(o.steps >= 1 && o.warmup >= 0, InvalidArgument, "--steps >= 1 and --warmup >= 0");
  OPD_CHECK(!o.with_torch || o.num_generations == 1, InvalidArgument, "--with-torch runs W1's "
            "anchor, one sample per prompt: leave --num-generations at 1");
  OPD_CHECK(device_hooks::cuda_device_count() > 0, Unsupported,
            "opd bench w1 needs a CUDA device (none is usable here)");
  OPD_CHECK(fs::exists(o.tokenizer + "/tokenizer.json"), InvalidArgument, "--tokenizer ",
            o.tokenizer, " has no tokenizer.json (run from the repository root, or pass the "
            "demo tokenizer's directory)");
  const char* rank_env = std::getenv("RANK");
  const int rank = rank_env ? std::atoi(rank_env) : 0;
  OPD_CHECK(rank == 0 || !o.work_dir.empty(), InvalidArgument,
            "opd bench w1 under opd launch needs --work-dir (a directory every rank sees)");
  const std::string work =
      o.work_dir.empty() ? cat(fs::temp_directory_path().string(), "/opd_bench_w1_", ::getpid())
                         : o.work_dir;
  fs::create_directories(work);
  const std::string ready = work + "/ready." + (std::getenv("MASTER_PORT") ? std::getenv("MASTER_PORT") : "0");
  // A temporary work directory (~10 GB of random weights) goes away even when the run fails.
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      if (!dir.empty()) fs::remove_all(dir, ec);
    }
  } cleanup{o.work_dir.empty() && !o.keep ? work : ""};
  ModelConfig sc = model_preset(o.student), tc = model_preset(o.teacher);
  if (o.layers > 0) sc.num_hidden_layers = o.layers;
  if (o.teacher_layers > 0) tc.num_hidden_layers = o.teacher_layers;
  OPD_CHECK(sc.vocab_size == tc.vocab_size, InvalidArgument, "student and teacher presets have "
            "different vocabularies");
  const std::string run = work + "/run";
  if (rank != 0) {  // rank 0 prepares the inputs
    const auto t0 = std::chrono::steady_clock::now();
    while (!fs::exists(ready)) {
      OPD_CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::minutes(20), Io,
                "bench w1: rank ", rank, " waited 20 min for rank 0's models (", ready, ")");
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  } else {
  make_model(work + "/student", sc, o.seed, o.tokenizer);
  make_model(work + "/teacher", tc, o.seed + 1, o.tokenizer);
  {  // prompts: random ids over the whole vocabulary, seeded
    std::ofstream f(work + "/prompts.jsonl", std::ios::binary | std::ios::trunc);
    for (int64_t p = 0; p < o.prompts; ++p) {
      nlohmann::json ids = nlohmann::json::array();
      for (int64_t i = 0; i < o.prompt_len; ++i)
        ids.push_back(static_cast<int64_t>(
            philox_uniform(o.seed, 0x77310000ull + static_cast<uint64_t>(p), static_cast<uint64_t>(i)) *
            static_cast<double>(sc.vocab_size)) % sc.vocab_size);
      f << nlohmann::json{{"prompt_ids", ids}}.dump() << "\n";
    }
    OPD_CHECK(f.good(), Io, "cannot write ", work, "/prompts.jsonl");
  }
  fs::remove_all(run);
  std::ofstream(ready) << "ready\n";
  }

  TrainOptions t;
  t.student = work + "/student";
  t.teacher = work + "/teacher";
  t.data = {work + "/prompts.jsonl"};
  t.out = run;
  t.device = "cuda";
  t.dtype = "bf16";
  t.recompute = o.recompute;
  t.zero_stage = o.zero_stage;
  t.recompute_granularity = o.recompute_granularity;
  t.offload_teacher = o.offload_teacher;
  t.device_memory_budget_gb = o.device_memory_budget_gb;
  t.lmbda = 1;
  t.beta = 0.5;
  t.loss_support = o.loss_support;
  t.kd_temperature = 1;
  t.teacher_top_k = o.k;
  t.temperature = 1;
  t.max_completion_length = o.completion_len;
  t.num_generations = o.num_generations;
  t.ignore_eos = true;
  t.kv_cache_gb = o.kv_cache_gb;
  t.batch_size = o.prompts;
  t.micro_batch_size = o.micro_batch;
  t.learning_rate = 1e-5;
  t.lr_scheduler_type = "constant";
  t.max_steps = o.warmup + o.steps;
  t.seed = o.seed;
  t.save_minutes = 0;
  t.save_at_end = false;
  t.resume = "never";
  t.tensorboard = false;
  t.eval_before = false;
  TrainResult r = train(t);
  OPD_CHECK(r.steps == t.max_steps, Internal, "bench w1: the run stopped at step ", r.steps);
  if (rank != 0) return;
  fs::remove(ready);

  // The trainer's metrics of the measured steps.
  std::vector<double> rollout, score, trainp, step, tokens;
  // The rollout's split (trainer metrics time/rollout/*), to tell where a slower rollout went.
  const char* kSplit[] = {"sync_wait_s", "prefill_s", "decode_forward_s", "sample_s", "host_s",
                          "fixed_s"};
  std::map<std::string, std::vector<double>> split;
  // Distributed runs: each phase's slowest and fastest rank (trainer metrics time/ranks_*).
  const char* kRanks[] = {"rollout_s", "score_s", "train_s", "step_s", "rollout/sync_wait_s"};
  std::map<std::string, std::vector<double>> ranks;
  int64_t peak = 0;
  // Each phase's peak over the measured steps (trainer metrics memory/peak_<phase>_bytes).
  const char* kPhases[] = {"rollout", "score", "train"};
  std::map<std::string, int64_t> phase_peak;
  std::string step_peaks;  // every step's phases, warm-up included (text output)
  std::ifstream mf(run + "/metrics.jsonl");
  std::string line;
  while (std::getline(mf, line)) {
    const auto m = nlohmann::json::parse(line);
    if (!m.contains("time/step_s")) continue;
    peak = std::max<int64_t>(peak, m.value("memory/peak_device_bytes", int64_t{0}));
    step_peaks += cat(step_peaks.empty() ? "" : "; ", "step ", m.value("step", int64_t{0}));
    for (const char* p : kPhases)
      step_peaks += cat(" ", p, " ", m.value(cat("memory/peak_", p, "_bytes"), int64_t{0}) >> 20);
    if (m.value("step", int64_t{0}) <= o.warmup) continue;
    for (const char* p : kPhases)
      phase_peak[p] = std::max(phase_peak[p], m.value(cat("memory/peak_", p, "_bytes"), int64_t{0}));
    rollout.push_back(m.value("time/rollout_s", 0.0));
    for (const char* k : kSplit) split[k].push_back(m.value(std::string("time/rollout/") + k, 0.0));
    for (const char* k : kRanks)
      for (const char* side : {"max", "min"}) {
        const std::string key = cat("time/ranks_", side, "/", k);
        if (m.contains(key)) ranks[key].push_back(m[key].get<double>());
      }
    score.push_back(m.value("time/score_s", 0.0));
    trainp.push_back(m.value("time/train_s", 0.0));
    step.push_back(m.value("time/step_s", 0.0));
    tokens.push_back(m.value("completion_tokens", 0.0));
  }
  OPD_CHECK(!step.empty(), Internal, "bench w1: no measured step in ", run, "/metrics.jsonl");
  const double n = median(tokens), rs = median(rollout), ss = median(score), ts = median(trainp),
               st = median(step);
  const double seq_len = static_cast<double>(o.prompt_len + o.completion_len);
  const double sequences = static_cast<double>(o.prompts * o.num_generations);
  const double flops =
      6.0 * static_cast<double>(sc.num_parameters()) * sequences * seq_len +
      3.0 * 2.0 * seq_len * seq_len * static_cast<double>(sc.head_dim * sc.num_attention_heads) *
          static_cast<double>(sc.num_hidden_layers) * sequences;
  const double mfu = flops / ts / kMeasuredPeak;
  const double peak_gib = static_cast<double>(peak) / (1024.0 * 1024 * 1024);
  const char* ws = std::getenv("WORLD_SIZE");
  // The memory setting the run used (--device-memory-budget may have chosen it).
  const auto cfg = nlohmann::json::parse(std::ifstream(run + "/config.json"), nullptr, false);
  const std::string recompute_used =
      cfg.is_object() ? (cfg.value("recompute", false) ? std::string("layer")
                                                       : cfg.value("recompute_granularity", std::string("none")))
                      : (o.recompute ? std::string("layer") : o.recompute_granularity);
  const bool offload_used = cfg.is_object() ? cfg.value("offload_teacher", false) : o.offload_teacher;
  nlohmann::json j = {{"bench", "w1"},
                      {"world_size", ws ? std::atoi(ws) : 1},
                      {"student", o.student},
                      {"teacher", o.teacher},
                      {"prompts", o.prompts},
                      {"num_generations", o.num_generations},
                      {"prompt_len", o.prompt_len},
                      {"completion_len", o.completion_len},
                      {"k", o.k},
                      {"recompute", recompute_used},
                      {"offload_teacher", offload_used},
                      {"loss_support", o.loss_support},
                      {"device_memory_budget_gb", o.device_memory_budget_gb},
                      {"zero_stage", o.zero_stage},
                      {"measured_steps", step.size()},
                      {"completion_tokens", n},
                      {"rollout_s", rs},
                      {"rollout_tok_s", rs > 0 ? n / rs : 0},
                      {"score_s", ss},
                      {"score_tok_s", ss > 0 ? n / ss : 0},
                      {"train_s", ts},
                      {"train_tok_s", ts > 0 ? sequences * seq_len / ts : 0},
                      {"train_mfu", mfu},
                      {"step_s", st},
                      {"peak_device_gib", peak_gib}};
  for (const char* k : kSplit) j[std::string("rollout_") + k] = median(split[k]);
  auto gib = [](int64_t b) { return static_cast<double>(b) / (1024.0 * 1024 * 1024); };
  for (const char* p : kPhases) j[cat("peak_", p, "_gib")] = gib(phase_peak[p]);
  for (const auto& [key, v] : ranks) j[key] = median(v);
  if (o.json) {
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("W1 step through opd train (%s student, %s teacher, %lld x (%lld + %lld) tokens, "
                "K %lld, micro-batch %lld%s), median of %zu steps after %d warm-up:\n",
                o.student.c_str(), o.teacher.c_str(),
                static_cast<long long>(o.prompts * o.num_generations),
                static_cast<long long>(o.prompt_len), static_cast<long long>(o.completion_len),
                static_cast<long long>(o.k), static_cast<long long>(o.micro_batch),
                (recompute_used != "none" ? cat(", recompute ", recompute_used) : std::string())
                    .append(offload_used ? ", teacher offloaded" : "")
                    .append(o.device_memory_budget_gb > 0
                                ? cat(" (chosen for --device-memory-budget ", o.device_memory_budget_gb, " GiB)")
                                : std::string())
                    .c_str(),
                step.size(), o.warmup);
    std::printf("  rollout          %8.3f s  %10.0f tok/s   (goal >= 40,000 tok/s)\n", rs, n / rs);
    std::printf("  teacher scoring  %8.3f s  %10.0f tok/s   (goal >= 200,000 tok/s)\n", ss, n / ss);
    std::printf("  student train    %8.3f s  MFU %5.1f%% of 776 TFLOP/s (goal >= 45%%)\n", ts,
                100 * mfu);
    std::printf("  whole step       %8.3f s   (goal <= 1.6 s; anchor 50.6 s)\n", st);
    std::printf("  peak device mem  %8.2f GiB (goal <= 16 GiB); measured steps' phases: rollout "
                "%.2f, scoring %.2f, train %.2f GiB\n",
                peak_gib, gib(phase_peak["rollout"]), gib(phase_peak["score"]),
                gib(phase_peak["train"]));
    std::printf("  phase peaks (MiB) %s\n", step_peaks.c_str());
  }
  if (o.with_torch) {
    std::fflush(stdout);
    const std::string cmd = cat(o.python, " ", o.torch_script, " --prompts ", o.prompts,
                                " --prompt-len ", o.prompt_len, " --completion-len ",
                                o.completion_len, " --k ", o.k, " --micro-batch ", o.micro_batch,
                                " --opd-step-s ", st);
    std::printf("running the HF transformers anchor: %s\n", cmd.c_str());
    std::fflush(stdout);
    const int rc = std::system(cmd.c_str());
    OPD_CHECK(rc == 0, Internal, "the PyTorch anchor failed (exit status ", rc, "): ", cmd);
  }
}

// The last JSON object a command prints on stdout (stderr passes through).
nlohmann::json run_json(const std::string& cmd) {
  std::printf("+ %s\n", cmd.c_str());
  std::fflush(stdout);
  FILE* p = ::popen(cmd.c_str(), "r");
  OPD_CHECK(p != nullptr, Io, "cannot run ", cmd);
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int rc = ::pclose(p);
  OPD_CHECK(rc == 0, Internal, "`", cmd, "` failed (status ", rc, ")");
  const size_t at = out.rfind("\n{");
  const std::string line = out.substr(at == std::string::npos ? 0 : at + 1);
  const auto j = nlohmann::json::parse(line, nullptr, false);
  OPD_CHECK(j.is_object(), Internal, "`", cmd, "` printed no JSON object: ", out);
  return j;
}

struct BenchW2Options {
  int nproc = 2;
  std::string work_dir = "/tmp/opd_bench_w2";
  bool recompute = false, json = false, offload_teacher = false;
  std::string recompute_granularity = "none";
  int warmup = 1, steps = 2;
  int zero_stage = 1;
};

void run_bench_w2(const BenchW2Options& o) {
  namespace fs = std::filesystem;
  OPD_CHECK(o.nproc >= 2, InvalidArgument, "--nproc must be >= 2");
  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  const std::string common = cat(" bench w1 --json --work-dir ", o.work_dir, " --warmup ", o.warmup,
                                 " --steps ", o.steps, o.recompute ? " --recompute" : "",
                                 " --recompute-granularity ", o.recompute_granularity,
                                 o.offload_teacher ? " --offload-teacher" : "",
                                 " --zero-stage ", o.zero_stage);
  const nlohmann::json w1 = run_json(cat(exe, common, " --prompts 64"));
  const nlohmann::json w2 = run_json(cat(exe, " launch --nproc-per-node ", o.nproc,
                                         " --master-port 0 --no-prefix -- ", exe, common,
                                         " --prompts ", 64 * o.nproc));
  const double eff = w1.at("step_s").get<double>() / w2.at("step_s").get<double>();
  nlohmann::json j = {{"bench", "w2"}, {"nproc", o.nproc}, {"w1", w1}, {"w2", w2},
                      {"scaling_efficiency", eff}};
  if (o.json) {
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("W2: W1 per GPU on %d GPUs (%d prompts per step) vs W1 on one GPU (64 prompts):\n",
              o.nproc, 64 * o.nproc);
  for (const char* k : {"rollout_s", "score_s", "train_s", "step_s"})
    std::printf("  %-10s  1 GPU %8.3f s   %d GPUs %8.3f s\n", k, w1.at(k).get<double>(), o.nproc,
                w2.at(k).get<double>());
  std::printf("  rollout split (rank 0; device time on CUDA):\n");
  for (const char* k : {"rollout_sync_wait_s", "rollout_prefill_s", "rollout_decode_forward_s",
                        "rollout_sample_s", "rollout_host_s", "rollout_fixed_s"})
    std::printf("    %-26s  1 GPU %8.4f s   %d GPUs %8.4f s\n", k, w1.value(k, 0.0), o.nproc,
                w2.value(k, 0.0));
  std::printf("  over the %d ranks (median of the steps' fastest / slowest rank):\n", o.nproc);
  for (const char* k : {"rollout_s", "score_s", "train_s", "step_s", "rollout/sync_wait_s"})
    std::printf("    %-26s  fastest %8.4f s   slowest %8.4f s\n", k,
                w2.value(cat("time/ranks_min/", k), 0.0), w2.value(cat("time/ranks_max/", k), 0.0));
  std::printf("  peak device memory: 1 GPU %.2f GiB, %d GPUs %.2f GiB per GPU\n",
              w1.at("peak_device_gib").get<double>(), o.nproc, w2.at("peak_device_gib").get<double>());
  std::printf("  scaling efficiency (W1 step / W2 step) %.1f%% (goal >= 95%%)\n", 100 * eff);
}

}  // namespace

void register_bench_w2(CLI::App& bench) {
  auto o = std::make_shared<BenchW2Options>();
  CLI::App* c = bench.add_subcommand(
      "w2", "W2: W1 per GPU on several GPUs (data parallel, ZeRO, under opd launch) against W1 "
            "on one GPU: per-phase times and scaling efficiency");
  c->add_option("--nproc", o->nproc, "GPUs (ranks)")->capture_default_str();
  c->add_option("--work-dir", o->work_dir, "random models, prompts and runs (kept, reused)")
      ->capture_default_str();
  c->add_option("--warmup", o->warmup, "steps not measured")->capture_default_str();
  c->add_option("--steps", o->steps, "measured steps")->capture_default_str();
  c->add_flag("--recompute", o->recompute, "per-layer activation recompute in the student");
  c->add_option("--zero-stage", o->zero_stage,
                "ZeRO stage of the N-GPU run: 1, or 2 (gradients reduce-scattered during the "
                "backward, overlapped)")
      ->check(CLI::IsMember({1, 2}))
      ->capture_default_str();
  c->add_option("--recompute-granularity", o->recompute_granularity, "student activation "
                "recompute: none | elementwise | layer (opd train's flag)")->capture_default_str();
  c->add_flag("--offload-teacher", o->offload_teacher, "the teacher on the GPU only while it "
              "scores (opd train's flag)");
  c->add_flag("--json", o->json, "print one JSON object");
  c->callback([o] { run_bench_w2(*o); });
}

void register_bench_w1(CLI::App& bench) {
  auto o = std::make_shared<BenchW1Options>();
  CLI::App* c = bench.add_subcommand(
      "w1", "W1: one whole on-policy distillation step (rollout, teacher top-K, fused JSD train, "
            "AdamW) on one GPU through opd train, per-phase times and peak memory");
  c->add_option("--student", o->student, "student shape (model preset)")->capture_default_str();
  c->add_option("--teacher", o->teacher, "teacher shape (model preset)")->capture_default_str();
  c->add_option("--layers", o->layers, "student layers (0 = the preset's)")->capture_default_str();
  c->add_option("--teacher-layers", o->teacher_layers, "teacher layers (0 = the preset's)")
      ->capture_default_str();
  c->add_option("--prompts", o->prompts, "prompts per step")->capture_default_str();
  c->add_option("--num-generations", o->num_generations, "student samples per prompt (opd "
                "train's flag; sequences per step = prompts x this; > 1 lets the teacher share "
                "each prompt's K/V across its samples)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  c->add_option("--prompt-len", o->prompt_len, "prompt tokens")->capture_default_str();
  c->add_option("--completion-len", o->completion_len, "completion tokens (EOS ignored)")
      ->capture_default_str();
  c->add_option("--k", o->k, "teacher top-K")->capture_default_str();
  c->add_option("--micro-batch", o->micro_batch, "sequences per forward/backward")
      ->capture_default_str();
  c->add_option("--warmup", o->warmup, "steps not measured")->capture_default_str();
  c->add_option("--steps", o->steps, "measured steps (median reported)")->capture_default_str();
  c->add_option("--kv-cache-gb", o->kv_cache_gb, "rollout KV cache budget")->capture_default_str();
  c->add_flag("--recompute", o->recompute, "per-layer activation recompute in the student");
  c->add_option("--zero-stage", o->zero_stage,
                "ZeRO stage when run data parallel under opd launch (1 or 2; ignored on one GPU)")
      ->check(CLI::IsMember({1, 2}))
      ->capture_default_str();
  c->add_option("--recompute-granularity", o->recompute_granularity, "student activation "
                "recompute: none | elementwise | layer (opd train's flag)")->capture_default_str();
  c->add_flag("--offload-teacher", o->offload_teacher, "the teacher on the GPU only while it "
              "scores (opd train's flag)");
  c->add_option("--loss-support", o->loss_support, "opd train's flag: topk+tail (W1) | topk | "
                "sampled | full (the teacher's dense logits inside the loss, no scoring phase)")
      ->capture_default_str();
  c->add_option("--device-memory-budget", o->device_memory_budget_gb, "GiB: the trainer picks "
                "the cheapest memory setting whose planned peak fits (opd train's flag; 0 = none; "
                "16 = W1's goal)")
      ->capture_default_str();
  c->add_option("--tokenizer", o->tokenizer, "tokenizer files for the random models")
      ->capture_default_str();
  c->add_option("--work-dir", o->work_dir, "where the random models, prompts and the run go "
                "(default: a temporary directory, removed afterwards; a given one is kept and its "
                "models reused)");
  c->add_flag("--keep", o->keep, "keep the temporary directory");
  c->add_option("--seed", o->seed, "seed of weights and prompts")->capture_default_str();
  c->add_flag("--json", o->json, "print one JSON object");
  c->add_flag("--with-torch", o->with_torch, "then run the HF transformers anchor "
              "(--torch-script) in the same command");
  c->add_option("--python", o->python, "python for the anchor")->capture_default_str();
  c->add_option("--torch-script", o->torch_script, "the anchor script")->capture_default_str();
  c->callback([o] { run_bench_w1(*o); });
}

}  // namespace opd::cli
