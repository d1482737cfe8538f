// GGUF -> Hugging Face conversion on a synthetic tiny Llama written by the test: weights start in
// HF layout, q/k are permuted the way llama.cpp's converter does (LlamaModel.permute), the
// embedding is stored as Q8_0; the converted directory must give back exactly the HF weights,
// load in opd (model, tokenizer, chat template), and every malformed input must be a named
// error. Also the layer-subset student (opd shrink) and both subcommands through the binary.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>

#include "common/test_util.h"
#include "core/error.h"
#include "gguf/gguf_test_util.h"
#include "model/config.h"
#include "model/dequant.h"
#include "model/gguf.h"
#include "model/gguf_convert.h"
#include "model/safetensors.h"
#include "model/shrink.h"
#include "model/transformer.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/gguf_vocab.h"
#include "tokenizer/tokenizer.h"

namespace opd {
namespace {

using test::GgufBuilder;
using test::byte_tokens;
using test::TempDirPath;

constexpr int64_t kH = 32, kHeads = 4, kKv = 2, kD = 8, kI = 48, kLayers = 3;

struct Tiny {
  std::vector<std::string> tokens;
  std::map<std::string, Tensor> hf;  // expected weights, HF names and layout, f32
  int64_t vocab() const { return static_cast<int64_t>(tokens.size()); }
};

struct TinyOptions {
  std::string arch = "llama";
  std::string tok_model = "gpt2";
  std::string pre = "smollm";
  std::string skip_tensor;   // GGUF name left out
  std::string extra_tensor;  // GGUF name added
  int32_t bos = 256 + 2;
};

// llama.cpp's LlamaModel.permute: reshape(n_head, 2, D/2, H).swapaxes(1, 2) on the rows.
Tensor permute_rows(const Tensor& w, int64_t n_head) {
  const int64_t rows = w.dim(0), cols = w.dim(1), half = rows / n_head / 2;
  Tensor out = Tensor::empty(w.shape(), DType::F32);
  for (int64_t h = 0; h < n_head; ++h)
    for (int64_t s = 0; s < 2; ++s)
      for (int64_t i = 0; i < half; ++i)
        std::copy_n(w.data<float>() + (h * 2 * half + s * half + i) * cols, cols,
                    out.data<float>() + (h * 2 * half + 2 * i + s) * cols);
  return out;
}

std::string f32_bytes(const Tensor& t) {
  return std::string(static_cast<const char*>(t.raw()), t.nbytes());
}

std::string build_tiny(Tiny& tiny, const TinyOptions& o = {}) {
  tiny.tokens = byte_tokens();
  for (const char* t : {"\xc4\xa0t", "he", "<s>", "</s>", "<tool>"}) tiny.tokens.push_back(t);
  const int64_t V = tiny.vocab();
  std::vector<int32_t> types(V, 1);
  types[V - 3] = 3;  // <s>
  types[V - 2] = 3;  // </s>
  types[V - 1] = 4;  // <tool>: user-defined
  GgufBuilder b;
  b.kv_str("general.architecture", o.arch)
      .kv_u32(o.arch + ".block_count", kLayers)
      .kv_u32(o.arch + ".context_length", 256)
      .kv_u32(o.arch + ".embedding_length", kH)
      .kv_u32(o.arch + ".feed_forward_length", kI)
      .kv_u32(o.arch + ".attention.head_count", kHeads)
      .kv_u32(o.arch + ".attention.head_count_kv", kKv)
      .kv_f32(o.arch + ".rope.freq_base", 10000.0f)
      .kv_f32(o.arch + ".attention.layer_norm_rms_epsilon", 1e-5f)
      .kv_u32(o.arch + ".rope.dimension_count", kD)
      .kv_str("tokenizer.ggml.model", o.tok_model)
      .kv_str("tokenizer.ggml.pre", o.pre)
      .kv_str_array("tokenizer.ggml.tokens", tiny.tokens)
      .kv_i32_array("tokenizer.ggml.token_type", types)
      .kv_str_array("tokenizer.ggml.merges", {"\xc4\xa0 t", "h e"})
      .kv_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(o.bos))
      .kv_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(V - 2))
      .kv_bool("tokenizer.ggml.add_bos_token", false)
      .kv_str("tokenizer.chat_template",
              "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}");

