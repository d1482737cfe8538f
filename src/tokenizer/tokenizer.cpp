// tokenizer.json loading and byte-level BPE encode/decode, matching HF `tokenizers` (see
// tokenizer.h for the contract; the comments below cite the HF behaviour each step copies).
#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "core/text_io.h"
#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"
#include "tokenizer/utf8.h"

namespace opd {

using json = nlohmann::json;

namespace {

// Ids above this are treated as a corrupt file rather than a real vocabulary (the largest
// real vocabularies are ~260k); it also bounds the id tables we allocate.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// GPT-2's byte-to-unicode table (HF pre_tokenizers/byte_level.rs bytes_char): printable bytes
// map to themselves, the other 68 to U+0100.. in byte order.
std::array<char32_t, 256> make_bytes_char() {
  std::array<char32_t, 256> table{};
  std::array<bool, 256> direct{};
  for (int b = '!'; b <= '~'; ++b) direct[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) table[b] = direct[b] ? static_cast<char32_t>(b) : next++;
  return table;
}

const std::array<char32_t, 256>& bytes_char() {
  static const std::array<char32_t, 256> table = make_bytes_char();
  return table;
}

// Inverse of bytes_char (code point -> byte), -1 where not in the image.
int char_byte(char32_t c) {
  static const std::vector<int> inverse = [] {
    std::vector<int> inv(324, -1);
    for (int b = 0; b < 256; ++b) inv[bytes_char()[b]] = b;
    return inv;
  }();
  return c < inverse.size() ? inverse[c] : -1;
}

bool is_white_space(char32_t c) {  // Unicode White_Space, what Rust's regex \s matches
  return (c >= 9 && c <= 13) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

// Open-addressing hash map from a (left id, right id) pair to (rank, merged id). The BPE inner
// loop does one lookup per adjacent pair; a flat table keeps that to ~one cache miss.
class MergeTable {
 public:
  struct Value {
    int32_t rank = -1, id = -1;
  };
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    keys_.assign(cap, kEmpty);
    values_.assign(cap, Value{});
    mask_ = cap - 1;
  }
  void insert(int32_t a, int32_t b, Value v) {  // later inserts of a pair win (HF collects a map)
    const uint64_t key = pack(a, b);
    for (size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == kEmpty || keys_[i] == key) {
        keys_[i] = key;
        values_[i] = v;
        return;
      }
    }
  }
  const Value* find(int32_t a, int32_t b) const {
    const uint64_t key = pack(a, b);
    for (size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == key) return &values_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  static uint64_t pack(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  static size_t hash(uint64_t x) {  // splitmix64 finalizer
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return static_cast<size_t>(x);
  }
  std::vector<uint64_t> keys_;
  std::vector<Value> values_;
  size_t mask_ = 0;
};

// Finds added tokens in text, leftmost-longest and non-overlapping, like the Aho-Corasick
// automaton (MatchKind::LeftmostLongest) HF builds over them.
class AddedMatcher {
 public:
  void add(std::string pattern, int index) {
    if (pattern.empty()) return;  // HF ignores empty added tokens
    const auto first = static_cast<unsigned char>(pattern[0]);
    by_first_[first].push_back({std::move(pattern), index});
    any_ = true;
  }
  void finish() {
    for (auto& list : by_first_)
      std::stable_sort(list.begin(), list.end(), [](const Entry& a, const Entry& b) {
        return a.pattern.size() > b.pattern.size();
      });
  }
  bool empty() const { return !any_; }
  // First match at or after `from`: (start, end, index) or start == npos.
  std::tuple<size_t, size_t, int> find(std::string_view text, size_t from) const {
    for (size_t i = from; i < text.size(); ++i) {
      const auto& list = by_first_[static_cast<unsigned char>(text[i])];
      for (const Entry& e : list)
        if (text.compare(i, e.pattern.size(), e.pattern) == 0)
          return {i, i + e.pattern.size(), e.index};
    }
    return {std::string_view::npos, 0, -1};
  }

 private:
  struct Entry {
    std::string pattern;
    int index;
  };
  std::array<std::vector<Entry>, 256> by_first_;
  bool any_ = false;
};

enum class PreKind { Split, ByteLevel };
struct PreStep {
  PreKind kind;
  std::shared_ptr<Regex> regex;  // Split, or ByteLevel with use_regex
  bool add_prefix_space = false;
};

struct TemplateItem {
  bool is_sequence = false;     // the input sequence A
  std::vector<int32_t> ids;     // special-token ids otherwise
};

// A tokenizer's JSON files: regular files of at most 1 GiB, nested at most kMaxJsonDepth.
std::string read_file(const std::string& path) {
  std::string text = read_text_file(path);
  check_json_depth(text, path);
  return text;
}

std::string type_of(const json& j) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) return "";
  return j["type"].get<std::string>();
}

bool get_bool(const json& j, const char* key, bool fallback, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean()) OPD_FAIL(InvalidData, where, ": field '", key, "' is not a boolean");
  return j[key].get<bool>();
}

// "x", {"content": "x", ...} or null in tokenizer_config.json.
std::optional<std::string> token_string(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string())
    return j["content"].get<std::string>();
  return std::nullopt;
}

