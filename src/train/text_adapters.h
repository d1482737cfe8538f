// Binds the data/ interfaces (TextEncoder, ChatRenderer) to the real tokenizer and chat
// template. It lives in train/ because data/ and tokenizer/ both depend only on core and must
// not see each other (docs/architecture.md); the trainer and the CLI use these adapters.
#pragma once

#include <filesystem>
#include <string>

#include "data/text_encoder.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace opd {

class TokenizerTextEncoder final : public TextEncoder {
 public:
  explicit TokenizerTextEncoder(const Tokenizer& tokenizer) : tok_(tokenizer) {}
  std::vector<int32_t> encode(std::string_view text) const override { return tok_.encode(text, false); }
  int32_t vocab_size() const override { return tok_.vocab_size(); }
  std::optional<int32_t> eos_id() const override { return tok_.eos_id(); }

 private:
  const Tokenizer& tok_;
};

class TemplateChatRenderer final : public ChatRenderer {
 public:
  TemplateChatRenderer(const ChatTemplate& tmpl, ChatTemplateOptions base = {})
      : tmpl_(tmpl), base_(std::move(base)) {}
  std::string render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                     bool add_generation_prompt) const override {
    ChatTemplateOptions o = base_;
    o.tools = tools;
    o.add_generation_prompt = add_generation_prompt;
    return tmpl_.render(messages, o);
  }

 private:
  const ChatTemplate& tmpl_;
  ChatTemplateOptions base_;
};

// A model directory's chat template, as ChatTemplate::from_model_dir reads it: a
// "chat_template" in tokenizer_config.json or a chat_template.jinja file.
inline bool has_chat_template(const std::string& model_dir, const Tokenizer& tokenizer) {
  std::error_code ec;
  return tokenizer.config().chat_template.has_value() ||
         std::filesystem::is_regular_file(model_dir + "/chat_template.jinja", ec);
}
// Where has_chat_template looks, for the dataset's error when a chat line finds none.
inline std::string chat_template_source(const std::string& model_dir) {
  return model_dir + " (a \"chat_template\" in its tokenizer_config.json, or chat_template.jinja)";
}

}  // namespace opd
