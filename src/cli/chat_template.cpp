// `opd chat-template --model DIR | --chat-template FILE --messages FILE.json
// [--add-generation-prompt] [--enable-thinking true|false] [--tools FILE.json] [--var KEY=JSON]`:
// prints the text the model's chat template renders for a conversation, byte-identical to
// transformers' apply_chat_template(tokenize=False) (no trailing newline is added).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "cli/commands.h"
#include "core/error.h"
#include "core/text_io.h"
#include "tokenizer/chat_template.h"

namespace opd::cli {
namespace {

struct ChatTemplateCliOptions {
  std::string model_dir, template_file, messages_file, tools_file, enable_thinking;
  std::vector<std::string> vars;
  bool add_generation_prompt = false;
};

nlohmann::ordered_json read_json_file(const std::string& path) {
  const std::string text = read_text_file(path);
  check_json_depth(text, path);
  try {
    return nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::ordered_json::exception& e) {  // out_of_range too (1e999)
    OPD_FAIL(InvalidData, path, ": invalid JSON: ", e.what());
  }
}

void run_chat_template(const ChatTemplateCliOptions& o) {
  OPD_CHECK(!o.model_dir.empty() || !o.template_file.empty(), InvalidArgument,
            "opd chat-template needs --model DIR or --chat-template FILE");
  // --chat-template overrides the model's template; the model still provides the special tokens.
  std::optional<ChatTemplate> t;
  if (!o.template_file.empty()) {
    t = ChatTemplate::from_file(o.template_file);
    if (!o.model_dir.empty()) {
      const std::string cfg = o.model_dir + "/tokenizer_config.json";
      if (std::filesystem::exists(cfg))
        t->set_special_tokens(special_tokens_from_config(nlohmann::json(read_json_file(cfg))));
    }
  } else {
    t = ChatTemplate::from_model_dir(o.model_dir);
  }
  nlohmann::ordered_json input = read_json_file(o.messages_file);
  ChatTemplateOptions opt;
  opt.add_generation_prompt = o.add_generation_prompt;
  nlohmann::ordered_json messages = input;
  if (input.is_object()) {  // {"messages": [...], "tools": [...]} as in a dataset line
    OPD_CHECK(input.contains("messages"), InvalidData, o.messages_file, ": an object must hold \"messages\"");
    messages = input["messages"];
    if (input.contains("tools")) opt.tools = input["tools"];
  }
  if (!o.tools_file.empty()) opt.tools = read_json_file(o.tools_file);
  if (!o.enable_thinking.empty()) {
    OPD_CHECK(o.enable_thinking == "true" || o.enable_thinking == "false", InvalidArgument,
              "--enable-thinking takes true or false, got '", o.enable_thinking, "'");
    opt.enable_thinking = o.enable_thinking == "true";
  }
  for (const std::string& kv : o.vars) {
    size_t eq = kv.find('=');
    OPD_CHECK(eq != std::string::npos && eq > 0, InvalidArgument, "--var takes KEY=JSON, got '", kv, "'");
    check_json_depth(kv.substr(eq + 1), "--var " + kv.substr(0, eq));
    try {
      opt.extra[kv.substr(0, eq)] = nlohmann::ordered_json::parse(kv.substr(eq + 1));
    } catch (const nlohmann::ordered_json::exception&) {
      opt.extra[kv.substr(0, eq)] = kv.substr(eq + 1);  // a bare word is a string
    }
  }
  std::string text = t->render(messages, opt);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

}  // namespace

void register_chat_template(CLI::App& app) {
  auto o = std::make_shared<ChatTemplateCliOptions>();
  CLI::App* cmd = app.add_subcommand("chat-template", "Render a conversation with a model's chat template (as transformers does)");
  cmd->add_option("--model", o->model_dir, "model directory (chat_template.jinja or tokenizer_config.json)");
  cmd->add_option("--chat-template", o->template_file, "Jinja template file; overrides the model's")->check(CLI::ExistingFile);
  cmd->add_option("--messages", o->messages_file, "JSON file: a list of messages, or {\"messages\": [...], \"tools\": [...]}")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_flag("--add-generation-prompt", o->add_generation_prompt, "end with the assistant header");
  cmd->add_option("--enable-thinking", o->enable_thinking, "true|false (Qwen3); unset leaves the variable undefined");
  cmd->add_option("--tools", o->tools_file, "JSON file with a list of tool schemas")->check(CLI::ExistingFile);
  cmd->add_option("--var", o->vars, "extra template variable KEY=JSON (repeatable), e.g. date_string='\"26 Jul 2024\"'");
  cmd->callback([o] { run_chat_template(*o); });
}

}  // namespace opd::cli
