// Deterministic mutation fuzzing of JSONL dataset loading (dataset.cpp): lines of every format
// (the committed fixtures plus pre-tokenized ids) mutated structurally (wrong types, missing
// keys, huge or negative ids, deep nesting) and bytewise (bad UTF-8, truncation, junk), loaded
// with a real chat template, with and without skip_bad_lines. Every case must end in a dataset
// whose ids are all inside the vocabulary and whose masks match, or in an opd::Error.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/fuzz_util.h"
#include "common/test_util.h"
#include "data/dataset_test_util.h"
#include "data/dataset.h"
#include "tokenizer/chat_template.h"

namespace opd {
namespace {

using ojson = nlohmann::ordered_json;

using test::ByteEncoder;

// A renderer over a real template that uses tool calls, tools and the generation prompt.
test::TemplateChat fuzz_chat() {
  return test::TemplateChat(ChatTemplate::from_string(
      "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m.tool_calls %}{{ m.tool_calls|tojson }}{% endif %}"
      "</s>{% endfor %}{% if tools %}{{ tools|tojson }}{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}",
      "fuzz.jinja"));
}

std::vector<std::string> base_lines() {
  std::vector<std::string> lines;
  for (const char* f : {"messages", "prompt_completion", "prompt_response", "query_response"}) {
    std::ifstream in(test::fixture_path(std::string("data/") + f + ".jsonl"));
    for (std::string l; std::getline(in, l);)
      if (!l.empty()) lines.push_back(l);
  }
  lines.push_back(R"({"prompt_ids": [1, 2, 3, 300], "completion_ids": [4, 5, 300]})");
  lines.push_back(R"({"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}]})");
  return lines;
}

TEST(DatasetFuzz, RandomMutations) {
  const std::string dir = ::testing::TempDir() + "opd_data_fuzz_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/d.jsonl";
  const auto lines = base_lines();
  ByteEncoder enc;
  const test::TemplateChat chat = fuzz_chat();
  const std::vector<std::string> dict = {"{", "}", "[", "]", ",", ":", "\"", "null", "-1", "1e999", "\\ud800", "\n",
                                         "\xff", "\xc0\x80", "\xed\xa0\x80", "99999999999999999999", "\"role\"",
                                         "\"content\"", "\"messages\"", "\"prompt_ids\"", "[[[[[[[[[[[[[["};
  const int iters = test::fuzz_iters(1200);
  int loaded = 0;
  for (int c = 0; c < iters; ++c) {
    test::FuzzRng rng(0xda7a0000u + static_cast<uint64_t>(c));
    std::string log = "case " + std::to_string(c) + ": ";
    std::string file;
    for (size_t k = 0, n = 1 + rng.below(3); k < n; ++k) {
      std::string line = lines[rng.below(lines.size())];
      if (rng.chance(60)) {
        ojson j = ojson::parse(line);
        for (size_t m = 0, e = 1 + rng.below(2); m < e; ++m) test::mutate_json(j, rng, &log);
        line = test::dump_raw(j);
      } else if (rng.chance(80)) {
        test::mutate_bytes(line, rng, dict, &log);
      }
      file += line + "\n";
    }
    std::ofstream(path, std::ios::binary | std::ios::trunc) << file;
    DatasetOptions o;
    o.skip_bad_lines = rng.chance(50);
    o.require_completion = rng.chance(70);
    o.max_prompt_length = rng.chance(30) ? static_cast<int64_t>(1 + rng.below(40)) : 0;
    o.truncation = rng.chance(50) ? Truncation::Left : Truncation::Skip;
    std::optional<Dataset> ds;
    if (!test::accepts(log, [&] { ds.emplace(Dataset::load({path}, enc, &chat, o)); })) continue;
    ++loaded;
    for (const Sample& s : ds->samples()) {
      for (int32_t id : s.prompt_ids) ASSERT_TRUE(id >= 0 && id < 301) << log;
      for (int32_t id : s.completion_ids) ASSERT_TRUE(id >= 0 && id < 301) << log;
      ASSERT_EQ(s.completion_mask.size(), s.prompt_ids.size() + s.completion_ids.size()) << log;
      ASSERT_FALSE(s.prompt_ids.empty()) << log;
    }
  }
  std::filesystem::remove_all(dir);
  std::cout << "[ fuzz     ] " << iters << " JSONL files: " << loaded << " loaded\n";
  EXPECT_GT(loaded, iters / 10);
}

// A number out of double range ("1e999") made nlohmann throw out_of_range, which the loader did
// not catch (it caught parse_error): with skip_bad_lines the whole load failed with a non-opd
// exception instead of skipping the line.
TEST(DatasetFuzz, Regressions) {
  const std::string dir = ::testing::TempDir() + "opd_data_fuzz_r_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/d.jsonl";
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      << "{\"prompt\": \"a\", \"completion\": \"b\", \"x\": 1e999}\n{\"prompt\": \"a\", \"completion\": \"b\"}\n";
  ByteEncoder enc;
  const test::TemplateChat chat = fuzz_chat();
  DatasetOptions o;
  o.skip_bad_lines = true;
  std::optional<Dataset> ds;
  ASSERT_TRUE(test::accepts("1e999", [&] { ds.emplace(Dataset::load({path}, enc, &chat, o)); }));
  EXPECT_EQ(ds->size(), 1u);
  EXPECT_EQ(ds->report().bad_lines, 1);
  o.skip_bad_lines = false;
  const std::string err = test::error_of([&] { Dataset::load({path}, enc, &chat, o); });
  EXPECT_NE(err.find("d.jsonl:1: invalid JSON"), std::string::npos) << err;

  // A line longer than max_line_bytes (here a 1 MB string, the last line without a newline) was
  // read whole by std::getline: a file without newlines became one string of its size.
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      << "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": \"" << std::string(1 << 20, 'x')
      << "\", \"completion\": \"b\"}";
  o.max_line_bytes = 4096;
  o.skip_bad_lines = true;
  ASSERT_TRUE(test::accepts("long line", [&] { ds.emplace(Dataset::load({path}, enc, &chat, o)); }));
  EXPECT_EQ(ds->size(), 1u);
  EXPECT_EQ(ds->report().bad_lines, 1);
  o.skip_bad_lines = false;
  const std::string err2 = test::error_of([&] { Dataset::load({path}, enc, &chat, o); });
  EXPECT_NE(err2.find("d.jsonl:2: line is longer than 4096 bytes"), std::string::npos) << err2;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace opd
