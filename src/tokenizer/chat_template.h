// Chat templates: renders a conversation to the exact text Hugging Face transformers'
// `tokenizer.apply_chat_template(messages, tokenize=False, ...)` produces, by running the
// template's own Jinja source through a small Jinja2 interpreter (the subset chat templates use:
// if/elif/else, for (loop.*, else, filters on the iterable, break/continue), set (names,
// namespace attributes, blocks), macros, generation blocks, expressions with Python semantics,
// the filters/tests/string and dict methods of Jinja2 that templates call, and transformers'
// globals raise_exception, strftime_now, namespace, dict, plus its tojson). Lexing follows the
// environment transformers builds: trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False.
// A construct outside the subset is an Unsupported error naming the construct and its line,
// never a silent approximation; template errors (raise_exception, an attribute of an undefined
// value, str + None, ...) are InvalidData errors naming the template origin and line.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace opd {

// Everything the template sees besides `messages`, as apply_chat_template's arguments.
struct ChatTemplateOptions {
  bool add_generation_prompt = false;
  // Qwen3's switch. Unset means the variable is undefined in the template, as when the keyword is
  // not passed to apply_chat_template (Qwen3 then thinks).
  std::optional<bool> enable_thinking;
  // Tool schemas (a JSON array) or null for none; the template sees `tools` = none when null.
  nlohmann::ordered_json tools = nullptr;
  // Further template variables (apply_chat_template **kwargs), e.g. {"date_string": "26 Jul 2024"}.
  // They override the special tokens of the same name, like transformers' template_kwargs.
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
  // The clock strftime_now() reads (local time); unset = now. Set it for reproducible renders.
  std::optional<std::chrono::system_clock::time_point> now;
};

class ChatTemplate {
 public:
  // source: the Jinja text; origin: what error messages call it (a path, or "tokenizer_config.json").
  // Parses eagerly, so an unsupported construct is reported here, before any data is read.
  static ChatTemplate from_string(const std::string& source, const std::string& origin = "<chat template>");
  // A file holding the Jinja text (e.g. chat_template.jinja, or any --chat-template FILE).
  static ChatTemplate from_file(const std::string& path);
  // A Hugging Face model/tokenizer directory: chat_template.jinja when present (transformers
  // prefers it), else tokenizer_config.json's "chat_template" (a string, or a list of
  // {name, template} from which "default" is taken). Special tokens come from
  // tokenizer_config.json in both cases. Error when the directory has no template.
  static ChatTemplate from_model_dir(const std::string& dir);

  // Render messages (a JSON array of message objects) like apply_chat_template(tokenize=False):
  // top-level message keys whose value is null are dropped first, reasoning_content / thinking /
  // reasoning are aliased as transformers does, and the special tokens are template variables.
  std::string render(const nlohmann::ordered_json& messages, const ChatTemplateOptions& options = {}) const;

  // bos_token, eos_token, ... as transformers' special_tokens_map (names mapped to strings).
  void set_special_tokens(std::map<std::string, std::string> tokens) { special_tokens_ = std::move(tokens); }
  const std::map<std::string, std::string>& special_tokens() const { return special_tokens_; }

  const std::string& source() const;
  const std::string& origin() const;
  std::string sha256() const;  // hex SHA-256 of source(), for logs and checkpoint metadata

  struct Program;  // parsed template (defined in chat_template.cpp)

 private:
  ChatTemplate() = default;
  std::shared_ptr<const Program> program_;
  std::map<std::string, std::string> special_tokens_;
};

// transformers' special_tokens_map from a parsed tokenizer_config.json: the named special tokens
// (bos, eos, unk, sep, pad, cls, mask) and the entries of "extra_special_tokens" when it is an
// object, each either a string or an AddedToken object {"content": ...}; null entries are left out.
std::map<std::string, std::string> special_tokens_from_config(const nlohmann::json& tokenizer_config);

}  // namespace opd