  // Embedding: Q8_0 blocks with seeded scales and quants; expected = their dequantization.
  {
    std::string raw;
    Tensor qs = test::random_ints({V * kH}, 7, -127, 128);
    for (int64_t blk = 0; blk < V * kH / 32; ++blk) {
      GgufBuilder::put<uint16_t>(raw, float_to_f16(0.01f + 0.001f * static_cast<float>(blk % 17)));
      for (int j = 0; j < 32; ++j) raw += static_cast<char>(qs.data<int32_t>()[blk * 32 + j]);
    }
    Tensor e = Tensor::empty({V, kH}, DType::F32);
    dequantize_blocks(GgmlType::Q8_0, {reinterpret_cast<const uint8_t*>(raw.data()), raw.size()},
                      {e.data<float>(), static_cast<size_t>(e.numel())});
    tiny.hf["model.embed_tokens.weight"] = e;
    if (o.skip_tensor != "token_embd.weight")
      b.tensor("token_embd.weight", {uint64_t(kH), uint64_t(V)}, 8, raw);
  }
  uint64_t seed = 100;
  auto add = [&](const std::string& gguf, const std::string& hf, const Shape& shape, int64_t permute_heads) {
    Tensor w = test::random_uniform(shape, DType::F32, seed++, -0.5, 0.5);
    tiny.hf[hf] = w;
    if (gguf == o.skip_tensor) return;
    const Tensor stored = permute_heads ? permute_rows(w, permute_heads) : w;
    std::vector<uint64_t> ne(shape.rbegin(), shape.rend());
    b.tensor(gguf, ne, 0, f32_bytes(stored));
  };
  for (int64_t l = 0; l < kLayers; ++l) {
    const std::string g = cat("blk.", l, "."), h = cat("model.layers.", l, ".");
    add(g + "attn_norm.weight", h + "input_layernorm.weight", {kH}, 0);
    // Only llama.cpp's Llama converter permutes q/k; Qwen files store them as HF does.
    const bool llama = o.arch == "llama";
    add(g + "attn_q.weight", h + "self_attn.q_proj.weight", {kHeads * kD, kH}, llama ? kHeads : 0);
    add(g + "attn_k.weight", h + "self_attn.k_proj.weight", {kKv * kD, kH}, llama ? kKv : 0);
    if (o.arch == "qwen2") {
      add(g + "attn_q.bias", h + "self_attn.q_proj.bias", {kHeads * kD}, 0);
      add(g + "attn_k.bias", h + "self_attn.k_proj.bias", {kKv * kD}, 0);
      add(g + "attn_v.bias", h + "self_attn.v_proj.bias", {kKv * kD}, 0);
    }
    if (o.arch == "qwen3") {
      add(g + "attn_q_norm.weight", h + "self_attn.q_norm.weight", {kD}, 0);
      add(g + "attn_k_norm.weight", h + "self_attn.k_norm.weight", {kD}, 0);
    }
    add(g + "attn_v.weight", h + "self_attn.v_proj.weight", {kKv * kD, kH}, 0);
    add(g + "attn_output.weight", h + "self_attn.o_proj.weight", {kH, kHeads * kD}, 0);
    add(g + "ffn_norm.weight", h + "post_attention_layernorm.weight", {kH}, 0);
    add(g + "ffn_gate.weight", h + "mlp.gate_proj.weight", {kI, kH}, 0);
    add(g + "ffn_up.weight", h + "mlp.up_proj.weight", {kI, kH}, 0);
    add(g + "ffn_down.weight", h + "mlp.down_proj.weight", {kH, kI}, 0);
  }
  add("output_norm.weight", "model.norm.weight", {kH}, 0);
  if (!o.extra_tensor.empty()) {
    std::vector<float> z(kH, 0.5f);
    b.tensor_f32(o.extra_tensor, {uint64_t(kH)}, z.data());
  }
  return b.build();
}

