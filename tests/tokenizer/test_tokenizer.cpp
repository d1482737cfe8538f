// Tokenizer unit tests that need no oracle: the UTF-8 replacement rule (against the Unicode
// standard's own example), incremental decoding, tokenizer_config.json fields checked against
// the fixture files themselves, id validation, and every load error path on small
// synthetic tokenizer.json files (each error test flips one thing in an otherwise valid file).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "tokenizer/oracle_util.h"
#include "tokenizer/regex.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace opd::test {
namespace {

using json = nlohmann::json;

// Unicode 15.0 §3.9, Table 3-8 ("U+FFFD for Non-Shortest Form Sequences"/maximal subparts):
// 61 F1 80 80 E1 80 C2 62 80 63 80 BF 64 -> a FFFD FFFD FFFD b FFFD c FFFD FFFD d.
TEST(Utf8, ReplacementFollowsUnicodeMaximalSubparts) {
  const std::string in = "\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64";
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(utf8::to_valid(in), "a" + r + r + r + "b" + r + "c" + r + r + "d");
  EXPECT_FALSE(utf8::is_valid(in));
  // Surrogates, overlongs and > U+10FFFF are ill-formed byte by byte (Table 3-7).
  EXPECT_EQ(utf8::to_valid("\xED\xA0\x80"), r + r + r);
  EXPECT_EQ(utf8::to_valid("\xC0\xAF"), r + r);
  EXPECT_EQ(utf8::to_valid("\xF4\x90\x80\x80"), r + r + r + r);
  const std::string ok = "a\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80";  // a é € 😀
  EXPECT_TRUE(utf8::is_valid(ok));
  EXPECT_EQ(utf8::to_valid(ok), ok);
}

TEST(Utf8, IncompleteTailHoldsOnlyValidPrefixes) {
  EXPECT_EQ(utf8::incomplete_tail("a\xC3"), 1u);          // é cut after its lead byte
  EXPECT_EQ(utf8::incomplete_tail("a\xE2\x82"), 2u);      // € cut after two bytes
  EXPECT_EQ(utf8::incomplete_tail("\xF0\x9F\x98"), 3u);   // 😀 cut after three
  EXPECT_EQ(utf8::incomplete_tail("a\xC3\xA9"), 0u);      // complete
  EXPECT_EQ(utf8::incomplete_tail("\xE0\x80"), 0u);       // E0 80 can never become valid
  EXPECT_EQ(utf8::incomplete_tail("\x80"), 0u);           // stray continuation
  EXPECT_EQ(utf8::incomplete_tail(""), 0u);
}

class Qwen3 : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tok_ = new Tokenizer(Tokenizer::load(fixture_path("tokenizers/qwen3")));  // directory form
    std::ifstream in(qwen3_tokenizer());
    file_ = new json(json::parse(in));
    std::ifstream cin(fixture_path("tokenizers/qwen3/tokenizer_config.json"));
    config_ = new json(json::parse(cin));
  }
  static void TearDownTestSuite() {
    delete tok_;
    delete file_;
    delete config_;
  }
  // The id tokenizer.json's added_tokens gives `content` (read from the file, not our code).
  static int32_t added_id(const std::string& content) {
    for (const json& t : (*file_)["added_tokens"])
      if (t["content"] == content) return t["id"].get<int32_t>();
    ADD_FAILURE() << content << " not in added_tokens";
    return -1;
  }
  static Tokenizer* tok_;
  static json* file_;
  static json* config_;
};
Tokenizer* Qwen3::tok_ = nullptr;
json* Qwen3::file_ = nullptr;
json* Qwen3::config_ = nullptr;

TEST_F(Qwen3, ConfigFieldsComeFromTokenizerConfig) {
  const Tokenizer& t = *tok_;
  ASSERT_TRUE(t.eos_id().has_value());
  EXPECT_EQ(*t.eos_id(), added_id((*config_)["eos_token"].get<std::string>()));
  ASSERT_TRUE(t.pad_id().has_value());
  EXPECT_EQ(*t.pad_id(), added_id((*config_)["pad_token"].get<std::string>()));
  EXPECT_TRUE((*config_)["bos_token"].is_null());
  EXPECT_FALSE(t.bos_id().has_value());
  ASSERT_TRUE(t.config().chat_template.has_value());
  EXPECT_EQ(*t.config().chat_template, (*config_)["chat_template"].get<std::string>());
  ASSERT_TRUE(t.config().add_bos_token.has_value());
  EXPECT_EQ(*t.config().add_bos_token, (*config_)["add_bos_token"].get<bool>());
}

