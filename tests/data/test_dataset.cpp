// data/: every dataset format, every malformed-line error and its file:line, skip_bad_lines
// accounting, the truncation policies, append_eos on and off, the completion mask, and the
// prompt/completion split of real chat templates against transformers (expected.json).
// The encoder double maps each UTF-8 byte to its value as id, so expected ids are the bytes of
// the expected text and decoding is exact.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/test_util.h"
#include "data/dataset_test_util.h"
#include "core/error.h"
#include "data/dataset.h"
#include "tokenizer/chat_template.h"

namespace opd {
namespace {

using ojson = nlohmann::ordered_json;

using test::ByteEncoder;
using test::TemplateChat;

// An encoder that returns an id outside its vocabulary (invariant 1 must catch it).
class BrokenEncoder : public ByteEncoder {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    auto ids = ByteEncoder::encode(text);
    if (!ids.empty()) ids.back() = 5000;
    return ids;
  }
};

// A chat format simple enough to write expected text by hand: "[role]content|" per message,
// "[assistant]" as generation prompt, tools appended as "{tools:N}".
class TinyChat : public ChatRenderer {
 public:
  std::string render(const ojson& messages, const ojson& tools, bool agp) const override {
    std::string out;
    if (tools.is_array()) out += "{tools:" + std::to_string(tools.size()) + "}";
    for (const auto& m : messages) {
      std::string content = m.contains("content") && m["content"].is_string() ? m["content"].get<std::string>() : "";
      if (m["role"] == "boom") throw Error(ErrorKind::InvalidData, "template raised: roles must alternate");
      out += "[" + m["role"].get<std::string>() + "]" + content + "|";
    }
    if (agp) out += "[assistant]";
    return out;
  }
};

std::string text_of(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) {
    EXPECT_LT(id, 256) << "not a byte id";
    s += static_cast<char>(id);
  }
  return s;
}

std::vector<int32_t> ids_of(const std::string& s) {
  std::vector<int32_t> ids;
  for (unsigned char c : s) ids.push_back(c);
  return ids;
}

class DatasetTest : public ::testing::Test {
 protected:
  std::string write(const std::string& name, const std::string& content) {
    const std::string dir = ::testing::TempDir() + "opd_data_test_" + std::to_string(::getpid()) + "";
    std::filesystem::create_directories(dir);
    const std::string path = dir + "/" + name;
    std::ofstream(path, std::ios::binary) << content;
    return path;
  }
  Dataset load(const std::string& content, DatasetOptions o = {}, const ChatRenderer* chat = nullptr) {
    const std::string path = write("d.jsonl", content);
    return Dataset::load({path}, enc_, chat ? chat : &chat_, o);
  }
  // The error a one-file load raises, or "" when it loads.
  std::string error(const std::string& content, DatasetOptions o = {}) {
    try {
      load(content, o);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
  ByteEncoder enc_;
  TinyChat chat_;
};

TEST_F(DatasetTest, MessagesFormatSplitsOffTheLastAssistantTurn) {
  Dataset ds = load(
      R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]})"
      "\n");
  ASSERT_EQ(ds.size(), 1u);
  EXPECT_EQ(text_of(ds[0].prompt_ids), "[system]S|[user]Q1|[assistant]A1|[user]Q2|[assistant]");
  // Chat completions carry the template's end of turn; no EOS is appended.
  EXPECT_EQ(text_of(ds[0].completion_ids), "A2|");
  std::vector<uint8_t> mask(ds[0].prompt_ids.size(), 0);
  mask.resize(mask.size() + 3, 1);
  EXPECT_EQ(ds[0].completion_mask, mask);
  EXPECT_NE(ds[0].source.find("d.jsonl:1"), std::string::npos);
}

TEST_F(DatasetTest, MessagesToolsReachTheTemplate) {
  Dataset ds = load(R"({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "tools": [{"type": "function"}]})" "\n");
  EXPECT_EQ(text_of(ds[0].prompt_ids), "{tools:1}[user]Q|[assistant]");
  EXPECT_EQ(text_of(ds[0].completion_ids), "A|");
}

