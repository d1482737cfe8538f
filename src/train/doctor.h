// Start-up compatibility checks of a teacher/student pair (issue 8 item 2; DESIGN.md
// invariant 1): vocabulary sizes, tokenizer fingerprints, special tokens, EOS ids and chat
// templates, the known trap of a base student whose EOS differs from an instruct teacher's
// (the student never learns to stop: completions run to the length limit), and the memory a
// run needs against what the machine has. `opd doctor` prints them; `opd train` runs the same
// checks before its first step and refuses errors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace opd {

struct ModelSide {
  std::string where;               // directory or URL
  int64_t vocab_size = 0;
  std::string fingerprint;         // tokenizer fingerprint sha256 ("" unknown)
  int64_t tokenizer_vocab = 0;     // ids in tokenizer.json (0 unknown)
  std::vector<int64_t> eos_ids;    // generation EOS ids (config, generation_config, tokenizer)
  std::string bos_token, eos_token, pad_token;
  bool has_chat_template = false;
  std::string chat_template;       // the text (for comparison)
  int64_t num_parameters = 0;
  int64_t hidden_size = 0, num_layers = 0, intermediate_size = 0;
};

enum class Severity { Ok, Warning, Error };

struct DoctorFinding {
  Severity severity = Severity::Ok;
  std::string check;    // "vocab_size", "tokenizer", "eos", ...
  std::string message;
};

// Reads a model directory (config.json, tokenizer files).
ModelSide describe_model_dir(const std::string& dir);

// Compares the two sides. policy_allows_clip: --vocab-policy clip-to-student was given (a
// vocabulary mismatch is then a warning, not an error).
std::vector<DoctorFinding> check_pair(const ModelSide& student, const ModelSide& teacher,
                                      bool policy_allows_clip);

struct MemoryEstimate {
  int64_t weights = 0, grads = 0, optimizer = 0, activations = 0, kv_cache = 0, teacher = 0;
  int64_t total() const { return weights + grads + optimizer + activations + kv_cache + teacher; }
};
// Bytes of a CPU (f32) training run: weights + grads + AdamW moments, activations of one
// micro-batch (tokens x (a per-layer constant x hidden + intermediate) x layers), the KV budget
// and an in-process teacher's weights.
MemoryEstimate estimate_memory(const ModelSide& student, const ModelSide* in_process_teacher,
                               int64_t micro_batch_tokens, double kv_cache_gb);
int64_t available_host_memory();  // MemAvailable of /proc/meminfo (0 when unknown)

}  // namespace opd
