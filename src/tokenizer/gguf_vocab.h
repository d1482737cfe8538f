// Rebuilds a Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) from the tokenizer
// metadata of a GGUF file (tokenizer.ggml.*, as llama.cpp's converter writes it): the "gpt2"
// (byte-level BPE) model with its tokens, merges, token types and special-token ids, the
// pre-tokenizer named by tokenizer.ggml.pre, and tokenizer.chat_template. Token types follow
// llama.cpp's enum: 1 normal, 2 unknown, 3 control (-> added token, special), 4 user-defined
// (-> added token, not special), 5 unused, 6 byte. Depends only on core (the caller reads the
// GGUF file); everything from the file is validated here, errors name the key, value and limit.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace opd {

struct GgufVocab {
  std::string source;                 // file name for error messages
  std::string model;                  // tokenizer.ggml.model
  std::string pre = "default";        // tokenizer.ggml.pre
  std::vector<std::string> tokens;    // tokenizer.ggml.tokens (index = id)
  std::vector<int64_t> token_types;   // tokenizer.ggml.token_type (empty = all normal)
  std::vector<std::string> merges;    // tokenizer.ggml.merges, "a b"
  std::optional<int64_t> bos_id, eos_id, unk_id, pad_id;
  std::optional<bool> add_bos, add_eos;
  std::optional<std::string> chat_template;
  std::optional<int64_t> model_max_length;  // {arch}.context_length
};

struct HfTokenizerFiles {
  std::string tokenizer_json;
  std::string tokenizer_config_json;
};

// Pre-tokenizer names accepted in tokenizer.ggml.pre, for help texts and errors.
std::string gguf_supported_pre_tokenizers();

// Throws Unsupported for another model than "gpt2" or an unknown pre-tokenizer, InvalidData
// for inconsistent metadata (array lengths, ids out of range, malformed merges, duplicate tokens).
HfTokenizerFiles build_hf_tokenizer(const GgufVocab& vocab);

}  // namespace opd
