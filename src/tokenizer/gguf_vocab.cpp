// GGUF tokenizer metadata -> tokenizer.json / tokenizer_config.json (see gguf_vocab.h).
// The pre-tokenizer for each tokenizer.ggml.pre name is the one the original tokenizer.json of
// that family carries, expressed with the components tokenizer.h supports:
//   default, gpt2           ByteLevel with the GPT-2 regex
//   smollm, starcoder, ...  Digits(individual_digits) then ByteLevel with the GPT-2 regex; Digits
//                           is written as Split(\p{N}, Isolated), which splits identically
//                           (Rust's char::is_numeric is the Unicode N categories)
//   llama-bpe               Llama-3's Split regex (\p{N}{1,3}) then ByteLevel without regex
//   qwen2                   NFC, Qwen2's Split regex (\p{N}) then ByteLevel without regex
#include "tokenizer/gguf_vocab.h"

#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace opd {

namespace {

using json = nlohmann::ordered_json;

const char* kGpt2Digits[] = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva"};

const char* kLlama3Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char* kQwen2Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

json byte_level(bool use_regex, bool trim_offsets) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", trim_offsets},
          {"use_regex", use_regex}};
}

json split_regex(const std::string& pattern) {
  return {{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"},
          {"invert", false}};
}

struct PreTokenizer {
  json normalizer;
  json pre_tokenizer;
  bool ignore_merges = false;
};

PreTokenizer pre_tokenizer_for(const std::string& pre, const std::string& source) {
  PreTokenizer p;
  p.normalizer = nullptr;
  if (pre == "default" || pre == "gpt2" || pre.empty()) {
    p.pre_tokenizer = byte_level(true, true);
    return p;
  }
  for (const char* name : kGpt2Digits) {
    if (pre == name) {
      p.pre_tokenizer = {{"type", "Sequence"},
                         {"pretokenizers", json::array({split_regex("\\p{N}"), byte_level(true, true)})}};
      return p;
    }
  }
  if (pre == "llama-bpe" || pre == "llama3") {
    p.pre_tokenizer = {{"type", "Sequence"},
                       {"pretokenizers", json::array({split_regex(kLlama3Regex), byte_level(false, true)})}};
    p.ignore_merges = true;  // Llama-3's tokenizer.json sets it: whole-word vocab hits win
    return p;
  }
  if (pre == "qwen2") {
    p.normalizer = {{"type", "NFC"}};
    p.pre_tokenizer = {{"type", "Sequence"},
                       {"pretokenizers", json::array({split_regex(kQwen2Regex), byte_level(false, false)})}};
    return p;
  }
  OPD_FAIL(Unsupported, source, ": tokenizer.ggml.pre = '", pre,
           "' is a pre-tokenizer opd does not know (supported: ", gguf_supported_pre_tokenizers(), ")");
}

// Throws InvalidData when s is not valid UTF-8 (JSON strings must be).
std::string checked_utf8(const std::string& s, const std::string& what) {
  try {
    (void)json(s).dump();
  } catch (const json::exception&) {
    OPD_FAIL(InvalidData, what, " is not valid UTF-8");
  }
  return s;
}

}  // namespace

std::string gguf_supported_pre_tokenizers() {
  std::string s = "default, gpt2, llama-bpe, qwen2";
  for (const char* name : kGpt2Digits) s += std::string(", ") + name;
  return s;
}

