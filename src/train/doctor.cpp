// Teacher/student compatibility checks and the memory estimate (see doctor.h).
#include "train/doctor.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "core/error.h"
#include "model/config.h"
#include "rollout/engine.h"
#include "teacher/scorer.h"  // SharedPromptOptions
#include "tokenizer/fingerprint.h"
#include "tokenizer/tokenizer.h"

namespace opd {

ModelSide describe_config(const ModelConfig& c) {
  ModelSide s;
  s.vocab_size = c.vocab_size;
  s.num_parameters = c.num_parameters();
  s.hidden_size = c.hidden_size;
  s.num_layers = c.num_hidden_layers;
  s.intermediate_size = c.intermediate_size;
  s.num_attention_heads = c.num_attention_heads;
  s.num_key_value_heads = c.num_key_value_heads;
  s.head_dim = c.head_dim;
  return s;
}

ModelSide describe_model_dir(const std::string& dir) {
  const ModelConfig c = load_model_config(dir);
  ModelSide s = describe_config(c);
  s.where = dir;
  const TokenizerFingerprint fp = tokenizer_fingerprint(dir, c.vocab_size);
  s.fingerprint = fp.sha256;
  s.tokenizer_vocab = fp.tokenizer_vocab;
  std::optional<Tokenizer> tok;
  if (std::filesystem::exists(dir + "/tokenizer.json")) tok.emplace(Tokenizer::load(dir));
  for (int32_t id : generation_eos_ids(dir, c, tok ? &*tok : nullptr)) s.eos_ids.push_back(id);
  if (tok) {
    const auto& tc = tok->config();
    s.bos_token = tc.bos_token.value_or("");
    s.eos_token = tc.eos_token.value_or("");
    s.pad_token = tc.pad_token.value_or("");
    s.has_chat_template = tc.chat_template.has_value();
    s.chat_template = tc.chat_template.value_or("");
  }
  return s;
}

namespace {
std::string list(const std::vector<int64_t>& v) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < v.size(); ++i) o << (i ? ", " : "") << v[i];
  o << "]";
  return o.str();
}
}  // namespace

std::vector<DoctorFinding> check_pair(const ModelSide& s, const ModelSide& t,
                                      bool policy_allows_clip) {
  std::vector<DoctorFinding> out;
  auto add = [&](Severity sev, const char* check, std::string msg) {
    out.push_back({sev, check, std::move(msg)});
  };
  const Severity vocab_sev = policy_allows_clip ? Severity::Warning : Severity::Error;
  if (s.vocab_size == t.vocab_size)
    add(Severity::Ok, "vocab_size", cat("both ", s.vocab_size));
  else
    add(t.vocab_size > s.vocab_size ? vocab_sev : Severity::Error, "vocab_size",
        cat("student ", s.vocab_size, ", teacher ", t.vocab_size,
            t.vocab_size > s.vocab_size
                ? (policy_allows_clip ? " (clip-to-student drops teacher ids >= the student's vocab)"
                                      : " (pass --vocab-policy clip-to-student to drop teacher ids the "
                                        "student lacks)")
                : " (a teacher vocabulary smaller than the student's cannot score every student token)"));
  if (s.fingerprint.empty() || t.fingerprint.empty())
    add(Severity::Warning, "tokenizer", "a fingerprint is unknown (no tokenizer.json on one side)");
  else if (s.fingerprint == t.fingerprint)
    add(Severity::Ok, "tokenizer", cat("same tokenizer (", s.fingerprint.substr(0, 12), ")"));
  else
    add(vocab_sev, "tokenizer",
        cat("tokenizers differ (student ", s.fingerprint.substr(0, 12), ", teacher ",
            t.fingerprint.substr(0, 12), "): the same id may mean different text"));
  const std::set<int64_t> se(s.eos_ids.begin(), s.eos_ids.end()), te(t.eos_ids.begin(), t.eos_ids.end());
  if (s.eos_ids.empty())
    add(Severity::Error, "eos", "the student has no EOS id: its completions can never end");
  else if (se == te)
    add(Severity::Ok, "eos", cat("both ", list(s.eos_ids)));
  else {
    bool overlap = false;
    for (int64_t id : se) overlap |= te.count(id) > 0;
    add(Severity::Warning, "eos",
        cat("student EOS ", list(s.eos_ids), ", teacher EOS ", list(t.eos_ids),
            overlap ? " (they overlap; tokens only one side stops on are learned as text)"
                    : " (disjoint: the teacher ends turns with a token the student never stops on, a "
                      "known cause of completions running to --max-completion-length; a base "
                      "student with an instruct teacher usually needs the teacher's EOS in the "
                      "student's generation_config.json)"));
  }
  if (s.eos_token != t.eos_token || s.bos_token != t.bos_token || s.pad_token != t.pad_token)
    add(Severity::Warning, "special_tokens",
        cat("student bos/eos/pad '", s.bos_token, "'/'", s.eos_token, "'/'", s.pad_token,
            "', teacher '", t.bos_token, "'/'", t.eos_token, "'/'", t.pad_token, "'"));
  else
    add(Severity::Ok, "special_tokens", cat("bos/eos/pad '", s.bos_token, "'/'", s.eos_token, "'/'",
                                            s.pad_token, "'"));
  if (s.has_chat_template != t.has_chat_template)
    add(Severity::Warning, "chat_template",
        cat(s.has_chat_template ? "only the student" : "only the teacher",
            " has a chat template: chat data is rendered with the student's template; the teacher "
            "scores those ids as they are"));
  else if (s.has_chat_template && s.chat_template != t.chat_template)
    add(Severity::Warning, "chat_template",
        "the chat templates differ: prompts are rendered with the student's template");
  else
    add(Severity::Ok, "chat_template", s.has_chat_template ? "same template" : "none on either side");
  return out;
}

