// Chat templates against Hugging Face transformers: every case of
// tests/fixtures/chat_templates/expected.json (real templates x conversations x options, and small
// probe templates for single Jinja rules) must render byte-identically, or fail where
// transformers failed. Expected strings come from tools/make_chat_fixtures.py (transformers 5.24),
// never from opd. Plus: unsupported constructs and syntax errors name construct and line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/test_util.h"
#include "core/error.h"
#include "tokenizer/chat_template.h"

namespace opd {
namespace {

using ojson = nlohmann::ordered_json;

ojson read_json(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  std::stringstream ss;
  ss << f.rdbuf();
  return ojson::parse(ss.str());
}

const ojson& expected() {
  static ojson j = read_json(test::fixture_path("chat_templates/expected.json"));
  return j;
}
const ojson& conversations() {
  static ojson j = read_json(test::fixture_path("chat_templates/conversations.json"));
  return j;
}

// Where two strings first differ, for a readable failure.
std::string first_difference(const std::string& a, const std::string& b) {
  size_t k = 0;
  while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
  auto window = [&](const std::string& s) {
    size_t from = k > 40 ? k - 40 : 0;
    return ojson(s.substr(from, 80)).dump();
  };
  return cat("byte ", k, " of ", a.size(), " vs ", b.size(), "\n  opd:  ", window(a), "\n  want: ", window(b));
}

ChatTemplate load_template(const std::string& name) {
  const std::string file = expected()["template_files"][name].get<std::string>();
  if (file == "qwen3/tokenizer_config.json") {
    return ChatTemplate::from_model_dir(test::fixture_path("chat_templates/qwen3"));
  }
  ChatTemplate t = ChatTemplate::from_file(test::fixture_path("chat_templates/" + file));
  std::map<std::string, std::string> special;
  const std::string tok = expected()["template_tokenizer"][name].get<std::string>();
  for (const auto& [k, v] : expected()["special_tokens"][tok].items()) special[k] = v.get<std::string>();
  t.set_special_tokens(special);
  return t;
}

TEST(ChatTemplate, RealTemplatesMatchTransformers) {
  std::map<std::string, ojson> convs;
  for (const auto& c : conversations()["conversations"]) convs[c["id"].get<std::string>()] = c;
  std::map<std::string, ChatTemplate> templates;
  int rendered = 0, errors = 0, failures = 0;
  std::map<std::string, int> per_template;
  for (const auto& c : expected()["cases"]) {
    const std::string name = c["template"].get<std::string>();
    if (!templates.count(name)) templates.emplace(name, load_template(name));
    const ChatTemplate& t = templates.at(name);
    const ojson& conv = convs.at(c["conversation"].get<std::string>());
    ChatTemplateOptions opt;
    for (const auto& [k, v] : c["options"].items()) {
      if (k == "add_generation_prompt") opt.add_generation_prompt = v.get<bool>();
      else if (k == "enable_thinking") opt.enable_thinking = v.get<bool>();
      else opt.extra[k] = v;
    }
    if (conv.contains("tools")) opt.tools = conversations()["tools"][conv["tools"].get<std::string>()];
    const std::string label = cat(name, " / ", c["conversation"].get<std::string>(), " / ", c["options"].dump());
    if (c.contains("expected")) {
      const std::string want = c["expected"].get<std::string>();
      try {
        std::string got = t.render(conv["messages"], opt);
        if (got != want) {
          ++failures;
          ADD_FAILURE() << label << ": " << first_difference(got, want);
        } else {
          ++rendered;
          ++per_template[name];
        }
      } catch (const Error& e) {
        ++failures;
        ADD_FAILURE() << label << ": opd threw where transformers rendered: " << e.what();
      }
    } else {
      const std::string err = c["error"].get<std::string>();
      try {
        std::string got = t.render(conv["messages"], opt);
        ++failures;
        ADD_FAILURE() << label << ": transformers raised '" << err << "', opd rendered " << ojson(got).dump();
      } catch (const Error& e) {
        ++errors;
        ++per_template[name];
        EXPECT_EQ(e.kind(), ErrorKind::InvalidData) << label << ": " << e.what();
        // raise_exception() messages come through verbatim; other errors need only be errors.
        if (c["error_type"] == "TemplateError") {
          EXPECT_NE(std::string(e.what()).find(err), std::string::npos) << label << ": " << e.what() << " vs " << err;
        }
      }
    }
  }
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(rendered + errors, static_cast<int>(expected()["cases"].size()));
  EXPECT_GE(rendered, 400);  // the fixture holds 452 successful renders
  for (const char* must : {"qwen3", "trl/llama3", "trl/llama3_1", "trl/llama3_2"}) EXPECT_GE(per_template[must], 30) << must;
  std::printf("chat templates: %d renders byte-identical, %d errors matched, %d failures\n", rendered, errors, failures);
}

TEST(ChatTemplate, ProbesMatchJinja) {
  int checked = 0;
  for (const auto& p : expected()["probes"]) {
    const std::string name = p["name"].get<std::string>();
    ChatTemplateOptions opt;
    opt.extra = p["variables"];
    if (p.contains("expected")) {
      try {
        ChatTemplate t = ChatTemplate::from_string(p["source"].get<std::string>(), name);
        // Probes see no messages/tools variables beyond what transformers also passes.
        std::string got = t.render(ojson::array(), opt);
        EXPECT_EQ(got, p["expected"].get<std::string>()) << name << ": " << first_difference(got, p["expected"].get<std::string>());
      } catch (const Error& e) {
        ADD_FAILURE() << name << ": opd threw where jinja2 rendered: " << e.what();
      }
    } else {
      EXPECT_THROW(
          {
            ChatTemplate t = ChatTemplate::from_string(p["source"].get<std::string>(), name);
            t.render(ojson::array(), opt);
          },
          Error)
          << name << " (jinja2: " << p["error"].get<std::string>() << ")";
    }
    ++checked;
  }
  EXPECT_GE(checked, 40);
}

TEST(ChatTemplate, SpecialTokensFromConfigMatchTransformers) {
  auto cfg = nlohmann::json::parse(std::ifstream(test::fixture_path("chat_templates/qwen3/tokenizer_config.json")));
  std::map<std::string, std::string> want;
  for (const auto& [k, v] : expected()["special_tokens"]["qwen"].items()) want[k] = v.get<std::string>();
  EXPECT_EQ(special_tokens_from_config(cfg), want);
  // AddedToken objects, nulls and extra_special_tokens.
  auto cfg2 = nlohmann::json::parse(R"({"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": null,
      "unk_token": "<unk>", "extra_special_tokens": {"image_token": "<img>"}, "additional_special_tokens": ["<x>"]})");
  std::map<std::string, std::string> want2{{"bos_token", "<s>"}, {"unk_token", "<unk>"}, {"image_token", "<img>"}};
  EXPECT_EQ(special_tokens_from_config(cfg2), want2);
}

std::string error_of(const std::string& source, const ojson& messages = ojson::array(), ErrorKind* kind = nullptr) {
  try {
    ChatTemplate t = ChatTemplate::from_string(source, "probe.jinja");
    t.render(messages, {});
  } catch (const Error& e) {
    if (kind) *kind = e.kind();
    return e.what();
  }
  return "";
}

TEST(ChatTemplate, UnsupportedConstructsNameConstructAndLine) {
  struct Case { const char* source; const char* construct; const char* where; };
  const Case cases[] = {
      {"a\nb\n{% include 'x.jinja' %}", "include", "probe.jinja:3:"},
      {"{{ 1 }}\n{{ xs|dictsort }}", "dictsort", "probe.jinja:2:"},
      {"{{ xs|no_such_filter }}", "no_such_filter", "probe.jinja:1:"},
      {"\n\n\n{% if x is frobnicated %}{% endif %}", "frobnicated", "probe.jinja:4:"},
      {"{% for x in xs recursive %}{% endfor %}", "recursive", "probe.jinja:1:"},
      {"{% set a, b = 1, 2 %}", "tuple assignment", "probe.jinja:1:"},
      {"{% extends 'base' %}", "extends", "probe.jinja:1:"},
      {"{% filter upper %}x{% endfilter %}", "filter", "probe.jinja:1:"},
  };
  for (const auto& c : cases) {
    ErrorKind kind = ErrorKind::Internal;
    std::string msg = error_of(c.source, ojson::array(), &kind);
    EXPECT_EQ(kind, ErrorKind::Unsupported) << c.source << " -> " << msg;
    EXPECT_NE(msg.find(c.construct), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.where), std::string::npos) << msg;
  }
}

