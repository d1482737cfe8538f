// Strict parser and writer for Hugging Face config.json (Qwen3 / Qwen2 / Llama causal LMs).
// Defaults and legacy keys follow transformers 5.24 (configuration_{llama,qwen2,qwen3}.py and
// modeling_rope_utils.py): a value transformers would fill in is filled in the same way, a
// value transformers would misread (non-divisible head_dim, a zero-width llama3 band) is an
// error here, and any feature the engine does not implement is Unsupported, never ignored.
#include "model/config.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/text_io.h"

namespace opd {

using nlohmann::json;

const char* architecture_name(Architecture arch) {
  switch (arch) {
    case Architecture::Qwen3: return "Qwen3ForCausalLM";
    case Architecture::Qwen2: return "Qwen2ForCausalLM";
    case Architecture::Llama: return "LlamaForCausalLM";
  }
  return "?";
}

const char* rope_type_name(RopeType type) {
  switch (type) {
    case RopeType::Default: return "default";
    case RopeType::Linear: return "linear";
    case RopeType::Llama3: return "llama3";
    case RopeType::Yarn: return "yarn";
  }
  return "?";
}

namespace {

const char* model_type_of(Architecture arch) {
  switch (arch) {
    case Architecture::Qwen3: return "qwen3";
    case Architecture::Qwen2: return "qwen2";
    case Architecture::Llama: return "llama";
  }
  return "?";
}

// A JSON value for an error message. Containers are described, not dumped: dump() recurses
// and a hostile file could nest deeply; long strings are cut so messages stay one line.
std::string describe_value(const json& v) {
  if (v.is_object()) return "an object";
  if (v.is_array()) return "an array";
  std::string s = v.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

// Typed access to the top-level fields of one config object; every error names `source`
// (the file) and the dotted field path.
class Fields {
 public:
  Fields(const json& obj, std::string source, std::string prefix = "")
      : obj_(obj), source_(std::move(source)), prefix_(std::move(prefix)) {}

  // Absent and null are the same: transformers writes null for "use the default".
  const json* find(const char* name) const {
    auto it = obj_.find(name);
    if (it == obj_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  bool has(const char* name) const { return find(name) != nullptr; }

  [[noreturn]] void fail(ErrorKind kind, const char* name, const std::string& what) const {
    throw_error(kind, cat(source_, ": field '", prefix_, name, "' ", what));
  }
  [[noreturn]] void bad_type(const char* name, const char* expected, const json& got) const {
    fail(ErrorKind::InvalidData, name, cat("must be ", expected, ", got ", describe_value(got)));
  }

  static bool is_integer(const json& v) { return v.is_number_integer() || v.is_number_unsigned(); }

  int64_t positive_int(const char* name) const {
    const json* v = find(name);
    if (!v) fail(ErrorKind::InvalidData, name, "is required but missing");
    return positive_int_value(name, *v);
  }
  int64_t positive_int(const char* name, int64_t fallback) const {
    const json* v = find(name);
    return v ? positive_int_value(name, *v) : fallback;
  }
  int64_t positive_int_value(const char* name, const json& v) const {
    // Unsigned values above int64 max and booleans are not integers for us; 2^31 bounds
    // every size so that products in parameter counts and kernels cannot overflow int64.
    if (!is_integer(v) || (v.is_number_unsigned() && v.get<uint64_t>() > kMaxSize) ||
        (v.is_number_integer() && (v.get<int64_t>() <= 0 || v.get<int64_t>() > kMaxSize))) {
      bad_type(name, "a positive integer", v);
    }
    return v.get<int64_t>();
  }
  int64_t token_id_value(const char* name, const json& v) const {
    if (!is_integer(v) || (v.is_number_integer() && v.get<int64_t>() < 0) ||
        (v.is_number_unsigned() && v.get<uint64_t>() > kMaxSize)) {
      bad_type(name, "a non-negative integer token id", v);
    }
    return v.get<int64_t>();
  }
  double positive_number(const char* name, double fallback) const {
    const json* v = find(name);
    if (!v) return fallback;
    if (!v->is_number() || !std::isfinite(v->get<double>()) || v->get<double>() <= 0) {
      bad_type(name, "a positive finite number", *v);
    }
    return v->get<double>();
  }
  double required_number(const char* name) const {
    const json* v = find(name);
    if (!v) fail(ErrorKind::InvalidData, name, "is required but missing");
    if (!v->is_number() || !std::isfinite(v->get<double>())) bad_type(name, "a finite number", *v);
    return v->get<double>();
  }
  bool boolean(const char* name, bool fallback) const {
    const json* v = find(name);
    if (!v) return fallback;
    if (!v->is_boolean()) bad_type(name, "true or false", *v);
    return v->get<bool>();
  }
  std::string string(const char* name, const std::string& fallback) const {
    const json* v = find(name);
    if (!v) return fallback;
    if (!v->is_string()) bad_type(name, "a string", *v);
    return v->get<std::string>();
  }

  static constexpr int64_t kMaxSize = std::numeric_limits<int32_t>::max();

 private:
  const json& obj_;
  std::string source_;
  std::string prefix_;
};

Architecture architecture_from_name(const std::string& name, bool* ok) {
  *ok = true;
  if (name == "Qwen3ForCausalLM") return Architecture::Qwen3;
  if (name == "Qwen2ForCausalLM") return Architecture::Qwen2;
  if (name == "LlamaForCausalLM") return Architecture::Llama;
  *ok = false;
  return Architecture::Qwen3;
}

Architecture architecture_from_model_type(const std::string& type, bool* ok) {
  *ok = true;
  if (type == "qwen3") return Architecture::Qwen3;
  if (type == "qwen2") return Architecture::Qwen2;
  if (type == "llama") return Architecture::Llama;
  *ok = false;
  return Architecture::Qwen3;
}

constexpr const char* kSupported = "Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM";

void parse_architecture(const Fields& f, ModelConfig& c) {
  std::string model_type = f.string("model_type", "");
  if (const json* archs = f.find("architectures")) {
    if (!archs->is_array() || archs->empty() || !(*archs)[0].is_string()) {
      f.bad_type("architectures", "a non-empty list of strings", *archs);
    }
    std::string name = (*archs)[0].get<std::string>();
    bool ok = false;
    c.arch = architecture_from_name(name, &ok);
    if (!ok) {
      f.fail(ErrorKind::Unsupported, "architectures",
             cat("names '", name, "', which opd does not support (supported: ", kSupported, ")"));
    }
    if (!model_type.empty() && model_type != model_type_of(c.arch)) {
      f.fail(ErrorKind::InvalidData, "model_type",
             cat("is '", model_type, "' but architectures[0] is '", name, "' (model_type '",
                 model_type_of(c.arch), "')"));
    }
  } else {
    // transformers' Auto classes dispatch on model_type alone, so a config without
    // `architectures` is still loadable; without either we cannot know the family.
    if (model_type.empty()) {
      f.fail(ErrorKind::InvalidData, "architectures",
             "is missing and there is no model_type to infer the architecture from");
    }
    bool ok = false;
    c.arch = architecture_from_model_type(model_type, &ok);
    if (!ok) {
      f.fail(ErrorKind::Unsupported, "model_type",
             cat("is '", model_type, "', which opd does not support (supported: ", kSupported, ")"));
    }
  }
  c.model_type = model_type_of(c.arch);
}

// RoPE as transformers 5 resolves it (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict,
// standardize_rope_params and the ROPE_INIT_FUNCTIONS): a legacy `rope_scaling` dict wins over
// `rope_parameters`; rope_theta comes from that dict, else the top-level `rope_theta`, else
// 10000; `type` is the old name of `rope_type`; for llama3 and yarn a top-level
// `original_max_position_embeddings` wins over the dict's (transformers' "Phi3 exception",
// applied when the rotary embedding is built), and without either max_position_embeddings is used.
void parse_rope(const Fields& f, const std::string& source, ModelConfig& c) {
  const char* dict_name = nullptr;
  const json* dict = nullptr;
  for (const char* name : {"rope_scaling", "rope_parameters"}) {
    const json* v = f.find(name);
    if (!v) continue;
    if (!v->is_object()) f.bad_type(name, "an object", *v);
    if (v->empty()) continue;  // {} is falsy in Python: transformers moves on to the next
    dict_name = name;
    dict = v;
    break;
  }
  double top_theta = f.positive_number("rope_theta", 10000.0);
  c.rope_theta = top_theta;
  c.rope_scaling = RopeScaling{};
  if (!dict) return;

  Fields r(*dict, source, cat(dict_name, "."));
  std::string type = "default";
  const char* type_key = r.has("rope_type") ? "rope_type" : "type";
  if (r.has(type_key)) type = r.string(type_key, "default");
  c.rope_theta = r.positive_number("rope_theta", top_theta);
  if (type == "default") return;
  RopeScaling& s = c.rope_scaling;
  if (type == "linear") {
    s.type = RopeType::Linear;
  } else if (type == "llama3") {
    s.type = RopeType::Llama3;
  } else if (type == "yarn") {
    s.type = RopeType::Yarn;
  } else {
    r.fail(ErrorKind::Unsupported, type_key,
           cat("is '", type, "'; opd supports 'default', 'linear', 'llama3' and 'yarn' RoPE",
               type == "dynamic" ? " ('dynamic' rescales the frequencies with the running "
                                   "sequence length)" : ""));
  }
  // The scaled types rotate int(head_dim * partial_rotary_factor) dimensions in transformers,
  // which for these families then fails to broadcast against the whole head: never a model that
  // runs. (The default type ignores the factor in LlamaRotaryEmbedding and the Qwen ones.)
  const char* prf_key = r.has("partial_rotary_factor") ? "partial_rotary_factor" : nullptr;
  const json* prf = prf_key ? r.find(prf_key) : f.find("partial_rotary_factor");
  if (prf && !(prf->is_number() && prf->get<double>() == 1.0)) {
    (prf_key ? r : f).fail(ErrorKind::Unsupported, "partial_rotary_factor",
                           cat("is ", describe_value(*prf), " with '", type,
                               "' RoPE; opd rotates the whole head (1.0)"));
  }
  if (s.type != RopeType::Linear) {
    if (f.has("original_max_position_embeddings")) {
      s.original_max_position_embeddings = f.positive_int("original_max_position_embeddings");
    } else {
      s.original_max_position_embeddings =
          r.positive_int("original_max_position_embeddings", c.max_position_embeddings);
    }
  }
  // yarn with "factor": null uses max_position_embeddings / original (DeepSeek-V3 configs).
  const auto factor_it = dict->find("factor");
  if (s.type == RopeType::Yarn && factor_it != dict->end() && factor_it->is_null()) {
    s.factor = static_cast<double>(c.max_position_embeddings) /
               static_cast<double>(s.original_max_position_embeddings);
  } else {
    s.factor = r.required_number("factor");
  }
  if (!(s.factor >= 1.0)) {
    r.fail(ErrorKind::InvalidData, "factor", cat("must be a number >= 1, got ", s.factor));
  }
  if (s.type == RopeType::Linear) return;
  if (s.type == RopeType::Llama3) {
    s.low_freq_factor = r.required_number("low_freq_factor");
    s.high_freq_factor = r.required_number("high_freq_factor");
    // llama3 smooths between wavelengths original/low and original/high, dividing by
    // (high - low): equal factors divide by zero.
    if (!(s.low_freq_factor > 0)) {
      r.bad_type("low_freq_factor", "a positive number", (*dict)["low_freq_factor"]);
    }
    if (!(s.high_freq_factor > s.low_freq_factor)) {
      r.fail(ErrorKind::InvalidData, "high_freq_factor",
             cat("must be greater than low_freq_factor (", s.low_freq_factor, "), got ",
                 s.high_freq_factor));
    }
    return;
  }
  // YaRN (_compute_yarn_parameters). Python truthiness decides the defaults: beta_fast or 32,
  // beta_slow or 1 (0 means the default); mscale and mscale_all_dim are used only when both
  // are non-zero.
  auto optional_number = [&](const char* name, double fallback) {
    const json* v = r.find(name);
    if (!v) return fallback;
    if (!v->is_number() || !std::isfinite(v->get<double>())) r.bad_type(name, "a finite number", *v);
    return v->get<double>();
  };
  s.beta_fast = optional_number("beta_fast", 32.0);
  if (s.beta_fast == 0) s.beta_fast = 32.0;
  s.beta_slow = optional_number("beta_slow", 1.0);
  if (s.beta_slow == 0) s.beta_slow = 1.0;
  if (!(s.beta_fast > 0 && s.beta_slow > 0)) {
    r.fail(ErrorKind::InvalidData, "beta_fast",
           cat("and beta_slow must be positive (rotation counts), got ", s.beta_fast, " and ",
               s.beta_slow));
  }
  s.truncate = r.boolean("truncate", true);
  auto get_mscale = [](double scale, double m) {
    return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
  };
  if (r.has("attention_factor")) {
    s.attention_factor = optional_number("attention_factor", 1.0);
    if (!(s.attention_factor > 0)) {
      r.bad_type("attention_factor", "a positive number", (*dict)["attention_factor"]);
    }
  } else {
    const double mscale = optional_number("mscale", 0.0);
    const double mscale_all_dim = optional_number("mscale_all_dim", 0.0);
    s.attention_factor = mscale != 0 && mscale_all_dim != 0
                             ? get_mscale(s.factor, mscale) / get_mscale(s.factor, mscale_all_dim)
                             : get_mscale(s.factor, 1.0);
    if (!(s.attention_factor > 0 && std::isfinite(s.attention_factor))) {
      r.fail(ErrorKind::InvalidData, "mscale",
             cat("and mscale_all_dim give an attention factor of ", s.attention_factor,
                 "; it must be positive"));
    }
  }
}

// Sliding-window attention (Qwen2/Qwen3 `use_sliding_window`, or explicit `layer_types`)
// changes the attention mask of some layers; the engine has only full causal attention.
void reject_sliding_window(const Fields& f, const ModelConfig& c) {
  if (const json* types = f.find("layer_types")) {
    if (!types->is_array()) f.bad_type("layer_types", "a list of strings", *types);
    if (static_cast<int64_t>(types->size()) != c.num_hidden_layers) {
      f.fail(ErrorKind::InvalidData, "layer_types",
             cat("has ", types->size(), " entries for ", c.num_hidden_layers, " layers"));
    }
    for (const json& t : *types) {
      if (!t.is_string()) f.bad_type("layer_types", "a list of strings", t);
      if (t.get<std::string>() != "full_attention") {
        f.fail(ErrorKind::Unsupported, "layer_types",
               cat("contains '", t.get<std::string>(), "'; opd supports only full_attention"));
      }
    }
    return;
  }
  if (c.arch == Architecture::Llama) return;
  // Same rule as Qwen2Config.__post_init__: layers i >= max_window_layers slide when
  // use_sliding_window is set and sliding_window is not null.
  if (!f.boolean("use_sliding_window", false)) return;
  if (!f.has("sliding_window")) return;
  int64_t max_window_layers = f.positive_int("max_window_layers", 28);
  if (max_window_layers < c.num_hidden_layers) {
    f.fail(ErrorKind::Unsupported, "use_sliding_window",
           cat("is true with max_window_layers ", max_window_layers, " < num_hidden_layers ",
               c.num_hidden_layers, "; opd has no sliding-window attention"));
  }
}

std::string parse_dtype(const Fields& f) {
  // transformers 5 writes `dtype`; older files have `torch_dtype`; with both, `dtype` wins.
  const char* key = f.has("dtype") ? "dtype" : "torch_dtype";
  std::string dtype = f.string(key, "");
  if (!dtype.empty() && dtype != "float32" && dtype != "bfloat16" && dtype != "float16" &&
      dtype != "float64") {
    f.fail(ErrorKind::Unsupported, key,
           cat("is '", dtype, "'; opd reads float32, bfloat16, float16 or float64 checkpoints"));
  }
  return dtype;
}

void parse_special_tokens(const json& root, const Fields& f, ModelConfig& c) {
  c.eos_token_ids.clear();
  if (const json* eos = f.find("eos_token_id")) {
    if (eos->is_array()) {
      for (const json& id : *eos) c.eos_token_ids.push_back(f.token_id_value("eos_token_id", id));
    } else {
      c.eos_token_ids.push_back(f.token_id_value("eos_token_id", *eos));
    }
  }
  c.bos_token_id = -1;
  if (const json* bos = f.find("bos_token_id")) c.bos_token_id = f.token_id_value("bos_token_id", *bos);
  // LlamaConfig's class defaults are bos_token_id 1 and eos_token_id 2 (an explicit null means
  // none; Qwen2Config/Qwen3Config default to none): transformers' generate stops at 2 for a
  // Llama config.json without the field and no generation_config.json. A default the vocabulary
  // cannot hold could never be produced, so it is dropped rather than refused.
  if (c.arch == Architecture::Llama) {
    if (!root.contains("eos_token_id") && c.vocab_size > 2) c.eos_token_ids.push_back(2);
    if (!root.contains("bos_token_id") && c.vocab_size > 1) c.bos_token_id = 1;
  }
  for (int64_t id : c.eos_token_ids) {
    if (id >= c.vocab_size) {
      f.fail(ErrorKind::InvalidData, "eos_token_id",
             cat("contains ", id, ", outside the vocabulary of ", c.vocab_size));
    }
  }
  if (c.bos_token_id >= c.vocab_size) {
    f.fail(ErrorKind::InvalidData, "bos_token_id",
           cat("is ", c.bos_token_id, ", outside the vocabulary of ", c.vocab_size));
  }
}

// a*b + c with a check; counts are bounded by kMaxSize per factor, so only sums of many
// products can overflow, and only for absurd configs.
int64_t checked_add(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_add_overflow(a, b, &out)) OPD_FAIL(InvalidData, "parameter count overflows int64");
  return out;
}
int64_t checked_mul(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out)) OPD_FAIL(InvalidData, "parameter count overflows int64");
  return out;
}

}  // namespace

ModelConfig parse_model_config(const std::string& json_text, const std::string& source) {
  json root;
  check_json_depth(json_text, source);
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    OPD_FAIL(InvalidData, source, ": not valid JSON: ", e.what());
  }
  if (!root.is_object()) {
    OPD_FAIL(InvalidData, source, ": expected a JSON object, got ", describe_value(root));
  }
  Fields f(root, source);
  ModelConfig c;
  parse_architecture(f, c);

