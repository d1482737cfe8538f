// Configuration of the distillation loss (DESIGN.md, "Loss"): the generalized JSD coefficient
// beta (0 = forward KL(P||Q), 1 = reverse KL(Q||P), TRL / ms-swift convention), the
// distillation temperature T (P and Q are softmax(logits / T)), the support mode, the SFT
// cross-entropy mix `sft_alpha`, and the policy for a teacher vocabulary larger than the
// student's.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace opd {

// Which part of the teacher distribution the divergence sees (DESIGN.md, "Loss").
enum class SupportMode : uint8_t {
  Full,      // dense teacher logits (in-process teacher only), p and q over all of V
  TopK,      // both renormalized over the teacher's K ids (what ms-swift does)
  TopKTail,  // K atoms + one "rest of vocabulary" atom per side, student's exact LSE (default)
  Sampled,   // REINFORCE with per-token reward log p(y) - log q(y) of the sampled token
};

// What to do when the teacher's vocabulary is larger than the student's.
enum class VocabPolicy : uint8_t {
  Error,          // refuse (the default): the models do not share a vocabulary
  ClipToStudent,  // drop teacher ids >= student vocab, renormalize, count the drops
};

std::string_view support_mode_name(SupportMode mode);  // "full", "topk", "topk+tail", "sampled"
SupportMode parse_support_mode(std::string_view name);  // throws InvalidArgument naming the choices
std::string_view vocab_policy_name(VocabPolicy policy);  // "error", "clip-to-student"
VocabPolicy parse_vocab_policy(std::string_view name);

struct LossConfig {
  double beta = 0.5;                       // in [0, 1]
  double temperature = 1.0;                // T > 0, finite
  SupportMode mode = SupportMode::TopKTail;
  double sft_alpha = 0.0;                  // >= 0: weight of the cross-entropy on dataset rows
  VocabPolicy vocab_policy = VocabPolicy::Error;
  // topk+tail: log-tails log1p(-sum) are clamped at log(tail_floor) (and carry no gradient
  // there), so a teacher or student whose K atoms hold all the mass up to rounding gives a
  // finite tail instead of log(0) or log(negative).
  double tail_floor = 1e-12;
  // Validation: sum_k exp(a_k) may exceed 1 by this much (rounding in the teacher's softmax)
  // before the payload is rejected as not a (sub-)distribution.
  double payload_sum_tolerance = 1e-3;
  // Vocabulary tile width of the fused lm_head + loss (logit columns held per pass).
  int64_t vocab_tile = 4096;
};

// Throws InvalidArgument naming the field, its value and the allowed range.
void check_loss_config(const LossConfig& config);

std::string describe(const LossConfig& config);  // "topk+tail beta=0.5 T=1 sft_alpha=0 ..."

}  // namespace opd