std::atomic<uint64_t> g_next_instance{1};

}  // namespace

struct Tokenizer::Impl {
  std::string path;
  TokenizerConfig config;
  uint64_t instance = 0;

  // Model (BPE).
  std::unordered_map<std::string, int32_t> vocab;
  MergeTable merges;
  std::array<int32_t, 256> byte_id{};
  bool ignore_merges = false;

  // All ids: token string, decoded bytes, flags.
  std::vector<std::string> id_token, id_bytes;
  std::vector<uint8_t> id_flags;  // kAssigned | kSpecial | kSkipWhenSpecial
  static constexpr uint8_t kAssigned = 1, kSpecial = 2, kSkippable = 4;

  bool nfc = false;
  std::vector<PreStep> pre;
  std::vector<AddedTokenInfo> added;
  std::unordered_map<std::string, int32_t> added_by_content;
  AddedMatcher raw_added, normalized_added;
  std::unique_ptr<Regex> word_start, word_end;  // \w at the edges, for single_word tokens
  bool any_single_word = false;

  std::vector<TemplateItem> single_template;
  bool has_template = false;
  bool byte_level_decoder = false;

  void load(const std::string& file);
  void parse(const json& root);
  void parse_model(const json& model);
  void parse_added(const json& list);
  void parse_normalizer(const json& j, const std::string& where);
  void parse_pre_tokenizer(const json& j, const std::string& where);
  void parse_post_processor(const json& j, const std::string& where);
  void parse_decoder(const json& j, const std::string& where);
  void finish_tables();

  void encode_text(std::string_view text, std::vector<int32_t>& ids) const;
  void split_added(std::string_view text, const AddedMatcher& matcher,
                   const std::function<void(std::string_view, int32_t)>& emit) const;
  void pre_tokenize_and_bpe(std::string_view text, std::vector<int32_t>& ids) const;
  void bpe(std::string_view word, std::vector<int32_t>& ids) const;
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;
  void check_id(int32_t id, size_t position) const;
};

// ---------------------------------------------------------------------------------------------
// Loading

void Tokenizer::Impl::load(const std::string& file) {
  path = file;
  const std::string text = read_file(file);
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    OPD_FAIL(InvalidData, file, ": not valid JSON: ", e.what());
  }
  if (!root.is_object()) OPD_FAIL(InvalidData, file, ": top level is not a JSON object");
  try {
    parse(root);
  } catch (const json::exception& e) {
    // A field of an unexpected JSON type that a check above did not anticipate.
    OPD_FAIL(InvalidData, file, ": unexpected structure: ", e.what());
  }
}

void Tokenizer::Impl::parse(const json& root) {
  const std::string& file = path;
  for (const char* key : {"truncation", "padding"})
    if (root.contains(key) && !root[key].is_null())
      OPD_FAIL(Unsupported, file, ": '", key,
               "' is set; opd never truncates or pads inside the tokenizer (set it to null)");
  if (!root.contains("model") || !root["model"].is_object())
    OPD_FAIL(InvalidData, file, ": missing 'model' object");
  parse_model(root["model"]);
  parse_normalizer(root.value("normalizer", json()), file + ": normalizer");
  parse_pre_tokenizer(root.value("pre_tokenizer", json()), file + ": pre_tokenizer");
  if (pre.empty() || pre.back().kind != PreKind::ByteLevel)
    OPD_FAIL(Unsupported, file,
             ": only byte-level BPE is supported (the pre_tokenizer must end with ByteLevel); "
             "this file's pre_tokenizer is ",
             root.value("pre_tokenizer", json()).dump().substr(0, 200));
  for (size_t i = 0; i + 1 < pre.size(); ++i)
    if (pre[i].kind == PreKind::ByteLevel)
      OPD_FAIL(Unsupported, file, ": ByteLevel must be the last pre_tokenizer");
  if (root.contains("added_tokens") && !root["added_tokens"].is_null()) {
    if (!root["added_tokens"].is_array())
      OPD_FAIL(InvalidData, file, ": 'added_tokens' is not an array");
    parse_added(root["added_tokens"]);
  }
  parse_post_processor(root.value("post_processor", json()), file + ": post_processor");
  parse_decoder(root.value("decoder", json()), file + ": decoder");
  finish_tables();
}