TEST_F(DatasetTest, PromptCompletionRawAppendsEosOnlyWhenAsked) {
  const std::string data = R"({"prompt": "2+2=", "completion": "4"})" "\n";
  DatasetOptions on;
  Dataset a = load(data, on);
  EXPECT_EQ(a[0].prompt_ids, ids_of("2+2="));
  EXPECT_EQ(a[0].completion_ids, (std::vector<int32_t>{'4', 300}));
  DatasetOptions off;
  off.append_eos = false;
  Dataset b = load(data, off);
  EXPECT_EQ(b[0].completion_ids, ids_of("4"));
  // No EOS in the tokenizer: an error only when asked to append one.
  ByteEncoder no_eos(std::nullopt);
  const std::string path = write("e.jsonl", data);
  EXPECT_THROW(Dataset::load({path}, no_eos, &chat_, on), Error);
  EXPECT_EQ(Dataset::load({path}, no_eos, &chat_, off)[0].completion_ids, ids_of("4"));
}

TEST_F(DatasetTest, PromptCompletionConversationalAndChatStyle) {
  Dataset ds = load(
      R"({"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Yo"}]})" "\n"
      R"({"prompt": [{"role": "user", "content": "Hi"}], "completion": "Yo"})" "\n");
  ASSERT_EQ(ds.size(), 2u);
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_EQ(text_of(ds[k].prompt_ids), "[user]Hi|[assistant]");
    EXPECT_EQ(text_of(ds[k].completion_ids), "Yo|");
  }
  DatasetOptions chat;
  chat.prompt_style = PromptStyle::Chat;
  Dataset c = load(R"({"prompt": "Hi", "completion": "Yo"})" "\n", chat);
  EXPECT_EQ(text_of(c[0].prompt_ids), "[user]Hi|[assistant]");
  EXPECT_EQ(text_of(c[0].completion_ids), "Yo|");
}

TEST_F(DatasetTest, PromptResponseIsChatByDefaultAndRawWhenAsked) {
  const std::string data = R"({"prompt": "Hi", "response": "Yo"})" "\n";
  Dataset a = load(data);
  EXPECT_EQ(text_of(a[0].prompt_ids), "[user]Hi|[assistant]");
  EXPECT_EQ(text_of(a[0].completion_ids), "Yo|");
  DatasetOptions raw;
  raw.prompt_style = PromptStyle::Raw;
  Dataset b = load(data, raw);
  EXPECT_EQ(b[0].prompt_ids, ids_of("Hi"));
  EXPECT_EQ(b[0].completion_ids, (std::vector<int32_t>{'Y', 'o', 300}));
}

TEST_F(DatasetTest, QueryResponseWithSystemAndHistory) {
  Dataset ds = load(R"({"system": "S", "history": [["q1", "a1"], ["q2", "a2"]], "query": "q3", "response": "a3"})" "\n"
                    R"({"query": "q", "response": "a"})" "\n");
  EXPECT_EQ(text_of(ds[0].prompt_ids), "[system]S|[user]q1|[assistant]a1|[user]q2|[assistant]a2|[user]q3|[assistant]");
  EXPECT_EQ(text_of(ds[0].completion_ids), "a3|");
  EXPECT_EQ(text_of(ds[1].prompt_ids), "[user]q|[assistant]");
  DatasetOptions raw;
  raw.prompt_style = PromptStyle::Raw;
  EXPECT_NE(error(R"({"system": "S", "query": "q", "response": "a"})" "\n", raw).find("need the chat template"), std::string::npos);
}

TEST_F(DatasetTest, ExplicitFormatRequiresItsFields) {
  DatasetOptions o;
  o.format = DatasetFormat::QueryResponse;
  std::string e = error(R"({"prompt": "p", "completion": "c"})" "\n", o);
  EXPECT_NE(e.find("missing field \"query\""), std::string::npos) << e;
  o.format = DatasetFormat::PromptCompletion;
  e = error(R"({"prompt": "p", "response": "c"})" "\n", o);
  EXPECT_NE(e.find("missing field \"completion\""), std::string::npos) << e;
}

