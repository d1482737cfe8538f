// `opd train` (on-policy distillation), `opd sft` (the same trainer, cross-entropy on dataset
// completions), `opd eval` (held-out exact match) and `opd init` (a randomly initialized model
// directory from a config.json). Flags follow TRL / ms-swift names where one exists; every flag
// can also come from a flags file (--config FILE: TOML or JSON, keys = flag names without
// dashes; cli/flags_file.h).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>

#include "cli/commands.h"
#include "cli/generation_progress.h"
#include "cli/model_device.h"
#include "cli/flags_file.h"
#include "core/error.h"
#include "core/text_io.h"
#include "core/log.h"
#include "data/dataset.h"
#include "model/config.h"
#include "model/presets.h"
#include "model/init.h"
#include "model/output_dir.h"
#include "model/transformer.h"
#include "rollout/engine.h"
#include "teacher/scorer.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "train/eval.h"
#include "train/text_adapters.h"
#include "train/trainer.h"

namespace opd::cli {
namespace {


// Flags shared by train and sft; `distill` adds the teacher/rollout/loss ones.
void add_trainer_flags(CLI::App* c, TrainOptions& o, bool distill) {
  accept_flags_file(c);
  c->add_option("--student", o.student, "student model directory (Hugging Face layout)")->required();
  c->add_option("--data", o.data, "training JSONL file(s): prompt/completion, messages, "
                "prompt/response or query/response (docs/data.md)")->required();
  c->add_option("--eval-data", o.eval_data, "held-out JSONL with reference completions: exact-"
                "match accuracy before/after training (and every --eval-steps)");
  c->add_option("--out", o.out, "run directory: checkpoints/, metrics.jsonl, tensorboard/, "
                "train.log, config.json")->capture_default_str();
  if (distill) {
    c->add_option("--teacher", o.teacher, "teacher model directory, scored in-process");
    c->add_option("--teacher-url", o.teacher_url, "remote teacher: an `opd serve` or vLLM "
                  "server, http://host:port; or a comma-separated pool, rank r of a data-parallel "
                  "run using entry r mod (pool size)");
    c->add_option("--teacher-config", o.teacher_config, "a vLLM --teacher-url: directory with the "
                  "served model's config.json and tokenizer files (no weights needed); its "
                  "vocabulary and tokenizer fingerprint stand in for what vLLM does not report "
                  "(an opd server's report must agree)");
    c->add_option("--teacher-timeout", o.teacher_timeout_s, "seconds a remote teacher may be "
                  "unreachable or not answering, at start-up (not up yet) or mid-run, while the run "
                  "waits and retries, before the run fails (each attempt waits at most half of "
                  "it for an answer; SIGTERM/SIGINT abandon the wait at once, data parallel "
                  "too)")->capture_default_str();
    c->add_option("--lmbda", o.lmbda, "probability that a step's completions are sampled from "
                  "the student (on-policy); otherwise the dataset's")->capture_default_str();
    c->add_flag("--seq-kd", o.seq_kd, "off-policy steps use completions sampled from the "
                "teacher instead of the dataset's (in-process, or a remote opd serve / vLLM "
                "teacher through /v1/completions)");
    c->add_option("--beta", o.beta, "generalized JSD coefficient: 0 forward KL(P||Q), 1 reverse "
                  "KL(Q||P), else JSD(beta)")->capture_default_str();
    c->add_option("--loss-support", o.loss_support, "topk+tail (K teacher atoms + a tail atom, "
                  "exact student LSE) | topk (renormalized over K) | sampled (per-token reverse-"
                  "KL reward)")->capture_default_str();
    c->add_option("--kd-temperature", o.kd_temperature, "distillation temperature T of teacher "
                  "and student distributions")->capture_default_str();
    c->add_option("--sft-alpha", o.sft_alpha, "weight of an added cross-entropy on dataset "
                  "completion tokens")->capture_default_str();
    c->add_option("--teacher-top-k", o.teacher_top_k, "teacher entries K per completion token "
                  "(clamped to the vocabulary)")->capture_default_str();
    c->add_option("--vocab-policy", o.vocab_policy, "teacher/student vocabularies differ: error "
                  "| clip-to-student")->capture_default_str();
    c->add_option("--temperature", o.temperature, "rollout sampling temperature (0 = greedy)")
        ->capture_default_str();
    c->add_option("--top-p", o.top_p, "rollout nucleus sampling (1 = off)")->capture_default_str();
    c->add_option("--top-k", o.top_k, "rollout top-k sampling (0 = off)")->capture_default_str();
    c->add_option("--min-p", o.min_p, "rollout min-p sampling (0 = off)")->capture_default_str();
    c->add_option("--num-generations", o.num_generations, "student samples per prompt on "
                  "on-policy steps")->capture_default_str();
    c->add_option("--kv-cache-gb", o.kv_cache_gb, "KV cache budget of the rollout")
        ->capture_default_str();
    c->add_flag("--ignore-eos", o.ignore_eos, "rollouts continue past EOS to "
                "--max-completion-length (benchmarks)");
  }
  c->add_option("--device", o.device, "cpu (f32 reference backend) | cuda (GPU: the student in "
                "--dtype with f32 master weights; teacher, rollout, loss and AdamW on the GPU)")
      ->capture_default_str();
  c->add_option("--dtype", o.dtype, "compute dtype on cuda: bf16 | f32")->capture_default_str();
  c->add_option("--zero-stage", o.zero_stage, "data parallel (under opd launch / torchrun / "
                "srun): 1 shards optimizer state, 2 also gradients")->capture_default_str();
  c->add_flag("--recompute", o.recompute, "recompute each layer's activations in the backward "
              "(less memory for one extra forward); = --recompute-granularity layer");
  c->add_option("--recompute-granularity", o.recompute_granularity, "student activation "
                "recompute: none | elementwise (cuda: rebuild norm outputs, normed q/k and the "
                "SwiGLU product in the backward: 36% fewer stored values, W1 peak 20.7 -> 18.6 GiB, no extra GEMM) | layer "
                "(keep only each layer's input: +1 forward)")->capture_default_str();
  c->add_flag("--offload-teacher", o.offload_teacher, "cuda, in-process teacher: keep its "
              "weights in pinned host memory, on the GPU only while it scores (frees its size "
              "during rollout and training for one host-to-device copy per step)");
  c->add_option("--device-memory-budget", o.device_memory_budget_gb, "cuda: GiB of device "
                "memory the run may use (0 = the GPU's free memory, used only when the chosen "
                "settings' plan exceeds it): the cheapest memory setting whose planned peak "
                "fits is chosen (elementwise recompute, then --offload-teacher, then both, then "
                "per-layer recompute; a recompute or offload given here stays); a budget nothing "
                "fits stops the run at start-up with the smallest plan")
      ->capture_default_str();
  c->add_option("--max-completion-length", o.max_completion_length, "tokens per completion "
                "(rollouts stop there; dataset completions are cut)")->capture_default_str();
  c->add_option("--max-prompt-length", o.max_prompt_length, "prompt tokens (0 = no limit)")
      ->capture_default_str();
  c->add_option("--truncation", o.truncation, "prompts over --max-prompt-length: left (keep the "
                "end) | error | skip")->capture_default_str();
  c->add_option("--batch-size", o.batch_size, "prompts per optimizer step")->capture_default_str();
  c->add_option("--micro-batch-size", o.micro_batch_size, "sequences per forward/backward "
                "(gradient accumulation inside a step; the loss is normalized by the step's "
                "tokens)")->capture_default_str();
  c->add_option("--learning-rate,--lr", o.learning_rate, "peak learning rate")->capture_default_str();
  c->add_option("--lr-scheduler-type", o.lr_scheduler_type, "constant | linear | cosine")
      ->capture_default_str();
  c->add_option("--warmup-steps", o.warmup_steps, "linear warmup steps")->capture_default_str();
  c->add_option("--warmup-ratio", o.warmup_ratio, "warmup as a share of all steps (when "
                "--warmup-steps is 0)")->capture_default_str();
  c->add_option("--min-lr-ratio", o.min_lr_ratio, "floor of linear/cosine decay, share of the "
                "peak")->capture_default_str();
  c->add_option("--weight-decay", o.weight_decay, "AdamW decoupled weight decay")->capture_default_str();
  c->add_option("--adam-beta1", o.adam_beta1, "AdamW beta1")->capture_default_str();
  c->add_option("--adam-beta2", o.adam_beta2, "AdamW beta2")->capture_default_str();
  c->add_option("--adam-epsilon", o.adam_epsilon, "AdamW epsilon")->capture_default_str();
  c->add_option("--max-grad-norm", o.max_grad_norm, "global gradient-norm clipping (0 = off)")
      ->capture_default_str();
  c->add_option("--max-steps", o.max_steps, "optimizer steps (0 = --num-train-epochs over the "
                "data)")->capture_default_str();
  c->add_option("--num-train-epochs", o.num_train_epochs, "passes over the prompts when "
                "--max-steps is 0")->capture_default_str();
  c->add_option("--seed", o.seed, "seed of data order, lmbda draws and sampling")
      ->capture_default_str();
  c->add_option("--save-steps", o.save_steps, "checkpoint every N steps (0 = off)")
      ->capture_default_str();
  c->add_option("--save-minutes", o.save_minutes, "checkpoint every M minutes (0 = off)")
      ->capture_default_str();
  c->add_option("--save-total-limit", o.save_total_limit, "checkpoints kept (0 = all)")
      ->capture_default_str();
  c->add_option("--resume", o.resume, "auto (newest valid checkpoint in --out, if any) | never "
                "| PATH of a checkpoint folder")->capture_default_str();
  c->add_option("--eval-steps", o.eval_steps, "evaluate every N steps (0 = before and after "
                "only)")->capture_default_str();
  c->add_option("--eval-limit", o.eval_limit, "evaluate on the first N samples (0 = all)")
      ->capture_default_str();
  c->add_option("--max-bad-steps", o.max_bad_steps, "non-finite steps skipped before the run "
                "aborts")->capture_default_str();
  c->add_option("--logging-steps", o.logging_steps, "write metrics every N steps")
      ->capture_default_str();
  c->add_flag("!--no-tensorboard", o.tensorboard, "do not write TensorBoard event files");
  c->add_flag("!--no-eval-before", o.eval_before, "skip the evaluation of the initial weights");
}

void report_result(const TrainResult& r) {
  if (r.eval_before >= 0 || r.eval_after >= 0) {
    std::printf("exact match: before %.1f%%  after %.1f%%\n", 100 * std::max(0.0, r.eval_before),
                100 * std::max(0.0, r.eval_after));
  }
  std::printf("steps %lld -> %lld%s, checkpoint %s\n", static_cast<long long>(r.first_step),
              static_cast<long long>(r.steps), r.stopped_by_signal ? " (stopped by a signal)" : "",
              r.last_checkpoint.c_str());
}

}  // namespace

void register_train(CLI::App& app) {
  auto o = std::make_shared<TrainOptions>();
  CLI::App* c = app.add_subcommand(
      "train", "On-policy distillation: the student samples, the teacher scores every token "
               "(top-K), the student learns with a generalized JSD (DESIGN.md)");
  add_trainer_flags(c, *o, true);
  c->callback([o] { report_result(train(*o)); });

  auto s = std::make_shared<TrainOptions>();
  s->learning_rate = 1e-4;
  s->lmbda = 0;
  CLI::App* sft = app.add_subcommand(
      "sft", "Supervised fine-tuning on dataset completions (the distillation trainer with a "
             "one-hot teacher, i.e. cross-entropy)");
  add_trainer_flags(sft, *s, false);
  sft->callback([s] {
    s->sft = true;
    report_result(train(*s));
  });
}

void register_eval(CLI::App& app) {
  struct Opts {
    std::string model, teacher;
    std::vector<std::string> data;
    std::vector<std::string> metrics{"exact-match"};
    int64_t max_new_tokens = 256, limit = 0, samples = 1, agreement_tokens = 32;
    double kv_cache_gb = 1.0, temperature = 1.0;
    uint64_t seed = 0;
    bool json = false;
    ModelDevice md;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* c = app.add_subcommand(
      "eval", "Held-out evaluation (prints one line per metric; --json for one object): "
              "exact-match accuracy of greedy completions against reference completions; with "
              "--teacher, reverse KL to the teacher on the model's own samples and agreement of "
              "greedy answers with the teacher's (src/train/eval.h)");
  c->add_option("--model", o->model, "model (student) directory")->required();
  c->add_option("--data", o->data, "JSONL file(s); exact-match needs reference completions, the "
                "teacher metrics accept prompt-only lines")->required();
  c->add_option("--metric", o->metrics, "exact-match | reverse-kl | agreement (repeat or "
                "space-separate for several)")
      ->check(CLI::IsMember({"exact-match", "reverse-kl", "agreement"}))
      ->capture_default_str();
  c->add_option("--teacher", o->teacher, "teacher model directory (reverse-kl: scored in-process "
                "on --device; agreement: generates greedily)");
  c->add_option("--max-new-tokens", o->max_new_tokens, "generation limit of exact-match and of "
                "the reverse-kl samples")->capture_default_str();
  c->add_option("--samples", o->samples, "reverse-kl: student samples per prompt")
      ->capture_default_str();
  c->add_option("--temperature", o->temperature, "reverse-kl: sampling temperature of the student "
                "and temperature of both distributions (> 0)")->capture_default_str();
  c->add_option("--seed", o->seed, "reverse-kl: sampling seed")->capture_default_str();
  c->add_option("--agreement-tokens", o->agreement_tokens, "agreement: greedy tokens each model "
                "generates; the first N are compared")->capture_default_str();
  c->add_option("--limit", o->limit, "first N samples (0 = all)")->capture_default_str();
  c->add_option("--kv-cache-gb", o->kv_cache_gb, "KV cache budget")->capture_default_str();
  add_model_device_flags(c, o->md, "the model and --teacher");
  c->add_flag("--json", o->json, "print a JSON object");
  c->callback([o] {
    auto has = [&](const char* m) {
      return std::find(o->metrics.begin(), o->metrics.end(), m) != o->metrics.end();
    };
    const bool want_teacher = has("reverse-kl") || has("agreement");
    OPD_CHECK(!want_teacher || !o->teacher.empty(), InvalidArgument,
              "opd eval: --metric reverse-kl and agreement need --teacher DIR");
    // As opd train's --kv-cache-gb: in GiB, converted to bytes below (NaN, inf or 1e12 would
    // overflow the int64 byte count).
    OPD_CHECK(std::isfinite(o->kv_cache_gb) && o->kv_cache_gb >= 1e-6 && o->kv_cache_gb <= 1e6,
              InvalidArgument, "opd eval: --kv-cache-gb ", o->kv_cache_gb,
              " must be > 0 and <= 1e6");
    OPD_CHECK(o->limit >= 0, InvalidArgument, "opd eval: --limit ", o->limit,
              " must be >= 0 (0 = all samples)");
    Transformer model = load_model_on(o->model, o->md, "opd eval");  // checks --device first
    Tokenizer tok = Tokenizer::load(o->model);
    TokenizerTextEncoder enc(tok);
    std::unique_ptr<ChatTemplate> tmpl;
    std::unique_ptr<TemplateChatRenderer> chat;
    if (has_chat_template(o->model, tok)) {
      tmpl = std::make_unique<ChatTemplate>(ChatTemplate::from_model_dir(o->model));
      chat = std::make_unique<TemplateChatRenderer>(*tmpl);
    }
    DatasetOptions dopt;
    dopt.require_completion = has("exact-match");
    dopt.id_limit = model.config().vocab_size;
    dopt.chat_template_source = chat_template_source(o->model);
    Dataset data = Dataset::load(o->data, enc, chat.get(), dopt);
    const auto eos = generation_eos_ids(o->model, model.config(), &tok);
    nlohmann::json out = {{"model", o->model}};
    if (!o->teacher.empty()) out["teacher"] = o->teacher;
    for (const auto& metric : o->metrics) {
      if (metric == "exact-match") {
        EvalOptions eo;
        eo.max_new_tokens = o->max_new_tokens;
        eo.limit = o->limit;
        eo.kv_cache_gb = o->kv_cache_gb;
        GenerationProgressDisplay shown("exact-match");
        eo.on_progress = shown.callback();
        EvalResult r = evaluate_exact_match(model, eos, data, eo);
        shown.finish();
        for (const auto& w : r.wrong_examples) log_info("wrong: ", w);
        out["samples"] = r.total;
        out["correct"] = r.correct;
        out["exact_match"] = r.accuracy();
        if (!o->json)
          std::printf("%s: exact match %lld/%lld = %.1f%%\n", o->model.c_str(),
                      static_cast<long long>(r.correct), static_cast<long long>(r.total),
                      100 * r.accuracy());
      } else if (metric == "reverse-kl") {
        std::unique_ptr<Scorer> teacher =
            make_local_scorer(o->teacher, o->md.where(), o->md.cuda_dtype());
        ReverseKlOptions ro;
        ro.max_new_tokens = o->max_new_tokens;
        ro.samples_per_prompt = o->samples;
        ro.temperature = o->temperature;
        ro.seed = o->seed;
        ro.limit = o->limit;
        ro.kv_cache_gb = o->kv_cache_gb;
        GenerationProgressDisplay shown("reverse-kl (student samples)");
        ro.on_progress = shown.callback();
        ReverseKlResult r = evaluate_reverse_kl(model, *teacher, eos, data, ro);
        shown.finish();
        out["reverse_kl"] = {{"per_token", r.mean}, {"std_error", r.std_error},
                             {"prompts", r.prompts}, {"samples", r.samples}, {"tokens", r.tokens},
                             {"truncated", r.truncated}, {"student_logprob", r.student_logprob},
                             {"teacher_logprob", r.teacher_logprob},
                             {"temperature", o->temperature}, {"seed", o->seed},
                             {"seconds_rollout", r.seconds_rollout},
                             {"seconds_teacher", r.seconds_teacher}};
        if (!o->json)
          std::printf("%s: reverse KL to %s %.4f +- %.4f nats/token (%lld samples of %lld prompts, "
                      "%lld tokens, %lld truncated; mean log q %.4f, log p %.4f; T %g)\n",
                      o->model.c_str(), o->teacher.c_str(), r.mean, r.std_error,
                      static_cast<long long>(r.samples), static_cast<long long>(r.prompts),
                      static_cast<long long>(r.tokens), static_cast<long long>(r.truncated),
                      r.student_logprob, r.teacher_logprob, o->temperature);
      } else {
        Transformer teacher = load_model_on(o->teacher, o->md, "opd eval");
        const auto teacher_eos = generation_eos_ids(o->teacher, teacher.config(), nullptr);
        AgreementOptions ao;
        ao.tokens = o->agreement_tokens;
        ao.limit = o->limit;
        ao.kv_cache_gb = o->kv_cache_gb;
        GenerationProgressDisplay shown("agreement (student, then teacher)");
        ao.on_progress = shown.callback();
        AgreementResult r = evaluate_agreement(model, eos, teacher, teacher_eos, data, ao, &tok);
        shown.finish();
        for (const auto& e : r.examples) log_info("differs: ", e);
        out["agreement"] = {{"tokens", o->agreement_tokens}, {"prompts", r.prompts},
                            {"exact", r.exact}, {"exact_rate", r.exact_rate()},
                            {"token_agreement", r.token_agreement()},
                            {"mean_common_prefix", r.mean_prefix()}};
        if (!o->json)
          std::printf("%s: greedy agreement with %s over the first %lld tokens: exact %lld/%lld = "
                      "%.1f%%, token agreement %.1f%%, mean common prefix %.1f tokens\n",
                      o->model.c_str(), o->teacher.c_str(),
                      static_cast<long long>(o->agreement_tokens), static_cast<long long>(r.exact),
                      static_cast<long long>(r.prompts), 100 * r.exact_rate(),
                      100 * r.token_agreement(), r.mean_prefix());
      }
    }
    if (o->json) std::printf("%s\n", out.dump().c_str());
  });
}

void register_init(CLI::App& app) {
  struct Opts {
    std::string config, preset, out, tokenizer;
    uint64_t seed = 0;
    double std = 0;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* c = app.add_subcommand(
      "init", "Write a randomly initialized model directory (N(0, initializer_range) weights, "
              "unit norms) from a config.json or a named shape");
  auto* cfg_opt = c->add_option("--config", o->config, "config.json (llama / qwen2 / qwen3)");
  std::string presets;
  for (const auto& n : model_preset_names()) presets += (presets.empty() ? "" : " | ") + n;
  auto* preset_opt = c->add_option("--preset", o->preset, "a named shape instead of --config: " + presets);
  cfg_opt->excludes(preset_opt);
  preset_opt->excludes(cfg_opt);
  c->add_option("--out", o->out, "output model directory")->required();
  c->add_option("--tokenizer", o->tokenizer, "directory holding tokenizer.json, copied in with "
                "tokenizer_config.json, generation_config.json, special_tokens_map.json when "
                "present");
  c->add_option("--seed", o->seed, "initialization seed")->capture_default_str();
  c->add_option("--std", o->std, "weight std, finite and >= 0 (0 = the config's "
                "initializer_range, else 0.02)")
      ->capture_default_str();
  c->callback([o] {
    namespace fs = std::filesystem;
    OPD_CHECK(!o->config.empty() || !o->preset.empty(), InvalidArgument,
              "opd init needs --config FILE or --preset NAME");
    OPD_CHECK(std::isfinite(o->std) && o->std >= 0, InvalidArgument, "opd init: --std ", o->std,
              " must be finite and >= 0 (0 = the config's initializer_range, else 0.02)");
    // As convert and shrink: never write beside an existing model's files.
    const fs::path out = checked_output_dir(o->out, "init");
    if (!o->tokenizer.empty()) {
      std::error_code ec;
      OPD_CHECK(fs::is_directory(o->tokenizer, ec), InvalidArgument, "opd init: --tokenizer ",
                o->tokenizer, " is not a directory (give the model or tokenizer directory "
                "holding tokenizer.json)");
      OPD_CHECK(fs::is_regular_file(fs::path(o->tokenizer) / "tokenizer.json", ec),
                InvalidArgument, "opd init: --tokenizer ", o->tokenizer,
                " holds no tokenizer.json (the files copied are tokenizer.json and, when present, "
                "tokenizer_config.json, generation_config.json, special_tokens_map.json)");
    }
    std::string text = "{}";
    ModelConfig cfg;
    if (!o->preset.empty()) {
      cfg = model_preset(o->preset);
    } else {
      text = read_text_file(o->config, int64_t{64} << 20);
      cfg = parse_model_config(text, o->config);
    }
    double init_std = o->std;
    if (init_std == 0) {
      init_std = 0.02;
      const auto j = nlohmann::json::parse(text, nullptr, false);
      if (j.is_object() && j.contains("initializer_range")) {
        const auto& r = j["initializer_range"];
        OPD_CHECK(r.is_number() && std::isfinite(r.get<double>()) && r.get<double>() > 0,
                  InvalidData, o->config, ": initializer_range = ", r.dump(),
                  " must be a finite number > 0 (or pass --std X)");
        init_std = r.get<double>();
      }
    }
    if (!o->tokenizer.empty()) {  // loads it: a broken tokenizer.json is refused here, not later
      const int64_t tv = Tokenizer::load(o->tokenizer).vocab_size();
      if (tv > cfg.vocab_size)
        log_warn("opd init: the tokenizer in ", o->tokenizer, " has ", tv,
                 " token ids (highest id + 1) but the model's vocab_size is ", cfg.vocab_size,
                 ": ids >= ", cfg.vocab_size, " have no embedding row");
    }
    save_model_dir(out.string(), cfg, init_weights(cfg, o->seed, init_std), o->tokenizer);
    std::printf("%s: %s, %lld parameters (seed %llu, std %g)\n", o->out.c_str(),
                architecture_name(cfg.arch), static_cast<long long>(cfg.num_parameters()),
                static_cast<unsigned long long>(o->seed), init_std);
  });
}

}  // namespace opd::cli
