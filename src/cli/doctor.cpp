// `opd doctor --student DIR (--teacher DIR | --teacher-url URL)`: the start-up checks of
// `opd train` on their own (train/doctor.h): vocabularies, tokenizers, special tokens, EOS ids,
// chat templates, and a memory estimate against the machine. Exit 1 when a check fails.
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "core/error.h"
#include "core/tensor.h"  // device_hooks::cuda_memory_info
#include "loss/loss_config.h"
#include "teacher/client.h"
#include "model/transformer.h"
#include "train/doctor.h"

namespace opd::cli {
namespace {

struct DoctorOptions {
  std::string student, teacher, teacher_url, teacher_config, vocab_policy = "error";
  int64_t micro_batch_tokens = 8192;
  double kv_cache_gb = 1.0;
  std::string device = "cpu", dtype = "bf16";
  bool recompute = false;
  std::string recompute_granularity = "none";
  bool offload_teacher = false;
  std::string loss_support = "topk+tail";  // as opd train: full keeps the teacher resident
  double device_memory_budget_gb = 0;  // as opd train --device-memory-budget
  int nproc = 1, zero_stage = 1;
};

std::string gib(int64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1 << 30));
  return buf;
}

// A parse_* call whose error names the flag it came from.
template <typename Parse>
void check_choice(const char* flag, Parse&& parse) {
  try {
    parse();
  } catch (const Error& e) {
    OPD_FAIL(InvalidArgument, flag, ": ", e.what());
  }
}

// The flags opd train shares with doctor, with opd train's choices and ranges (train/trainer.cpp),
// so a setting doctor passes is one opd train accepts.
void validate(const DoctorOptions& o) {
  check_choice("--vocab-policy", [&] { parse_vocab_policy(o.vocab_policy); });
  check_choice("--loss-support", [&] { parse_support_mode(o.loss_support); });
  check_choice("--recompute-granularity", [&] { parse_recompute(o.recompute_granularity); });
  OPD_CHECK(o.device == "cpu" || o.device == "cuda", InvalidArgument, "--device ", o.device,
            " must be cpu or cuda");
  OPD_CHECK(o.dtype == "bf16" || o.dtype == "f32", InvalidArgument, "--dtype ", o.dtype,
            " must be bf16 or f32");
  OPD_CHECK(o.nproc >= 1 && o.nproc <= 65536, InvalidArgument, "--nproc ", o.nproc,
            " must be in [1, 65536]");
  OPD_CHECK(o.zero_stage == 1 || o.zero_stage == 2, InvalidArgument, "--zero-stage ",
            o.zero_stage, " must be 1 or 2");
  OPD_CHECK(o.micro_batch_tokens >= 1 && o.micro_batch_tokens <= (int64_t{1} << 31),
            InvalidArgument, "--micro-batch-tokens ", o.micro_batch_tokens,
            " must be in [1, 2^31]");
  OPD_CHECK(std::isfinite(o.kv_cache_gb) && o.kv_cache_gb >= 1e-6 && o.kv_cache_gb <= 1e6,
            InvalidArgument, "--kv-cache-gb ", o.kv_cache_gb, " must be > 0 and <= 1e6");
  OPD_CHECK(std::isfinite(o.device_memory_budget_gb) && o.device_memory_budget_gb >= 0 &&
                o.device_memory_budget_gb <= 1e6 &&
                (o.device_memory_budget_gb == 0 || o.device == "cuda"),
            InvalidArgument, "--device-memory-budget ", o.device_memory_budget_gb,
            " must be >= 0 and <= 1e6 and needs --device cuda");
}

