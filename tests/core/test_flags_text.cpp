// core/flags_text.h: the TOML subset and JSON of `--config` flags files, value by value, every
// error with its file:line, and a mutation fuzz (any input ends in entries or an opd::Error;
// the _asan variant runs it under ASan + UBSan).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/fuzz_util.h"
#include "core/error.h"
#include "core/flags_text.h"

namespace opd {
namespace {

std::vector<FlagsEntry> toml(const std::string& text) {
  return parse_flags_text(text, "run.toml", false, "train");
}
std::string error_of(const std::string& text, bool json = false) {
  try {
    parse_flags_text(text, json ? "run.json" : "run.toml", json, "train");
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "accepted: " << text;
  return "";
}

TEST(FlagsText, TomlValuesCommentsSectionsAndArrays) {
  const auto e = toml(
      "# a comment\n"
      "\n"
      "[train]\n"
      "learning_rate = 1e-5   # trailing comment\n"
      "seed=1_000\r\n"
      "name = \"a \\\"quoted\\\" # not a comment\\n\"\n"
      "path = 'C:\\dir'\n"
      "seq-kd = true\n"
      "data = [\"a.jsonl\", 'b.jsonl' , 3]\n"
      "empty = []\n"
      "\"quoted-key\" = -inf\n");
  ASSERT_EQ(e.size(), 8u);
  EXPECT_EQ(e[0].key, "learning_rate");
  EXPECT_EQ(e[0].where, "run.toml:4");
  EXPECT_EQ(e[0].values[0].text, "1e-5");
  EXPECT_FALSE(e[0].is_array);
  EXPECT_EQ(e[1].values[0].text, "1000");
  EXPECT_EQ(e[2].values[0].text, "a \"quoted\" # not a comment\n");
  EXPECT_EQ(e[3].values[0].text, "C:\\dir");  // literal string: no escapes
  EXPECT_TRUE(e[4].values[0].is_bool);
  EXPECT_EQ(e[4].values[0].text, "true");
  EXPECT_TRUE(e[5].is_array);
  ASSERT_EQ(e[5].values.size(), 3u);
  EXPECT_EQ(e[5].values[1].text, "b.jsonl");
  EXPECT_EQ(e[5].values[2].text, "3");
  EXPECT_TRUE(e[6].is_array);
  EXPECT_TRUE(e[6].values.empty());
  EXPECT_EQ(e[7].key, "quoted-key");
  EXPECT_EQ(e[7].values[0].text, "-inf");
}

TEST(FlagsText, JsonObjectOfScalarsAndArrays) {
  const auto e = parse_flags_text(
      R"({"learning_rate": 0.5, "seq_kd": false, "data": ["a", "b"], "out": "-x"})", "run.json",
      true, "train");
  ASSERT_EQ(e.size(), 4u);
  for (const auto& x : e) EXPECT_EQ(x.where, "run.json");
  // nlohmann keeps object members sorted by key.
  EXPECT_EQ(e[0].key, "data");
  EXPECT_EQ(e[0].values.size(), 2u);
  EXPECT_EQ(e[1].key, "learning_rate");
  EXPECT_EQ(e[1].values[0].text, "0.5");
  EXPECT_EQ(e[2].values[0].text, "-x");
  EXPECT_TRUE(e[3].values[0].is_bool);
  EXPECT_EQ(e[3].values[0].text, "false");
}

TEST(FlagsText, EveryMistakeNamesTheLine) {
  const struct {
    const char* text;
    const char* expect;
  } cases[] = {
      {"a = 1\nb = word\n", "run.toml:2: `word` is not a value"},
      {"a = 1\n= 2\n", "run.toml:2: expected a key"},
      {"a 1\n", "run.toml:1: expected `=` after `a`"},
      {"a =\n", "run.toml:1: a key without a value"},
      {"a = \"open\n", "run.toml:1: unterminated string"},
      {"a = \"\\q\"\n", "run.toml:1: unsupported escape \\q"},
      {"a = [1, 2\n", "run.toml:1: expected `]` closing the array of `a`"},
      {"a = 1 2\n", "run.toml:1: unexpected text after the value of `a`"},
      {"\n[sft]\n", "run.toml:2: section [sft]"},
      {"[train\n", "run.toml:1: section [train"},
      {"a = 1.2.3\n", "run.toml:1: `1.2.3` is not a value"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    EXPECT_NE(error_of(c.text).find(c.expect), std::string::npos) << error_of(c.text);
  }
  EXPECT_NE(error_of("[1, 2]", true).find("run.json: a flags file in JSON is one object"),
            std::string::npos);
  EXPECT_NE(error_of("{\"a\": null}", true).find("the value of \"a\" is null"), std::string::npos);
  EXPECT_NE(error_of("{\"a\": [[1]]}", true).find("the value of \"a\" is array"),
            std::string::npos);
  EXPECT_NE(error_of("{\"a\": {\"b\": 1}}", true).find("is object"), std::string::npos);
  EXPECT_NE(error_of("{\"a\": ", true).find("run.json: invalid JSON"), std::string::npos);
}

// Mutations of a valid file of each kind: every outcome is entries or an opd::Error (never a
// crash, another exception type, or a hang); accepted TOML entries always carry a key and a
// FILE:LINE inside the file.
TEST(FlagsTextFuzz, RandomMutations) {
  const std::string base_toml =
      "# flags\n[train]\nlearning_rate = 1e-5\nseed = 1_000\nname = \"x \\\"y\\\"\"\n"
      "path = 'p'\nseq-kd = true\ndata = [\"a\", 'b', 3]\n\"k\" = -inf\n";
  const std::string base_json = R"({"learning_rate": 0.5, "seq_kd": false, "data": ["a", "b"]})";
  const std::vector<std::string> dict = {"[",  "]",    "\"",   "'",     "=",   "#",    "\\",
                                         "\n", ",",    "true", "1e999", "_",   "[train]",
                                         "{",  "}",    ":",    "null",  "\r",  std::string(1, '\0')};
  const int iters = test::fuzz_iters(1500);
  int accepted = 0;
  for (int i = 0; i < iters; ++i) {
    test::FuzzRng rng(0xf1a95, static_cast<uint32_t>(i));
    const bool json = rng.chance(30);
    std::string text = json ? base_json : base_toml, log;
    const int edits = 1 + static_cast<int>(rng.below(4));
    for (int k = 0; k < edits; ++k) test::mutate_bytes(text, rng, dict, &log);
    std::vector<FlagsEntry> got;
    if (test::accepts("case " + std::to_string(i) + ": " + log,
                      [&] { got = parse_flags_text(text, "f.toml", json, "train"); })) {
      ++accepted;
      for (const auto& e : got) {
        if (!json) {
          EXPECT_FALSE(e.key.empty()) << "case " << i << ": " << log;
          EXPECT_EQ(e.where.rfind("f.toml:", 0), 0u) << "case " << i;
        }
        if (!e.is_array) EXPECT_EQ(e.values.size(), 1u) << "case " << i;
      }
    }
  }
  EXPECT_GT(accepted, 0);  // the mutations do not all break the files
}

}  // namespace
}  // namespace opd
