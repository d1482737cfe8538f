// Held-out evaluation of a model, three metrics (all through the rollout engine, so the
// completions are exactly what training would sample):
//  - exact match: each prompt is completed greedily (temperature 0) and the completion's token
//    ids, EOS included, are compared with the reference completion's ids (the dataset appends
//    EOS to raw-text completions). Token-level, so formatting is judged as the model writes it.
//  - reverse KL to a teacher on the student's own samples (the quantity on-policy distillation
//    with beta = 1 minimizes; Agarwal et al. 2024, Thinking Machines' "on-policy distillation"):
//      KL(Q||P) per token = E_{y ~ q} [log q(y_t | y_<t) - log p(y_t | y_<t)],
//    estimated by sampling completions from the student Q at temperature T (no top-k/p/min-p
//    filtering, so the draws are from q_T itself) and taking, for every sampled token, the
//    student's log q_T(y_t) from the rollout and the teacher's log p_T(y_t) from a Scorer
//    (teacher/scorer.h, top-K = 0: only the actual token). The mean over all completion tokens
//    (EOS included) estimates the mean of the per-position KL(q(.|y_<t) || p(.|y_<t)) over the
//    positions the student visits; one term can be negative, its expectation given y_<t cannot.
//  - agreement of greedy answers with the teacher's: both complete each prompt greedily for N
//    tokens; exact = the first N ids are identical (so the first N tokens' text is too), token
//    agreement = matching ids position by position over max(len_student, len_teacher) positions
//    of the N, and the mean common-prefix length.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "model/transformer.h"
#include "rollout/engine.h"  // GenerationProgress
#include "tokenizer/tokenizer.h"

namespace opd {
class Scorer;  // teacher/scorer.h
}

namespace opd {

struct EvalOptions {
  int64_t max_new_tokens = 256;
  int64_t limit = 0;                 // first N samples (0 = all)
  double kv_cache_gb = 1.0;
  int64_t max_examples = 3;          // wrong answers kept for the log
  // Polled once per generation step: true stops the evaluation with a Cancelled error (a
  // training run's stop signal must not wait for a long evaluation).
  std::function<bool()> should_cancel;
  // The rollout engine's per-step report (EngineOptions::on_progress), e.g. a progress bar.
  std::function<void(const GenerationProgress&)> on_progress;
};

struct EvalResult {
  int64_t total = 0, correct = 0;
  double accuracy() const { return total > 0 ? static_cast<double>(correct) / total : 0.0; }
  std::vector<std::string> wrong_examples;  // "source: got [ids] want [ids]"
};

// Samples without a reference completion are an InvalidArgument error naming the sample.
EvalResult evaluate_exact_match(const Transformer& model, const std::vector<int32_t>& eos_ids,
                                const Dataset& data, const EvalOptions& options);

struct ReverseKlOptions {
  int64_t max_new_tokens = 256;      // completion length limit (EOS ends a sample earlier)
  int64_t samples_per_prompt = 1;    // student samples per prompt (variance reduction)
  double temperature = 1.0;          // T of the student's samples and of both distributions, > 0
  uint64_t seed = 0;                 // sampling seed (draws keyed by (seed, prompt, sample, step))
  int64_t limit = 0;                 // first N prompts (0 = all)
  double kv_cache_gb = 1.0;
  bool keep_samples = false;         // return every sample's ids and logprobs (tests, dumps)
  std::function<void(const GenerationProgress&)> on_progress;  // the student's sampling
};

struct ReverseKlSample {
  int64_t prompt_index = 0;
  std::vector<int32_t> ids;                   // completion ids (EOS included when it ended there)
  std::vector<double> student_logprobs;       // log q_T(y_t)
  std::vector<double> teacher_logprobs;       // log p_T(y_t)
};

struct ReverseKlResult {
  int64_t prompts = 0, samples = 0, tokens = 0;
  int64_t truncated = 0;             // samples that hit max_new_tokens without EOS
  double mean = 0;                   // sum_t (log q - log p) / tokens: reverse KL per token
  double std_error = 0;              // of `mean`, over samples (ratio estimator; 0 if samples < 2)
  double student_logprob = 0;        // mean log q_T(y_t) (= minus the student's entropy rate)
  double teacher_logprob = 0;        // mean log p_T(y_t)
  double seconds_rollout = 0, seconds_teacher = 0;
  std::vector<ReverseKlSample> kept; // when keep_samples
};

// Every completion token is scored: the teacher's vocabulary must cover the student's sampled
// ids (checked by the scorer: InvalidArgument naming sequence, position, id and limit). The
// teacher's answer is checked against the request (shape) and for finite values (InvalidData).
ReverseKlResult evaluate_reverse_kl(const Transformer& student, Scorer& teacher,
                                    const std::vector<int32_t>& eos_ids, const Dataset& data,
                                    const ReverseKlOptions& options);

struct AgreementOptions {
  int64_t tokens = 32;               // N: greedy tokens generated by each model and compared
  int64_t limit = 0;                 // first N prompts (0 = all)
  double kv_cache_gb = 1.0;
  int64_t max_examples = 3;          // disagreeing answers kept (text when a tokenizer is given)
  // Both generations report through it, the student's first (its steps restart at 1).
  std::function<void(const GenerationProgress&)> on_progress;
};

struct AgreementResult {
  int64_t prompts = 0, exact = 0;
  int64_t compared_tokens = 0, agreeing_tokens = 0;  // positional, over max(len_s, len_t)
  int64_t prefix_tokens = 0;                         // sum of common-prefix lengths
  double exact_rate() const { return prompts > 0 ? static_cast<double>(exact) / prompts : 0.0; }
  double token_agreement() const {
    return compared_tokens > 0 ? static_cast<double>(agreeing_tokens) / compared_tokens : 0.0;
  }
  double mean_prefix() const { return prompts > 0 ? static_cast<double>(prefix_tokens) / prompts : 0.0; }
  std::vector<std::string> examples;  // "source: student <text> | teacher <text>"
};

// Student and teacher may have different EOS sets (each stops at its own). The tokenizer, when
// given, only decodes the kept examples.
AgreementResult evaluate_agreement(const Transformer& student, const std::vector<int32_t>& student_eos,
                                   const Transformer& teacher, const std::vector<int32_t>& teacher_eos,
                                   const Dataset& data, const AgreementOptions& options,
                                   const Tokenizer* tokenizer = nullptr);

}  // namespace opd
