// `opd bench overlap`: can teacher scoring run beside the rollout? (docs/rollout.md "Rollout and
// teacher scoring at once"). W1's rollout (bench rollout's workload: Qwen3-0.6B shape, bf16, 64
// prompts x 256 random ids, 512 new tokens at T 1, EOS ignored) is bound by bandwidth and launch
// latency; W1's teacher scoring (Qwen3-1.7B shape, 64 x (256 + 512) tokens, top-64 on the 512
// completion positions) is bound by tensor-core FLOPs. This bench measures, on one GPU:
//   alone:      the rollout (median of --runs) and the whole W1 scoring request, each on the
//               whole GPU, and one chunk (--chunk-sequences of the 64 sequences) of scoring;
//   per split:  the GPU's SMs split into two groups (cuda::SmPartition, CUDA green contexts;
//               --teacher-sms lists group B's sizes; 0 = no split: the rollout on a high-priority
//               stream, the teacher on a low-priority one), then
//                 the rollout alone on group A, a scoring chunk alone on group B, and
//                 both at once: a thread scores chunks back to back on group B while the
//                 rollout runs on group A (and once more with the rollout on the whole GPU).
// Reported per configuration: the rollout's time, the chunks of scoring completed while it ran
// (as a share of the whole W1 request) and what W1's rollout + scoring would take if the
// teacher's share were done during the rollout and the rest after it on the whole GPU:
//   projected = rollout_with_teacher + (1 - share) x scoring_alone.
// Scoring whole sequences in chunks is the proxy for the teacher's work here (a streaming
// teacher would score completion tokens as they are sampled, with its own K/V cache); the
// FLOPs per scored row are the same.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli/bench_util.h"  // median, qwen3_06b, Rng, random_bf16_cuda_weights
#include "cli/commands.h"
#include "core/error.h"
#include "model/presets.h"
#include "model/transformer.h"
#include "rollout/engine.h"
#include "teacher/cuda_scorer.h"

#if defined(OPD_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "core/cuda/allocator.h"     // StreamScope, device_allocator
#include "core/cuda/sm_partition.h"
#include "core/cuda/stream.h"        // device_count, device_description
#include "kernels/cuda/gemm.h"       // gemm_set_stream_sm_count
#endif

