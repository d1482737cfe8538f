// A real dataset through the real tokenizer and chat template: a `messages` JSONL line loaded
// with the committed Qwen3 tokenizer.json/tokenizer_config.json gives prompt ids equal to the
// tokenizer's ids of the rendered prompt, and prompt+completion ids equal to the ids of the
// full rendered conversation (TRL's split), with the completion mask over the completion only.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "common/test_util.h"
#include "data/dataset.h"
#include "train/text_adapters.h"

namespace opd {
namespace {

TEST(TextAdapters, MessagesDatasetWithTheRealQwen3TokenizerAndTemplate) {
  const std::string dir = test::fixture_path("tokenizers/qwen3");
  Tokenizer tok = Tokenizer::load(dir);
  ChatTemplate tmpl = ChatTemplate::from_model_dir(dir);
  TokenizerTextEncoder enc(tok);
  ChatTemplateOptions base;
  base.enable_thinking = false;
  TemplateChatRenderer chat(tmpl, base);

  const nlohmann::ordered_json messages = nlohmann::ordered_json::parse(
      R"([{"role":"system","content":"You add numbers."},{"role":"user","content":"What is 12+30?"},)"
      R"({"role":"assistant","content":"12+30=42"}])");
  const std::string path = std::filesystem::temp_directory_path() /
                           ("opd_adapters_" + std::to_string(::getpid()) + ".jsonl");
  {
    std::ofstream out(path);
    out << nlohmann::ordered_json{{"messages", messages}}.dump() << "\n";
  }
  Dataset ds = Dataset::load({path}, enc, &chat, DatasetOptions{});
  std::filesystem::remove(path);
  ASSERT_EQ(ds.size(), 1u);
  const Sample& s = ds[0];

  nlohmann::ordered_json prompt_msgs = nlohmann::ordered_json::array();
  prompt_msgs.push_back(messages[0]);
  prompt_msgs.push_back(messages[1]);
  ChatTemplateOptions gen = base;
  gen.add_generation_prompt = true;
  EXPECT_EQ(s.prompt_ids, tok.encode(tmpl.render(prompt_msgs, gen)));
  std::vector<int32_t> all = s.prompt_ids;
  all.insert(all.end(), s.completion_ids.begin(), s.completion_ids.end());
  EXPECT_EQ(all, tok.encode(tmpl.render(messages, base)));
  ASSERT_FALSE(s.completion_ids.empty());
  EXPECT_EQ(tok.decode(s.completion_ids).find("12+30=42"), 0u) << tok.decode(s.completion_ids);
  ASSERT_EQ(s.completion_mask.size(), all.size());
  for (size_t i = 0; i < all.size(); ++i)
    EXPECT_EQ(s.completion_mask[i], i >= s.prompt_ids.size() ? 1 : 0) << i;
}

}  // namespace
}  // namespace opd
