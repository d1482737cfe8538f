// The resume policy of every saved training option (see resume_policy.h) and the comparison
// that applies it.
#include "train/resume_policy.h"

#include <algorithm>

#include "core/error.h"

namespace opd {

namespace {

using P = ResumePolicy;

// The flag's spelling on the command line (the to_json key with dashes).
std::string flag_of(const std::string& key) {
  if (key == "sft") return "the command";
  std::string flag = key;
  std::replace(flag.begin(), flag.end(), '_', '-');
  return "--" + flag;
}

std::string value_of(const std::string& key, const nlohmann::json& v) {
  if (key == "sft" && v.is_boolean()) return v.get<bool>() ? "opd sft" : "opd train";
  return v.dump();
}

}  // namespace

const std::vector<ResumeOptionRule>& resume_option_rules() {
  static const std::vector<ResumeOptionRule> rules = {
      // What is trained towards and from what: another objective or data order is another run.
      {"sft", P::MustMatch, "the objective (cross-entropy or distillation)"},
      {"seed", P::MustMatch,
       "the seed orders the data, the saved data cursor indexes that order, and it keys every "
       "random draw"},
      // The data's content is checked by the data cursor (sample count and SHA-256 of every
      // sample's ids), so the same data under another path resumes.
      {"data", P::Free, ""},
      {"student", P::Warn,
       "the checkpoint's weights continue, the new directory supplies only its config, "
       "tokenizer and chat template"},
      {"teacher", P::Warn, "the teacher the student is distilled towards"},
      {"teacher_url", P::Warn, "the teacher the student is distilled towards"},
      // What it asserts (vocabulary, tokenizer) is part of the teacher's identity, compared
      // by check_resume_teacher.
      {"teacher_config", P::Free, ""},
      // The objective's settings: legitimate to change, but the resumed run is not the same run.
      {"lmbda", P::Warn, "the on-policy share of steps"},
      {"seq_kd", P::Warn, "who writes the off-policy completions"},
      {"beta", P::Warn, "the divergence"},
      {"loss_support", P::Warn, "the divergence's support"},
      {"kd_temperature", P::Warn, "the distillation temperature"},
      {"sft_alpha", P::Warn, "the loss's cross-entropy term"},
      {"teacher_top_k", P::Warn, "the teacher's scored support"},
      {"vocab_policy", P::Warn, "how teacher ids outside the student's vocabulary are treated"},
      {"temperature", P::Warn, "rollout sampling"},
      {"top_p", P::Warn, "rollout sampling"},
      {"top_k", P::Warn, "rollout sampling"},
      {"min_p", P::Warn, "rollout sampling"},
      {"num_generations", P::Warn, "completions per prompt"},
      {"max_completion_length", P::Warn, "the completions' length"},
      {"max_prompt_length", P::Warn, "which prompts are cut"},
      {"truncation", P::Warn, "which prompts are cut"},
      {"ignore_eos", P::Warn, "the completions' length"},
      {"device", P::Warn, "the arithmetic: the steps are not bitwise those of the saved run's device"},
      {"dtype", P::Warn, "the arithmetic"},
      {"batch_size", P::Warn, "prompts per step; the data cursor goes on where it stood"},
      {"learning_rate", P::Warn, "the step size from here on"},
      {"lr_scheduler_type", P::Warn, "the learning rate from here on"},
      {"warmup_steps", P::Warn, "the learning rate from here on"},
      {"warmup_ratio", P::Warn, "the learning rate from here on"},
      {"min_lr_ratio", P::Warn, "the learning rate from here on"},
      {"weight_decay", P::Warn, "the update"},
      {"adam_beta1", P::Warn, "the update; the saved moments continue"},
      {"adam_beta2", P::Warn, "the update; the saved moments continue"},
      {"adam_epsilon", P::Warn, "the update"},
      {"max_grad_norm", P::Warn, "the update's clipping"},
      {"max_steps", P::Warn,
       "the run's length; the learning-rate schedule is recomputed over the new total"},
      {"num_train_epochs", P::Warn,
       "the run's length; the learning-rate schedule is recomputed over the new total"},
      // How and where the same steps are computed, saved, logged and evaluated.
      {"micro_batch_size", P::Free, ""},  // the step's mean is the same; only rounding differs
      {"eval_data", P::Free, ""},
      {"out", P::Free, ""},  // --resume PATH may continue another run's checkpoint elsewhere
      {"teacher_timeout_s", P::Free, ""},
      {"kv_cache_gb", P::Free, ""},
      {"recompute", P::Free, ""},
      {"recompute_granularity", P::Free, ""},
      {"offload_teacher", P::Free, ""},
      {"device_memory_budget_gb", P::Free, ""},
      {"zero_stage", P::Free, ""},
      {"save_steps", P::Free, ""},
      {"save_minutes", P::Free, ""},
      {"save_total_limit", P::Free, ""},
      {"resume", P::Free, ""},
      {"eval_steps", P::Free, ""},
      {"eval_limit", P::Free, ""},
      {"max_bad_steps", P::Free, ""},
      {"logging_steps", P::Free, ""},
      {"tensorboard", P::Free, ""},
      {"eval_before", P::Free, ""},
  };
  return rules;
}

std::optional<std::string> check_resume_teacher(const nlohmann::json& saved,
                                               const nlohmann::json& now) {
  if (!saved.is_object() || !now.is_object()) return std::nullopt;
  auto str = [](const nlohmann::json& j, const char* key) {
    return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : std::string();
  };
  auto short_fp = [](const std::string& fp) { return fp.substr(0, 16); };
  const char* why = "the teacher the student is distilled towards";
  if (saved.contains("teacher") && now.contains("teacher")) {  // in-process: --teacher DIR
    const std::string a = str(saved, "weights_fingerprint"), b = str(now, "weights_fingerprint");
    if (a.empty() || b.empty() || a == b) return std::nullopt;
    const std::string was = str(saved, "teacher"), is = str(now, "teacher");
    return cat("resume: the teacher's weights fingerprint (config.json, safetensors headers and "
               "sampled data) was ", short_fp(a), " (--teacher \"", was, "\") in the checkpoint, now ",
               short_fp(b), " (--teacher \"", is, "\")",
               was == is ? ": its files changed under the same path" : "", "; ", why,
               "; the resumed run is not the same run");
  }
  if (saved.contains("teacher_url") && now.contains("teacher_url")) {  // a served teacher
    std::string was, is;
    for (const char* key : {"model", "vocab_size", "tokenizer_fingerprint", "weights_fingerprint"}) {
      if (!saved.contains(key) || !now.contains(key) || saved[key] == now[key]) continue;
      const bool fp = std::string(key).find("fingerprint") != std::string::npos;
      auto show = [&](const nlohmann::json& v) {
        return fp && v.is_string() ? short_fp(v.get<std::string>()) : v.dump();
      };
      was += cat(was.empty() ? "" : ", ", key, " ", show(saved[key]));
      is += cat(is.empty() ? "" : ", ", key, " ", show(now[key]));
    }
    if (was.empty()) return std::nullopt;
    return cat("resume: the teacher at --teacher-url reported ", was, " (", str(saved, "teacher_url"),
               ") in the checkpoint, now ", is, " (", str(now, "teacher_url"), "): ", why,
               "; the resumed run is not the same run");
  }
  return std::nullopt;
}

std::vector<std::string> check_resume_options(const nlohmann::json& saved, const nlohmann::json& now,
                                              const std::string& checkpoint_dir) {
  std::vector<std::string> warnings, refusals;
  if (!saved.is_object() || !now.is_object()) return warnings;
  const auto& rules = resume_option_rules();
  for (const auto& [key, value] : now.items()) {
    if (!saved.contains(key) || saved[key] == value) continue;
    const auto rule = std::find_if(rules.begin(), rules.end(),
                                   [&](const ResumeOptionRule& r) { return key == r.key; });
    const ResumePolicy policy = rule == rules.end() ? ResumePolicy::Warn : rule->policy;
    if (policy == ResumePolicy::Free) continue;
    std::string line = cat(flag_of(key), " was ", value_of(key, saved[key]), " in the checkpoint, now ",
                           value_of(key, value), ": ",
                           rule == rules.end() ? "an option without a resume policy" : rule->why);
    (policy == ResumePolicy::MustMatch ? refusals : warnings).push_back(std::move(line));
  }
  if (!refusals.empty()) {
    std::string all;
    for (const auto& r : refusals) all += (all.empty() ? "" : "; ") + r;
    OPD_FAIL(InvalidArgument, "cannot resume from ", checkpoint_dir, ": ", all,
             ". Continuing it so would not be the run it saved: resume with the saved values, "
             "or start a new run from its weights (--student ", checkpoint_dir,
             " --out NEW_DIR)");
  }
  for (auto& w : warnings) w = "resume: " + w + "; the resumed run is not the same run";
  return warnings;
}

}  // namespace opd