std::string write_tiny(const std::string& name, Tiny& tiny, const TinyOptions& o = {}) {
  const std::string path = test::gguf_temp_path(name);
  test::write_bytes(path, build_tiny(tiny, o));
  return path;
}

std::string convert_error(const TinyOptions& o) {
  Tiny tiny;
  const std::string gguf = write_tiny("bad.gguf", tiny, o);
  TempDirPath out("bad_out");
  try {
    convert_gguf_to_hf(gguf, out.path(), DType::F32);
  } catch (const Error& e) {
    std::filesystem::remove(gguf);
    EXPECT_FALSE(std::filesystem::exists(out.path())) << "no partial output on error";
    return e.what();
  }
  std::filesystem::remove(gguf);
  return "";
}

TEST(GgufConvert, UnpermuteInvertsLlamaCppPermute) {
  const Tensor w = test::random_uniform({3 * 16, 5}, DType::F32, 3);
  const Tensor back = unpermute_qk_rows(permute_rows(w, 3), 3);
  EXPECT_TRUE(test::close(back, w, 0, 0));
  // And it is a real permutation (not the identity) for head_dim > 2.
  EXPECT_GT(test::compare(permute_rows(w, 3), w).max_abs, 0.0);
  EXPECT_THROW(unpermute_qk_rows(w, 5), Error);  // 48 rows are not 5 heads of even size
}

TEST(GgufConvert, TinyLlamaRoundTripsToHfWeights) {
  Tiny tiny;
  const std::string gguf = write_tiny("tiny.gguf", tiny);
  TempDirPath out("tiny_f32");
  const GgufConvertSummary s = convert_gguf_to_hf(gguf, out.path(), DType::F32);
  EXPECT_EQ(s.num_tensors, 1 + 9 * kLayers + 1);
  EXPECT_EQ(s.tensor_types.at("Q8_0"), 1);

  const ModelConfig c = load_model_config(out.path());
  EXPECT_EQ(c.arch, Architecture::Llama);
  EXPECT_EQ(c.vocab_size, tiny.vocab());
  EXPECT_EQ(c.num_hidden_layers, kLayers);
  EXPECT_EQ(c.num_key_value_heads, kKv);
  EXPECT_EQ(c.head_dim, kD);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);  // the float32 9.99999975e-06 written back as 1e-05
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{tiny.vocab() - 2}));

  const WeightStore store = WeightStore::open_dir(out.path());
  EXPECT_EQ(store.names().size(), tiny.hf.size());
  for (const auto& [name, want] : tiny.hf) {
    SCOPED_TRACE(name);
    const Tensor got = store.get(name);
    EXPECT_EQ(got.dtype(), DType::F32);
    EXPECT_TRUE(test::close(got, want, 0, 0));  // exact: q/k un-permuted, Q8_0 dequantized
  }
  // The directory runs in opd: same logits as a model built from the HF-layout weights.
  const Transformer loaded = Transformer::load(out.path());
  const Batch batch = make_batch({{1, 5, 200, 259}, {7, 7}}, c.vocab_size);
  ModelWeights w = zeros_weights(c);
  w.for_each([&](const std::string& name, Tensor& t) { t.copy_from(tiny.hf.at(name)); });
  const Transformer direct(c, std::move(w));
  EXPECT_TRUE(test::close(loaded.forward(batch), direct.forward(batch), 0, 0));

  // Tokenizer: byte-level BPE with the two merges, control and user-defined added tokens.
  const Tokenizer tok = Tokenizer::load(out.path());
  EXPECT_EQ(tok.vocab_size(), tiny.vocab());
  const int32_t the = tok.encode("the")[1];
  EXPECT_EQ(tok.id_to_token(the), "he");
  EXPECT_EQ(tok.encode(" t"), (std::vector<int32_t>{256}));
  EXPECT_EQ(tok.encode("<s>x<tool>"), (std::vector<int32_t>{258, tok.encode("x")[0], 260}));
  EXPECT_TRUE(tok.is_special(258));
  EXPECT_FALSE(tok.is_special(260));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{258, 72, 260}, true), "H<tool>");  // id b = byte b
  // Digits are split one by one (the "smollm" pre-tokenizer).
  EXPECT_EQ(tok.encode("12").size(), 2u);
  EXPECT_EQ(tok.eos_id(), std::optional<int32_t>(259));
  const ChatTemplate tmpl = ChatTemplate::from_model_dir(out.path());
  EXPECT_EQ(tmpl.render(nlohmann::ordered_json::parse(R"([{"role":"user","content":"hi"}])")),
            "<s>user: hi</s>");
  std::filesystem::remove(gguf);
}

