// Names, parsing and range checks of the loss configuration (loss_config.h).
#include "loss/loss_config.h"

#include <cmath>

#include "core/error.h"

namespace opd {

std::string_view support_mode_name(SupportMode mode) {
  switch (mode) {
    case SupportMode::Full: return "full";
    case SupportMode::TopK: return "topk";
    case SupportMode::TopKTail: return "topk+tail";
    case SupportMode::Sampled: return "sampled";
  }
  return "?";
}

SupportMode parse_support_mode(std::string_view name) {
  for (SupportMode m : {SupportMode::Full, SupportMode::TopK, SupportMode::TopKTail,
                        SupportMode::Sampled}) {
    if (name == support_mode_name(m)) return m;
  }
  OPD_FAIL(InvalidArgument, "unknown support mode '", name,
           "' (choices: full, topk, topk+tail, sampled)");
}

std::string_view vocab_policy_name(VocabPolicy policy) {
  switch (policy) {
    case VocabPolicy::Error: return "error";
    case VocabPolicy::ClipToStudent: return "clip-to-student";
  }
  return "?";
}

VocabPolicy parse_vocab_policy(std::string_view name) {
  if (name == "error") return VocabPolicy::Error;
  if (name == "clip-to-student") return VocabPolicy::ClipToStudent;
  OPD_FAIL(InvalidArgument, "unknown vocab policy '", name, "' (choices: error, clip-to-student)");
}

void check_loss_config(const LossConfig& c) {
  OPD_CHECK(c.beta >= 0.0 && c.beta <= 1.0, InvalidArgument, "loss: beta ", c.beta,
            " is outside [0, 1]");
  OPD_CHECK(std::isfinite(c.temperature) && c.temperature > 0.0, InvalidArgument,
            "loss: temperature ", c.temperature, " must be finite and > 0");
  OPD_CHECK(std::isfinite(c.sft_alpha) && c.sft_alpha >= 0.0, InvalidArgument,
            "loss: sft_alpha ", c.sft_alpha, " must be finite and >= 0");
  OPD_CHECK(c.tail_floor > 0.0 && c.tail_floor < 1e-3, InvalidArgument, "loss: tail_floor ",
            c.tail_floor, " must be in (0, 1e-3)");
  OPD_CHECK(c.payload_sum_tolerance >= 0.0 && c.payload_sum_tolerance < 0.5, InvalidArgument,
            "loss: payload_sum_tolerance ", c.payload_sum_tolerance, " must be in [0, 0.5)");
  OPD_CHECK(c.vocab_tile >= 1 && c.vocab_tile <= (int64_t{1} << 24), InvalidArgument,
            "loss: vocab_tile ", c.vocab_tile, " must be in [1, 2^24]");
}

std::string describe(const LossConfig& c) {
  return cat(support_mode_name(c.mode), " beta=", c.beta, " T=", c.temperature,
             " sft_alpha=", c.sft_alpha, " vocab_policy=", vocab_policy_name(c.vocab_policy),
             " tile=", c.vocab_tile);
}

}  // namespace opd