void Tokenizer::Impl::parse_model(const json& model) {
  const std::string where = path + ": model";
  const std::string type = type_of(model);
  if (!type.empty() && type != "BPE")
    OPD_FAIL(Unsupported, where, " type '", type, "' is not supported (only BPE)");
  if (!model.contains("vocab") || !model["vocab"].is_object())
    OPD_FAIL(InvalidData, where, ": missing 'vocab' object");
  if (!model.contains("merges") || !model["merges"].is_array())
    OPD_FAIL(InvalidData, where, ": missing 'merges' array");
  if (model.contains("dropout") && !model["dropout"].is_null() &&
      !(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0))
    OPD_FAIL(Unsupported, where, ": BPE dropout ", model["dropout"].dump(),
             " is not supported (encoding would be random)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(key) && !model[key].is_null() &&
        !(model[key].is_string() && model[key].get<std::string>().empty()))
      OPD_FAIL(Unsupported, where, ": '", key, "' = ", model[key].dump(), " is not supported");
  ignore_merges = get_bool(model, "ignore_merges", false, where);

  const json& v = model["vocab"];
  vocab.reserve(v.size() * 2);
  std::vector<std::pair<int32_t, const std::string*>> by_id;
  by_id.reserve(v.size());
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (!it.value().is_number_integer())
      OPD_FAIL(InvalidData, where, ": vocab entry '", it.key(), "' has a non-integer id ",
               it.value().dump());
    const int64_t id = it.value().get<int64_t>();
    if (id < 0 || id > kMaxTokenId)
      OPD_FAIL(InvalidData, where, ": vocab entry '", it.key(), "' has id ", id,
               " outside [0, ", kMaxTokenId, "]");
    vocab.emplace(it.key(), static_cast<int32_t>(id));
  }
  int32_t max_id = -1;
  for (const auto& [tok, id] : vocab) max_id = std::max(max_id, id);
  id_token.assign(static_cast<size_t>(max_id + 1), std::string());
  id_flags.assign(static_cast<size_t>(max_id + 1), 0);
  for (const auto& [tok, id] : vocab) {
    if (id_flags[id] & kAssigned)
      OPD_FAIL(InvalidData, where, ": id ", id, " is used by two vocab entries, '", id_token[id],
               "' and '", tok, "'");
    id_flags[id] = kAssigned;
    id_token[id] = tok;
  }

  // Merges: "a b" strings (legacy) or ["a", "b"] pairs; rank = position (after #version lines).
  const json& m = model["merges"];
  merges.reserve(m.size());
  int32_t rank = 0;
  std::string merged;
  for (size_t i = 0; i < m.size(); ++i) {
    std::string a, b;
    if (m[i].is_string()) {
      const std::string line = m[i].get<std::string>();
      if (line.rfind("#version", 0) == 0) continue;
      const size_t sp = line.find(' ');
      if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos)
        OPD_FAIL(InvalidData, where, ": merge ", i, " '", line,
                 "' is not two tokens separated by one space");
      a = line.substr(0, sp);
      b = line.substr(sp + 1);
    } else if (m[i].is_array() && m[i].size() == 2 && m[i][0].is_string() && m[i][1].is_string()) {
      a = m[i][0].get<std::string>();
      b = m[i][1].get<std::string>();
    } else {
      OPD_FAIL(InvalidData, where, ": merge ", i, " is neither \"a b\" nor [\"a\", \"b\"]: ",
               m[i].dump().substr(0, 100));
    }
    auto ia = vocab.find(a), ib = vocab.find(b);
    if (ia == vocab.end())
      OPD_FAIL(InvalidData, where, ": merge ", i, " uses '", a, "', which is not in the vocab");
    if (ib == vocab.end())
      OPD_FAIL(InvalidData, where, ": merge ", i, " uses '", b, "', which is not in the vocab");
    merged = a + b;
    auto im = vocab.find(merged);
    if (im == vocab.end())
      OPD_FAIL(InvalidData, where, ": merge ", i, " produces '", merged,
               "', which is not in the vocab");
    merges.insert(ia->second, ib->second, {rank, im->second});
    ++rank;
  }

  // Byte-level alphabet: every byte must have a token, or some texts could not be encoded.
  for (int b = 0; b < 256; ++b) {
    std::string ch;
    utf8::append(ch, bytes_char()[b]);
    auto it = vocab.find(ch);
    if (it == vocab.end()) {
      // Some real vocabularies lack a few bytes (SmolLM2: six control characters, 0xf1, 0xf2
      // and the bytes UTF-8 never uses). HF's BPE then drops such a byte when there is no
      // unk_token (models/bpe/model.rs merge_word), and so does merge_word below; with an
      // unk_token HF would emit it, which opd does not implement.
      if (model.contains("unk_token") && !model["unk_token"].is_null())
        OPD_FAIL(Unsupported, where, ": byte 0x", std::hex, b, std::dec, " (token '", ch,
                 "') is missing from the vocab and unk_token is set; opd does not emit unk");
      byte_id[b] = -1;
      continue;
    }
    byte_id[b] = it->second;
  }
}

