// `opd bench rollout`: the rollout phase of W1 (shared/BENCHMARKS.md) on one GPU: Qwen3-0.6B
// shape (vocab 151,936, hidden 1,024, 28 layers, 16/8 heads x 128, intermediate 3,072, tied
// embeddings, q/k norm, rope_theta 1e6, eps 1e-6), random init (seeded normal, std 0.02; norms
// 1), bf16; 64 prompts of 256 seeded random ids, 512 new tokens each at temperature 1 with EOS
// ignored, through RolloutEngine exactly as the trainer calls it. One warm-up rollout, then the
// median of --runs timed rollouts: tokens/s (generated tokens / s), seconds, decode-step time,
// achieved bandwidth (bytes a decode step must read: weights + the K/V of every context token,
// over the decode forward's time) against the 4.15 TB/s copy ceiling, peak device memory, and
// the engine's time split (prefill, decode forward, sampling, host scheduling).
// With --with-torch the transformers twin (tools/bench_rollout_torch.py: the same shape, random
// init, bf16, HF `generate` eager and with a static cache + torch.compile) runs afterwards in the
// same command and the ratios are printed.
//
// Bytes per decode step (the floor): weights 2 x params (the tied lm_head counted once; the
// embedding lookup reads B rows, not counted) + K/V: sum over sequences of context length x
// 2 x layers x kv heads x head_dim x 2 bytes. W1: 1.19 GB + 64 x 512 (average context) x
// 112 KiB = 3.76 GB.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/bench_util.h"  // median, qwen3_06b, Rng, run_twin
#include "cli/commands.h"
#include "core/error.h"
#include "core/tensor.h"
#include "model/config.h"
#include "model/paged_forward.h"  // parse_stages
#include "model/presets.h"
#include "model/transformer.h"
#include "model/weights.h"
#include "rollout/engine.h"

#if defined(OPD_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "core/cuda/allocator.h"
#include "core/cuda/stream.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/gemm.h"  // gemm_tune_records: what the decode GEMM tuning chose
#endif

