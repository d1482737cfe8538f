// The two services data/ needs from a tokenizer and a chat template, as interfaces, so that data/
// depends only on core (DESIGN.md: "tokenizer and data depend only on core"). The layer above
// (train/, cli/) binds them to opd::Tokenizer and opd::ChatTemplate; tests bind test doubles.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace opd {

class TextEncoder {
 public:
  virtual ~TextEncoder() = default;
  // Token ids of text, without the tokenizer's post-processor (no BOS added): chat templates and
  // raw prompts carry their own special tokens as text.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Exclusive upper bound of valid ids (DESIGN.md invariant 1: every id is checked against it).
  virtual int32_t vocab_size() const = 0;
  // The id appended to raw-text completions when DatasetOptions::append_eos is on.
  virtual std::optional<int32_t> eos_id() const = 0;
};

// Renders a conversation to text with the model's chat template, as
// apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=...).
// tools: a JSON array of tool schemas, or null. Errors (e.g. the template's raise_exception) are
// thrown as opd::Error; the dataset reports them against the line.
class ChatRenderer {
 public:
  virtual ~ChatRenderer() = default;
  virtual std::string render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                             bool add_generation_prompt) const = 0;
};

}  // namespace opd