TEST_F(Qwen3, VocabSizeAndSpecialFlagsMatchTheFile) {
  int64_t max_id = -1;
  for (const auto& item : (*file_)["model"]["vocab"].items())
    max_id = std::max<int64_t>(max_id, item.value().get<int64_t>());
  for (const json& t : (*file_)["added_tokens"]) {
    max_id = std::max<int64_t>(max_id, t["id"].get<int64_t>());
    EXPECT_EQ(tok_->is_special(t["id"]), t["special"].get<bool>()) << t["content"];
    EXPECT_EQ(tok_->id_to_token(t["id"]), t["content"].get<std::string>());
    EXPECT_EQ(tok_->token_to_id(t["content"].get<std::string>()), t["id"].get<int32_t>());
  }
  EXPECT_EQ(tok_->vocab_size(), max_id + 1);
  EXPECT_FALSE(tok_->is_special(0));
  EXPECT_FALSE(tok_->token_to_id("definitely not a token \x01").has_value());
}

TEST_F(Qwen3, DecodeRejectsIdsOutsideTheVocabulary) {
  const int32_t n = tok_->vocab_size();
  for (int32_t bad : {-1, n, n + 1000, INT32_MAX}) {
    const std::vector<int32_t> ids = {0, 1, bad};
    try {
      (void)tok_->decode(ids);
      FAIL() << "decode accepted id " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find("position 2"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::to_string(bad)), std::string::npos) << e.what();
    }
    IncrementalDecoder dec(*tok_);
    EXPECT_THROW((void)dec.push(bad), Error);
    EXPECT_THROW((void)tok_->id_to_token(bad), Error);
  }
}

// A multi-byte character spread over several byte tokens is emitted only once complete.
TEST_F(Qwen3, IncrementalDecoderNeverEmitsHalfACharacter) {
  for (const std::string text : {"🎉 party 𓀀", "日本語", "a👨‍👩‍👧‍👦b", "é\xCC\x81x"}) {
    const std::vector<int32_t> ids = tok_->encode(text);
    IncrementalDecoder dec(*tok_);
    std::string out;
    for (int32_t id : ids) {
      const std::string part = dec.push(id);
      EXPECT_TRUE(utf8::is_valid(part)) << "half a character emitted for " << text;
      out += part;
    }
    out += dec.finish();
    EXPECT_EQ(out, text);
  }
  // A rare character (U+13000, Egyptian hieroglyph) is several byte tokens: nothing comes out
  // until the last one, then the whole character.
  const std::vector<int32_t> ids = tok_->encode("\U00013000");
  ASSERT_GE(ids.size(), 2u) << "expected U+13000 to span several byte tokens";
  IncrementalDecoder dec(*tok_);
  for (size_t i = 0; i + 1 < ids.size(); ++i) EXPECT_EQ(dec.push(ids[i]), "");
  EXPECT_EQ(dec.push(ids.back()), "\U00013000");
  // A dangling partial sequence is flushed as U+FFFD, like decode() does.
  IncrementalDecoder cut(*tok_);
  EXPECT_EQ(cut.push(ids[0]), "");
  EXPECT_EQ(cut.finish(), tok_->decode(std::vector<int32_t>{ids[0]}));
  EXPECT_EQ(cut.finish(), "");
}

TEST_F(Qwen3, SpecialTokensAreMatchedBeforeBpeAndSkippable) {
  const int32_t start = added_id("<|im_start|>"), end = added_id("<|im_end|>");
  const std::vector<int32_t> ids = tok_->encode("<|im_start|>user\nhi<|im_end|>");
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), start);
  EXPECT_EQ(ids.back(), end);
  EXPECT_EQ(tok_->decode(ids), "<|im_start|>user\nhi<|im_end|>");
  EXPECT_EQ(tok_->decode(ids, /*skip_special_tokens=*/true), "user\nhi");
  // Both settings of add_special_tokens: Qwen3 has no template, so they agree.
  EXPECT_EQ(tok_->encode("hello", true), tok_->encode("hello", false));
}