TEST_F(DatasetTest, PromptOnlyLinesWhenCompletionIsOptional) {
  DatasetOptions o;
  o.require_completion = false;
  Dataset ds = load(R"({"prompt": "p"})" "\n" R"({"messages": [{"role": "user", "content": "u"}]})" "\n"
                    R"({"query": "q"})" "\n", o);
  ASSERT_EQ(ds.size(), 3u);
  EXPECT_EQ(ds[0].prompt_ids, ids_of("p"));
  EXPECT_TRUE(ds[0].completion_ids.empty());
  EXPECT_EQ(ds[0].completion_mask, std::vector<uint8_t>(1, 0));
  EXPECT_EQ(text_of(ds[1].prompt_ids), "[user]u|[assistant]");
  EXPECT_EQ(text_of(ds[2].prompt_ids), "[user]q|[assistant]");
  // The same lines are errors when a completion is required.
  EXPECT_NE(error(R"({"prompt": "p"})" "\n").find("a \"prompt\" without a reference completion"),
            std::string::npos);
  EXPECT_NE(error(R"({"query": "q"})" "\n").find("a \"query\" without a reference completion"),
            std::string::npos);
  EXPECT_NE(error(R"({"messages": [{"role": "user", "content": "u"}]})" "\n").find("no assistant turn"), std::string::npos);
}

// Each malformed line: the error names file:line and the problem.
TEST_F(DatasetTest, MalformedLinesNameFileLineAndProblem) {
  struct Case { const char* line; const char* problem; };
  const Case cases[] = {
      {R"({"prompt": "p", "completion": )", "invalid JSON"},
      {"\xff\xfe not json", "invalid JSON"},
      {R"([1, 2])", "expected a JSON object, got array"},
      {R"({"text": "x"})", "no recognized fields"},
      {R"({"prompt": 5, "completion": "c"})", "\"prompt\" must be a string or a list of messages, got number"},
      {R"({"prompt": "p", "completion": 7})", "\"completion\" must be a string or a list of messages, got number"},
      {R"({"prompt": "p", "completion": ""})", "empty completion"},
      {R"({"prompt": "", "completion": "c"})", "\"prompt\" is an empty string"},
      {R"({"prompt": "p", "completion": [{"role": "assistant", "content": "c"}]})", "prompt style raw"},
      {R"({"prompt": [{"role": "user", "content": "u"}], "completion": [{"role": "user", "content": "c"}]})", "only assistant turns"},
      {R"({"query": 3, "response": "r"})", "\"query\" must be a string, got number"},
      {R"({"query": "q", "response": 1})", "\"response\" must be a string, got number"},
      {R"({"query": "q", "response": "r", "history": [["only one"]]})", "\"history\"[0] must be a [query, response] pair"},
      {R"({"query": "q", "response": "r", "system": 1})", "\"system\" must be a string"},
      {R"({"messages": "hi"})", "\"messages\" must be a list of messages, got string"},
      {R"({"messages": []})", "\"messages\" is an empty list"},
      {R"({"messages": [{"role": "user", "content": "u"}, "x"]})", "\"messages\"[1] must be an object"},
      {R"({"messages": [{"content": "u"}, {"role": "assistant", "content": "a"}]})", "\"messages\"[0] has no \"role\""},
      {R"({"messages": [{"role": 1, "content": "u"}, {"role": "assistant", "content": "a"}]})", "\"role\" must be a string"},
      {R"({"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]})", "has no \"content\""},
      {R"({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]})", "\"content\" must be a string"},
      {R"({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": ""}]})", "empty completion"},
      {R"({"messages": [{"role": "user", "content": "u"}]})", "no assistant turn"},
      {R"({"messages": [{"role": "assistant", "content": "a"}]})", "no prompt"},
      {R"({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], "tools": "x"})", "\"tools\" must be a list"},
      {R"({"messages": [{"role": "boom", "content": "u"}, {"role": "assistant", "content": "a"}]})", "roles must alternate"},
  };
  for (const auto& c : cases) {
    // Two good lines first, so the line number is 3.
    const std::string content = std::string(R"({"prompt": "p", "completion": "c"})") + "\n\n" + c.line + "\n";
    std::string e = error(content);
    EXPECT_NE(e.find("d.jsonl:3: "), std::string::npos) << c.line << " -> " << e;
    EXPECT_NE(e.find(c.problem), std::string::npos) << c.line << " -> " << e;
  }
}

