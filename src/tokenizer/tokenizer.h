// Hugging Face tokenizer.json, byte-level BPE (Qwen2/Qwen3, Llama-3, GPT-2/SmolLM families),
// reproducing the `tokenizers` library id for id: added/special tokens matched first
// (leftmost-longest, honouring lstrip/rstrip/single_word/normalized), NFC normalizer, Split
// (PCRE2, the file's own pattern) and ByteLevel pre-tokenizers, BPE merges by rank (the same
// lowest-rank-then-leftmost order as HF's merge_all), ByteLevel decoder and TemplateProcessing.
// Anything else in a tokenizer.json is an Unsupported error naming the component, never a
// silent approximation. A byte without a vocab entry (SmolLM2 lacks 21) is dropped before
// merging, exactly as HF's BPE does when the model has no unk_token.
//
// Text rule: encode() takes bytes; invalid UTF-8 is replaced by U+FFFD per maximal ill-formed
// subsequence (utf8.h), i.e. exactly what Python's bytes.decode("utf-8", errors="replace")
// gives, so a corpus line read that way on the HF side tokenizes identically.
// Ids rule (DESIGN.md invariant 1): decode() rejects an id outside the vocabulary with an
// error naming position, value and limit, where HF would silently drop it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace opd {

// What tokenizer_config.json says (all optional; empty when the file or field is absent).
struct TokenizerConfig {
  std::optional<std::string> bos_token, eos_token, pad_token, unk_token;
  std::optional<std::string> chat_template;  // the "default" one when several are given
  std::optional<bool> add_bos_token, add_eos_token;
  std::string path;                          // the file read, empty when none
};

struct AddedTokenInfo {
  int32_t id = 0;
  std::string content;
  bool special = false, lstrip = false, rstrip = false, single_word = false, normalized = false;
};

class Tokenizer {
 public:
  // path: a tokenizer.json file, or a model directory holding one. tokenizer_config.json
  // beside it is read when present.
  static Tokenizer load(const std::string& path);

  // Token ids of text (add_special_tokens: apply the file's post_processor, e.g. Llama-3's
  // <|begin_of_text|>). Thread-safe; each thread keeps its own word cache.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;

  // Text of ids (skip_special_tokens: drop tokens marked special). Invalid byte sequences that
  // the ids spell are replaced with U+FFFD, as HF does.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token string (byte-level form for BPE tokens); throws InvalidArgument for an id that is
  // out of range or unassigned.
  const std::string& id_to_token(int32_t id) const;
  // The raw bytes this token contributes to decoded text (not necessarily valid UTF-8).
  const std::string& token_bytes(int32_t id) const;

  int32_t vocab_size() const;  // highest id + 1 (BPE vocabulary and added tokens)
  bool is_special(int32_t id) const;
  bool contains(int32_t id) const;  // id is assigned
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  std::optional<int32_t> pad_id() const;
  const TokenizerConfig& config() const;
  const std::vector<AddedTokenInfo>& added_tokens() const;
  const std::string& path() const;  // the tokenizer.json read

  struct Impl;

 private:
  Tokenizer() = default;  // only load() makes one, so impl_ is never null
  friend class IncrementalDecoder;
  std::shared_ptr<const Impl> impl_;
};

// Streaming detokenizer: feed ids one at a time, get text as soon as whole UTF-8 characters are
// available. The concatenation of everything returned by push() and finish() equals
// Tokenizer::decode() of all the ids pushed.
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);
  std::string push(int32_t id);
  std::string push(std::span<const int32_t> ids);
  // Emits what is still held (an incomplete sequence becomes U+FFFD) and resets.
  std::string finish();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_;
  bool any_ = false;     // a token was emitted (for decoders that join with a space)
  std::string pending_;  // bytes of an incomplete UTF-8 sequence
};

}  // namespace opd