TEST_F(Qwen3, EncodeIsThreadSafeWithPerThreadCaches) {
  const std::vector<std::string> lines = corpus_lines(corpus_path());
  ASSERT_GT(lines.size(), 2000u);
  std::vector<std::vector<int32_t>> serial;
  for (size_t i = 0; i < 2000; ++i) serial.push_back(tok_->encode(lines[i]));
  std::vector<std::vector<std::vector<int32_t>>> results(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (size_t i = 0; i < 2000; ++i) results[t].push_back(tok_->encode(lines[(i + 500 * t) % 2000]));
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t)
    for (size_t i = 0; i < 2000; ++i) ASSERT_EQ(results[t][i], serial[(i + 500 * t) % 2000]);
}

// ---- synthetic files for the error paths --------------------------------------------------

// The GPT-2 byte-to-unicode alphabet as token strings, ids 0..255 in byte order.
json byte_vocab() {
  json v = json::object();
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool direct = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    std::string s;
    utf8::append(s, direct ? static_cast<char32_t>(b) : static_cast<char32_t>(next++));
    v[s] = b;
  }
  return v;
}

json minimal_tokenizer() {
  json v = byte_vocab();
  v["ab"] = 256;
  json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = json::array({{{"id", 257}, {"content", "<|end|>"}, {"special", true},
                                    {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                                    {"single_word", false}}});
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  j["post_processor"] = nullptr;
  j["decoder"] = {{"type", "ByteLevel"}};
  j["model"] = {{"type", "BPE"}, {"vocab", v}, {"merges", json::array({"a b"})}};
  return j;
}

std::string write_temp(const std::string& text, const std::string& name) {
  const std::string path = temp_path(name);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// Loading `j` must throw `kind` with every string of `needles` in the message.
void expect_load_error(const std::string& text, ErrorKind kind,
                       std::vector<std::string> needles, const std::string& name) {
  const std::string path = write_temp(text, name + ".json");
  needles.push_back(path);  // errors name the file
  try {
    (void)Tokenizer::load(path);
    ADD_FAILURE() << name << ": load succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << name << ": " << e.what();
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << name << ": message lacks '" << n << "': " << e.what();
  }
  std::remove(path.c_str());
}

TEST(TokenizerLoad, MinimalFileLoadsAndMerges) {
  const std::string path = write_temp(minimal_tokenizer().dump(), "minimal.json");
  const Tokenizer t = Tokenizer::load(path);
  // Ids fixed by the file above: "ab" is 256, '<|end|>' 257, 'c' is byte 0x63 = id 99.
  EXPECT_EQ(t.encode("abc"), (std::vector<int32_t>{256, 99}));
  EXPECT_EQ(t.encode("ab<|end|>"), (std::vector<int32_t>{256, 257}));
  EXPECT_EQ(t.vocab_size(), 258);
  EXPECT_EQ(t.decode(std::vector<int32_t>{256, 257, 99}, true), "abc");
  std::remove(path.c_str());
}

TEST(TokenizerLoad, ErrorsNameTheFileAndTheProblem) {
  expect_load_error("{\"model\": ", ErrorKind::InvalidData, {"not valid JSON"}, "truncated");
  expect_load_error("[1, 2]", ErrorKind::InvalidData, {"not a JSON object"}, "array");
  json j = minimal_tokenizer();
  j.erase("model");
  expect_load_error(j.dump(), ErrorKind::InvalidData, {"model"}, "no_model");

  j = minimal_tokenizer();
  j["normalizer"] = {{"type", "Lowercase"}};
  expect_load_error(j.dump(), ErrorKind::Unsupported, {"normalizer", "Lowercase"}, "lowercase");
  j = minimal_tokenizer();
  j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}};
  expect_load_error(j.dump(), ErrorKind::Unsupported, {"pre_tokenizer", "Metaspace"}, "metaspace");
  j = minimal_tokenizer();
  j["decoder"] = {{"type", "WordPiece"}};
  expect_load_error(j.dump(), ErrorKind::Unsupported, {"decoder", "WordPiece"}, "wordpiece");
  j = minimal_tokenizer();
  j["post_processor"] = {{"type", "BertProcessing"}};
  expect_load_error(j.dump(), ErrorKind::Unsupported, {"post_processor", "BertProcessing"}, "bert");
  j = minimal_tokenizer();
  j["model"]["type"] = "Unigram";
  expect_load_error(j.dump(), ErrorKind::Unsupported, {"model", "Unigram"}, "unigram");
  j = minimal_tokenizer();
  j["model"]["dropout"] = 0.1;
  expect_load_error(j.dump(), ErrorKind::Unsupported, {"dropout"}, "dropout");
  j = minimal_tokenizer();
  j["truncation"] = {{"max_length", 8}};
  expect_load_error(j.dump(), ErrorKind::Unsupported, {"truncation"}, "truncation");
  j = minimal_tokenizer();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}},
                        {"behavior", "Isolated"}, {"invert", false}};
  expect_load_error(j.dump(), ErrorKind::InvalidData, {"regex", "(unclosed"}, "bad_regex");
  j = minimal_tokenizer();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}},
                        {"behavior", "Removed"}, {"invert", false}};
  expect_load_error(j.dump(), ErrorKind::Unsupported, {"Removed"}, "removed");
}