TEST(ChatTemplate, SyntaxErrorsNameLine) {
  struct Case { const char* source; const char* what; const char* where; };
  const Case cases[] = {
      {"x\n{% if true %}never closed", "endif", "probe.jinja:"},
      {"{{ 'unterminated }}", "unterminated string", "probe.jinja:1:"},
      {"\n{{ (1 }}", "expected ')'", "probe.jinja:2:"},
      {"{# never closed", "comment", "probe.jinja:1:"},
      {"\n\n{{ 1 + }}", "unexpected '}}'", "probe.jinja:3:"},
      {"{% for x in %}{% endfor %}", "unexpected", "probe.jinja:1:"},
      {"{{ a ]] }}", "unexpected ']'", "probe.jinja:1:"},
  };
  for (const auto& c : cases) {
    ErrorKind kind = ErrorKind::Internal;
    std::string msg = error_of(c.source, ojson::array(), &kind);
    EXPECT_EQ(kind, ErrorKind::InvalidData) << c.source << " -> " << msg;
    EXPECT_NE(msg.find(c.what), std::string::npos) << c.source << " -> " << msg;
    EXPECT_NE(msg.find(c.where), std::string::npos) << c.source << " -> " << msg;
  }
}

TEST(ChatTemplate, RaiseExceptionCarriesTemplateMessageAndLine) {
  std::string msg = error_of("line one\n{{ raise_exception('Conversation roles must alternate') }}");
  EXPECT_NE(msg.find("Conversation roles must alternate"), std::string::npos) << msg;
  EXPECT_NE(msg.find("probe.jinja:2:"), std::string::npos) << msg;
}

