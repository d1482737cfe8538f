// Completion text and stop strings for one generated sample: token ids are decoded
// incrementally (tokenizer/IncrementalDecoder, so a character split across tokens is emitted
// once complete) and each new piece is searched for the stop strings together with the
// max_len - 1 bytes before it, so a stop string spanning any number of tokens is found as soon
// as its last byte is decoded, in O(piece + max_len) per token.
// Convention (vLLM's default): the text ends just before the earliest stop string; the token
// ids keep every token generated, including the one that completed the stop string.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace opd {

class CompletionText {
 public:
  // skip_special_tokens: special tokens (e.g. EOS) add no text, as in vLLM's default.
  CompletionText(const Tokenizer& tokenizer, std::vector<std::string> stop_strings,
                 bool skip_special_tokens = true);

  // Appends a token; returns true when a stop string has just been completed (text() is then
  // cut before it and matched() names it). Pushing after a match is an error.
  bool push(int32_t id);
  // Flushes an incomplete trailing character (as U+FFFD) unless a stop string matched.
  void finish();

  const std::string& text() const { return text_; }
  const std::optional<std::string>& matched() const { return matched_; }

 private:
  IncrementalDecoder decoder_;
  std::vector<std::string> stops_;
  size_t max_len_ = 0;
  std::string text_;
  std::optional<std::string> matched_;
};

}  // namespace opd