HfTokenizerFiles build_hf_tokenizer(const GgufVocab& v) {
  const std::string& src = v.source;
  if (v.model != "gpt2")
    OPD_FAIL(Unsupported, src, ": tokenizer.ggml.model = '", v.model,
             "'; opd rebuilds only byte-level BPE tokenizers ('gpt2'), not SentencePiece ('llama') "
             "or others");
  const int64_t n = static_cast<int64_t>(v.tokens.size());
  if (n == 0) OPD_FAIL(InvalidData, src, ": tokenizer.ggml.tokens is empty");
  if (n > INT32_MAX) OPD_FAIL(InvalidData, src, ": tokenizer.ggml.tokens has ", n, " entries");
  if (!v.token_types.empty() && static_cast<int64_t>(v.token_types.size()) != n)
    OPD_FAIL(InvalidData, src, ": tokenizer.ggml.token_type has ", v.token_types.size(),
             " entries but tokenizer.ggml.tokens has ", n);
  auto check_id = [&](const std::optional<int64_t>& id, const char* key) {
    if (id && (*id < 0 || *id >= n))
      OPD_FAIL(InvalidData, src, ": ", key, " = ", *id, " is outside the vocabulary [0, ", n, ")");
  };
  check_id(v.bos_id, "tokenizer.ggml.bos_token_id");
  check_id(v.eos_id, "tokenizer.ggml.eos_token_id");
  check_id(v.unk_id, "tokenizer.ggml.unknown_token_id");
  check_id(v.pad_id, "tokenizer.ggml.padding_token_id");
  const PreTokenizer pre = pre_tokenizer_for(v.pre, src);

  json vocab = json::object();
  std::unordered_map<std::string, int64_t> seen;
  seen.reserve(static_cast<size_t>(n) * 2);
  json added = json::array();
  json added_decoder = json::object();
  for (int64_t id = 0; id < n; ++id) {
    const std::string& tok = v.tokens[id];
    const std::string what = cat(src, ": tokenizer.ggml.tokens[", id, "]");
    if (tok.empty()) OPD_FAIL(InvalidData, what, " is empty");
    auto [it, fresh] = seen.emplace(tok, id);
    if (!fresh)
      OPD_FAIL(InvalidData, what, " '", tok, "' repeats token ", it->second,
               " (a tokenizer.json vocabulary maps each string to one id)");
    vocab[checked_utf8(tok, what)] = id;
    const int64_t type = v.token_types.empty() ? 1 : v.token_types[id];
    if (type < 1 || type > 6)
      OPD_FAIL(InvalidData, src, ": tokenizer.ggml.token_type[", id, "] = ", type,
               " (must be 1..6: normal, unknown, control, user-defined, unused, byte)");
    if (type == 3 || type == 4) {
      // Control tokens are HF's special added tokens; user-defined ones are added tokens that
      // are matched in text but not skipped when decoding with skip_special_tokens.
      const bool special = type == 3;
      json entry = {{"id", id}, {"content", tok}, {"single_word", false}, {"lstrip", false},
                    {"rstrip", false}, {"normalized", !special}, {"special", special}};
      added.push_back(entry);
      added_decoder[std::to_string(id)] = {{"content", tok}, {"lstrip", false},
                                           {"normalized", !special}, {"rstrip", false},
                                           {"single_word", false}, {"special", special}};
    }
  }

  json merges = json::array();
  for (size_t i = 0; i < v.merges.size(); ++i) {
    const std::string& line = v.merges[i];
    const size_t sp = line.find(' ');
    if (sp == std::string::npos || sp == 0 || sp + 1 == line.size() ||
        line.find(' ', sp + 1) != std::string::npos)
      OPD_FAIL(InvalidData, src, ": tokenizer.ggml.merges[", i, "] = '", line,
               "' is not two tokens separated by one space");
    std::string a = line.substr(0, sp), b = line.substr(sp + 1);
    for (const std::string* part : {&a, &b})
      if (!seen.count(*part))
        OPD_FAIL(InvalidData, src, ": tokenizer.ggml.merges[", i, "] = '", line, "' uses '", *part,
                 "', which is not a token");
    if (!seen.count(a + b))
      OPD_FAIL(InvalidData, src, ": tokenizer.ggml.merges[", i, "] = '", line, "' makes '", a + b,
               "', which is not a token");
    merges.push_back(json::array({std::move(a), std::move(b)}));
  }

  json post = byte_level(true, false);
  if (v.add_bos.value_or(false) && v.bos_id) {
    const std::string bos = v.tokens[*v.bos_id];
    post = {{"type", "TemplateProcessing"},
            {"single", json::array({{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
                                    {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
            {"pair", json::array({{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
                                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                  {{"SpecialToken", {{"id", bos}, {"type_id", 1}}}},
                                  {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
            {"special_tokens", {{bos, {{"id", bos}, {"ids", {*v.bos_id}}, {"tokens", {bos}}}}}}};
  }
  if (v.add_eos.value_or(false))
    OPD_FAIL(Unsupported, src, ": tokenizer.ggml.add_eos_token = true is not supported");

  json tok = json::object();
  tok["version"] = "1.0";
  tok["truncation"] = nullptr;
  tok["padding"] = nullptr;
  tok["added_tokens"] = std::move(added);
  tok["normalizer"] = pre.normalizer;
  tok["pre_tokenizer"] = pre.pre_tokenizer;
  tok["post_processor"] = std::move(post);
  tok["decoder"] = byte_level(true, true);
  tok["model"] = {{"type", "BPE"},
                  {"dropout", nullptr},
                  {"unk_token", nullptr},
                  {"continuing_subword_prefix", nullptr},
                  {"end_of_word_suffix", nullptr},
                  {"fuse_unk", false},
                  {"byte_fallback", false},
                  {"ignore_merges", pre.ignore_merges},
                  {"vocab", std::move(vocab)},
                  {"merges", std::move(merges)}};

  json cfg = json::object();
  cfg["add_bos_token"] = v.add_bos.value_or(false);
  cfg["add_eos_token"] = false;
  cfg["added_tokens_decoder"] = std::move(added_decoder);
  auto name = [&](const std::optional<int64_t>& id) -> json {
    return id ? json(v.tokens[*id]) : json(nullptr);
  };
  cfg["bos_token"] = name(v.bos_id);
  cfg["eos_token"] = name(v.eos_id);
  cfg["pad_token"] = name(v.pad_id);
  cfg["unk_token"] = name(v.unk_id);
  if (v.chat_template) cfg["chat_template"] = checked_utf8(*v.chat_template, src + ": tokenizer.chat_template");
  cfg["clean_up_tokenization_spaces"] = false;
  if (v.model_max_length) cfg["model_max_length"] = *v.model_max_length;
  // The generic class: transformers then uses tokenizer.json exactly as written.
  cfg["tokenizer_class"] = "PreTrainedTokenizerFast";

  HfTokenizerFiles out;
  out.tokenizer_json = tok.dump(1) + "\n";
  out.tokenizer_config_json = cfg.dump(2) + "\n";
  return out;
}

}  // namespace opd