void Tokenizer::Impl::parse_added(const json& list) {
  const std::string where = path + ": added_tokens";
  for (size_t i = 0; i < list.size(); ++i) {
    const json& t = list[i];
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() ||
        !t.contains("content") || !t["content"].is_string())
      OPD_FAIL(InvalidData, where, "[", i, "]: needs an integer 'id' and a string 'content'");
    AddedTokenInfo a;
    const int64_t id = t["id"].get<int64_t>();
    if (id < 0 || id > kMaxTokenId)
      OPD_FAIL(InvalidData, where, "[", i, "]: id ", id, " outside [0, ", kMaxTokenId, "]");
    a.id = static_cast<int32_t>(id);
    a.content = t["content"].get<std::string>();
    if (!utf8::is_valid(a.content))
      OPD_FAIL(InvalidData, where, "[", i, "]: content is not valid UTF-8");
    const std::string w = where + "[" + std::to_string(i) + "]";
    a.special = get_bool(t, "special", false, w);
    a.lstrip = get_bool(t, "lstrip", false, w);
    a.rstrip = get_bool(t, "rstrip", false, w);
    a.single_word = get_bool(t, "single_word", false, w);
    a.normalized = get_bool(t, "normalized", !a.special, w);
    if (static_cast<size_t>(a.id) >= id_token.size()) {
      id_token.resize(static_cast<size_t>(a.id) + 1);
      id_flags.resize(static_cast<size_t>(a.id) + 1, 0);
    }
    if (id_flags[a.id] & kAssigned) {
      // HF gives an added token the id of an identical vocab entry; a different string on the
      // same id would make encode and decode disagree.
      const bool same_vocab_token = id_token[a.id] == a.content && !added_by_content.count(a.content);
      if (!same_vocab_token)
        OPD_FAIL(InvalidData, where, "[", i, "]: id ", a.id, " ('", a.content,
                 "') is already used by '", id_token[a.id], "'");
    }
    if (added_by_content.count(a.content))
      OPD_FAIL(InvalidData, where, "[", i, "]: '", a.content, "' is listed twice");
    id_flags[a.id] |= kAssigned;
    if (a.special) id_flags[a.id] |= kSpecial;
    id_token[a.id] = a.content;
    added_by_content.emplace(a.content, a.id);
    any_single_word |= a.single_word;
    added.push_back(std::move(a));
  }
  for (size_t i = 0; i < added.size(); ++i) {
    const AddedTokenInfo& a = added[i];
    if (!a.normalized) {
      raw_added.add(a.content, static_cast<int>(i));
    } else {
      // Normalized tokens are matched in normalized text, so their pattern is normalized too;
      // decoding also yields the normalized form (HF's normalized_cache).
      std::string pattern = a.content, normed;
      if (nfc && unicode::nfc(a.content, normed)) {
        pattern = normed;
        id_token[a.id] = normed;
      }
      normalized_added.add(pattern, static_cast<int>(i));
    }
  }
  raw_added.finish();
  normalized_added.finish();
  if (any_single_word) {
    // HF tests word edges with Rust's \w: Alphabetic, marks, decimal digits, connector
    // punctuation and Join_Control (not PCRE2's L/N/_), plus the letters Unicode 16 added.
    const std::string w = "[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}" +
                          unicode::regex_letter_delta() + "]";
    word_start = std::make_unique<Regex>("^" + w, "single_word check");
    word_end = std::make_unique<Regex>(w + "$", "single_word check");
  }
}

void Tokenizer::Impl::parse_normalizer(const json& j, const std::string& where) {
  if (j.is_null()) return;
  const std::string type = type_of(j);
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence" && j.contains("normalizers") && j["normalizers"].is_array()) {
    for (const json& n : j["normalizers"]) parse_normalizer(n, where);
  } else {
    OPD_FAIL(Unsupported, where, " type '", type.empty() ? j.dump().substr(0, 80) : type,
             "' is not supported (supported: NFC, Sequence of NFC, null)");
  }
}