namespace opd::cli {
namespace {

struct BenchOverlapOptions {
  std::string teacher_sms = "0,24,32,48";
  int64_t layers = 28, teacher_layers = 28;
  int64_t prompts = 64, prompt_len = 256, new_tokens = 512, k = 64;
  int64_t chunk_sequences = 8;
  int runs = 1;
  double kv_cache_gb = 8.0;
  uint64_t seed = 1234;
  bool json = false;
};

#if defined(OPD_WITH_CUDA)

using Clock = std::chrono::steady_clock;
double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::vector<int> parse_sms(const std::string& list) {
  std::vector<int> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    OPD_CHECK(!item.empty(), InvalidArgument, "--teacher-sms: empty item in '", list, "'");
    size_t used = 0;
    int v = -1;
    try {
      v = std::stoi(item, &used);
    } catch (...) {
      used = 0;
    }
    OPD_CHECK(used == item.size() && v >= 0, InvalidArgument, "--teacher-sms: '", item,
              "' is not a count of SMs (0 = no split)");
    out.push_back(v);
  }
  OPD_CHECK(!out.empty(), InvalidArgument, "--teacher-sms: no sizes given");
  return out;
}

// Teacher scoring of chunks back to back on `stream` until `stop`; the completion time of
// each chunk is recorded.
struct ChunkLoop {
  std::atomic<bool> stop{false};
  std::atomic<bool> started{false};
  std::vector<Clock::time_point> done;
  std::string error;
  void run(CudaScorer& scorer, const ScoreRequest& chunk, cudaStream_t stream) {
    try {
      cuda::StreamScope scope(stream);
      started = true;
      while (!stop.load()) {
        (void)scorer.score(chunk);
        done.push_back(Clock::now());
      }
    } catch (const std::exception& e) {
      error = e.what();
      started = true;
    }
  }
};

struct Row {
  std::string config;
  int sms_a = 0, sms_b = 0;
  double rollout_alone = 0, chunk_alone = 0;
  double rollout_with = 0, chunks = 0, share = 0, projected = 0;
  double rollout_all_with = 0, chunks_all = 0, share_all = 0, projected_all = 0;
};

void run_bench_overlap(const BenchOverlapOptions& o) {
  OPD_CHECK(cuda::device_count() > 0, Unsupported, "opd bench overlap needs a CUDA device");
  OPD_CHECK(o.prompts >= 1 && o.prompt_len >= 1 && o.new_tokens >= 1 && o.layers >= 1 &&
                o.teacher_layers >= 1 && o.runs >= 1 && o.k >= 1,
            InvalidArgument, "bench overlap: sizes and --runs must be >= 1");
  OPD_CHECK(o.chunk_sequences >= 1 && o.chunk_sequences <= o.prompts, InvalidArgument,
            "--chunk-sequences ", o.chunk_sequences, " outside [1, --prompts ", o.prompts, "]");
  const std::vector<int> splits = parse_sms(o.teacher_sms);
  const ModelConfig sc = qwen3_06b(o.layers);
  ModelConfig tc = model_preset("qwen3-1.7b");
  tc.num_hidden_layers = o.teacher_layers;
  OPD_CHECK(o.k <= tc.vocab_size, InvalidArgument, "--k ", o.k, " above the vocabulary");

  Transformer student(sc, random_bf16_cuda_weights(sc, o.seed));
  auto teacher = std::make_shared<const Transformer>(tc, random_bf16_cuda_weights(tc, o.seed + 7919));
  CudaScorer scorer(teacher, TeacherInfo{}, CudaScorer::Options{});

  Rng rng(o.seed + 17);
  std::vector<GenerationRequest> reqs(static_cast<size_t>(o.prompts));
  ScoreRequest whole;
  whole.k = o.k;
  for (size_t r = 0; r < reqs.size(); ++r) {
    GenerationRequest& q = reqs[r];
    for (int64_t p = 0; p < o.prompt_len; ++p)
      q.prompt.push_back(static_cast<int32_t>(rng.next() % static_cast<uint64_t>(sc.vocab_size)));
    q.sampling.temperature = 1.0;
    q.sampling.seed = o.seed + r;
    q.max_new_tokens = o.new_tokens;
    q.ignore_eos = true;
    ScoreSequence s;
    s.ids = q.prompt;
    for (int64_t p = 0; p < o.new_tokens; ++p)
      s.ids.push_back(static_cast<int32_t>(rng.next() % static_cast<uint64_t>(tc.vocab_size)));
    s.begin = o.prompt_len;
    s.end = o.prompt_len + o.new_tokens;
    whole.sequences.push_back(std::move(s));
  }
  ScoreRequest chunk;
  chunk.k = o.k;
  chunk.sequences.assign(whole.sequences.begin(), whole.sequences.begin() + o.chunk_sequences);
  const double chunk_share = static_cast<double>(o.chunk_sequences) / static_cast<double>(o.prompts);

  auto engine_options = [&](cudaStream_t stream) {
    EngineOptions eo;
    eo.kv_cache_bytes = static_cast<int64_t>(o.kv_cache_gb * (1ll << 30));
    eo.max_step_tokens = 2048;
    eo.cuda_stream = stream;
    return eo;
  };
  auto time_rollout = [&](RolloutEngine& engine) {
    std::vector<double> t;
    for (int i = 0; i < o.runs; ++i) {
      (void)engine.generate(reqs);
      t.push_back(engine.stats().seconds);
    }
    return median(t);
  };
  auto time_score = [&](const ScoreRequest& q, cudaStream_t stream, int iters) {
    cuda::StreamScope scope(stream);
    (void)scorer.score(q);  // warm-up: plans, workspace
    std::vector<double> t;
    for (int i = 0; i < iters; ++i) {
      const auto t0 = Clock::now();
      (void)scorer.score(q);
      t.push_back(seconds_between(t0, Clock::now()));
    }
    return median(t);
  };
  // The engine's rollout while chunks are scored on `teacher_stream` by a second thread: the rollout's
  // time and the chunks completed during it.
  auto together = [&](RolloutEngine& engine, cudaStream_t teacher_stream, double& chunks) {
    ChunkLoop loop;
    std::thread t([&] { loop.run(scorer, chunk, teacher_stream); });
    while (!loop.started.load()) std::this_thread::yield();
    const auto t0 = Clock::now();
    std::string rollout_error;
    try {
      (void)engine.generate(reqs);
    } catch (const std::exception& e) {
      rollout_error = e.what();
    }
    const auto t1 = Clock::now();
    loop.stop = true;
    t.join();
    OPD_CHECK(loop.error.empty(), Internal, "bench overlap: teacher thread: ", loop.error);
    OPD_CHECK(rollout_error.empty(), Internal, "bench overlap: rollout: ", rollout_error);
    chunks = static_cast<double>(std::count_if(loop.done.begin(), loop.done.end(),
                                               [&](Clock::time_point d) { return d >= t0 && d <= t1; }));
    return seconds_between(t0, t1);
  };

  const std::string device = cuda::device_description(0);
  if (!o.json)
    std::printf("opd bench overlap on %s\nstudent Qwen3-0.6B shape (%lld layers), teacher "
                "Qwen3-1.7B shape (%lld layers), bf16; %lld prompts x %lld + %lld tokens, top-%lld; "
                "teacher chunks of %lld sequences\n",
                device.c_str(), (long long)o.layers, (long long)o.teacher_layers, (long long)o.prompts,
                (long long)o.prompt_len, (long long)o.new_tokens, (long long)o.k,
                (long long)o.chunk_sequences);

  // Alone, on the whole GPU (the process's default streams).
  RolloutEngine full_engine(student, engine_options(nullptr), {});
  (void)full_engine.generate(reqs);  // warm-up
  const double rollout_full = time_rollout(full_engine);
  cuda::Stream full_stream;
  const double score_full = time_score(whole, full_stream.get(), o.runs);
  const double chunk_full = time_score(chunk, full_stream.get(), 3);
  if (!o.json)
    std::printf("alone on the whole GPU: rollout %.3f s, scoring %.3f s (rollout + scoring %.3f s), "
                "one chunk %.4f s\n",
                rollout_full, score_full, rollout_full + score_full, chunk_full);

  std::vector<Row> rows;
  for (int sms : splits) {
    Row r;
    std::unique_ptr<cuda::SmPartition> part;
    cudaStream_t sa = nullptr, sb = nullptr;
    cudaStream_t prio_a = nullptr, prio_b = nullptr;
    if (sms > 0) {
      part = std::make_unique<cuda::SmPartition>(0, sms);
      sa = part->stream_a();
      sb = part->stream_b();
      r.sms_a = part->sms_a();
      r.sms_b = part->sms_b();
      r.config = part->describe();
      cuda::gemm_set_stream_sm_count(sa, r.sms_a);
      cuda::gemm_set_stream_sm_count(sb, r.sms_b);
    } else {
      int lo = 0, hi = 0;
      OPD_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
      OPD_CUDA_CHECK(cudaStreamCreateWithPriority(&prio_a, cudaStreamNonBlocking, hi));
      OPD_CUDA_CHECK(cudaStreamCreateWithPriority(&prio_b, cudaStreamNonBlocking, lo));
      sa = prio_a;
      sb = prio_b;
      r.config = "no split: rollout high priority, teacher low priority";
    }
    {
      RolloutEngine engine(student, engine_options(sa), {});
      (void)engine.generate(reqs);  // warm-up on this stream
      r.rollout_alone = time_rollout(engine);
      r.chunk_alone = time_score(chunk, sb, 3);
      r.rollout_with = together(engine, sb, r.chunks);
      r.share = std::min(1.0, r.chunks * chunk_share);
      r.projected = r.rollout_with + (1.0 - r.share) * score_full;
    }
    if (sms > 0) {  // the rollout on the whole GPU, the teacher on its group
      r.rollout_all_with = together(full_engine, sb, r.chunks_all);
      r.share_all = std::min(1.0, r.chunks_all * chunk_share);
      r.projected_all = r.rollout_all_with + (1.0 - r.share_all) * score_full;
    }
    if (!o.json) {
      std::printf("%s\n  alone: rollout %.3f s, chunk %.4f s (%.2fx the whole GPU's)\n"
                  "  together: rollout %.3f s (%+.1f%%), %.0f chunks during it = %.0f%% of the "
                  "scoring -> rollout + scoring %.3f s (%+.3f s)\n",
                  r.config.c_str(), r.rollout_alone, r.chunk_alone, r.chunk_alone / chunk_full,
                  r.rollout_with, 100.0 * (r.rollout_with / rollout_full - 1.0), r.chunks,
                  100.0 * r.share, r.projected, r.projected - (rollout_full + score_full));
      if (sms > 0)
        std::printf("  rollout on the whole GPU, teacher on B: rollout %.3f s (%+.1f%%), %.0f "
                    "chunks = %.0f%% -> %.3f s (%+.3f s)\n",
                    r.rollout_all_with, 100.0 * (r.rollout_all_with / rollout_full - 1.0),
                    r.chunks_all, 100.0 * r.share_all, r.projected_all,
                    r.projected_all - (rollout_full + score_full));
      std::fflush(stdout);
    }
    if (sms > 0) {
      cuda::gemm_set_stream_sm_count(sa, 0);
      cuda::gemm_set_stream_sm_count(sb, 0);
    }
    for (cudaStream_t s : {prio_a, prio_b})
      if (s) {
        cuda::device_allocator().release_stream(s);
        OPD_CUDA_CHECK(cudaStreamDestroy(s));
      }
    rows.push_back(r);
  }

  nlohmann::json j;
  j["bench"] = "overlap";
  j["device"] = device;
  j["rollout_s"] = rollout_full;
  j["scoring_s"] = score_full;
  j["chunk_s"] = chunk_full;
  j["chunk_sequences"] = o.chunk_sequences;
  for (const Row& r : rows)
    j["configs"].push_back({{"config", r.config}, {"sms_a", r.sms_a}, {"sms_b", r.sms_b},
                            {"rollout_alone_s", r.rollout_alone}, {"chunk_alone_s", r.chunk_alone},
                            {"rollout_with_teacher_s", r.rollout_with}, {"chunks", r.chunks},
                            {"share", r.share}, {"projected_s", r.projected},
                            {"rollout_all_with_teacher_s", r.rollout_all_with},
                            {"chunks_all", r.chunks_all}, {"share_all", r.share_all},
                            {"projected_all_s", r.projected_all}});
  std::printf("%s\n", j.dump().c_str());
}

#else

void run_bench_overlap(const BenchOverlapOptions&) {
  OPD_FAIL(Unsupported, "opd bench overlap needs the CUDA backend (this build has none)");
}

#endif

}  // namespace