  if (f.has("quantization_config")) {
    f.fail(ErrorKind::Unsupported, "quantization_config",
           "is present; opd loads only unquantized checkpoints");
  }

  c.vocab_size = f.positive_int("vocab_size");
  c.hidden_size = f.positive_int("hidden_size");
  c.intermediate_size = f.positive_int("intermediate_size");
  c.num_hidden_layers = f.positive_int("num_hidden_layers");
  if (c.num_hidden_layers > kMaxModelLayers) {
    f.fail(ErrorKind::InvalidData, "num_hidden_layers",
           cat("= ", c.num_hidden_layers, " is over opd's limit of ", kMaxModelLayers, " layers"));
  }
  c.num_attention_heads = f.positive_int("num_attention_heads");
  // When absent, LlamaConfig copies num_attention_heads but Qwen2Config/Qwen3Config keep
  // their class default of 32 (only an explicit null means "copy"): transformers builds, and
  // saves, 32 key/value heads, so the checkpoint has that shape.
  const bool kv_absent = !f.has("num_key_value_heads");
  const bool kv_null = root.contains("num_key_value_heads");  // present but null
  const int64_t kv_default =
      c.arch == Architecture::Llama || kv_null ? c.num_attention_heads : 32;
  c.num_key_value_heads = f.positive_int("num_key_value_heads", kv_default);
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    f.fail(ErrorKind::InvalidData, "num_key_value_heads",
           cat("(", c.num_key_value_heads, kv_absent && !kv_null ? ", the default when absent" : "",
               ") must divide num_attention_heads (", c.num_attention_heads, ")"));
  }
  // LlamaConfig.validate_architecture requires the division even when head_dim is given.
  bool divides = c.hidden_size % c.num_attention_heads == 0;
  if (c.arch == Architecture::Llama && !divides) {
    f.fail(ErrorKind::InvalidData, "num_attention_heads",
           cat("(", c.num_attention_heads, ") must divide hidden_size (", c.hidden_size, ")"));
  }
  if (f.has("head_dim")) {
    c.head_dim = f.positive_int("head_dim");
  } else if (c.arch == Architecture::Qwen3) {
    c.head_dim = 128;  // Qwen3Config's class default, not hidden_size / heads
  } else {
    // Qwen2 computes hidden_size // heads in Python, silently flooring: refuse instead.
    if (!divides) {
      f.fail(ErrorKind::InvalidData, "head_dim",
             cat("is missing and num_attention_heads (", c.num_attention_heads,
                 ") does not divide hidden_size (", c.hidden_size, ")"));
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.head_dim % 2 != 0) {
    f.fail(ErrorKind::InvalidData, "head_dim",
           cat("must be even (RoPE rotates pairs of dimensions), got ", c.head_dim));
  }

  c.max_position_embeddings =
      f.positive_int("max_position_embeddings", c.arch == Architecture::Llama ? 2048 : 32768);
  c.rms_norm_eps = f.positive_number("rms_norm_eps", 1e-6);
  parse_rope(f, source, c);

  c.tie_word_embeddings = f.boolean("tie_word_embeddings", false);
  switch (c.arch) {
    case Architecture::Qwen2:
      c.attention_bias = true;  // Qwen2Attention hard-codes bias=True on q/k/v
      c.qk_norm = false;
      break;
    case Architecture::Qwen3:
      c.attention_bias = f.boolean("attention_bias", false);
      c.qk_norm = true;
      break;
    case Architecture::Llama:
      c.attention_bias = f.boolean("attention_bias", false);
      c.qk_norm = false;
      if (f.boolean("mlp_bias", false)) {
        f.fail(ErrorKind::Unsupported, "mlp_bias", "is true; opd's MLP has no biases");
      }
      break;
  }

  c.hidden_act = f.string("hidden_act", "silu");
  if (c.hidden_act != "silu" && c.hidden_act != "swish") {
    f.fail(ErrorKind::Unsupported, "hidden_act",
           cat("is '", c.hidden_act, "'; opd supports only 'silu' (alias 'swish')"));
  }
  reject_sliding_window(f, c);
  c.torch_dtype = parse_dtype(f);
  parse_special_tokens(root, f, c);
  return c;
}