TEST(GgufConvert, QwenFamiliesKeepTheirLayoutAndExtraTensors) {
  for (const char* arch : {"qwen2", "qwen3"}) {
    SCOPED_TRACE(arch);
    Tiny tiny;
    TinyOptions o;
    o.arch = arch;
    o.pre = "qwen2";
    const std::string gguf = write_tiny(cat(arch, ".gguf"), tiny, o);
    TempDirPath out(cat(arch, "_out"));
    convert_gguf_to_hf(gguf, out.path(), DType::F32);
    const ModelConfig c = load_model_config(out.path());
    EXPECT_EQ(c.arch, std::string(arch) == "qwen2" ? Architecture::Qwen2 : Architecture::Qwen3);
    EXPECT_EQ(c.attention_bias, std::string(arch) == "qwen2");
    EXPECT_EQ(c.qk_norm, std::string(arch) == "qwen3");
    const WeightStore store = WeightStore::open_dir(out.path());
    EXPECT_EQ(store.names().size(), tiny.hf.size());
    for (const auto& [name, want] : tiny.hf) EXPECT_TRUE(test::close(store.get(name), want, 0, 0)) << name;
    const Transformer m = Transformer::load(out.path());
    const Tensor logits = m.forward(make_batch({{1, 2, 3}}, c.vocab_size));
    EXPECT_FALSE(test::compare(logits, logits).has_nan);
    std::filesystem::remove(gguf);
  }
}

TEST(GgufConvert, Bf16OutputIsTheRoundedF32) {
  Tiny tiny;
  const std::string gguf = write_tiny("tiny16.gguf", tiny);
  TempDirPath out("tiny_bf16");
  convert_gguf_to_hf(gguf, out.path(), DType::BF16);
  EXPECT_EQ(load_model_config(out.path()).torch_dtype, "bfloat16");
  const WeightStore store = WeightStore::open_dir(out.path());
  for (const auto& [name, want] : tiny.hf) {
    const Tensor got = store.get(name);
    ASSERT_EQ(got.dtype(), DType::BF16) << name;
    EXPECT_TRUE(test::close(got.to_dtype(DType::F32), want.to_dtype(DType::BF16).to_dtype(DType::F32), 0, 0)) << name;
  }
  std::filesystem::remove(gguf);
}