TEST(ChatTemplate, StrftimeNowReadsTheGivenClock) {
  // 2024-07-26 12:00 local time: whatever the zone, strftime of that local time is the 26th.
  std::tm tm{};
  tm.tm_year = 2024 - 1900;
  tm.tm_mon = 6;
  tm.tm_mday = 26;
  tm.tm_hour = 12;
  tm.tm_isdst = -1;
  ChatTemplateOptions opt;
  opt.now = std::chrono::system_clock::from_time_t(std::mktime(&tm));
  ChatTemplate t = ChatTemplate::from_string("{{ strftime_now('%d %b %Y') }}");
  EXPECT_EQ(t.render(ojson::array(), opt), "26 Jul 2024");
  // Llama 3.2 takes the date from strftime_now when date_string is not given.
  ChatTemplate llama = ChatTemplate::from_file(test::fixture_path("chat_templates/trl/llama3_2.jinja"));
  std::string out = llama.render(ojson::parse(R"([{"role": "user", "content": "hi"}])"), opt);
  EXPECT_NE(out.find("Today Date: 26 Jul 2024\n"), std::string::npos) << out;
}

TEST(ChatTemplate, ModelDirWithChatTemplateJinjaAndMissingTemplate) {
  const std::string dir = ::testing::TempDir() + "opd_chat_template_dir_" + std::to_string(::getpid()) + "";
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir + "/tokenizer_config.json") << R"({"bos_token": "<B>", "chat_template": "from config"})";
  }
  EXPECT_EQ(ChatTemplate::from_model_dir(dir).render(ojson::array()), "from config");
  {
    std::ofstream(dir + "/chat_template.jinja") << "{{ bos_token }}from jinja file\n";
  }
  // transformers prefers chat_template.jinja over the config's string.
  EXPECT_EQ(ChatTemplate::from_model_dir(dir).render(ojson::array()), "<B>from jinja file");
  std::filesystem::remove(dir + "/chat_template.jinja");
  {
    std::ofstream(dir + "/tokenizer_config.json")
        << R"({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})";
  }
  EXPECT_EQ(ChatTemplate::from_model_dir(dir).render(ojson::array()), "D");
  {
    std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": "</s>"})";
  }
  try {
    ChatTemplate::from_model_dir(dir);
    ADD_FAILURE() << "expected an error for a directory without a chat template";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--chat-template"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(ChatTemplate, RejectsMalformedMessages) {
  ChatTemplate t = ChatTemplate::from_string("{% for m in messages %}{{ m.content }}{% endfor %}");
  EXPECT_THROW(t.render(ojson::parse(R"({"role": "user"})")), Error);
  EXPECT_THROW(t.render(ojson::parse(R"(["just a string"])")), Error);
  EXPECT_EQ(t.render(ojson::parse(R"([{"role": "user", "content": "a"}, {"role": "x", "content": null}])")), "a");
}

}  // namespace
}  // namespace opd

namespace opd {
namespace {

// `opd chat-template` end to end: the printed bytes equal transformers' render.
std::string run_capture(const std::string& cmd, int* status) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  *status = pclose(p);
  return out;
}

TEST(ChatTemplateCli, PrintsTransformersBytes) {
  const std::string dir = ::testing::TempDir() + "opd_chat_cli_" + std::to_string(::getpid()) + "";
  std::filesystem::create_directories(dir);
  int checked = 0;
  for (const auto& c : expected()["cases"]) {
    if (c["template"] != "qwen3" || !c.contains("expected")) continue;
    const std::string conv_id = c["conversation"].get<std::string>();
    if (conv_id != "multi_turn_system_ends_user" && conv_id != "tool_call_dict_args") continue;
    ojson input;
    for (const auto& conv : conversations()["conversations"]) {
      if (conv["id"] == conv_id) {
        input["messages"] = conv["messages"];
        if (conv.contains("tools")) input["tools"] = conversations()["tools"][conv["tools"].get<std::string>()];
      }
    }
    const std::string file = dir + "/m.json";
    std::ofstream(file) << input.dump();
    std::string cmd = test::opd_binary() + " chat-template --model " + test::fixture_path("chat_templates/qwen3") +
                      " --messages " + file;
    if (c["options"]["add_generation_prompt"].get<bool>()) cmd += " --add-generation-prompt";
    if (c["options"].contains("enable_thinking")) cmd += std::string(" --enable-thinking ") + (c["options"]["enable_thinking"].get<bool>() ? "true" : "false");
    int status = -1;
    std::string out = run_capture(cmd, &status);
    EXPECT_EQ(status, 0) << cmd;
    EXPECT_EQ(out, c["expected"].get<std::string>()) << cmd;
    ++checked;
  }
  EXPECT_EQ(checked, 12);
  // A directory without a template: exit 1 and a message naming the override.
  int status = -1;
  std::string out = run_capture(test::opd_binary() + " chat-template --model " + dir + " --messages " + dir + "/m.json 2>&1", &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(out.find("--chat-template"), std::string::npos) << out;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace opd
