// Vocabulary/tokenizer fingerprint: the identity that teacher/student compatibility checks
// compare. SHA-256 over a canonical JSON (sorted keys, no whitespace) of the parts of
// tokenizer.json that decide ids — model (type, vocab, merges), added_tokens, normalizer,
// pre_tokenizer — plus the config's vocab_size (the embedding rows, which can exceed the
// tokenizer's vocabulary). Formatting changes to tokenizer.json do not change it.
#pragma once

#include <cstdint>
#include <string>

namespace opd {

struct TokenizerFingerprint {
  std::string sha256;        // 64 hex chars
  bool has_tokenizer = false;  // false: only vocab_size went in (no tokenizer.json)
  int64_t tokenizer_vocab = 0;  // highest token id + 1 in tokenizer.json (0 without one)
};

TokenizerFingerprint tokenizer_fingerprint(const std::string& model_dir, int64_t vocab_size);

}  // namespace opd
