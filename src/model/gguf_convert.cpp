// GGUF -> Hugging Face directory (see gguf_convert.h). Names follow llama.cpp's tensor table
// (token_embd, blk.N.attn_q, ..., output_norm, output) mapped to transformers' names.
#include "model/gguf_convert.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/output_dir.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "tokenizer/gguf_vocab.h"

namespace opd {

namespace fs = std::filesystem;

namespace {

// GGUF stores eps and theta as float32 (1e-5 becomes 9.99999975e-06); config.json gets the
// shortest decimal that reads back as the same float32, i.e. the value the original config had.
double shortest_from_f32(double value) {
  const float f = static_cast<float>(value);
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), f);
  *res.ptr = '\0';
  return std::strtod(buf, nullptr);
}

// A float metadata value that goes into config.json: finite and > 0 also once rounded to float32
// (NaN and inf would be written as null and later replaced by a default; a negative eps is
// refused by every other command). Without a fallback the key is required.
double positive_finite(const GgufFile& g, const std::string& key,
                       std::optional<double> fallback = std::nullopt) {
  const double v = fallback ? g.get_float(key, *fallback) : g.get_float(key);
  const float f = static_cast<float>(v);
  if (!(std::isfinite(v) && v > 0 && std::isfinite(f) && f > 0))
    OPD_FAIL(InvalidData, g.path(), ": metadata key '", key, "' = ", v,
             " must be finite and > 0 (also as a float32: at most 3.4e38)");
  return shortest_from_f32(v);
}

int64_t positive(const GgufFile& g, const std::string& key) {
  const uint64_t v = g.get_uint(key);
  if (v == 0 || v > (1ull << 31))
    OPD_FAIL(InvalidData, g.path(), ": metadata key '", key, "' = ", v, " is outside [1, 2^31]");
  return static_cast<int64_t>(v);
}

// The transformers name of a GGUF tensor name; empty when it is not a model parameter we map.
std::string hf_name(const std::string& name, Architecture arch, int64_t n_layers) {
  if (name == "token_embd.weight") return "model.embed_tokens.weight";
  if (name == "output_norm.weight") return "model.norm.weight";
  if (name == "output.weight") return "lm_head.weight";
  // "blk.<layer>.<part>.<weight|bias>", parsed by hand (layer: 1-6 decimal digits).
  if (name.rfind("blk.", 0) != 0) return "";
  const size_t dot1 = name.find('.', 4);
  const size_t dot2 = dot1 == std::string::npos ? dot1 : name.find('.', dot1 + 1);
  if (dot2 == std::string::npos || dot1 == 4 || dot1 - 4 > 6) return "";
  const std::string digits = name.substr(4, dot1 - 4);
  if (digits.find_first_not_of("0123456789") != std::string::npos) return "";
  const int64_t layer = std::stoll(digits);
  const std::string part = name.substr(dot1 + 1, dot2 - dot1 - 1), kind = name.substr(dot2 + 1);
  if (kind != "weight" && kind != "bias") return "";
  if (layer >= n_layers) return "";
  static const std::map<std::string, std::string> table = {
      {"attn_norm", "input_layernorm"},      {"ffn_norm", "post_attention_layernorm"},
      {"attn_q", "self_attn.q_proj"},        {"attn_k", "self_attn.k_proj"},
      {"attn_v", "self_attn.v_proj"},        {"attn_output", "self_attn.o_proj"},
      {"attn_q_norm", "self_attn.q_norm"},   {"attn_k_norm", "self_attn.k_norm"},
      {"ffn_gate", "mlp.gate_proj"},         {"ffn_up", "mlp.up_proj"},
      {"ffn_down", "mlp.down_proj"}};
  auto it = table.find(part);
  if (it == table.end()) return "";
  if ((part == "attn_q_norm" || part == "attn_k_norm") && arch != Architecture::Qwen3) return "";
  return cat("model.layers.", layer, ".", it->second, ".", kind);
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  OPD_CHECK(out.good(), Io, "cannot create ", path.string());
  out << text;
  out.close();
  OPD_CHECK(out.good(), Io, "cannot write ", path.string());
}

}  // namespace