void run_doctor(const DoctorOptions& o) {
  OPD_CHECK(o.teacher.empty() != o.teacher_url.empty(), InvalidArgument,
            "give exactly one of --teacher DIR or --teacher-url URL");
  validate(o);
  // As opd train: with full support the dense teacher runs inside the training phase, so it is
  // never offloaded (neither asked for nor chosen by --device-memory-budget).
  const bool full = parse_support_mode(o.loss_support) == SupportMode::Full;
  OPD_CHECK(!o.offload_teacher || !full, InvalidArgument,
            "--offload-teacher cannot be used with --loss-support full (the dense teacher runs "
            "inside the training phase, so its weights must stay on the GPU)");
  const ModelSide s = describe_model_dir(o.student);
  ModelSide t;
  if (!o.teacher.empty()) {
    t = describe_model_dir(o.teacher);
  } else {
    ClientOptions c;
    c.url = o.teacher_url;
    c.max_attempts = 2;
    if (!o.teacher_config.empty()) {  // as opd train: what a vLLM server does not report
      t = describe_model_dir(o.teacher_config);
      c.assume_teacher_vocab = t.vocab_size;
      c.assume_teacher_fingerprint = t.fingerprint;
    } else {
      // A server does not report special tokens or its chat template: assume the student's.
      t.bos_token = s.bos_token;
      t.eos_token = s.eos_token;
      t.pad_token = s.pad_token;
      t.has_chat_template = s.has_chat_template;
      t.chat_template = s.chat_template;
    }
    TeacherClient client(c);
    const TeacherInfo& i = client.info();
    t.where = o.teacher_url;
    t.vocab_size = i.vocab_size;
    t.fingerprint = i.fingerprint;
    if (o.teacher_config.empty() || !i.eos_token_ids.empty()) t.eos_ids = i.eos_token_ids;
  }
  std::printf("student  %s: vocab %lld, %lld parameters\n", s.where.c_str(),
              static_cast<long long>(s.vocab_size), static_cast<long long>(s.num_parameters));
  std::printf("teacher  %s: vocab %lld%s\n", t.where.c_str(), static_cast<long long>(t.vocab_size),
              t.num_parameters ? cat(", ", t.num_parameters, " parameters").c_str() : "");
  int errors = 0, warnings = 0;
  for (const auto& f : check_pair(s, t, o.vocab_policy == "clip-to-student")) {
    const char* tag = f.severity == Severity::Ok ? "ok   " : f.severity == Severity::Warning ? "WARN " : "ERROR";
    errors += f.severity == Severity::Error;
    warnings += f.severity == Severity::Warning;
    std::printf("%s %-15s %s\n", tag, f.check.c_str(), f.message.c_str());
  }
  if (o.device == "cuda") {
    MemoryPlanOptions po;
    po.dtype = o.dtype == "f32" ? DType::F32 : DType::BF16;
    po.recompute = o.recompute ? Recompute::PerLayer : parse_recompute(o.recompute_granularity);
    po.offload_teacher = o.offload_teacher && !o.teacher.empty();
    po.full_support = full && !o.teacher.empty();
    po.world_size = o.nproc;
    po.zero_stage = o.nproc > 1 ? o.zero_stage : 0;
    po.micro_batch_tokens = o.micro_batch_tokens;
    po.kv_cache_bytes = static_cast<int64_t>(o.kv_cache_gb * (1 << 30));
    const MemoryPlan p = plan_gpu_memory(s, o.teacher.empty() ? nullptr : &t, po);
    std::printf("info  memory          GPU plan per device (%d rank%s%s): peak ~%s = max(rollout "
                "%s, scoring %s, training %s); model %s, f32 master %s, AdamW %s, f32 grads %s "
                "(%s), teacher %s (%s), training activations %s at %lld tokens/micro-batch "
                "(recompute %s), rollout KV + packed weights %s\n",
                o.nproc, o.nproc > 1 ? "s" : "",
                o.nproc > 1 ? cat(", ZeRO-", po.zero_stage).c_str() : "", gib(p.peak()).c_str(),
                gib(p.rollout_phase()).c_str(), gib(p.scoring_phase()).c_str(),
                gib(p.training_phase()).c_str(), gib(p.model).c_str(), gib(p.master).c_str(),
                gib(p.optimizer).c_str(), gib(p.grads).c_str(),
                p.grads_whole_run ? "whole run" : "training phase only", gib(p.teacher).c_str(),
                p.teacher_whole_run ? "whole run" : "offloaded: scoring phase only",
                gib(p.activations).c_str(), static_cast<long long>(o.micro_batch_tokens),
                recompute_name(po.recompute), gib(p.rollout).c_str());
    // What opd train would choose for a budget (the device's memory or --device-memory-budget):
    // the cheapest fitting setting, or the smallest plan when nothing fits (fits false).
    auto choose = [&](int64_t budget, bool* fits) {
      MemoryChoice smallest;
      const auto c = fit_memory_budget(s, o.teacher.empty() ? nullptr : &t, po,
                                       !o.teacher.empty() && !full, budget, &smallest);
      *fits = c.has_value();
      return c ? *c : smallest;
    };
    auto setting = [](const MemoryChoice& m) {
      return cat("recompute ", recompute_name(m.recompute), m.offload_teacher ? ", teacher offloaded" : "");
    };
    // Against the device (the GPU this process sees), as opd train does without a budget.
    const device_hooks::CudaMemoryInfo dev = device_hooks::cuda_memory_info();
    if (o.device_memory_budget_gb <= 0 && dev.total > 0) {
      const int64_t avail = dev.free + dev.reserved;
      if (p.peak() <= avail) {
        std::printf("ok    memory device   the plan's peak %s fits the GPU's %s available (%s "
                    "total)\n", gib(p.peak()).c_str(), gib(avail).c_str(), gib(dev.total).c_str());
      } else {
        bool c = false;
        const MemoryChoice shown = choose(avail, &c);
        std::printf("%s memory device   the plan's peak %s exceeds the GPU's %s available (%s "
                    "total): %s %s, planned peak %s\n",
                    c ? "WARN " : "ERROR", gib(p.peak()).c_str(), gib(avail).c_str(),
                    gib(dev.total).c_str(),
                    c ? "opd train would switch to" : "nothing fits; the smallest plan is",
                    setting(shown).c_str(), gib(shown.plan.peak()).c_str());
        errors += c ? 0 : 1;
        warnings += c ? 1 : 0;
      }
    } else if (o.device_memory_budget_gb <= 0) {
      std::printf("info  memory device   no GPU visible here: the plan is not compared with a "
                  "device (--device-memory-budget GIB compares it with a budget)\n");
    }
    if (o.device_memory_budget_gb > 0) {  // what opd train --device-memory-budget would choose
      const int64_t budget = static_cast<int64_t>(o.device_memory_budget_gb * (1 << 30));
      bool c = false;
      const MemoryChoice shown = choose(budget, &c);
      std::printf("%s memory budget   %g GiB: %s %s, planned peak %s (rollout %s, "
                  "scoring %s, training %s)\n",
                  c ? "ok   " : "ERROR", o.device_memory_budget_gb,
                  c ? "opd train would use" : "nothing fits; the smallest plan is",
                  setting(shown).c_str(), gib(shown.plan.peak()).c_str(),
                  gib(shown.plan.rollout_phase()).c_str(),
                  gib(shown.plan.scoring_phase()).c_str(), gib(shown.plan.training_phase()).c_str());
      errors += c ? 0 : 1;
    }
  }
  if (o.device == "cuda") {
    std::printf("%d error(s), %d warning(s)\n", errors, warnings);
    if (errors) set_exit_code(1);
    return;
  }
  const MemoryEstimate m = estimate_memory(s, o.teacher.empty() ? nullptr : &t,
                                           o.micro_batch_tokens, o.kv_cache_gb);
  const int64_t avail = available_host_memory();
  const bool fits = avail == 0 || m.total() <= avail;
  std::printf("%s memory          CPU run needs ~%s (weights %s, grads %s, AdamW %s, activations "
              "%s at %lld tokens/micro-batch, KV cache %s, teacher %s); available %s\n",
              fits ? "ok   " : "WARN ", gib(m.total()).c_str(), gib(m.weights).c_str(),
              gib(m.grads).c_str(), gib(m.optimizer).c_str(), gib(m.activations).c_str(),
              static_cast<long long>(o.micro_batch_tokens), gib(m.kv_cache).c_str(),
              gib(m.teacher).c_str(), avail ? gib(avail).c_str() : "unknown");
  warnings += !fits;
  std::printf("%d error(s), %d warning(s)\n", errors, warnings);
  if (errors) set_exit_code(1);
}

}  // namespace