TEST_F(DatasetTest, SkipBadLinesCountsAndListsThem) {
  std::string content;
  for (int k = 0; k < 15; ++k) content += k % 3 == 0 ? "not json\n" : R"({"prompt": "p", "completion": "c"})" "\n";
  content += "\n   \n";
  DatasetOptions o;
  o.skip_bad_lines = true;
  o.max_listed_bad_lines = 3;
  Dataset ds = load(content, o);
  const LoadReport& r = ds.report();
  EXPECT_EQ(r.lines, 17);
  EXPECT_EQ(r.blank_lines, 2);
  EXPECT_EQ(r.bad_lines, 5);
  EXPECT_EQ(r.samples, 10);
  EXPECT_EQ(ds.size(), 10u);
  ASSERT_EQ(r.first_bad_lines.size(), 3u);
  EXPECT_NE(r.first_bad_lines[0].source.find("d.jsonl:1"), std::string::npos);
  EXPECT_NE(r.first_bad_lines[1].source.find("d.jsonl:4"), std::string::npos);
  EXPECT_NE(r.first_bad_lines[2].source.find("d.jsonl:7"), std::string::npos);
  EXPECT_NE(r.first_bad_lines[0].problem.find("invalid JSON"), std::string::npos);
  EXPECT_NE(r.summary().find("5 bad lines skipped"), std::string::npos) << r.summary();
  // Off: the first bad line stops the load.
  o.skip_bad_lines = false;
  EXPECT_NE(error(content, o).find("d.jsonl:1: invalid JSON"), std::string::npos);
}

TEST_F(DatasetTest, AllBadIsAnErrorEvenWhenSkipping) {
  DatasetOptions o;
  o.skip_bad_lines = true;
  std::string e = error("nope\n{}\n", o);
  EXPECT_NE(e.find("no usable samples"), std::string::npos) << e;
  EXPECT_NE(e.find("2 bad lines skipped"), std::string::npos) << e;
}

TEST_F(DatasetTest, TruncationPolicies) {
  const std::string data = R"({"prompt": "abcdefgh", "completion": "Z"})" "\n" R"({"prompt": "abc", "completion": "Y"})" "\n";
  DatasetOptions o;
  o.max_prompt_length = 4;
  o.truncation = Truncation::Left;
  Dataset left = load(data, o);
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(left[0].prompt_ids, ids_of("efgh"));  // the end of the prompt is kept
  EXPECT_EQ(left[0].completion_ids, (std::vector<int32_t>{'Z', 300}));
  EXPECT_EQ(left[0].completion_mask, (std::vector<uint8_t>{0, 0, 0, 0, 1, 1}));
  EXPECT_EQ(left[1].prompt_ids, ids_of("abc"));
  EXPECT_EQ(left.report().truncated_left, 1);

  o.truncation = Truncation::Skip;
  Dataset skip = load(data, o);
  ASSERT_EQ(skip.size(), 1u);
  EXPECT_EQ(skip[0].prompt_ids, ids_of("abc"));
  EXPECT_EQ(skip.report().skipped_too_long, 1);
  ASSERT_EQ(skip.report().first_skipped_too_long.size(), 1u);
  EXPECT_NE(skip.report().first_skipped_too_long[0].find("d.jsonl:1"), std::string::npos);

  o.truncation = Truncation::Error;
  std::string e = error(data, o);
  EXPECT_NE(e.find("d.jsonl:1: prompt has 8 tokens, over max_prompt_length 4"), std::string::npos) << e;
  // skip_bad_lines does not turn the error policy into skipping.
  o.skip_bad_lines = true;
  EXPECT_NE(error(data, o).find("over max_prompt_length"), std::string::npos);
  // Exactly at the limit is fine; 0 means no limit.
  o.max_prompt_length = 8;
  EXPECT_EQ(load(data, o).size(), 2u);
  o.max_prompt_length = 0;
  EXPECT_EQ(load(data, o).size(), 2u);
}

