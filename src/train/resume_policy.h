// What a resumed run may change: every option `opd train` saves in a checkpoint's state.json
// ("options", TrainOptions::to_json) has one policy, and resume compares the saved values with
// this run's under it. A run that would be wrong or meaningless to continue (another objective,
// another data order) is refused naming each such option with both values; a legitimate change
// (a new learning rate, more steps, another teacher) is allowed with a warning naming both
// values; settings that only decide how or where the same steps are computed, saved or logged
// (memory, checkpoints, evaluation) are free. The table is in resume_policy.cpp; a test holds it
// to cover every key of TrainOptions::to_json, and an option missing from it is warned about.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace opd {

enum class ResumePolicy {
  MustMatch,  // a difference refuses the resume (InvalidArgument naming old and new values)
  Warn,       // a difference is allowed and warned about (old and new values, what it changes)
  Free,       // a difference is allowed silently
};

struct ResumeOptionRule {
  const char* key;     // TrainOptions::to_json's key
  ResumePolicy policy;
  const char* why;     // what the option decides, said with a difference ("" for Free)
};

// The table, one entry per key of TrainOptions::to_json.
const std::vector<ResumeOptionRule>& resume_option_rules();

// The differences between `saved` (a checkpoint's "options") and `now` (this run's
// TrainOptions::to_json). Keys absent from `saved` (a checkpoint written before the option
// existed) are not compared. Throws InvalidArgument naming every MustMatch difference, the
// checkpoint and how to start a new run from its weights instead; returns one warning line per
// Warn difference (and per key without a rule), each naming the flag, both values and why.
std::vector<std::string> check_resume_options(const nlohmann::json& saved, const nlohmann::json& now,
                                              const std::string& checkpoint_dir);

// The teacher's identity, saved beside the options in a checkpoint's state.json ("teacher"),
// because an option compares only the --teacher path or --teacher-url: weights rewritten under
// the same path would resume silently. For --teacher DIR {"teacher": DIR, "weights_fingerprint":
// model/weights_fingerprint.h's SHA-256, "safetensors_files", "safetensors_bytes"}; for
// --teacher-url what /v1/models reports {"teacher_url", "model", "vocab_size",
// "tokenizer_fingerprint", "weights_fingerprint" (an `opd serve`; absent for vLLM)}.
// Returns the warning line (the options' wording: "resume: ... was X in the checkpoint, now Y:
// the teacher the student is distilled towards; the resumed run is not the same run") when
// `saved` and `now` are of the same kind and differ in the weights fingerprint (DIR) or in
// model, vocabulary, tokenizer or weights fingerprint (URL; the URL itself is the option's,
// and a data-parallel run's ranks use different URLs of one pool). Nothing when `saved` is
// absent (a checkpoint written before session 17), when the kinds differ (the --teacher /
// --teacher-url warnings say it), or for a field only one side has.
std::optional<std::string> check_resume_teacher(const nlohmann::json& saved, const nlohmann::json& now);

}  // namespace opd
