// PCRE2-backed regex for the tokenizer's pre-split patterns (RAII over pcre2_code, JIT when
// available). Patterns come from tokenizer.json and were written for Oniguruma, which Hugging
// Face tokenizers uses; translate_pattern() rewrites the constructs whose meaning differs in
// PCRE2 (\s, \S, \p{L}, \p{N}: see unicode.h) so that both engines match the same text.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace opd {

// Rewrites an Oniguruma pattern into an equivalent PCRE2 one (throws Unsupported for a
// construct it cannot translate, e.g. \S inside a character class).
std::string translate_pattern(std::string_view onig_pattern);

class Regex {
 public:
  // pattern: PCRE2 syntax (already translated); what: names it in error messages.
  Regex(const std::string& pattern, const std::string& what);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-overlapping matches [start, end) in valid UTF-8 text, left to right; empty matches are
  // skipped. Appends to out.
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct Code;
  std::unique_ptr<Code> code_;
  std::string pattern_, what_;
};

}  // namespace opd