namespace opd::cli {
namespace {

struct BenchRolloutOptions {
  int64_t prompts = 64;
  int64_t prompt_len = 256;
  int64_t new_tokens = 512;
  int64_t layers = 28;
  int64_t n = 1;
  double temperature = 1.0;
  uint64_t seed = 1234;
  int warmup = 1;
  int runs = 3;
  double kv_cache_gb = 8.0;
  int64_t block_size = 16;
  int64_t max_step_tokens = 2048;
  int64_t max_running = 256;
  bool no_graphs = false;
  bool no_fused = false;
  bool tuned_gemm = false;
  EngineOptions switches;  // the on/off CUDA engine switches of kSwitches, at their defaults
  bool keep_state = false;
  unsigned decode_linear_gemms = EngineOptions{}.cuda_decode_linear_gemms;
  std::string skip_stages;  // measurement only: PagedForward::parse_stages names
  bool json = false;
  bool with_torch = false;
  std::string python = "python3";
  std::string torch_script = "tools/bench_rollout_torch.py";
  std::string torch_modes = "eager,compiled";
};

// The engine's on/off CUDA switches: `--NAME` / `--no-NAME`, JSON key (NAME with '_'), the
// EngineOptions member, and what "on" does (the help adds the default).
struct Switch {
  const char* flag;
  const char* key;
  bool EngineOptions::*member;
  const char* help;
};
const Switch kSwitches[] = {
    {"cluster-sampler", "cluster_sampler", &EngineOptions::cuda_cluster_sampler,
     "sampling splits each row over a cluster of up to 8 CTAs; --no-cluster-sampler: one CTA "
     "per row, the kernel before"},
    {"pdl", "pdl", &EngineOptions::cuda_pdl,
     "decode steps launch opd's kernels that follow a kernel with programmatic dependent launch "
     "(same results)"},
    {"decode-linear", "decode_linear", &EngineOptions::cuda_decode_linear,
     "decode steps run the per-layer GEMMs named by --decode-linear-gemms on opd's decode linear "
     "(weights streamed under the PDL wait) instead of cuBLASLt; --no-decode-linear: cuBLASLt for "
     "all"},
    {"fresh-prefill", "fresh_prefill", &EngineOptions::cuda_fresh_prefill,
     "prompt chunks starting at position 0 attend with the tensor-core varlen attention instead "
     "of the paged kernel (bf16, head_dim 64/128)"},
    {"context-prefill", "context_prefill", &EngineOptions::cuda_context_prefill,
     "with --fresh-prefill: prompt chunks over cached context (prompts longer than "
     "--max-step-tokens) of >= 16 rows also attend on the tensor-core kernel, over their context "
     "K/V gathered from the cache"},
};

#if defined(OPD_WITH_CUDA)

constexpr double kCopyCeiling = 4.15e12;  // device-to-device copy, lent H200 (BENCHMARKS.md)

// Runs the transformers twin and returns its last JSON line (null when it failed). A non-zero
// exit status with a JSON line still counts: the twin reports each mode it could run.
nlohmann::json run_torch(const BenchRolloutOptions& o) {
  return run_twin({.python = o.python,
                   .script = o.torch_script,
                   .args = cat(" --json --prompts ", o.prompts, " --prompt-len ", o.prompt_len,
                               " --new-tokens ", o.new_tokens, " --layers ", o.layers,
                               " --temperature ", o.temperature, " --seed ", o.seed, " --modes ",
                               o.torch_modes),
                   .name = "transformers twin",
                   .quiet = o.json,
                   .require_success = false});
}

void run_bench_rollout(const BenchRolloutOptions& o) {
  const unsigned skip_stages = PagedForward::parse_stages(o.skip_stages);  // names first
  OPD_CHECK(cuda::device_count() > 0, Unsupported, "opd bench rollout needs a CUDA device");
  OPD_CHECK(o.prompts >= 1 && o.prompt_len >= 1 && o.new_tokens >= 1 && o.layers >= 1 &&
                o.runs >= 1 && o.warmup >= 0 && o.n >= 1,
            InvalidArgument, "bench rollout: prompts, prompt-len, new-tokens, layers, n, runs must be >= 1");
  const ModelConfig c = qwen3_06b(o.layers);
  const std::string device = cuda::device_description(0);
  const int64_t sequences = o.prompts * o.n, generated = sequences * o.new_tokens;

  // bf16 weights straight on the device: normal(0, 0.02) matrices, norms 1 (seeded per tensor).
  Transformer model(c, random_bf16_cuda_weights(c, o.seed));
  const int64_t params = model.weights().num_parameters();

  Rng rng(o.seed + 17);
  std::vector<GenerationRequest> reqs(static_cast<size_t>(o.prompts));
  for (size_t r = 0; r < reqs.size(); ++r) {
    GenerationRequest& q = reqs[r];
    for (int64_t p = 0; p < o.prompt_len; ++p)
      q.prompt.push_back(static_cast<int32_t>(rng.next() % static_cast<uint64_t>(c.vocab_size)));
    q.sampling.temperature = o.temperature;
    q.sampling.seed = o.seed + r;
    q.n = o.n;
    q.max_new_tokens = o.new_tokens;
    q.ignore_eos = true;
  }
  EngineOptions eo = o.switches;
  eo.kv_cache_bytes = static_cast<int64_t>(o.kv_cache_gb * (1ll << 30));
  eo.block_size = o.block_size;
  eo.max_step_tokens = o.max_step_tokens;
  eo.max_running = o.max_running;
  eo.cuda_graphs = !o.no_graphs;
  eo.cuda_fused = !o.no_fused;
  eo.cuda_tuned_gemm = o.tuned_gemm;
  eo.cuda_decode_linear_gemms = o.decode_linear_gemms;
  eo.cuda_skip_stages = skip_stages;
  eo.keep_device_state = o.keep_state;
  RolloutEngine engine(model, eo, {});

  // Floor bytes of the decode steps: every sequence in lockstep (EOS ignored, n samples share
  // the prompt but each reads its own view of it); decode step j (1..M-1) feeds token j, so a
  // sequence's context is P + j.
  const double kv_per_token = 2.0 * static_cast<double>(c.num_hidden_layers * c.num_key_value_heads *
                                                        c.head_dim) * 2.0;
  const double weight_bytes = 2.0 * static_cast<double>(params);
  double kv_bytes = 0;
  for (int64_t j = 1; j < o.new_tokens; ++j)
    kv_bytes += static_cast<double>(sequences) * static_cast<double>(o.prompt_len + j) * kv_per_token;

  struct Run {
    double s, prefill, decode_fwd, sample, host;
    int64_t steps, decode_steps, graph_steps, captures, preemptions;
  };
  std::vector<Run> runs;
  auto& alloc = cuda::device_allocator();
  if (!o.json) {
    std::printf("opd bench rollout on %s\n", device.c_str());
    std::printf("Qwen3-0.6B shape, %lld layers, bf16, %lld prompts x %lld tokens, n %lld, %lld new "
                "tokens, T %g, EOS ignored; block %lld, max_step_tokens %lld, kv cache %.1f GiB, "
                "graphs %s, fused layers %s, fresh prefill %s, context prefill %s, PDL %s, sampler %s\n",
                (long long)o.layers, (long long)o.prompts, (long long)o.prompt_len, (long long)o.n,
                (long long)o.new_tokens, o.temperature, (long long)o.block_size,
                (long long)o.max_step_tokens, o.kv_cache_gb, o.no_graphs ? "off" : "on",
                o.no_fused ? "off" : "on",
                eo.cuda_fresh_prefill ? "tensor-core attention" : "paged kernel",
                eo.cuda_context_prefill ? "tensor-core attention" : "paged kernel",
                eo.cuda_pdl ? "on" : "off",
                eo.cuda_cluster_sampler ? "cluster" : "one CTA per row");
  }
  if (eo.cuda_skip_stages != 0)
    std::fprintf(stderr, "warning: --skip-stages %s: decode steps leave those kernels out; the "
                 "times attribute a step, the samples are not the model's\n", o.skip_stages.c_str());
  std::vector<RequestOutput> last;
  for (int i = 0; i < o.warmup + o.runs; ++i) {
    if (i == o.warmup) {
      alloc.reset_peak();
      reset_peak_memory(Device::CUDA);
    }
    last = engine.generate(reqs);
    const EngineStats& st = engine.stats();
    Run r{st.seconds, st.prefill_seconds, st.decode_forward_seconds, st.sample_seconds,
          st.host_seconds, st.steps, st.decode_steps, st.graph_steps, st.graph_captures,
          st.preemptions};
    if (!o.json) {
      std::printf("  run %d%s: %.3f s, %.0f tok/s (prefill %.3f s, decode forward %.3f s, sampling "
                  "%.3f s, host %.3f s; %lld steps, %lld decode, %lld from graphs, %lld captures, "
                  "%lld preemptions)\n",
                  i, i < o.warmup ? " (warm-up)" : "", r.s, generated / r.s, r.prefill,
                  r.decode_fwd, r.sample, r.host, (long long)r.steps, (long long)r.decode_steps,
                  (long long)r.graph_steps, (long long)r.captures, (long long)r.preemptions);
      std::printf("         fixed costs: sync wait %.2f ms, kv alloc %.2f ms, %s %.2f ms, runner %.2f "
                  "ms, captures %.2f ms (%lld in place), teardown %.2f ms\n",
                  st.sync_wait_seconds * 1e3, st.kv_alloc_seconds * 1e3,
                  st.reused_device_state ? "refresh" : "pack", st.pack_seconds * 1e3,
                  st.runner_seconds * 1e3, st.capture_seconds * 1e3, (long long)st.graph_updates,
                  st.teardown_seconds * 1e3);
    }
    if (i >= o.warmup) runs.push_back(r);
  }
  int64_t produced = 0;
  for (const RequestOutput& ro : last)
    for (const SampleOutput& so : ro.samples) produced += static_cast<int64_t>(so.ids.size());
  OPD_CHECK(produced == generated, Internal, "bench rollout: ", produced, " tokens generated, expected ",
            generated);
  auto med = [&](double Run::*f) {
    std::vector<double> v;
    for (const Run& r : runs) v.push_back(r.*f);
    return median(v);
  };
  const double s = med(&Run::s), prefill = med(&Run::prefill), fwd = med(&Run::decode_fwd),
               smp = med(&Run::sample), host = med(&Run::host);
  const int64_t decode_steps = runs.back().decode_steps;
  const double step_ms = decode_steps > 0 ? (fwd + smp) / decode_steps * 1e3 : 0;
  const double fwd_ms = decode_steps > 0 ? fwd / decode_steps * 1e3 : 0;
  const double bytes = weight_bytes * static_cast<double>(decode_steps) + kv_bytes;
  const double bw = fwd > 0 ? bytes / fwd : 0;
  const double floor_s = bytes / kCopyCeiling;
  const cuda::AllocatorStats as = alloc.stats();

  nlohmann::json j;
  j["bench"] = "rollout";
  j["device"] = device;
  j["layers"] = o.layers;
  j["prompts"] = o.prompts;
  j["prompt_len"] = o.prompt_len;
  j["n"] = o.n;
  j["new_tokens"] = o.new_tokens;
  j["temperature"] = o.temperature;
  j["graphs"] = !o.no_graphs;
  j["fused"] = !o.no_fused;
  j["tuned_gemm"] = o.tuned_gemm;
  for (const Switch& w : kSwitches) j[w.key] = o.switches.*w.member;
  j["keep_state"] = o.keep_state;
  j["decode_linear_gemms"] = o.decode_linear_gemms;
  j["skip_stages"] = o.skip_stages;
  j["max_step_tokens"] = o.max_step_tokens;
  j["params"] = params;
  j["generated_tokens"] = generated;
  j["seconds"] = s;
  j["seconds_all"] = [&] {
    std::vector<double> v;
    for (const Run& r : runs) v.push_back(r.s);
    return v;
  }();
  j["tokens_per_s"] = generated / s;
  j["goal_tokens_per_s"] = 40000;
  j["prefill_s"] = prefill;
  j["decode_forward_s"] = fwd;
  j["sampling_s"] = smp;
  j["host_s"] = host;
  j["decode_steps"] = decode_steps;
  j["decode_step_ms"] = step_ms;
  j["decode_forward_step_ms"] = fwd_ms;
  j["sampling_step_ms"] = decode_steps > 0 ? smp / decode_steps * 1e3 : 0;
  j["steps"] = runs.back().steps;
  j["graph_steps"] = runs.back().graph_steps;
  j["graph_captures"] = runs.back().captures;
  j["preemptions"] = runs.back().preemptions;
  j["decode_bytes"] = bytes;
  j["weight_bytes_per_step"] = weight_bytes;
  j["kv_bytes_per_step_avg"] = decode_steps > 0 ? kv_bytes / decode_steps : 0;
  j["achieved_bytes_per_s"] = bw;
  j["fraction_of_copy_ceiling"] = bw / kCopyCeiling;
  j["decode_floor_s"] = floor_s;
  j["peak_in_use_bytes"] = as.peak_in_use;
  j["peak_reserved_bytes"] = as.peak_reserved;
  if (!o.json) {
    std::printf("\nopd: %.3f s (median of %d), %.0f tokens/s (goal >= 40,000)\n", s, o.runs,
                generated / s);
    std::printf("     split: prefill %.3f s, decode forward %.3f s, sampling %.3f s, host %.3f s\n",
                prefill, fwd, smp, host);
    std::printf("     decode step %.3f ms (forward %.3f ms + sampling %.3f ms) x %lld steps\n",
                step_ms, fwd_ms, decode_steps > 0 ? smp / decode_steps * 1e3 : 0,
                (long long)decode_steps);
    std::printf("     decode reads %.2f GB/step (weights %.2f GB + KV %.2f GB avg): %.2f TB/s = %.0f%% "
                "of the 4.15 TB/s copy ceiling (floor %.3f s)\n",
                bytes / std::max<int64_t>(1, decode_steps) / 1e9, weight_bytes / 1e9,
                kv_bytes / std::max<int64_t>(1, decode_steps) / 1e9, bw / 1e12,
                100 * bw / kCopyCeiling, floor_s);
    std::printf("     peak device memory: %.2f GiB in use, %.2f GiB reserved (allocator)\n",
                as.peak_in_use / 1073741824.0, as.peak_reserved / 1073741824.0);
    for (const cuda::GemmTuneRecord& t : cuda::gemm_tune_records())
      std::printf("     tuned GEMM m %lld n %lld k %lld: %d candidates, heuristic %.1f us -> %.1f us "
                  "(candidate %d, split-K %d)\n",
                  (long long)t.m, (long long)t.n, (long long)t.k, t.candidates, t.heuristic_us,
                  t.best_us, t.best_index, t.split_k);
  }
  if (o.with_torch) {
    cuda::device_allocator().empty_cache();  // the twin gets the memory back
    nlohmann::json t = run_torch(o);
    j["torch"] = t;
    if (t.is_object()) {
      for (const char* mode : {"eager", "compiled"}) {
        if (!t.contains(mode) || !t[mode].is_object() || !t[mode].contains("seconds")) continue;
        const double ts = t[mode]["seconds"].get<double>();
        j[cat("speedup_vs_torch_", mode)] = ts / s;
        if (!o.json)
          std::printf("opd vs transformers generate (%s): %.3f s vs %.3f s, %.1fx\n", mode, s, ts,
                      ts / s);
      }
    }
  }
  std::printf("%s\n", j.dump().c_str());
}

#else

void run_bench_rollout(const BenchRolloutOptions&) {
  OPD_FAIL(Unsupported, "opd bench rollout needs the CUDA backend (this build has none)");
}

#endif

}  // namespace

void register_bench_rollout(CLI::App& bench) {
  auto o = std::make_shared<BenchRolloutOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "rollout", "W1 rollout phase (Qwen3-0.6B shape, bf16, 64 x 256-token prompts, 512 new "
                 "tokens at T 1) through the rollout engine on CUDA");
  cmd->add_option("--prompts", o->prompts, "prompts")->capture_default_str();
  cmd->add_option("--prompt-len", o->prompt_len, "tokens per prompt (seeded random ids)")
      ->capture_default_str();
  cmd->add_option("--new-tokens", o->new_tokens, "tokens generated per sample (EOS ignored)")
      ->capture_default_str();
  cmd->add_option("--n", o->n, "samples per prompt")->capture_default_str();
  cmd->add_option("--layers", o->layers, "decoder layers (28 = Qwen3-0.6B)")->capture_default_str();
  cmd->add_option("--temperature", o->temperature, "sampling temperature (0 = greedy)")
      ->capture_default_str();
  cmd->add_option("--seed", o->seed, "seed of weights, prompts and sampling")->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "untimed rollouts first")->capture_default_str();
  cmd->add_option("--runs", o->runs, "timed rollouts (median reported)")->capture_default_str();
  cmd->add_option("--kv-cache-gb", o->kv_cache_gb, "KV cache budget in GiB")->capture_default_str();
  cmd->add_option("--block-size", o->block_size, "tokens per KV block")->capture_default_str();
  cmd->add_option("--decode-linear-gemms", o->decode_linear_gemms,
                  "with --decode-linear: which per-layer GEMMs run on it, a bit mask (1 q|k|v, 2 o, "
                  "4 gate|up, 8 down; 11 = q|k|v, o and down, the three it wins on the H200)")
      ->capture_default_str();
  cmd->add_option("--skip-stages", o->skip_stages,
                  cat("measurement only: decode steps leave out these per-layer kernels, a comma "
                      "list of ", PagedForward::stage_names(), "; the step's time without them "
                      "attributes its time to stages (the samples are then not the model's; "
                      "default none)"));
  cmd->add_option("--max-step-tokens", o->max_step_tokens, "tokens per step (prefill chunk budget)")
      ->capture_default_str();
  cmd->add_option("--max-running", o->max_running, "sequences in the running batch")
      ->capture_default_str();
  cmd->add_flag("--no-graphs", o->no_graphs, "run decode steps eagerly instead of from CUDA graphs (default off)");
  cmd->add_flag("--no-fused", o->no_fused,
                "plain op sequence per layer (18 kernels) instead of the fused one (10) (default off)");
  cmd->add_flag("--tuned-gemm", o->tuned_gemm,
                "decode GEMMs take the fastest measured cuBLASLt algorithm instead of the "
                "heuristic's first (default off)");
  for (const Switch& w : kSwitches)
    cmd->add_flag(cat("--", w.flag, ",!--no-", w.flag), o->switches.*w.member,
                  cat(w.help, " (default ", EngineOptions{}.*w.member ? "on" : "off", ")"));
  cmd->add_flag("--keep-state", o->keep_state,
                "keep packed weights, buffers and graphs between rollouts instead of rebuilding "
                "them in every rollout (default off)");
  cmd->add_flag("--json", o->json, "print only the JSON line (default off)");
  cmd->add_flag("--with-torch", o->with_torch,
                "also run the transformers twin (tools/bench_rollout_torch.py) and print the "
                "ratios (default off)");
  cmd->add_option("--python", o->python, "python interpreter for --with-torch")->capture_default_str();
  cmd->add_option("--torch-script", o->torch_script,
                  "the twin's path (relative paths resolve under $OPD_SOURCE_DIR when set)")
      ->capture_default_str();
  cmd->add_option("--torch-modes", o->torch_modes,
                  "twin modes, comma-separated: eager (HF generate, dynamic cache), compiled "
                  "(static cache + torch.compile)")
      ->capture_default_str();
  cmd->callback([o] { run_bench_rollout(*o); });
}

}  // namespace opd::cli