void Tokenizer::Impl::parse_pre_tokenizer(const json& j, const std::string& where) {
  if (j.is_null()) return;
  const std::string type = type_of(j);
  if (type == "Sequence" && j.contains("pretokenizers") && j["pretokenizers"].is_array()) {
    for (const json& p : j["pretokenizers"]) parse_pre_tokenizer(p, where);
  } else if (type == "Split") {
    const std::string behavior = j.value("behavior", "");
    if (behavior != "Isolated")
      OPD_FAIL(Unsupported, where, " Split behavior '", behavior,
               "' is not supported (supported: Isolated)");
    if (get_bool(j, "invert", false, where))
      OPD_FAIL(Unsupported, where, " Split with invert=true is not supported");
    if (!j.contains("pattern") || !j["pattern"].is_object())
      OPD_FAIL(InvalidData, where, " Split has no 'pattern' object");
    const json& p = j["pattern"];
    std::string pcre;
    if (p.contains("Regex") && p["Regex"].is_string()) {
      pcre = translate_pattern(p["Regex"].get<std::string>());
    } else if (p.contains("String") && p["String"].is_string()) {
      // A literal: \Q..\E quotes everything except a literal "\E", which we split around.
      const std::string s = p["String"].get<std::string>();
      if (s.empty()) OPD_FAIL(Unsupported, where, " Split with an empty String pattern");
      std::string quoted;
      size_t start = 0;
      for (size_t e; (e = s.find("\\E", start)) != std::string::npos; start = e + 2)
        quoted += "\\Q" + s.substr(start, e - start) + "\\E\\\\E";
      pcre = quoted + "\\Q" + s.substr(start) + "\\E";
    } else {
      OPD_FAIL(InvalidData, where, " Split pattern is neither {\"Regex\": ..} nor {\"String\": ..}");
    }
    pre.push_back({PreKind::Split, std::make_shared<Regex>(pcre, where + " Split pattern"), false});
  } else if (type == "ByteLevel") {
    PreStep step{PreKind::ByteLevel, nullptr, get_bool(j, "add_prefix_space", true, where)};
    if (get_bool(j, "use_regex", true, where)) {
      // HF's built-in GPT-2 pattern (pre_tokenizers/byte_level.rs).
      step.regex = std::make_shared<Regex>(
          translate_pattern(
              R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"),
          where + " ByteLevel regex");
    }
    pre.push_back(std::move(step));
  } else {
    OPD_FAIL(Unsupported, where, " type '", type.empty() ? j.dump().substr(0, 80) : type,
             "' is not supported (supported: Split, ByteLevel, Sequence)");
  }
}

void Tokenizer::Impl::parse_post_processor(const json& j, const std::string& where) {
  if (j.is_null()) return;
  const std::string type = type_of(j);
  if (type == "ByteLevel") return;  // offsets only: no effect on ids
  if (type == "Sequence" && j.contains("processors") && j["processors"].is_array()) {
    for (const json& p : j["processors"]) parse_post_processor(p, where);
    return;
  }
  if (type != "TemplateProcessing")
    OPD_FAIL(Unsupported, where, " type '", type.empty() ? j.dump().substr(0, 80) : type,
             "' is not supported (supported: TemplateProcessing, ByteLevel, Sequence)");
  if (has_template) OPD_FAIL(Unsupported, where, ": two TemplateProcessing steps");
  if (!j.contains("single") || !j["single"].is_array())
    OPD_FAIL(InvalidData, where, " TemplateProcessing has no 'single' array");
  const json specials = j.value("special_tokens", json::object());
  for (const json& item : j["single"]) {
    TemplateItem t;
    if (item.contains("Sequence")) {
      const std::string id = item["Sequence"].value("id", "");
      if (id != "A")
        OPD_FAIL(InvalidData, where, " TemplateProcessing 'single' refers to sequence '", id, "'");
      t.is_sequence = true;
    } else if (item.contains("SpecialToken")) {
      const std::string name = item["SpecialToken"].value("id", "");
      if (!specials.contains(name) || !specials[name].contains("ids") ||
          !specials[name]["ids"].is_array())
        OPD_FAIL(InvalidData, where, " TemplateProcessing special token '", name,
                 "' has no entry with 'ids' in special_tokens");
      for (const json& id : specials[name]["ids"]) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > kMaxTokenId)
          OPD_FAIL(InvalidData, where, " TemplateProcessing special token '", name,
                   "' has an invalid id ", id.dump());
        t.ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
      }
    } else {
      OPD_FAIL(InvalidData, where, " TemplateProcessing item is neither Sequence nor SpecialToken");
    }
    single_template.push_back(std::move(t));
  }
  has_template = true;
}

void Tokenizer::Impl::parse_decoder(const json& j, const std::string& where) {
  if (j.is_null()) return;
  const std::string type = type_of(j);
  if (type == "ByteLevel") {
    byte_level_decoder = true;
  } else if (type == "Sequence" && j.contains("decoders") && j["decoders"].is_array() &&
             j["decoders"].size() == 1) {
    parse_decoder(j["decoders"][0], where);
  } else {
    OPD_FAIL(Unsupported, where, " type '", type.empty() ? j.dump().substr(0, 80) : type,
             "' is not supported (supported: ByteLevel)");
  }
}

void Tokenizer::Impl::finish_tables() {
  // Template ids must exist (checked here because added tokens are parsed before).
  for (const TemplateItem& t : single_template)
    for (int32_t id : t.ids)
      if (static_cast<size_t>(id) >= id_flags.size() || !(id_flags[id] & Impl::kAssigned))
        OPD_FAIL(InvalidData, path, ": post_processor uses token id ", id,
                 ", which no vocab entry or added token has");
  // Bytes each token contributes to decoded text (HF ByteLevel decoder: a token whose every
  // character is in the byte-level alphabet becomes those bytes, any other token its UTF-8).
  id_bytes.assign(id_token.size(), std::string());
  std::unordered_set<std::string> special_contents;
  for (const AddedTokenInfo& a : added)
    if (a.special) special_contents.insert(a.content);
  for (size_t id = 0; id < id_token.size(); ++id) {
    if (!(id_flags[id] & kAssigned)) continue;
    const std::string& tok = id_token[id];
    // HF skips by *string*: any id whose token string is a special token's content.
    if (special_contents.count(tok)) id_flags[id] |= kSkippable;
    if (!byte_level_decoder) {
      id_bytes[id] = tok;
      continue;
    }
    std::string bytes;
    bool all_mapped = true;
    for (size_t i = 0; i < tok.size();) {
      const int b = char_byte(utf8::decode_at(tok, i));
      if (b < 0) {
        all_mapped = false;
        break;
      }
      bytes.push_back(static_cast<char>(b));
    }
    id_bytes[id] = all_mapped ? bytes : tok;
  }
  instance = g_next_instance.fetch_add(1);
}

// ---------------------------------------------------------------------------------------------
// Encoding