ModelConfig load_model_config(const std::string& model_dir) {
  std::string path = model_dir + "/config.json";
  return parse_model_config(read_text_file(path, int64_t{64} << 20), path);
}

double ModelConfig::attention_scale() const {
  const double m = rope_scaling.type == RopeType::Yarn ? rope_scaling.attention_factor : 1.0;
  return m * m / std::sqrt(static_cast<double>(head_dim));
}

int64_t ModelConfig::num_embedding_parameters() const {
  int64_t embed = checked_mul(vocab_size, hidden_size);
  return tie_word_embeddings ? embed : checked_add(embed, embed);
}

int64_t ModelConfig::num_parameters() const {
  const int64_t h = hidden_size, q = num_attention_heads * head_dim,
                kv = num_key_value_heads * head_dim;
  int64_t layer = 0;
  layer = checked_add(layer, checked_mul(h, q));           // q_proj
  layer = checked_add(layer, checked_mul(2 * h, kv));      // k_proj, v_proj
  layer = checked_add(layer, checked_mul(q, h));           // o_proj
  if (attention_bias) layer = checked_add(layer, q + 2 * kv);
  if (o_proj_bias()) layer = checked_add(layer, h);
  if (qk_norm) layer = checked_add(layer, 2 * head_dim);    // q_norm, k_norm over head_dim
  layer = checked_add(layer, checked_mul(3 * h, intermediate_size));  // gate, up, down
  layer = checked_add(layer, 2 * h);                       // input / post-attention norms
  int64_t total = checked_mul(layer, num_hidden_layers);
  total = checked_add(total, h);                           // final norm
  return checked_add(total, num_embedding_parameters());
}

