// Held-out evaluation by exact match: each prompt is completed greedily (temperature 0) with
// the rollout engine and the completion's token ids, EOS included, are compared with the
// reference completion's ids (the dataset appends EOS to raw-text completions). Token-level
// comparison, so formatting is judged exactly as the model writes it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "model/transformer.h"

namespace opd {

struct EvalOptions {
  int64_t max_new_tokens = 256;
  int64_t limit = 0;                 // first N samples (0 = all)
  double kv_cache_gb = 1.0;
  int64_t max_examples = 3;          // wrong answers kept for the log
};

struct EvalResult {
  int64_t total = 0, correct = 0;
  double accuracy() const { return total > 0 ? static_cast<double>(correct) / total : 0.0; }
  std::vector<std::string> wrong_examples;  // "source: got [ids] want [ids]"
};

// Samples without a reference completion are an InvalidArgument error naming the sample.
EvalResult evaluate_exact_match(const Transformer& model, const std::vector<int32_t>& eos_ids,
                                const Dataset& data, const EvalOptions& options);

}  // namespace opd
