// `opd bench train`: the student training phase of W1 (shared/BENCHMARKS.md) on one GPU:
// Qwen3-0.6B shape (vocab 151,936, hidden 1,024, 28 layers, 16/8 heads x 128, intermediate
// 3,072, tied embeddings, q/k norm), random init (seeded normal, std 0.02; norms 1), bf16
// weights and activations, f32 master weights, gradients and moments; 64 sequences of 256 prompt
// + 512 completion tokens in micro-batches of 8; per micro-batch: forward_hidden over the packed
// batch, the fused lm_head + JSD (beta 0.5, T 1, topk+tail, K 64, synthetic but valid teacher
// top-K) on the 512 completion rows of each sequence, backward; then one CUDA AdamW step with
// global-norm clipping. Warm-up steps, then timed steps: s/step, tokens/s, MFU, per-phase
// times (CUDA events: no sync inside a step beyond the loss's own read-back of its sums),
// peak device memory. With --with-torch the PyTorch twin (tools/bench_train_torch.py: HF
// transformers Qwen3, same config, bf16, sdpa, dense logits + the same JSD, fused AdamW) runs
// afterwards in the same command and the ratio is printed.
//
// MFU = model FLOPs / time / peak, model FLOPs = 6 N tokens + attention (causal, fwd + 2x bwd:
// 3 x 2 S^2 D Hq per layer and sequence), N = parameters incl. the tied embedding (its lm_head
// product is real work; the embedding lookup is not, which the tokens the loss skips roughly
// offset). Reported against the measured bf16 GEMM ceiling (776 TFLOP/s, the goal of
// >= 45% uses it) and against the H200's dense bf16 spec (989 TFLOP/s). Recompute's extra
// forward is not model work: it lowers MFU, as it should.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
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
#include "loss/fused_loss.h"
#include "loss/loss_config.h"
#include "loss/teacher_payload.h"
#include "model/config.h"
#include "model/presets.h"
#include "model/transformer.h"
#include "model/weights.h"
#include "train/optimizer.h"

#if defined(OPD_WITH_CUDA)
#include "core/cuda/allocator.h"
#include "core/cuda/stream.h"
#include "kernels/cuda/cuda_ops.h"
#include "loss/fused_loss_cuda.h"
#endif