TEST(TokenizerLoad, IdsAndMergesAreValidated) {
  json j = minimal_tokenizer();
  j["model"]["vocab"]["xy"] = 5;  // id 5 already belongs to a byte token
  expect_load_error(j.dump(), ErrorKind::InvalidData, {"id 5", "xy"}, "duplicate_id");
  j = minimal_tokenizer();
  j["model"]["vocab"]["xy"] = -3;
  expect_load_error(j.dump(), ErrorKind::InvalidData, {"xy", "-3"}, "negative_id");
  j = minimal_tokenizer();
  j["model"]["vocab"]["xy"] = int64_t{1} << 31;
  expect_load_error(j.dump(), ErrorKind::InvalidData, {"xy", "2147483648"}, "huge_id");
  j = minimal_tokenizer();
  j["model"]["vocab"]["xy"] = "7";
  expect_load_error(j.dump(), ErrorKind::InvalidData, {"xy", "non-integer"}, "string_id");
  j = minimal_tokenizer();
  j["model"]["merges"].push_back("a zz");
  expect_load_error(j.dump(), ErrorKind::InvalidData, {"merge 1", "'zz'"}, "merge_unknown");
  j = minimal_tokenizer();
  j["model"]["merges"].push_back("b c");  // "bc" is not in the vocab
  expect_load_error(j.dump(), ErrorKind::InvalidData, {"merge 1", "'bc'"}, "merge_result");
  j = minimal_tokenizer();
  j["model"]["merges"].push_back("a b c");
  expect_load_error(j.dump(), ErrorKind::InvalidData, {"merge 1"}, "merge_three");
  // A byte missing from the vocab is dropped as HF drops it (MissingByteIsDroppedAsHfDoes),
  // unless an unk_token asks for HF's unk path, which opd does not implement.
  j = minimal_tokenizer();
  j["model"]["vocab"].erase("a");
  j["model"]["merges"] = json::array();
  j["model"]["unk_token"] = "<|end|>";
  expect_load_error(j.dump(), ErrorKind::Unsupported, {"byte 0x61", "unk_token"}, "missing_byte_unk");
  j = minimal_tokenizer();
  j["added_tokens"][0]["id"] = 97;  // the id of "a"
  expect_load_error(j.dump(), ErrorKind::InvalidData, {"id 97", "<|end|>"}, "added_collision");
  j = minimal_tokenizer();
  j["added_tokens"].push_back(j["added_tokens"][0]);
  j["added_tokens"][1]["id"] = 300;
  expect_load_error(j.dump(), ErrorKind::InvalidData, {"listed twice"}, "added_twice");
  j = minimal_tokenizer();
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", {{{"SpecialToken", {{"id", "<s>"}}}}, {{"Sequence", {{"id", "A"}}}}}},
                         {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {999}}}}}}};
  expect_load_error(j.dump(), ErrorKind::InvalidData, {"999"}, "template_unknown_id");
}

