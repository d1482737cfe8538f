// Exactness of opd's tokenizer against Hugging Face `tokenizers` (the oracle, run at test time
// by tools/tokenizer_oracle.py): every line of the committed corpus for real tokenizer.json
// files of two families (Qwen3, committed; Llama-3.2, pip-installed), random id sequences for
// decoding, synthetic variants of the Qwen3 file that switch on the components the real files
// leave off, the regex character classes and NFC over all of Unicode.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tokenizer/regex.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"
#include "tokenizer/utf8.h"
#include "tokenizer/oracle_util.h"

namespace opd::test {
namespace {

using json = nlohmann::json;

std::string ids_str(const std::vector<int32_t>& v, size_t max = 40) {
  std::string s = "[";
  for (size_t i = 0; i < v.size() && i < max; ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + (v.size() > max ? ",...]" : "]");
}

std::vector<int32_t> as_ids(const json& j) { return j.get<std::vector<int32_t>>(); }

// Incremental decoding in chunks of `step` ids must add up to decode().
std::string decode_incrementally(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip,
                                 size_t step) {
  IncrementalDecoder dec(tok, skip);
  std::string out;
  for (size_t i = 0; i < ids.size(); i += step) {
    const size_t n = std::min(step, ids.size() - i);
    std::string part = dec.push(std::span<const int32_t>(ids.data() + i, n));
    EXPECT_TRUE(utf8::is_valid(part)) << "incremental decoder emitted invalid UTF-8";
    out += part;
  }
  return out + dec.finish();
}

// Compares every corpus line; returns the number of lines checked.
void check_corpus(const std::string& tokenizer_json, const std::string& corpus) {
  const std::string out = temp_path("corpus.jsonl");
  OracleRun run = run_oracle("corpus --tokenizer " + shell_quote(tokenizer_json) + " --corpus " +
                             shell_quote(corpus) + " --out " + shell_quote(out));
  OPD_REQUIRE_ORACLE(run);
  const std::vector<json> expected = read_json_lines(out);
  std::remove(out.c_str());
  const std::vector<std::string> lines = corpus_lines(corpus);
  ASSERT_EQ(expected.size(), lines.size());

  const Tokenizer tok = Tokenizer::load(tokenizer_json);
  size_t id_mismatch = 0, special_mismatch = 0, decode_mismatch = 0, roundtrip_fail = 0,
         roundtrips = 0, incremental_mismatch = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const json& e = expected[i];
    const std::vector<int32_t> ids = tok.encode(lines[i]);
    if (ids != as_ids(e["ids"]) && ++id_mismatch <= 5)
      ADD_FAILURE() << "line " << i + 1 << " ids differ\n  text: " << e["text"].dump()
                    << "\n  hf:   " << ids_str(as_ids(e["ids"])) << "\n  opd:  " << ids_str(ids);
    const std::vector<int32_t> ids_sp = tok.encode(lines[i], /*add_special_tokens=*/true);
    if (ids_sp != as_ids(e["ids_special"]) && ++special_mismatch <= 5)
      ADD_FAILURE() << "line " << i + 1 << " ids with special tokens differ: hf "
                    << ids_str(as_ids(e["ids_special"])) << " opd " << ids_str(ids_sp);
    // Decode the oracle's ids (so a decode check never hides behind an encode mismatch).
    const std::vector<int32_t> hf_ids = as_ids(e["ids"]);
    const std::string dec = tok.decode(hf_ids), dec_skip = tok.decode(hf_ids, true);
    if ((dec != e["decoded"].get<std::string>() || dec_skip != e["decoded_skip"].get<std::string>()) &&
        ++decode_mismatch <= 5)
      ADD_FAILURE() << "line " << i + 1 << " decode differs: hf " << e["decoded"].dump()
                    << " opd " << json(dec).dump();
    // decode(encode(x)) == x wherever HF round-trips (text = the line after U+FFFD replacement).
    if (e["decoded"] == e["text"]) {
      ++roundtrips;
      if (tok.decode(ids) != e["text"].get<std::string>() && ++roundtrip_fail <= 5)
        ADD_FAILURE() << "line " << i + 1 << " does not round-trip: " << e["text"].dump();
    }
    if (i % 7 == 0 && (decode_incrementally(tok, hf_ids, false, 1 + i % 3) != dec ||
                       decode_incrementally(tok, hf_ids, true, 1) != dec_skip))
      if (++incremental_mismatch <= 5) ADD_FAILURE() << "line " << i + 1 << " incremental decode differs";
  }
  std::printf("[ oracle ] %s: %zu lines, %zu id mismatches, %zu with special tokens, %zu decode "
              "mismatches, %zu/%zu round-trips failed, %zu incremental mismatches\n",
              tokenizer_json.c_str(), lines.size(), id_mismatch, special_mismatch,
              decode_mismatch, roundtrip_fail, roundtrips, incremental_mismatch);
  EXPECT_GE(lines.size(), 10000u);
  EXPECT_EQ(id_mismatch, 0u);
  EXPECT_EQ(special_mismatch, 0u);
  EXPECT_EQ(decode_mismatch, 0u);
  EXPECT_EQ(roundtrip_fail, 0u);
  EXPECT_EQ(incremental_mismatch, 0u);
}

void check_random_decode(const std::string& tokenizer_json) {
  const std::string out = temp_path("random.jsonl");
  OracleRun run = run_oracle("random-ids --tokenizer " + shell_quote(tokenizer_json) +
                             " --count 3000 --out " + shell_quote(out));
  OPD_REQUIRE_ORACLE(run);
  const std::vector<json> expected = read_json_lines(out);
  std::remove(out.c_str());
  ASSERT_EQ(expected.size(), 3000u);
  const Tokenizer tok = Tokenizer::load(tokenizer_json);
  size_t bad = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const std::vector<int32_t> ids = as_ids(expected[i]["ids"]);
    const std::string want = expected[i]["decoded"], want_skip = expected[i]["decoded_skip"];
    const bool ok = tok.decode(ids) == want && tok.decode(ids, true) == want_skip &&
                    decode_incrementally(tok, ids, false, 1) == want &&
                    decode_incrementally(tok, ids, false, 2 + i % 5) == want &&
                    decode_incrementally(tok, ids, true, 1) == want_skip;
    if (!ok && ++bad <= 5)
      ADD_FAILURE() << "random ids " << ids_str(ids) << ": hf " << json(want).dump() << " opd "
                    << json(tok.decode(ids)).dump();
  }
  EXPECT_EQ(bad, 0u);
}

std::string llama3_tokenizer(OracleRun& run) {
  run = run_oracle("path llama3");
  std::string p = run.stdout_text;
  while (!p.empty() && (p.back() == '\n' || p.back() == '\r')) p.pop_back();
  return p;
}

TEST(TokenizerOracle, Qwen3CorpusMatchesHf) { check_corpus(qwen3_tokenizer(), corpus_path()); }

TEST(TokenizerOracle, Llama3CorpusMatchesHf) {
  OracleRun run;
  const std::string path = llama3_tokenizer(run);
  OPD_REQUIRE_ORACLE(run);
  check_corpus(path, corpus_path());
}

TEST(TokenizerOracle, Qwen3RandomIdsDecodeLikeHf) { check_random_decode(qwen3_tokenizer()); }

TEST(TokenizerOracle, Llama3RandomIdsDecodeLikeHf) {
  OracleRun run;
  const std::string path = llama3_tokenizer(run);
  OPD_REQUIRE_ORACLE(run);
  check_random_decode(path);
}

// Variants of the real Qwen3 file that turn on what neither real file uses: ByteLevel with
// its own regex and a prefix space, ignore_merges, a String split, lstrip/rstrip/single_word
// and normalized added tokens, a TemplateProcessing with tokens on both sides.
json qwen3_json() {
  std::ifstream in(qwen3_tokenizer());
  return json::parse(in);
}

std::string write_variant(const json& j, const std::string& name) {
  const std::string path = temp_path(name + ".json");
  std::ofstream(path) << j.dump();
  return path;
}

void set_added_flags(json& j, const std::string& content, const json& flags) {
  for (json& t : j["added_tokens"])
    if (t["content"] == content)
      for (auto it = flags.begin(); it != flags.end(); ++it) t[it.key()] = it.value();
}

TEST(TokenizerOracle, Gpt2StyleVariantMatchesHf) {
  json j = qwen3_json();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true},
                        {"use_regex", true}};
  j["model"]["ignore_merges"] = true;
  set_added_flags(j, "<|im_start|>", {{"lstrip", true}});
  set_added_flags(j, "<|im_end|>", {{"rstrip", true}});
  set_added_flags(j, "<|endoftext|>", {{"lstrip", true}, {"rstrip", true}});
  set_added_flags(j, "<think>", {{"single_word", true}, {"normalized", true}});
  set_added_flags(j, "</think>", {{"single_word", true}});
  const std::string path = write_variant(j, "gpt2_style");
  check_corpus(path, corpus_path());
  std::remove(path.c_str());
}