namespace opd::cli {
namespace {

struct BenchTrainOptions {
  int64_t sequences = 64;
  int64_t micro_batch = 8;
  int64_t prompt = 256;
  int64_t completion = 512;
  int64_t layers = 28;
  int64_t k = 64;
  double beta = 0.5;
  double temperature = 1.0;
  std::string mode = "topk+tail";
  double lr = 1e-5;
  double max_grad_norm = 1.0;
  uint64_t seed = 1234;
  int warmup = 1;
  int steps = 3;
  bool recompute = false;
  std::string recompute_granularity = "none";
  bool json = false;
  bool with_torch = false;
  std::string python = "python3";
  std::string torch_script = "tools/bench_train_torch.py";
  std::string torch_params = "fp32-autocast";
  std::string loss_tile = "bf16";
};

#if defined(OPD_WITH_CUDA)

constexpr double kMeasuredPeak = 776e12;  // bf16 GEMM 8192^3 on the lent H200 (BENCHMARKS.md)
constexpr double kSpecPeak = 989e12;      // H200 dense bf16 spec

struct Flops {
  double dense = 0, attention = 0;
  double total() const { return dense + attention; }
};
Flops model_flops(const ModelConfig& c, int64_t params, int64_t sequences, int64_t seq_len) {
  Flops f;
  const double tokens = static_cast<double>(sequences * seq_len);
  f.dense = 6.0 * static_cast<double>(params) * tokens;
  const double s = static_cast<double>(seq_len);
  f.attention = 3.0 * 2.0 * s * s * static_cast<double>(c.head_dim * c.num_attention_heads) *
                static_cast<double>(c.num_hidden_layers * sequences);
  return f;
}

// One micro-batch's inputs, on the device before the timed steps (as a real step has them
// from rollout and teacher scoring).
struct MicroBatch {
  Batch batch;       // host (the model uploads ids/positions once per forward)
  Tensor targets;    // i32 [N] the completion token each loss row predicts
  Tensor weights;    // f32 [N] ones
  TeacherTopK teacher;
};

struct PhaseTimes {
  double forward_ms = 0, loss_ms = 0, backward_ms = 0, optimizer_ms = 0, step_ms = 0;
};

struct OpdResult {
  PhaseTimes median;
  std::vector<double> step_ms;
  double loss = 0, grad_norm = 0;
  int64_t params = 0;
  int64_t peak_in_use = 0, peak_reserved = 0, peak_tensors = 0;
};

OpdResult run_opd(const BenchTrainOptions& o, const ModelConfig& c) {
  const int64_t S = o.prompt + o.completion, B = o.micro_batch, T = B * S, N = B * o.completion;
  const int64_t H = c.hidden_size, V = c.vocab_size, K = o.k;
  const int64_t micro_batches = o.sequences / o.micro_batch;
  cudaStream_t stream = cuda::current_stream();

  // Master weights (f32, device): normal(0, 0.02) matrices, norms 1. Then the bf16 model copy.
  ModelWeights master = zeros_weights(c, DType::F32, Device::CUDA);
  uint64_t seed = o.seed;
  master.for_each([&](const std::string& name, Tensor& t) {
    const bool norm = t.ndim() == 1;
    if (norm) cuda::fill_uniform(t.raw(), t.numel(), DType::F32, seed++, 1.0f, 1.0f, stream);
    else cuda::fill_normal(t.raw(), t.numel(), DType::F32, seed++, 0.0f, 0.02f, stream);
  });
  Transformer model(c, weights_to(master, Device::CUDA, DType::BF16));
  model.set_recompute(o.recompute ? Recompute::PerLayer : parse_recompute(o.recompute_granularity));
  ModelWeights grads = zeros_weights(c, DType::F32, Device::CUDA);
  std::vector<Tensor> mt, gt, bt;
  master.for_each([&](const std::string&, Tensor& t) { mt.push_back(t); });
  grads.for_each([&](const std::string&, Tensor& t) { gt.push_back(t); });
  model.weights().for_each([&](const std::string&, Tensor& t) { bt.push_back(t); });
  std::vector<OptimParam> params;
  for (size_t i = 0; i < mt.size(); ++i) params.push_back({mt[i], gt[i], bt[i]});
  AdamWConfig ac;
  ac.weight_decay = 0.0;  // TRL's default
  AdamW adamw(std::move(params), ac);

  LossConfig cfg;
  cfg.mode = parse_support_mode(o.mode);
  cfg.beta = o.beta;
  cfg.temperature = o.temperature;
  check_loss_config(cfg);

  // Loss rows: position p of a sequence predicts token p + 1, so the completion tokens
  // [prompt, S) are predicted by rows [prompt - 1, S - 1). inverse: packed row -> loss row.
  std::vector<int32_t> rows(static_cast<size_t>(N)), inverse(static_cast<size_t>(T), -1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < o.completion; ++j) {
      const int64_t r = b * S + o.prompt - 1 + j, i = b * o.completion + j;
      rows[i] = static_cast<int32_t>(r);
      inverse[r] = static_cast<int32_t>(i);
    }
  const Tensor rows_d = Tensor::from_vector(rows, {N}).to(Device::CUDA);
  const Tensor inverse_d = Tensor::from_vector(inverse, {T}).to(Device::CUDA);

  // Inputs: random token ids; the teacher's top-K is K distinct ids per row with log-probs
  // decreasing from -3 (a valid distribution with a tail), checked on the host like a real
  // payload, then copied.
  Rng rng(o.seed + 17);
  std::vector<MicroBatch> mbs(static_cast<size_t>(micro_batches));
  for (MicroBatch& mb : mbs) {
    std::vector<std::vector<int32_t>> seqs(static_cast<size_t>(B));
    for (auto& s : seqs)
      for (int64_t p = 0; p < S; ++p) s.push_back(static_cast<int32_t>(rng.next() % V));
    mb.batch = make_batch(seqs, V);
    TeacherTopK t;
    t.rows = N;
    t.k = K;
    t.ids = Tensor::empty({N, K}, DType::I32);
    t.logprobs = Tensor::empty({N, K}, DType::F32);
    t.actual_logprobs = Tensor::empty({N}, DType::F32);
    t.valid = Tensor::empty({N}, DType::I32);
    Tensor targets = Tensor::empty({N}, DType::I32), weights = Tensor::empty({N}, DType::F32);
    for (int64_t i = 0; i < N; ++i) {
      const int64_t r = rows[i];
      const int32_t target = mb.batch.ids.data<int32_t>()[r + 1];
      targets.data<int32_t>()[i] = target;
      weights.data<float>()[i] = 1.0f;
      // Distinct ids: j * stride < V for j < K.
      const int64_t stride = 1 + static_cast<int64_t>(rng.next() % std::max<int64_t>(1, (V - 1) / K));
      const int64_t base = static_cast<int64_t>(rng.next() % V);
      // a_j = -3 - decay * j, decay in [0.06, 0.16]: top-K mass 0.34-0.84 (< 1: a tail).
      const double decay = 0.06 + 0.1 * rng.uniform();
      for (int64_t j = 0; j < K; ++j) {
        t.ids.data<int32_t>()[i * K + j] = static_cast<int32_t>((base + j * stride) % V);
        t.logprobs.data<float>()[i * K + j] = static_cast<float>(-3.0 - decay * j);
      }
      t.actual_logprobs.data<float>()[i] = -4.0f;
      t.valid.data<int32_t>()[i] = 1;
    }
    // The checks the payload validator makes where a real payload enters: ids in range,
    // finite log-probs whose mass is below 1 (the tail atom is positive).
    for (int64_t i = 0; i < N; ++i) {
      double mass = 0;
      for (int64_t j = 0; j < K; ++j) {
        const int32_t id = t.ids.data<int32_t>()[i * K + j];
        OPD_CHECK(id >= 0 && id < V, Internal, "bench train: teacher id ", id);
        mass += std::exp(static_cast<double>(t.logprobs.data<float>()[i * K + j]));
      }
      OPD_CHECK(mass < 1.0, Internal, "bench train: teacher top-K mass ", mass);
    }
    mb.teacher = cuda::teacher_to_device(t);
    mb.targets = targets.to(Device::CUDA);
    mb.weights = weights.to(Device::CUDA);
  }
  const double n_total = static_cast<double>(o.sequences * o.completion);
  cuda::CudaLossOptions loss_opt;
  OPD_CHECK(o.loss_tile == "bf16" || o.loss_tile == "f32", InvalidArgument,
            "bench train: --loss-tile must be bf16 or f32, got ", o.loss_tile);
  loss_opt.tile_dtype = o.loss_tile == "bf16" ? DType::BF16 : DType::F32;
  loss_opt.tile_budget_bytes = kTrainingLossTileBudgetBytes;  // as opd train

  OpdResult res;
  res.params = master.num_parameters();
  std::vector<PhaseTimes> timed;
  auto& alloc = cuda::device_allocator();
  alloc.reset_peak();
  reset_peak_memory(Device::CUDA);
  for (int step = 0; step < o.warmup + o.steps; ++step) {
    // Events: start, then per micro-batch 3 (after forward, loss, backward), then the optimizer.
    std::vector<std::unique_ptr<cuda::Event>> ev;
    auto mark = [&] {
      ev.push_back(std::make_unique<cuda::Event>());
      ev.back()->record(stream);
    };
    const auto t0 = std::chrono::steady_clock::now();
    mark();
    double loss = 0;
    for (MicroBatch& mb : mbs) {
      ForwardCache cache;
      Tensor hidden = model.forward_hidden(mb.batch, &cache);
      mark();
      Tensor hc = Tensor::empty({N, H}, DType::BF16, Device::CUDA);
      cuda::gather_rows(hidden.raw(), DType::BF16, T, rows_d.data<int32_t>(), N, H, hc.raw(),
                        DType::BF16, stream);
      FusedLossArgs a;
      a.hidden = hc;
      a.lm_head = model.weights().lm_head;
      a.targets = mb.targets;
      a.weights = mb.weights;
      a.teacher = &mb.teacher;
      a.n_total = n_total;
      Tensor d_hc = Tensor::empty({N, H}, DType::F32, Device::CUDA);
      // Tied: the lm_head gradient is the embedding's gradient (one f32 tensor).
      LossResult lr = cuda::fused_lm_head_loss_cuda(cfg, a, &d_hc, &grads.lm_head, loss_opt, stream);
      loss += lr.loss;
      hc = Tensor();
      Tensor dh = Tensor::empty({T, H}, DType::BF16, Device::CUDA);
      cuda::gather_rows(d_hc.raw(), DType::F32, N, inverse_d.data<int32_t>(), T, H, dh.raw(),
                        DType::BF16, stream);  // scatter back: prompt rows get 0
      d_hc = Tensor();
      mark();
      model.backward_hidden(mb.batch, cache, dh, grads);
      mark();
    }
    StepReport rep = adamw.step(o.lr, o.max_grad_norm);
    for (Tensor& g : gt) g.fill_zero();  // next step accumulates from zero
    mark();
    OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double wall_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    PhaseTimes pt;
    size_t e = 0;
    for (size_t m = 0; m < mbs.size(); ++m, e += 3) {
      pt.forward_ms += ev[e + 1]->elapsed_ms_since(*ev[e]);
      pt.loss_ms += ev[e + 2]->elapsed_ms_since(*ev[e + 1]);
      pt.backward_ms += ev[e + 3]->elapsed_ms_since(*ev[e + 2]);
    }
    pt.optimizer_ms = ev[e + 1]->elapsed_ms_since(*ev[e]);
    pt.step_ms = std::max(static_cast<double>(ev.back()->elapsed_ms_since(*ev.front())), wall_ms);
    OPD_CHECK(std::isfinite(loss) && std::isfinite(rep.grad_norm), Internal,
              "bench train: non-finite loss ", loss, " or grad norm ", rep.grad_norm);
    res.loss = loss;
    res.grad_norm = rep.grad_norm;
    if (!o.json) {
      std::printf("  step %d%s: %.1f ms (fwd %.1f, loss %.1f, bwd %.1f, adamw %.1f), loss %.6f, "
                  "grad norm %.4g\n",
                  step, step < o.warmup ? " (warm-up)" : "", pt.step_ms, pt.forward_ms,
                  pt.loss_ms, pt.backward_ms, pt.optimizer_ms, loss, rep.grad_norm);
    }
    if (step >= o.warmup) {
      timed.push_back(pt);
      res.step_ms.push_back(pt.step_ms);
    }
  }
  auto med = [&](double PhaseTimes::*f) {
    std::vector<double> v;
    for (const PhaseTimes& p : timed) v.push_back(p.*f);
    return median(v);
  };
  res.median = {med(&PhaseTimes::forward_ms), med(&PhaseTimes::loss_ms),
                med(&PhaseTimes::backward_ms), med(&PhaseTimes::optimizer_ms),
                med(&PhaseTimes::step_ms)};
  cuda::AllocatorStats st = alloc.stats();
  res.peak_in_use = st.peak_in_use;
  res.peak_reserved = st.peak_reserved;
  res.peak_tensors = memory_stats(Device::CUDA).peak;
  return res;
}

// Runs the PyTorch twin and returns its last JSON line (null when it failed).
nlohmann::json run_torch(const BenchTrainOptions& o) {
  return run_twin({.python = o.python,
                   .script = o.torch_script,
                   .args = cat(" --json --sequences ", o.sequences, " --micro-batch ",
                               o.micro_batch, " --prompt ", o.prompt, " --completion ",
                               o.completion, " --layers ", o.layers, " --k ", o.k, " --beta ",
                               o.beta, " --temperature ", o.temperature, " --lr ", o.lr,
                               " --max-grad-norm ", o.max_grad_norm, " --warmup ", o.warmup,
                               " --steps ", o.steps, " --seed ", o.seed, " --params ",
                               o.torch_params, o.recompute ? " --recompute" : ""),
                   .name = "PyTorch twin",
                   .quiet = o.json,
                   .require_success = true});
}

void run_bench_train(const BenchTrainOptions& o) {
  OPD_CHECK(cuda::device_count() > 0, Unsupported, "opd bench train needs a CUDA device");
  OPD_CHECK(o.micro_batch >= 1 && o.sequences >= o.micro_batch && o.sequences % o.micro_batch == 0,
            InvalidArgument, "bench train: --sequences (", o.sequences,
            ") must be a positive multiple of --micro-batch (", o.micro_batch, ")");
  OPD_CHECK(o.prompt >= 1 && o.completion >= 1 && o.layers >= 1 && o.k >= 1 && o.steps >= 1 &&
                o.warmup >= 0,
            InvalidArgument, "bench train: prompt, completion, layers, k, steps must be >= 1");
  const ModelConfig c = qwen3_06b(o.layers);
  const int64_t S = o.prompt + o.completion;
  const std::string device = cuda::device_description(0);
  if (!o.json) {
    std::printf("opd bench train on %s\n", device.c_str());
    std::printf("Qwen3-0.6B shape, %lld layers, bf16 (f32 master/grads/moments), %lld sequences "
                "x %lld tokens (%lld prompt + %lld completion), micro-batch %lld, %s K %lld "
                "beta %g T %g, recompute %s\n",
                (long long)o.layers, (long long)o.sequences, (long long)S, (long long)o.prompt,
                (long long)o.completion, (long long)o.micro_batch, o.mode.c_str(),
                (long long)o.k, o.beta, o.temperature,
                o.recompute ? "layer" : o.recompute_granularity.c_str());
  }
  OpdResult r = run_opd(o, c);
  cuda::device_allocator().empty_cache();  // the twin gets the memory back
  const Flops f = model_flops(c, r.params, o.sequences, S);
  const double s = r.median.step_ms * 1e-3;
  const double tokens = static_cast<double>(o.sequences * S);
  nlohmann::json j;
  j["bench"] = "train";
  j["device"] = device;
  j["layers"] = o.layers;
  j["sequences"] = o.sequences;
  j["seq_len"] = S;
  j["micro_batch"] = o.micro_batch;
  j["recompute"] = o.recompute ? "layer" : o.recompute_granularity;
  j["loss_tile"] = o.loss_tile;
  j["params"] = r.params;
  j["step_s"] = s;
  j["step_ms_all"] = r.step_ms;
  j["forward_s"] = r.median.forward_ms * 1e-3;
  j["loss_s"] = r.median.loss_ms * 1e-3;
  j["backward_s"] = r.median.backward_ms * 1e-3;
  j["optimizer_s"] = r.median.optimizer_ms * 1e-3;
  j["tokens_per_s"] = tokens / s;
  j["model_flops"] = f.total();
  j["attention_flops"] = f.attention;
  j["tflops"] = f.total() / s / 1e12;
  j["mfu_measured_peak"] = f.total() / s / kMeasuredPeak;
  j["mfu_spec_peak"] = f.total() / s / kSpecPeak;
  j["goal_mfu_measured_peak"] = 0.45;
  j["peak_in_use_bytes"] = r.peak_in_use;
  j["peak_reserved_bytes"] = r.peak_reserved;
  j["peak_tensor_bytes"] = r.peak_tensors;
  j["loss"] = r.loss;
  j["grad_norm"] = r.grad_norm;
  if (!o.json) {
    std::printf("\nopd: %.3f s/step (median of %d), %.0f tokens/s, %.1f TFLOP/s model\n", s,
                o.steps, tokens / s, f.total() / s / 1e12);
    std::printf("     MFU %.1f%% of the measured 776 TFLOP/s (goal >= 45%%), %.1f%% of the 989 "
                "TFLOP/s spec\n",
                100 * f.total() / s / kMeasuredPeak, 100 * f.total() / s / kSpecPeak);
    std::printf("     phases: forward %.3f s, loss %.3f s, backward %.3f s, AdamW %.3f s\n",
                r.median.forward_ms * 1e-3, r.median.loss_ms * 1e-3, r.median.backward_ms * 1e-3,
                r.median.optimizer_ms * 1e-3);
    std::printf("     peak device memory: %.2f GiB in use, %.2f GiB reserved (allocator)\n",
                r.peak_in_use / 1073741824.0, r.peak_reserved / 1073741824.0);
  }
  if (o.with_torch) {
    nlohmann::json t = run_torch(o);
    j["torch"] = t;
    if (t.is_object() && t.contains("step_s")) {
      const double ts = t["step_s"].get<double>();
      j["speedup_vs_torch"] = ts / s;
      if (!o.json) {
        std::printf("\nPyTorch: %.3f s/step, %.0f tokens/s, peak %.2f GiB\n", ts, tokens / ts,
                    t.value("peak_allocated_bytes", 0.0) / 1073741824.0);
        std::printf("opd vs PyTorch: %.2fx the tokens/s (goal >= 2x)\n", ts / s);
      }
    }
  }
  std::printf("%s\n", j.dump().c_str());
}

#else

void run_bench_train(const BenchTrainOptions&) {
  OPD_FAIL(Unsupported, "opd bench train needs the CUDA backend (this build has none)");
}

#endif

}  // namespace

void register_bench_train(CLI::App& bench) {
  auto o = std::make_shared<BenchTrainOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "train", "W1 student training step (Qwen3-0.6B shape, bf16, fused JSD loss, AdamW) on CUDA");
  cmd->add_option("--sequences", o->sequences, "sequences per optimizer step")->capture_default_str();
  cmd->add_option("--micro-batch", o->micro_batch, "sequences per micro-batch")->capture_default_str();
  cmd->add_option("--prompt", o->prompt, "prompt tokens per sequence")->capture_default_str();
  cmd->add_option("--completion", o->completion, "completion tokens per sequence (loss rows)")
      ->capture_default_str();
  cmd->add_option("--layers", o->layers, "decoder layers (28 = Qwen3-0.6B)")->capture_default_str();
  cmd->add_option("--k", o->k, "teacher top-K")->capture_default_str();
  cmd->add_option("--beta", o->beta, "JSD beta")->capture_default_str();
  cmd->add_option("--temperature", o->temperature, "distillation temperature")->capture_default_str();
  cmd->add_option("--mode", o->mode, "support mode: topk, topk+tail, sampled")->capture_default_str();
  cmd->add_option("--lr", o->lr, "AdamW learning rate")->capture_default_str();
  cmd->add_option("--max-grad-norm", o->max_grad_norm, "global gradient-norm clip (0 = off)")
      ->capture_default_str();
  cmd->add_option("--seed", o->seed, "seed of weights, token ids and teacher payload")
      ->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "untimed steps first")->capture_default_str();
  cmd->add_option("--steps", o->steps, "timed steps (median reported)")->capture_default_str();
  cmd->add_option("--loss-tile", o->loss_tile,
                  "logit tile storage of the fused loss: bf16 (logits rounded as a bf16 lm_head "
                  "gives them, like the twin) or f32")
      ->capture_default_str();
  cmd->add_flag("--recompute", o->recompute, "per-layer activation recompute (default off)");
  cmd->add_option("--recompute-granularity", o->recompute_granularity,
                  "activation recompute: none | elementwise | layer (the twin recomputes only "
                  "with --recompute)")->capture_default_str();
  cmd->add_flag("--json", o->json, "print only the JSON line (default off)");
  cmd->add_flag("--with-torch", o->with_torch,
                "also run the PyTorch twin (tools/bench_train_torch.py) and print the ratio "
                "(default off)");
  cmd->add_option("--python", o->python, "python interpreter for --with-torch")->capture_default_str();
  cmd->add_option("--torch-script", o->torch_script,
                  "the twin's path (relative paths resolve under $OPD_SOURCE_DIR when set)")
      ->capture_default_str();
  cmd->add_option("--torch-params", o->torch_params,
                  "twin's precision: fp32-autocast (f32 params, bf16 autocast, as HF Trainer "
                  "bf16=True) or bf16 (bf16 params)")
      ->capture_default_str();
  cmd->callback([o] { run_bench_train(*o); });
}

}  // namespace opd::cli