// SmolLM2's vocabulary lacks 21 byte tokens; HF's BPE (models/bpe/model.rs merge_word) skips a
// character that has no vocab entry when there is no unk_token, and its neighbours then merge.
TEST(TokenizerLoad, MissingByteIsDroppedAsHfDoes) {
  json j = minimal_tokenizer();
  j["model"]["vocab"].erase("c");
  const Tokenizer tok = Tokenizer::load(write_temp(j.dump(), "missing_byte.json"));
  const int32_t a = *tok.token_to_id("a"), b = *tok.token_to_id("b"), ab = *tok.token_to_id("ab");
  EXPECT_EQ(tok.encode("acb"), (std::vector<int32_t>{ab}));  // "c" dropped, then "a b" merges
  EXPECT_EQ(tok.encode("c"), (std::vector<int32_t>{}));
  EXPECT_EQ(tok.encode("bca"), (std::vector<int32_t>{b, a}));
}

// Untrusted files: random type changes anywhere in a valid file either load or raise
// opd::Error (InvalidData/Unsupported), never another exception or a crash (ASan variant).
TEST(TokenizerLoad, MutatedFilesFailCleanly) {
  const json base = minimal_tokenizer();
  std::vector<std::vector<std::string>> paths = {
      {"model"}, {"model", "type"}, {"model", "vocab"}, {"model", "merges"}, {"model", "dropout"},
      {"model", "ignore_merges"}, {"added_tokens"}, {"normalizer"}, {"pre_tokenizer"},
      {"pre_tokenizer", "type"}, {"pre_tokenizer", "use_regex"}, {"decoder"}, {"decoder", "type"},
      {"post_processor"}, {"truncation"}};
  const std::vector<json> values = {nullptr, 1, -7, 2.5, true, "x", json::array(),
                                    json::array({1, "a", nullptr}), json::object(),
                                    {{"type", "Sequence"}}, {{"type", 3}}};
  int n = 0;
  for (const auto& p : paths)
    for (const json& v : values) {
      json j = base;
      json* node = &j;
      for (size_t i = 0; i + 1 < p.size(); ++i) node = &(*node)[p[i]];
      (*node)[p.back()] = v;
      const std::string path = write_temp(j.dump(), "mutated.json");
      try {
        (void)Tokenizer::load(path);
      } catch (const Error& e) {
        EXPECT_TRUE(e.kind() == ErrorKind::InvalidData || e.kind() == ErrorKind::Unsupported)
            << e.what();
      } catch (const std::exception& e) {
        ADD_FAILURE() << "non-opd exception for " << j.dump().substr(0, 200) << ": " << e.what();
      }
      std::remove(path.c_str());
      ++n;
    }
  EXPECT_EQ(n, static_cast<int>(paths.size() * values.size()));
}

// Without a normalizer, byte-level BPE is lossless on any valid text, so decode(encode(x)) is
// x after the U+FFFD rule, for arbitrary bytes.
TEST(TokenizerLoad, RandomBytesRoundTripThroughTheReplacementRule) {
  const std::string path = write_temp(minimal_tokenizer().dump(), "minimal_rt.json");
  const Tokenizer t = Tokenizer::load(path);
  uint64_t state = 0x9E3779B97F4A7C15ULL;
  auto next = [&] {  // xorshift64*
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return state * 0x2545F4914F6CDD1DULL;
  };
  for (int i = 0; i < 3000; ++i) {
    std::string s(next() % 64, '\0');
    for (char& c : s) {
      const uint64_t r = next();
      c = static_cast<char>((r & 3) == 0 ? ' ' : (r & 3) == 1 ? 'a' + (r >> 8) % 3 : (r >> 8) & 0xFF);
    }
    const std::vector<int32_t> ids = t.encode(s);
    for (int32_t id : ids) ASSERT_TRUE(t.contains(id));
    ASSERT_EQ(t.decode(ids), utf8::to_valid(s)) << "input bytes: " << s.size();
  }
  std::remove(path.c_str());
}

TEST(TokenizerLoad, MissingFileIsAnIoError) {
  try {
    (void)Tokenizer::load("/nonexistent/dir");
    FAIL() << "loaded a missing file";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Io);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir"), std::string::npos);
  }
}

TEST(TokenizerRegex, UntranslatableConstructIsUnsupported) {
  EXPECT_THROW((void)translate_pattern("[\\S\\d]"), Error);
  EXPECT_NO_THROW((void)translate_pattern("[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"));
}

}  // namespace
}  // namespace opd::test