ModelConfig gguf_model_config(const GgufFile& g) {
  const std::string arch_name = g.get_string("general.architecture");
  ModelConfig c;
  if (arch_name == "llama") c.arch = Architecture::Llama;
  else if (arch_name == "qwen2") c.arch = Architecture::Qwen2;
  else if (arch_name == "qwen3") c.arch = Architecture::Qwen3;
  else
    OPD_FAIL(Unsupported, g.path(), ": general.architecture = '", arch_name,
             "'; opd converts llama, qwen2 and qwen3");
  c.model_type = arch_name;
  const std::string p = arch_name + ".";
  c.hidden_size = positive(g, p + "embedding_length");
  c.intermediate_size = positive(g, p + "feed_forward_length");
  c.num_hidden_layers = positive(g, p + "block_count");
  if (c.num_hidden_layers > kMaxModelLayers)
    OPD_FAIL(InvalidData, g.path(), ": ", p, "block_count = ", c.num_hidden_layers,
             " is over opd's limit of ", kMaxModelLayers, " layers");
  c.num_attention_heads = positive(g, p + "attention.head_count");
  c.num_key_value_heads = g.find(p + "attention.head_count_kv")
                              ? positive(g, p + "attention.head_count_kv")
                              : c.num_attention_heads;
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    OPD_FAIL(InvalidData, g.path(), ": ", p, "attention.head_count = ", c.num_attention_heads,
             " is not a multiple of head_count_kv = ", c.num_key_value_heads);
  c.head_dim = g.find(p + "attention.key_length") ? positive(g, p + "attention.key_length")
                                                    : c.hidden_size / c.num_attention_heads;
  if (g.find(p + "attention.value_length") &&
      positive(g, p + "attention.value_length") != c.head_dim)
    OPD_FAIL(Unsupported, g.path(), ": ", p, "attention.value_length differs from key_length");
  if (g.find(p + "rope.dimension_count") && positive(g, p + "rope.dimension_count") != c.head_dim)
    OPD_FAIL(Unsupported, g.path(), ": ", p, "rope.dimension_count = ",
             g.get_uint(p + "rope.dimension_count"), " rotates part of the head (head_dim ",
             c.head_dim, "); opd supports full rotary only");
  if (c.head_dim % 2 != 0)
    OPD_FAIL(InvalidData, g.path(), ": head_dim ", c.head_dim, " is odd");
  if (auto scaling = g.find_string(p + "rope.scaling.type"); scaling && *scaling != "none")
    OPD_FAIL(Unsupported, g.path(), ": ", p, "rope.scaling.type = '", *scaling,
             "' is not supported");
  if (g.find_tensor("rope_freqs.weight"))
    OPD_FAIL(Unsupported, g.path(), ": rope_freqs.weight (Llama-3.1 RoPE scaling baked into "
                                    "per-dimension factors) cannot be mapped back to rope_scaling");
  c.rms_norm_eps = positive_finite(g, p + "attention.layer_norm_rms_epsilon");
  c.rope_theta = positive_finite(g, p + "rope.freq_base", 10000.0);
  c.max_position_embeddings = g.find(p + "context_length") ? positive(g, p + "context_length") : 2048;
  const GgufTensorInfo& embd = g.tensor("token_embd.weight");
  if (embd.ne.size() != 2 || embd.ne[0] != c.hidden_size)
    OPD_FAIL(InvalidData, g.path(), ": token_embd.weight has dims ", shape_str(embd.ne),
             ", expected [", c.hidden_size, ", vocab]");
  c.vocab_size = embd.ne[1];
  if (g.find(p + "vocab_size") && static_cast<int64_t>(g.get_uint(p + "vocab_size")) != c.vocab_size)
    OPD_FAIL(InvalidData, g.path(), ": ", p, "vocab_size = ", g.get_uint(p + "vocab_size"),
             " but token_embd.weight has ", c.vocab_size, " rows");
  c.tie_word_embeddings = g.find_tensor("output.weight") == nullptr;
  c.qk_norm = c.arch == Architecture::Qwen3;
  c.attention_bias = c.arch == Architecture::Qwen2 || g.find_tensor("blk.0.attn_q.bias") != nullptr;
  if (c.arch == Architecture::Llama && c.attention_bias)
    OPD_FAIL(Unsupported, g.path(), ": a Llama GGUF with attention biases is not supported");
  // Ids are read as uint64: one past INT64_MAX would turn negative in a plain cast and slip
  // under the `>= vocab` checks below.
  auto token_id = [&](const char* key) {
    const uint64_t id = g.get_uint(key);
    if (id >= static_cast<uint64_t>(c.vocab_size))
      OPD_FAIL(InvalidData, g.path(), ": ", key, " = ", id, " is outside the vocabulary (", c.vocab_size, ")");
    return static_cast<int64_t>(id);
  };
  if (g.find("tokenizer.ggml.bos_token_id")) c.bos_token_id = token_id("tokenizer.ggml.bos_token_id");
  if (g.find("tokenizer.ggml.eos_token_id")) c.eos_token_ids = {token_id("tokenizer.ggml.eos_token_id")};
  for (int64_t id : c.eos_token_ids)
    if (id >= c.vocab_size)
      OPD_FAIL(InvalidData, g.path(), ": tokenizer.ggml.eos_token_id = ", id,
               " is outside the vocabulary (", c.vocab_size, ")");
  if (c.bos_token_id >= c.vocab_size)
    OPD_FAIL(InvalidData, g.path(), ": tokenizer.ggml.bos_token_id = ", c.bos_token_id,
             " is outside the vocabulary (", c.vocab_size, ")");
  return c;
}