TEST(GgufConvert, MalformedInputsAreNamedErrors) {
  auto expect_error = [](const TinyOptions& o, const std::string& needle) {
    const std::string err = convert_error(o);
    EXPECT_NE(err.find(needle), std::string::npos) << "wanted '" << needle << "', got: " << err;
  };
  TinyOptions o;
  o.skip_tensor = "blk.2.ffn_up.weight";
  expect_error(o, "no tensor for model.layers.2.mlp.up_proj.weight");
  o = {};
  o.extra_tensor = "blk.0.attn_mystery.weight";
  expect_error(o, "tensor 'blk.0.attn_mystery.weight' (F32 [32]) has no place");
  o = {};
  o.extra_tensor = "blk.9.attn_norm.weight";  // a layer the config does not have
  expect_error(o, "has no place in a LlamaForCausalLM with 3 layers");
  o = {};
  o.arch = "gpt2";
  expect_error(o, "general.architecture = 'gpt2'");
  o = {};
  o.tok_model = "llama";
  expect_error(o, "tokenizer.ggml.model = 'llama'");
  o = {};
  o.pre = "deepseek-coder";
  expect_error(o, "tokenizer.ggml.pre = 'deepseek-coder'");
  o = {};
  o.bos = 5000;
  expect_error(o, "bos_token_id = 5000 is outside the vocabulary");

  // A non-empty output directory is refused and left alone.
  Tiny tiny;
  const std::string gguf = write_tiny("ok.gguf", tiny);
  TempDirPath out("nonempty");
  std::filesystem::create_directories(out.path());
  test::write_bytes(out.path() + "/keep.txt", "mine");
  EXPECT_THROW(convert_gguf_to_hf(gguf, out.path(), DType::F32), Error);
  EXPECT_TRUE(std::filesystem::exists(out.path() + "/keep.txt"));
  std::filesystem::remove(gguf);
}

TEST(GgufVocab, InconsistentMetadataIsRejected) {
  GgufVocab v;
  v.source = "v.gguf";
  v.model = "gpt2";
  v.tokens = byte_tokens();
  EXPECT_NO_THROW(build_hf_tokenizer(v));
  GgufVocab w = v;
  w.token_types = {1, 1};
  EXPECT_THROW(build_hf_tokenizer(w), Error);
  w = v;
  w.merges = {"ab"};
  EXPECT_THROW(build_hf_tokenizer(w), Error);
  w = v;
  w.merges = {"a b"};  // "ab" is not a token
  EXPECT_THROW(build_hf_tokenizer(w), Error);
  w = v;
  w.tokens.push_back("a");  // duplicate string
  EXPECT_THROW(build_hf_tokenizer(w), Error);
  w = v;
  w.token_types.assign(w.tokens.size(), 1);
  w.token_types[3] = 9;
  EXPECT_THROW(build_hf_tokenizer(w), Error);
  w = v;
  w.eos_id = 256;
  EXPECT_THROW(build_hf_tokenizer(w), Error);
  w = v;
  w.tokens[5] = std::string("\xff\xfe", 2);  // not UTF-8
  EXPECT_THROW(build_hf_tokenizer(w), Error);
}

TEST(GgufVocab, AddBosBecomesATemplateAndTypesBecomeAddedTokens) {
  GgufVocab v;
  v.source = "v.gguf";
  v.model = "gpt2";
  v.pre = "llama-bpe";
  v.tokens = byte_tokens();
  v.tokens.push_back("12");
  v.tokens.push_back("123");
  v.tokens.push_back("<|begin|>");
  v.merges = {"1 2", "12 3"};
  v.token_types.assign(v.tokens.size(), 1);
  v.token_types.back() = 3;
  v.bos_id = 258;
  v.add_bos = true;
  const HfTokenizerFiles files = build_hf_tokenizer(v);
  TempDirPath dir("vocab_bos");
  std::filesystem::create_directories(dir.path());
  test::write_bytes(dir.path() + "/tokenizer.json", files.tokenizer_json);
  test::write_bytes(dir.path() + "/tokenizer_config.json", files.tokenizer_config_json);
  const Tokenizer tok = Tokenizer::load(dir.path());
  EXPECT_EQ(tok.encode("a", /*add_special_tokens=*/true), (std::vector<int32_t>{258, 'a'}));
  EXPECT_EQ(tok.encode("a"), (std::vector<int32_t>{'a'}));
  EXPECT_TRUE(tok.is_special(258));
  EXPECT_EQ(tok.bos_id(), std::optional<int32_t>(258));
  // llama-bpe groups up to three digits: "123" + "4" (per-digit splitting would give 4 ids).
  EXPECT_EQ(tok.encode("1234"), (std::vector<int32_t>{257, '4'}));
}

