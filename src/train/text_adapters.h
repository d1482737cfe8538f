// Binds the data/ interfaces (TextEncoder, ChatRenderer) to the real tokenizer and chat
// template. It lives in train/ because data/ and tokenizer/ both depend only on core and must
// not see each other (docs/architecture.md); the trainer and the CLI use these adapters.
#pragma once

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

}  // namespace opd