TEST_F(DatasetTest, IdsOutsideTheVocabularyAreRejected) {
  BrokenEncoder broken;
  const std::string path = write("b.jsonl", R"({"prompt": "p", "completion": "c"})" "\n");
  try {
    Dataset::load({path}, broken, &chat_, {});
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("b.jsonl:1: prompt token 0 has id 5000, outside the vocabulary [0, 301)"), std::string::npos) << m;
  }
}

TEST_F(DatasetTest, PreTokenizedIdsAreUsedAsTheyAreAndChecked) {
  // Used verbatim: no template, no EOS appended; ids up to id_limit (a padded model vocabulary).
  DatasetOptions o;
  o.id_limit = 1000;
  Dataset d = load(R"({"prompt_ids": [5, 700, 9], "completion_ids": [999, 1]})" "\n"
                   R"({"prompt_ids": [3]})" "\n", [&] { auto p = o; p.require_completion = false; return p; }());
  ASSERT_EQ(d.size(), 2);
  EXPECT_EQ(d[0].prompt_ids, (std::vector<int32_t>{5, 700, 9}));
  EXPECT_EQ(d[0].completion_ids, (std::vector<int32_t>{999, 1}));
  EXPECT_EQ(d[0].completion_mask, (std::vector<uint8_t>{0, 0, 0, 1, 1}));
  EXPECT_TRUE(d[1].completion_ids.empty());
  // Without id_limit the tokenizer's vocabulary (301) is the limit.
  EXPECT_NE(error(R"({"prompt_ids": [300, 301], "completion_ids": [1]})").find(
                "d.jsonl:1: prompt token 1 has id 301, outside the vocabulary [0, 301)"),
            std::string::npos);
  EXPECT_NE(error(R"({"prompt_ids": [1], "completion_ids": [1000]})", o).find(
                "completion token 0 has id 1000, outside the vocabulary [0, 1000)"),
            std::string::npos);
  EXPECT_NE(error(R"({"prompt_ids": [1, -2], "completion_ids": [1]})").find(
                "field \"prompt_ids\" entry 1 = -2 is not a token id"), std::string::npos);
  EXPECT_NE(error(R"({"prompt_ids": [1, 1.5], "completion_ids": [1]})").find(
                "entry 1 must be an integer token id"), std::string::npos);
  EXPECT_NE(error(R"({"prompt_ids": [1, 4294967297], "completion_ids": [1]})").find(
                "is not a token id"), std::string::npos);
  EXPECT_NE(error(R"({"prompt_ids": [], "completion_ids": [1]})").find(
                "field \"prompt_ids\" is an empty list"), std::string::npos);
  EXPECT_NE(error(R"({"prompt_ids": "1 2", "completion_ids": [1]})").find(
                "must be a list of token ids, got string"), std::string::npos);
  EXPECT_NE(error(R"({"prompt_ids": [1]})").find("missing field \"completion_ids\""),
            std::string::npos);
}

TEST_F(DatasetTest, ChatLineWithoutTemplateIsABadLine) {
  const std::string path = write("c.jsonl", R"({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]})" "\n");
  try {
    Dataset::load({path}, enc_, nullptr, {});
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("c.jsonl:1: this line needs a chat template"), std::string::npos) << e.what();
  }
}