MemoryEstimate estimate_memory(const ModelSide& s, const ModelSide* teacher,
                               int64_t micro_batch_tokens, double kv_cache_gb) {
  MemoryEstimate m;
  m.weights = s.num_parameters * 4;
  m.grads = s.num_parameters * 4;
  m.optimizer = s.num_parameters * 8;
  // Per layer and token the backward keeps ~12 hidden-sized and 3 intermediate-sized f32 rows.
  m.activations = micro_batch_tokens * s.num_layers * (12 * s.hidden_size + 3 * s.intermediate_size) * 4;
  m.kv_cache = static_cast<int64_t>(kv_cache_gb * (1 << 30));
  if (teacher) m.teacher = teacher->num_parameters * 4;
  return m;
}

MemoryPlan plan_gpu_memory(const ModelSide& s, const ModelSide* teacher,
                           const MemoryPlanOptions& o) {
  const int64_t P = s.num_parameters, bytes = static_cast<int64_t>(dtype_size(o.dtype));
  const int64_t ranks = o.zero_stage > 0 ? std::max(1, o.world_size) : 1;
  MemoryPlan m;
  m.model = P * bytes;
  m.master = P * 4 / ranks;
  m.optimizer = P * 8 / ranks;
  m.grads = P * 4 + (o.zero_stage == 2 ? P * 4 / ranks : 0);
  m.grads_whole_run = o.zero_stage > 0;
  if (teacher) {
    m.teacher = teacher->num_parameters * bytes;
    const int64_t Ht = teacher->hidden_size, It = teacher->intermediate_size;
    const int64_t qkv = (teacher->num_attention_heads + 2 * teacher->num_key_value_heads) *
                        teacher->head_dim;
    m.scoring = o.scorer_batch_tokens * (6 * Ht + 2 * qkv + 4 * It) * bytes +
                o.scorer_row_chunk * o.scorer_vocab_tile * 4;
    if (o.shared_prompt_tokens > 0) {
      const int64_t kv_row = teacher->num_key_value_heads * teacher->head_dim * bytes;
      const int64_t block = SharedPromptOptions{}.block_size;
      const int64_t cache_tokens = o.shared_prompt_tokens +
                                   std::max(o.scorer_batch_tokens, o.shared_completion_tokens) +
                                   block * std::max<int64_t>(1, o.shared_group);
      m.scoring += cache_tokens * 2 * teacher->num_layers * kv_row +
                   2 * std::max<int64_t>(1, o.shared_group) *
                       (o.shared_prompt_tokens + o.shared_completion_tokens) * kv_row;
    }
  }
  m.teacher_whole_run = !o.offload_teacher;
  const int64_t H = s.hidden_size, I = s.intermediate_size, T = o.micro_batch_tokens;
  const int64_t per_layer = T * (14 * H + 3 * I) * bytes;
  switch (o.recompute) {
    case Recompute::Off: m.activations = per_layer * s.num_layers; break;
    case Recompute::Elementwise: m.activations = T * (9 * H + 2 * I) * bytes * s.num_layers; break;
    case Recompute::PerLayer: m.activations = T * H * bytes * s.num_layers + 2 * per_layer; break;
  }
  m.workspace = T * 4 * (H + 4 * H) + (int64_t{256} << 20);
  if (teacher && o.full_support) {  // the teacher runs inside the training phase, never scores
    const int64_t Ht = teacher->hidden_size, It = teacher->intermediate_size;
    m.scoring = 0;
    m.workspace += T * (14 * Ht + 3 * It) * bytes + 2 * T * Ht * bytes;
  }
  m.rollout = o.kv_cache_bytes + P * bytes / 2;
  return m;
}

std::optional<MemoryChoice> fit_memory_budget(const ModelSide& s, const ModelSide* teacher,
                                              const MemoryPlanOptions& base, bool can_offload,
                                              int64_t budget, MemoryChoice* smallest) {
  const std::pair<Recompute, bool> order[] = {
      {Recompute::Off, false},        {Recompute::Elementwise, false},
      {Recompute::Off, true},         {Recompute::Elementwise, true},
      {Recompute::PerLayer, false},   {Recompute::PerLayer, true}};
  auto rank = [](Recompute r) { return r == Recompute::Off ? 0 : r == Recompute::Elementwise ? 1 : 2; };
  std::optional<MemoryChoice> best_small;
  for (const auto& [recompute, offload] : order) {
    if (rank(recompute) < rank(base.recompute) || (base.offload_teacher && !offload)) continue;
    if (offload && !(can_offload && teacher)) continue;
    MemoryPlanOptions o = base;
    o.recompute = recompute;
    o.offload_teacher = offload;
    MemoryChoice c{recompute, offload, plan_gpu_memory(s, teacher, o)};
    if (c.plan.peak() <= budget) return c;
    if (!best_small || c.plan.peak() < best_small->plan.peak()) best_small = c;
  }
  if (smallest && best_small) *smallest = *best_small;
  return std::nullopt;
}

int64_t available_host_memory() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

}  // namespace opd