Tensor unpermute_qk_rows(const Tensor& w, int64_t n_head) {
  OPD_CHECK(w.ndim() == 2 && n_head > 0 && w.dim(0) % (2 * n_head) == 0, InvalidArgument,
            "unpermute_qk_rows: ", w.describe(), " cannot be split into ", n_head,
            " heads of an even size");
  const int64_t rows = w.dim(0), half = rows / n_head / 2;
  const size_t row_bytes = static_cast<size_t>(w.dim(1)) * dtype_size(w.dtype());
  Tensor out = Tensor::empty(w.shape(), w.dtype());
  const char* src = static_cast<const char*>(w.raw());
  char* dst = static_cast<char*>(out.raw());
  for (int64_t h = 0; h < n_head; ++h)
    for (int64_t s = 0; s < 2; ++s)
      for (int64_t i = 0; i < half; ++i) {
        const int64_t hf_row = h * 2 * half + s * half + i;
        const int64_t gguf_row = h * 2 * half + 2 * i + s;
        std::memcpy(dst + hf_row * row_bytes, src + gguf_row * row_bytes, row_bytes);
      }
  return out;
}

std::map<std::string, Tensor> gguf_model_tensors(const GgufFile& g, const ModelConfig& config,
                                                 DType dtype) {
  std::map<std::string, Shape> expected;
  for (const auto& [name, shape] : parameter_shapes(config)) expected[name] = shape;
  std::map<std::string, Tensor> out;
  for (const GgufTensorInfo& info : g.tensors()) {
    const std::string name = hf_name(info.name, config.arch, config.num_hidden_layers);
    if (name.empty() || !expected.count(name))
      OPD_FAIL(Unsupported, g.path(), ": tensor '", info.name, "' (",
               ggml_type_info(static_cast<uint32_t>(info.type))->name, " ", shape_str(info.ne),
               ") has no place in a ", architecture_name(config.arch), " with ",
               config.num_hidden_layers, " layers; refusing to drop it");
    const Shape& want = expected[name];
    if (info.shape() != want)
      OPD_FAIL(InvalidData, g.path(), ": tensor '", info.name, "' has shape ",
               shape_str(info.shape()), " (GGUF dims ", shape_str(info.ne), "), but ", name,
               " must be ", shape_str(want), " for this config");
    Tensor t = g.dequantize(info, DType::F32);
    if (config.arch == Architecture::Llama) {
      if (name.ends_with("q_proj.weight")) t = unpermute_qk_rows(t, config.num_attention_heads);
      if (name.ends_with("k_proj.weight")) t = unpermute_qk_rows(t, config.num_key_value_heads);
    }
    out[name] = dtype == DType::F32 ? t : t.to_dtype(dtype);
  }
  for (const auto& [name, shape] : expected)
    if (!out.count(name))
      OPD_FAIL(InvalidData, g.path(), ": no tensor for ", name, " ", shape_str(shape),
               " (GGUF files name it after llama.cpp's table, e.g. blk.N.attn_q.weight)");
  return out;
}