std::string model_config_to_json(const ModelConfig& c) {
  // ordered_json keeps the key order below, which groups the fields as transformers does.
  nlohmann::ordered_json j;
  j["architectures"] = {architecture_name(c.arch)};
  j["model_type"] = model_type_of(c.arch);
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = c.hidden_act;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  // The legacy pair (top-level rope_theta + rope_scaling) is read by transformers 4 and 5
  // and by vLLM; transformers 5 converts it to rope_parameters on load.
  j["rope_theta"] = c.rope_theta;
  const RopeScaling& rs = c.rope_scaling;
  switch (rs.type) {
    case RopeType::Default:
      j["rope_scaling"] = nullptr;
      break;
    case RopeType::Linear:
      j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", rs.factor}};
      break;
    case RopeType::Llama3:
      j["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", rs.factor},
                           {"low_freq_factor", rs.low_freq_factor},
                           {"high_freq_factor", rs.high_freq_factor},
                           {"original_max_position_embeddings", rs.original_max_position_embeddings}};
      break;
    case RopeType::Yarn:
      // attention_factor written resolved, so readers need not repeat the mscale rule.
      j["rope_scaling"] = {{"rope_type", "yarn"},
                           {"factor", rs.factor},
                           {"original_max_position_embeddings", rs.original_max_position_embeddings},
                           {"beta_fast", rs.beta_fast},
                           {"beta_slow", rs.beta_slow},
                           {"truncate", rs.truncate},
                           {"attention_factor", rs.attention_factor}};
      break;
  }
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  if (c.arch != Architecture::Qwen2) j["attention_bias"] = c.attention_bias;
  if (c.arch == Architecture::Llama) j["mlp_bias"] = false;
  if (c.arch != Architecture::Llama) j["use_sliding_window"] = false;
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  else j["bos_token_id"] = nullptr;
  if (c.eos_token_ids.size() == 1) j["eos_token_id"] = c.eos_token_ids[0];
  else if (c.eos_token_ids.empty()) j["eos_token_id"] = nullptr;
  else j["eos_token_id"] = c.eos_token_ids;
  if (!c.torch_dtype.empty()) {
    // Both spellings: transformers 5 reads `dtype`, transformers 4 and vLLM `torch_dtype`.
    j["dtype"] = c.torch_dtype;
    j["torch_dtype"] = c.torch_dtype;
  }
  return j.dump(2) + "\n";
}

}  // namespace opd
