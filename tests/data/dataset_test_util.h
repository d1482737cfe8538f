// Test doubles shared by the dataset tests (test_dataset.cpp, test_dataset_fuzz.cpp): an encoder
// that maps each UTF-8 byte to its value as id (vocabulary 301, EOS 300 unless given), so
// expected ids are the bytes of the expected text, and a chat renderer over a ChatTemplate.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/dataset.h"
#include "tokenizer/chat_template.h"

namespace opd::test {

class ByteEncoder : public TextEncoder {
 public:
  explicit ByteEncoder(std::optional<int32_t> eos = 300) : eos_(eos) {}
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    for (unsigned char c : text) ids.push_back(c);
    return ids;
  }
  int32_t vocab_size() const override { return 301; }
  std::optional<int32_t> eos_id() const override { return eos_; }

 private:
  std::optional<int32_t> eos_;
};

class TemplateChat : public ChatRenderer {
 public:
  explicit TemplateChat(ChatTemplate t) : t_(std::move(t)) {}
  std::string render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                     bool agp) const override {
    ChatTemplateOptions o;
    o.add_generation_prompt = agp;
    o.tools = tools;
    return t_.render(messages, o);
  }

 private:
  ChatTemplate t_;
};

}  // namespace opd::test