HfTokenizerFiles gguf_tokenizer_files(const GgufFile& g, const ModelConfig& config) {
  GgufVocab v;
  v.source = g.path();
  v.model = g.get_string("tokenizer.ggml.model");
  v.pre = g.find_string("tokenizer.ggml.pre").value_or("default");
  v.tokens = g.get_string_array("tokenizer.ggml.tokens");
  if (g.find("tokenizer.ggml.token_type")) v.token_types = g.get_int_array("tokenizer.ggml.token_type");
  if (g.find("tokenizer.ggml.merges")) v.merges = g.get_string_array("tokenizer.ggml.merges");
  auto opt_id = [&](const char* key) -> std::optional<int64_t> {
    if (!g.find(key)) return std::nullopt;
    // Clamped, not wrapped: past INT64_MAX stays out of range for check_id.
    return static_cast<int64_t>(std::min<uint64_t>(g.get_uint(key), INT64_MAX));
  };
  v.bos_id = opt_id("tokenizer.ggml.bos_token_id");
  v.eos_id = opt_id("tokenizer.ggml.eos_token_id");
  v.unk_id = opt_id("tokenizer.ggml.unknown_token_id");
  v.pad_id = opt_id("tokenizer.ggml.padding_token_id");
  if (g.find("tokenizer.ggml.add_bos_token")) v.add_bos = g.get_bool("tokenizer.ggml.add_bos_token", false);
  if (g.find("tokenizer.ggml.add_eos_token")) v.add_eos = g.get_bool("tokenizer.ggml.add_eos_token", false);
  v.chat_template = g.find_string("tokenizer.chat_template");
  v.model_max_length = config.max_position_embeddings;
  if (static_cast<int64_t>(v.tokens.size()) != config.vocab_size)
    OPD_FAIL(InvalidData, g.path(), ": tokenizer.ggml.tokens has ", v.tokens.size(),
             " entries but token_embd.weight has ", config.vocab_size, " rows");
  return build_hf_tokenizer(v);
}

GgufConvertSummary convert_gguf_to_hf(const std::string& gguf_path, const std::string& out_dir,
                                      DType dtype) {
  OPD_CHECK(dtype == DType::F32 || dtype == DType::BF16, InvalidArgument,
            "convert: --dtype must be f32 or bf16");
  const fs::path out = checked_output_dir(out_dir, "convert");
  std::error_code ec;
  GgufFile g = GgufFile::open(gguf_path);
  GgufConvertSummary summary;
  summary.config = gguf_model_config(g);
  summary.config.torch_dtype = dtype == DType::F32 ? "float32" : "bfloat16";
  for (const GgufTensorInfo& t : g.tensors())
    ++summary.tensor_types[ggml_type_info(static_cast<uint32_t>(t.type))->name];
  summary.num_tensors = static_cast<int64_t>(g.tensors().size());

  // Tokenizer first: it is cheap and its errors should come before the dequantization.
  const HfTokenizerFiles tok = gguf_tokenizer_files(g, summary.config);

  std::map<std::string, Tensor> tensors = gguf_model_tensors(g, summary.config, dtype);

  const fs::path tmp = out.string() + ".tmp." + std::to_string(::getpid());
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  OPD_CHECK(!ec, Io, "cannot create ", tmp.string(), ": ", ec.message());
  try {
    save_safetensors((tmp / "model.safetensors").string(), tensors,
                     {{"format", "pt"}, {"source", "opd convert --from-gguf"}});
    write_text(tmp / "config.json", model_config_to_json(summary.config));
    nlohmann::ordered_json gen = nlohmann::ordered_json::object();
    for (const char* key : {"bos", "eos", "padding"})
      if (g.find(cat("tokenizer.ggml.", key, "_token_id")))
        gen[cat(key == std::string("padding") ? "pad" : key, "_token_id")] =
            g.get_uint(cat("tokenizer.ggml.", key, "_token_id"));
    write_text(tmp / "generation_config.json", gen.dump(2) + "\n");
    write_text(tmp / "tokenizer.json", tok.tokenizer_json);
    write_text(tmp / "tokenizer_config.json", tok.tokenizer_config_json);
    if (fs::exists(out, ec)) fs::remove(out, ec);  // an empty directory (checked above)
    fs::rename(tmp, out, ec);
    OPD_CHECK(!ec, Io, "cannot rename ", tmp.string(), " to ", out_dir, ": ", ec.message());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  return summary;
}

}  // namespace opd