TEST(TokenizerOracle, TemplateAndStringSplitVariantMatchesHf) {
  json j = qwen3_json();
  json seq = json::array();
  seq.push_back({{"type", "Split"}, {"pattern", {{"String", ". "}}}, {"behavior", "Isolated"},
                 {"invert", false}});
  seq.push_back(j["pre_tokenizer"]["pretokenizers"][0]);
  seq.push_back({{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false},
                 {"use_regex", false}});
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", seq}};
  json special = {{"<|im_start|>", {{"id", "<|im_start|>"}, {"ids", {151644}}, {"tokens", {"<|im_start|>"}}}},
                  {"<|im_end|>", {{"id", "<|im_end|>"}, {"ids", {151645}}, {"tokens", {"<|im_end|>"}}}}};
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", {{{"SpecialToken", {{"id", "<|im_start|>"}, {"type_id", 0}}}},
                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                  {{"SpecialToken", {{"id", "<|im_end|>"}, {"type_id", 0}}}}}},
      {"pair", {{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
      {"special_tokens", special}};
  set_added_flags(j, "<tool_call>", {{"normalized", true}, {"lstrip", true}});
  const std::string path = write_variant(j, "template");
  check_corpus(path, corpus_path());
  std::remove(path.c_str());
}

// The translated \s, \p{L}, \p{N} accept exactly the code points Oniguruma accepts.
TEST(TokenizerOracle, RegexClassesMatchOniguruma) {
  const std::string out = temp_path("classes.json");
  OracleRun run = run_oracle("classes --out " + shell_quote(out));
  OPD_REQUIRE_ORACLE(run);
  std::ifstream in(out);
  const json classes = json::parse(in);
  std::remove(out.c_str());
  for (const char* pat : {"\\s", "\\p{L}", "\\p{N}"}) {
    std::vector<char> expect(0x110000, 0);
    for (const json& r : classes[pat])
      for (uint32_t c = r[0].get<uint32_t>(); c <= r[1].get<uint32_t>(); ++c) expect[c] = 1;
    // Match the class over a string of every code point; matched spans are the members.
    std::string all;
    std::vector<uint32_t> at;  // byte offset -> code point
    for (uint32_t c = 1; c < 0x110000; ++c) {
      if (c >= 0xD800 && c <= 0xDFFF) continue;
      at.resize(all.size() + 4, 0);
      at[all.size()] = c;
      utf8::append(all, c);
    }
    const Regex re(translate_pattern(pat), pat);
    std::vector<std::pair<size_t, size_t>> spans;
    re.find_all(all, spans);
    std::vector<char> got(0x110000, 0);
    for (const auto& [a, b] : spans) got[at[a]] = 1;
    size_t bad = 0;
    for (uint32_t c = 1; c < 0x110000; ++c)
      if (got[c] != expect[c] && ++bad <= 5)
        ADD_FAILURE() << pat << ": U+" << std::hex << c << std::dec << " opd " << int(got[c])
                      << " oniguruma " << int(expect[c]);
    EXPECT_EQ(bad, 0u) << pat;
  }
}

TEST(TokenizerOracle, NfcMatchesHfOnEveryCodePoint) {
  const std::string out = temp_path("nfc.jsonl");
  OracleRun run = run_oracle("nfc --out " + shell_quote(out));
  OPD_REQUIRE_ORACLE(run);
  const std::vector<json> cases = read_json_lines(out);
  std::remove(out.c_str());
  ASSERT_GT(cases.size(), 1000000u);
  size_t bad = 0;
  for (const json& c : cases) {
    const std::string in = c["in"], want = c["nfc"];
    std::string got;
    if (!unicode::nfc(in, got)) got = in;
    if (got != want && ++bad <= 5)
      ADD_FAILURE() << "NFC of " << json(in).dump() << ": hf " << json(want).dump() << " opd "
                    << json(got).dump();
  }
  EXPECT_EQ(bad, 0u);
}

}  // namespace
}  // namespace opd::test