TEST(Shrink, LayerSelection) {
  EXPECT_EQ(parse_layer_selection("even", 5, "--keep-layers"), (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(parse_layer_selection("odd", 5, "--keep-layers"), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(parse_layer_selection("3,0", 5, "--keep-layers"), (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(complement_layers({1, 3}, 5), (std::vector<int64_t>{0, 2, 4}));
  EXPECT_THROW(parse_layer_selection("5", 5, "--keep-layers"), Error);
  EXPECT_THROW(parse_layer_selection("1,1", 5, "--keep-layers"), Error);
  EXPECT_THROW(parse_layer_selection("a", 5, "--keep-layers"), Error);
  EXPECT_THROW(parse_layer_selection("", 5, "--keep-layers"), Error);
  EXPECT_THROW(parse_layer_selection("odd", 1, "--keep-layers"), Error);  // selects nothing
}

TEST(Shrink, KeptLayersGiveTheSameModelAsDroppingThemByHand) {
  Tiny tiny;
  const std::string gguf = write_tiny("shrink.gguf", tiny);
  TempDirPath full("shrink_full"), small("shrink_small");
  convert_gguf_to_hf(gguf, full.path(), DType::F32);
  const ModelConfig c = shrink_model_dir(full.path(), small.path(), {0, 2});
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_TRUE(std::filesystem::exists(small.path() + "/tokenizer.json"));
  EXPECT_TRUE(std::filesystem::exists(small.path() + "/tokenizer_config.json"));
  EXPECT_TRUE(std::filesystem::exists(small.path() + "/generation_config.json"));
  const Transformer big = Transformer::load(full.path());
  const Transformer shrunk = Transformer::load(small.path());
  // By hand: the full model's weights with layer 1 removed.
  ModelWeights w = big.weights();
  w.layers.erase(w.layers.begin() + 1);
  ModelConfig c2 = big.config();
  c2.num_hidden_layers = 2;
  const Transformer by_hand(c2, std::move(w));
  const Batch batch = make_batch({{3, 4, 5, 6, 7}}, c.vocab_size);
  EXPECT_TRUE(test::close(shrunk.forward(batch), by_hand.forward(batch), 0, 0));
  EXPECT_GT(test::compare(shrunk.forward(batch), big.forward(batch)).max_abs, 0.0);
  EXPECT_THROW(shrink_model_dir(full.path(), small.path(), {0}), Error);  // output exists
  std::filesystem::remove(gguf);
}

int run(const std::string& args) {
  const std::string cmd = test::opd_binary() + " " + args + " >/dev/null 2>&1";
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(GgufCli, ConvertAndShrinkSubcommands) {
  Tiny tiny;
  const std::string gguf = write_tiny("cli.gguf", tiny);
  TempDirPath out("cli_out"), small("cli_small"), bad("cli_bad");
  ASSERT_EQ(run("convert --from-gguf " + gguf + " --out " + out.path() + " --dtype f32"), 0);
  EXPECT_EQ(load_model_config(out.path()).torch_dtype, "float32");
  ASSERT_EQ(run("shrink --model " + out.path() + " --out " + small.path() + " --drop-layers odd"), 0);
  EXPECT_EQ(load_model_config(small.path()).num_hidden_layers, 2);  // layers 0 and 2
  EXPECT_NE(run("shrink --model " + out.path() + " --out " + bad.path()), 0);  // neither flag
  EXPECT_NE(run("shrink --model " + out.path() + " --out " + bad.path() +
                " --keep-layers 0 --drop-layers 1"), 0);
  EXPECT_NE(run("convert --from-gguf " + gguf + " --out " + bad.path() + " --dtype f16"), 0);
  EXPECT_FALSE(std::filesystem::exists(bad.path()));
  std::filesystem::remove(gguf);
}

}  // namespace
}  // namespace opd