namespace {

// Per-thread cache of BPE results by pre-token bytes. A few slots so that threads alternating
// between two tokenizers (student and teacher) do not thrash.
struct WordCache {
  uint64_t owner = 0;
  std::unordered_map<std::string, std::vector<int32_t>> words;
};
constexpr size_t kCacheWords = 1 << 17;

WordCache& word_cache(uint64_t owner) {
  thread_local std::array<WordCache, 4> slots;
  thread_local size_t next = 0;
  for (WordCache& c : slots)
    if (c.owner == owner) return c;
  WordCache& c = slots[next++ % slots.size()];
  c.owner = owner;
  c.words.clear();
  return c;
}

struct Symbol {
  int32_t id, prev, next, len;
};
struct MergeCandidate {
  int32_t rank, pos, new_id;
  bool operator>(const MergeCandidate& o) const {
    return rank != o.rank ? rank > o.rank : pos > o.pos;
  }
};

}  // namespace

// HF models/bpe/word.rs merge_all: repeatedly apply the lowest-rank merge (leftmost on ties)
// using a min-heap of candidate pairs, skipping stale entries (same validity test as HF).
void Tokenizer::Impl::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  thread_local std::vector<Symbol> sym;
  thread_local std::vector<MergeCandidate> heap_storage;
  // Bytes without a vocab entry (byte_id -1) are dropped before merging, as HF does, so their
  // neighbours become adjacent and may merge.
  int32_t n = 0;
  sym.resize(word.size());
  for (unsigned char c : word)
    if (byte_id[c] >= 0) sym[n++] = {byte_id[c], 0, 0, 1};
  for (int32_t i = 0; i < n; ++i) {
    sym[i].prev = i - 1;
    sym[i].next = i + 1 < n ? i + 1 : -1;
  }
  if (n == 0) return;
  heap_storage.clear();
  std::priority_queue<MergeCandidate, std::vector<MergeCandidate>, std::greater<>> heap(
      std::greater<>(), std::move(heap_storage));
  for (int32_t i = 0; i + 1 < n; ++i)
    if (const MergeTable::Value* m = merges.find(sym[i].id, sym[i + 1].id))
      heap.push({m->rank, i, m->id});
  while (!heap.empty()) {
    const MergeCandidate top = heap.top();
    heap.pop();
    Symbol& cur = sym[top.pos];
    if (cur.len == 0 || cur.next == -1) continue;
    const int32_t next_pos = cur.next;
    const Symbol right = sym[next_pos];
    const MergeTable::Value* m = merges.find(cur.id, right.id);
    if (!m || m->id != top.new_id) continue;  // stale entry
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    sym[next_pos].len = 0;
    if (right.next > -1 && right.next < n) sym[right.next].prev = top.pos;
    if (cur.prev >= 0)
      if (const MergeTable::Value* p = merges.find(sym[cur.prev].id, cur.id))
        heap.push({p->rank, cur.prev, p->id});
    if (cur.next >= 0 && cur.next < n)
      if (const MergeTable::Value* p = merges.find(cur.id, sym[cur.next].id))
        heap.push({p->rank, top.pos, p->id});
  }
  for (int32_t i = 0; i < n;) {  // symbols in order: follow next from the first
    out.push_back(sym[i].id);
    if (sym[i].next < 0) break;
    i = sym[i].next;
  }
}

void Tokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>& ids) const {
  if (word.empty()) return;
  if (word.size() == 1) {
    if (const int32_t id = byte_id[static_cast<unsigned char>(word[0])]; id >= 0) ids.push_back(id);
    return;
  }
  WordCache& cache = word_cache(instance);
  thread_local std::string key;
  key.assign(word);
  if (auto it = cache.words.find(key); it != cache.words.end()) {
    ids.insert(ids.end(), it->second.begin(), it->second.end());
    return;
  }
  const size_t before = ids.size();
  std::string mapped;
  if (ignore_merges) {  // HF: a pre-token that is itself a vocab entry is taken whole
    for (unsigned char b : word) utf8::append(mapped, bytes_char()[b]);
  }
  if (auto it = ignore_merges ? vocab.find(mapped) : vocab.end(); it != vocab.end())
    ids.push_back(it->second);
  else
    merge_word(word, ids);
  if (cache.words.size() >= kCacheWords) cache.words.clear();
  cache.words.emplace(key, std::vector<int32_t>(ids.begin() + static_cast<ptrdiff_t>(before),
                                                ids.end()));
}

void Tokenizer::Impl::pre_tokenize_and_bpe(std::string_view text, std::vector<int32_t>& ids) const {
  if (text.empty()) return;
  // Pieces are views into `text` or into `owned` (pieces that got a prefix space).
  thread_local std::vector<std::string_view> pieces, next;
  thread_local std::vector<std::pair<size_t, size_t>> spans;
  std::deque<std::string> owned;  // prefixed pieces; a deque never moves its elements
  pieces.clear();
  pieces.push_back(text);
  for (const PreStep& step : pre) {
    next.clear();
    for (std::string_view piece : pieces) {
      if (step.kind == PreKind::ByteLevel && step.add_prefix_space && piece[0] != ' ') {
        owned.push_back(" " + std::string(piece));
        piece = owned.back();
      }
      if (!step.regex) {
        next.push_back(piece);
        continue;
      }
      // Isolated: every match and every gap between matches is its own piece.
      spans.clear();
      step.regex->find_all(piece, spans);
      size_t prev = 0;
      for (const auto& [a, b] : spans) {
        if (a > prev) next.push_back(piece.substr(prev, a - prev));
        next.push_back(piece.substr(a, b - a));
        prev = b;
      }
      if (prev < piece.size()) next.push_back(piece.substr(prev));
    }
    std::swap(pieces, next);
  }
  for (std::string_view piece : pieces) bpe(piece, ids);
}