TEST_F(DatasetTest, SeveralFilesKeepTheirOwnLineNumbers) {
  const std::string a = write("a.jsonl", R"({"prompt": "1", "completion": "c"})" "\n");
  const std::string b = write("b2.jsonl", R"({"prompt": "2", "completion": "c"})" "\n" "bad\n");
  DatasetOptions o;
  o.skip_bad_lines = true;
  Dataset ds = Dataset::load({a, b}, enc_, &chat_, o);
  ASSERT_EQ(ds.size(), 2u);
  EXPECT_EQ(ds[1].prompt_ids, ids_of("2"));
  ASSERT_EQ(ds.report().first_bad_lines.size(), 1u);
  EXPECT_NE(ds.report().first_bad_lines[0].source.find("b2.jsonl:2"), std::string::npos);
  EXPECT_THROW(Dataset::load({a, a + ".missing"}, enc_, &chat_, o), Error);
}

TEST_F(DatasetTest, CommittedFixturesOfEveryFormat) {
  struct Case { const char* file; size_t samples; };
  const Case cases[] = {{"data/messages.jsonl", 3}, {"data/prompt_completion.jsonl", 3},
                        {"data/prompt_response.jsonl", 2}, {"data/query_response.jsonl", 2}};
  for (const auto& c : cases) {
    Dataset ds = Dataset::load({test::fixture_path(c.file)}, enc_, &chat_, {});
    EXPECT_EQ(ds.size(), c.samples) << c.file;
    for (const Sample& s : ds.samples()) {
      EXPECT_FALSE(s.prompt_ids.empty()) << s.source;
      EXPECT_FALSE(s.completion_ids.empty()) << s.source;
      EXPECT_EQ(s.completion_mask.size(), s.prompt_ids.size() + s.completion_ids.size());
    }
  }
}

// The prompt/completion split with the real Qwen3 and Llama 3.1 templates equals transformers'
// renders: prompt == apply_chat_template(messages[:-1], add_generation_prompt=True) and
// prompt + completion == apply_chat_template(messages).
TEST_F(DatasetTest, RealTemplateSplitMatchesTransformers) {
  std::ifstream f(test::fixture_path("chat_templates/expected.json"));
  ojson expected = ojson::parse(f);
  std::ifstream g(test::fixture_path("chat_templates/conversations.json"));
  ojson convs = ojson::parse(g);
  int checked = 0;
  for (const auto& split : expected["dataset_splits"]) {
    const std::string name = split["template"].get<std::string>();
    ChatTemplate t = name == "qwen3" ? ChatTemplate::from_model_dir(test::fixture_path("chat_templates/qwen3"))
                                     : ChatTemplate::from_file(test::fixture_path("chat_templates/trl/llama3_1.jinja"));
    if (name != "qwen3") {
      std::map<std::string, std::string> sp;
      for (const auto& [k, v] : expected["special_tokens"]["llama"].items()) sp[k] = v.get<std::string>();
      t.set_special_tokens(sp);
    }
    TemplateChat chat(std::move(t));
    ojson line;
    for (const auto& c : convs["conversations"]) if (c["id"] == split["conversation"]) line["messages"] = c["messages"];
    const std::string path = write("real.jsonl", line.dump() + "\n");
    if (split["conversation"] == "empty_contents") {  // an empty assistant turn is not a completion
      EXPECT_THROW(Dataset::load({path}, enc_, &chat, {}), Error);
      continue;
    }
    Dataset ds = Dataset::load({path}, enc_, &chat, {});
    const std::string prompt = text_of(ds[0].prompt_ids), completion = text_of(ds[0].completion_ids);
    EXPECT_EQ(prompt, split["prompt"].get<std::string>()) << name << " " << split["conversation"];
    EXPECT_EQ(prompt + completion, split["full"].get<std::string>()) << name << " " << split["conversation"];
    ++checked;
  }
  EXPECT_GE(checked, 10);
}

}  // namespace
}  // namespace opd