void register_doctor(CLI::App& app) {
  auto o = std::make_shared<DoctorOptions>();
  CLI::App* c = app.add_subcommand(
      "doctor", "Check a teacher/student pair before training: vocabularies, tokenizers, "
                "special tokens, EOS ids, chat templates, memory (exit 1 on an error)");
  c->add_option("--student", o->student, "student model directory")->required();
  c->add_option("--teacher", o->teacher, "teacher model directory");
  c->add_option("--teacher-url", o->teacher_url, "remote teacher (opd serve / vLLM)");
  c->add_option("--teacher-config", o->teacher_config, "a vLLM --teacher-url: directory with the "
                "served model's config.json and tokenizer files (as opd train)");
  c->add_option("--vocab-policy", o->vocab_policy, "error | clip-to-student (as opd train)")
      ->capture_default_str();
  c->add_option("--micro-batch-tokens", o->micro_batch_tokens, "tokens per micro-batch for the "
                "activation estimate")->capture_default_str();
  c->add_option("--kv-cache-gb", o->kv_cache_gb, "rollout KV cache budget")->capture_default_str();
  c->add_option("--device", o->device, "cpu | cuda: cuda also prints the per-GPU memory plan "
                "(as opd train --device cuda would use it)")->capture_default_str();
  c->add_option("--dtype", o->dtype, "GPU compute dtype: bf16 | f32")->capture_default_str();
  c->add_flag("--recompute", o->recompute, "plan with per-layer activation recompute");
  c->add_option("--recompute-granularity", o->recompute_granularity, "plan with this student "
                "activation recompute: none | elementwise | layer (as opd train)")
      ->capture_default_str();
  c->add_flag("--offload-teacher", o->offload_teacher, "plan with the in-process teacher on the "
              "GPU only while it scores (as opd train --offload-teacher)");
  c->add_option("--loss-support", o->loss_support, "as opd train: topk | topk+tail | sampled | "
                "full (full keeps the in-process teacher on the GPU: never offloaded)")
      ->capture_default_str();
  c->add_option("--device-memory-budget", o->device_memory_budget_gb, "with --device cuda: GiB "
                "of device memory; prints the memory setting opd train --device-memory-budget "
                "would choose (an error when nothing fits)")
      ->capture_default_str();
  c->add_option("--nproc", o->nproc, "ranks (GPUs) of a data-parallel run")->capture_default_str();
  c->add_option("--zero-stage", o->zero_stage, "ZeRO stage with --nproc > 1: 1 | 2")
      ->capture_default_str();
  c->callback([o] { run_doctor(*o); });
}

}  // namespace opd::cli