void Tokenizer::Impl::split_added(
    std::string_view s, const AddedMatcher& matcher,
    const std::function<void(std::string_view, int32_t)>& emit) const {
  if (matcher.empty()) {
    emit(s, -1);
    return;
  }
  // HF added_vocabulary.rs find_matches, step for step.
  size_t start_offset = 0, search = 0;
  while (search < s.size()) {
    auto [mstart, mstop, index] = matcher.find(s, search);
    if (mstart == std::string_view::npos) break;
    search = mstop;  // the automaton resumes after the raw match whatever we do with it
    const AddedTokenInfo& tok = added[static_cast<size_t>(index)];
    size_t start = mstart, stop = mstop;
    if (tok.single_word) {
      thread_local std::vector<std::pair<size_t, size_t>> m;
      m.clear();
      if (start > 0) word_end->find_all(s.substr(0, start), m);
      const bool start_space = start == 0 || m.empty();
      m.clear();
      if (stop < s.size()) word_start->find_all(s.substr(stop), m);
      const bool stop_space = stop == s.size() || m.empty();
      if (!start_space || !stop_space) continue;
    }
    if (tok.lstrip) {
      size_t new_start = start;
      while (new_start > 0) {  // step back over whole white-space characters
        size_t p = new_start - 1;
        while (p > 0 && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80) --p;
        size_t q = p;
        if (!is_white_space(utf8::decode_at(s, q))) break;
        new_start = p;
      }
      start = std::max(new_start, start_offset);
    }
    if (tok.rstrip) {
      while (stop < s.size()) {
        size_t q = stop;
        if (!is_white_space(utf8::decode_at(s, q))) break;
        stop = q;
      }
    }
    if (start_offset < start) emit(s.substr(start_offset, start - start_offset), -1);
    emit(s.substr(start, stop - start), tok.id);
    start_offset = stop;
  }
  if (start_offset < s.size()) emit(s.substr(start_offset), -1);
}

void Tokenizer::Impl::encode_text(std::string_view text, std::vector<int32_t>& ids) const {
  // 1. Non-normalized added tokens on the raw text; 2. normalize the rest; 3. normalized
  // added tokens on that; 4. pre-tokenize and BPE what remains (HF extract_and_normalize).
  split_added(text, raw_added, [&](std::string_view piece, int32_t id) {
    if (id >= 0) {
      ids.push_back(id);
      return;
    }
    std::string normed;
    if (nfc && unicode::nfc(piece, normed)) piece = normed;
    split_added(piece, normalized_added, [&](std::string_view p, int32_t id2) {
      if (id2 >= 0)
        ids.push_back(id2);
      else
        pre_tokenize_and_bpe(p, ids);
    });
  });
}

void Tokenizer::Impl::check_id(int32_t id, size_t position) const {
  if (id < 0 || static_cast<size_t>(id) >= id_flags.size())
    OPD_FAIL(InvalidArgument, "token id ", id, " at position ", position,
             " is outside the vocabulary [0, ", id_flags.size(), ") of ", path);
  if (!(id_flags[id] & kAssigned))
    OPD_FAIL(InvalidArgument, "token id ", id, " at position ", position,
             " is not assigned to any token in ", path);
}

// ---------------------------------------------------------------------------------------------
// Public API