void register_bench_overlap(CLI::App& bench) {
  auto o = std::make_shared<BenchOverlapOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "overlap", "W1's rollout and teacher scoring at once on one GPU: the SMs split into two "
                 "groups (CUDA green contexts), the time each phase loses and the scoring hidden");
  cmd->add_option("--teacher-sms", o->teacher_sms,
                  "comma-separated SM counts for the teacher's group (rounded up by the driver; "
                  "0 = no split, two streams of different priority)")
      ->capture_default_str();
  cmd->add_option("--layers", o->layers, "student layers (28 = Qwen3-0.6B)")->capture_default_str();
  cmd->add_option("--teacher-layers", o->teacher_layers, "teacher layers (28 = Qwen3-1.7B)")
      ->capture_default_str();
  cmd->add_option("--prompts", o->prompts, "prompts (one sample each)")->capture_default_str();
  cmd->add_option("--prompt-len", o->prompt_len, "tokens per prompt (seeded random ids)")
      ->capture_default_str();
  cmd->add_option("--new-tokens", o->new_tokens, "tokens generated (and scored) per sequence")
      ->capture_default_str();
  cmd->add_option("--k", o->k, "teacher top-K per scored position")->capture_default_str();
  cmd->add_option("--chunk-sequences", o->chunk_sequences,
                  "sequences per teacher scoring call in the concurrent loop")
      ->capture_default_str();
  cmd->add_option("--runs", o->runs, "timed rollouts / whole scorings alone (median)")
      ->capture_default_str();
  cmd->add_option("--kv-cache-gb", o->kv_cache_gb, "rollout KV cache budget in GiB")
      ->capture_default_str();
  cmd->add_option("--seed", o->seed, "seed of weights, prompts and sampling")->capture_default_str();
  cmd->add_flag("--json", o->json, "print only the JSON line (default off)");
  cmd->callback([o] { run_bench_overlap(*o); });
}

}  // namespace opd::cli
