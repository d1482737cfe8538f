// Incremental completion text with stop-string search (contract in stop.h).
#include "rollout/stop.h"

#include <algorithm>

#include "core/error.h"

namespace opd {

CompletionText::CompletionText(const Tokenizer& tokenizer, std::vector<std::string> stop_strings,
                               bool skip_special_tokens)
    : decoder_(tokenizer, skip_special_tokens), stops_(std::move(stop_strings)) {
  for (size_t i = 0; i < stops_.size(); ++i) {
    OPD_CHECK(!stops_[i].empty(), InvalidArgument, "stop string ", i, " is empty");
    max_len_ = std::max(max_len_, stops_[i].size());
  }
}

bool CompletionText::push(int32_t id) {
  OPD_CHECK(!matched_, InvalidArgument, "CompletionText::push after the stop string '",
            *matched_, "' matched");
  const size_t old_len = text_.size();
  text_ += decoder_.push(id);
  if (stops_.empty() || text_.size() == old_len) return false;
  // A match must end in the new piece, so it starts at or after old_len - (max_len - 1).
  const size_t from = old_len >= max_len_ - 1 ? old_len - (max_len_ - 1) : 0;
  size_t best = std::string::npos;
  for (const std::string& s : stops_) {
    const size_t at = text_.find(s, from);
    if (at != std::string::npos && (best == std::string::npos || at < best)) {
      best = at;
      matched_ = s;
    }
  }
  if (best == std::string::npos) return false;
  text_.resize(best);
  return true;
}

void CompletionText::finish() {
  if (!matched_) text_ += decoder_.finish();
}

}  // namespace opd