Tokenizer Tokenizer::load(const std::string& path) {
  namespace fs = std::filesystem;
  std::string file = path;
  std::error_code ec;
  if (fs::is_directory(path, ec)) file = (fs::path(path) / "tokenizer.json").string();
  if (!fs::exists(file, ec)) OPD_FAIL(Io, "no tokenizer.json at ", file);
  auto impl = std::make_shared<Impl>();
  impl->load(file);

  const fs::path config_path = fs::path(file).parent_path() / "tokenizer_config.json";
  if (fs::exists(config_path, ec)) {
    const std::string cfile = config_path.string();
    json c;
    try {
      c = json::parse(read_file(cfile));
    } catch (const json::exception& e) {
      OPD_FAIL(InvalidData, cfile, ": not valid JSON: ", e.what());
    }
    if (!c.is_object()) OPD_FAIL(InvalidData, cfile, ": top level is not a JSON object");
    TokenizerConfig& tc = impl->config;
    tc.path = cfile;
    if (c.contains("bos_token")) tc.bos_token = token_string(c["bos_token"]);
    if (c.contains("eos_token")) tc.eos_token = token_string(c["eos_token"]);
    if (c.contains("pad_token")) tc.pad_token = token_string(c["pad_token"]);
    if (c.contains("unk_token")) tc.unk_token = token_string(c["unk_token"]);
    if (c.contains("add_bos_token") && c["add_bos_token"].is_boolean())
      tc.add_bos_token = c["add_bos_token"].get<bool>();
    if (c.contains("add_eos_token") && c["add_eos_token"].is_boolean())
      tc.add_eos_token = c["add_eos_token"].get<bool>();
    if (c.contains("chat_template")) {
      const json& t = c["chat_template"];
      if (t.is_string()) {
        tc.chat_template = t.get<std::string>();
      } else if (t.is_array()) {  // [{"name": ..., "template": ...}]: the "default" one
        for (const json& e : t)
          if (e.is_object() && e.value("name", "") == "default" && e.contains("template") &&
              e["template"].is_string())
            tc.chat_template = e["template"].get<std::string>();
      } else if (!t.is_null()) {
        OPD_FAIL(InvalidData, cfile, ": 'chat_template' is neither a string nor a list");
      }
    }
    for (const auto* tok : {&tc.bos_token, &tc.eos_token, &tc.pad_token})
      if (*tok && !impl->vocab.count(**tok) && !impl->added_by_content.count(**tok))
        OPD_FAIL(InvalidData, cfile, ": special token '", **tok, "' is not in ", file);
  }
  Tokenizer t;
  t.impl_ = std::move(impl);
  return t;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& im = *impl_;
  std::string valid;
  if (!utf8::is_valid(text)) {
    valid = utf8::to_valid(text);
    text = valid;
  }
  std::vector<int32_t> body;
  body.reserve(text.size() / 3 + 4);
  im.encode_text(text, body);
  if (!add_special_tokens || !im.has_template) return body;
  std::vector<int32_t> out;
  out.reserve(body.size() + 4);
  for (const TemplateItem& t : im.single_template) {
    if (t.is_sequence)
      out.insert(out.end(), body.begin(), body.end());
    else
      out.insert(out.end(), t.ids.begin(), t.ids.end());
  }
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& im = *impl_;
  std::string bytes;
  bool first = true;
  for (size_t i = 0; i < ids.size(); ++i) {
    im.check_id(ids[i], i);
    if (skip_special_tokens && (im.id_flags[ids[i]] & Impl::kSkippable)) continue;
    if (!im.byte_level_decoder && !first) bytes += ' ';  // HF without a decoder: join(" ")
    bytes += im.id_bytes[ids[i]];
    first = false;
  }
  return utf8::is_valid(bytes) ? bytes : utf8::to_valid(bytes);
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const std::string key(token);
  if (auto it = impl_->added_by_content.find(key); it != impl_->added_by_content.end())
    return it->second;
  if (auto it = impl_->vocab.find(key); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

const std::string& Tokenizer::id_to_token(int32_t id) const {
  impl_->check_id(id, 0);
  return impl_->id_token[id];
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
  impl_->check_id(id, 0);
  return impl_->id_bytes[id];
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_flags.size()); }

bool Tokenizer::contains(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->id_flags.size() &&
         (impl_->id_flags[id] & Impl::kAssigned);
}

bool Tokenizer::is_special(int32_t id) const {
  return contains(id) && (impl_->id_flags[id] & Impl::kSpecial);
}

std::optional<int32_t> Tokenizer::bos_id() const {
  return impl_->config.bos_token ? token_to_id(*impl_->config.bos_token) : std::nullopt;
}
std::optional<int32_t> Tokenizer::eos_id() const {
  return impl_->config.eos_token ? token_to_id(*impl_->config.eos_token) : std::nullopt;
}
std::optional<int32_t> Tokenizer::pad_id() const {
  return impl_->config.pad_token ? token_to_id(*impl_->config.pad_token) : std::nullopt;
}
const TokenizerConfig& Tokenizer::config() const { return impl_->config; }
const std::vector<AddedTokenInfo>& Tokenizer::added_tokens() const { return impl_->added; }
const std::string& Tokenizer::path() const { return impl_->path; }

// ---------------------------------------------------------------------------------------------
// Incremental decoding

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(&tokenizer), skip_special_(skip_special_tokens) {}

std::string IncrementalDecoder::push(int32_t id) { return push(std::span<const int32_t>(&id, 1)); }

std::string IncrementalDecoder::push(std::span<const int32_t> ids) {
  const Tokenizer::Impl& im = *tokenizer_->impl_;
  for (size_t i = 0; i < ids.size(); ++i) {
    im.check_id(ids[i], i);
    if (skip_special_ && (im.id_flags[ids[i]] & Tokenizer::Impl::kSkippable)) continue;
    if (!im.byte_level_decoder && any_) pending_ += ' ';
    pending_ += im.id_bytes[ids[i]];
    any_ = true;
  }
  // Emit everything except a trailing sequence that is incomplete but may still become valid.
  const size_t hold = utf8::incomplete_tail(pending_);
  std::string out = utf8::to_valid(std::string_view(pending_).substr(0, pending_.size() - hold));
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string IncrementalDecoder::finish() {
  std::string out = utf8::to_valid(pending_);
  pending_.clear();
  any_ = false;
  return out;
}

}  // namespace opd
