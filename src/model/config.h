// Hugging Face config.json for the decoder-only families opd runs: Qwen3ForCausalLM,
// Qwen2ForCausalLM, LlamaForCausalLM. Parsed strictly: a missing required field, a wrong
// type or an impossible value is an InvalidData error naming the file and the field.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace opd {

enum class Architecture { Qwen3, Qwen2, Llama };
const char* architecture_name(Architecture arch);  // "Qwen3ForCausalLM", ...

// RoPE frequency scaling, as transformers' ROPE_INIT_FUNCTIONS compute it
// (modeling_rope_utils.py). The types opd does not implement ("dynamic", "longrope", ...) are
// refused at load: "dynamic" recomputes the frequencies from the running sequence length, which
// a KV cache shared across steps cannot follow.
enum class RopeType {
  Default,  // absent, null, {} or "default"
  Linear,   // inv_freq / factor
  Llama3,   // Llama 3.1+: long wavelengths / factor, short kept, a smooth band between
  Yarn,     // YaRN: per-dimension ramp between inv_freq and inv_freq / factor, and cos/sin
            // multiplied by attention_factor
};
const char* rope_type_name(RopeType type);  // "default", "linear", "llama3", "yarn"

struct RopeScaling {
  RopeType type = RopeType::Default;
  double factor = 1.0;                // linear, llama3, yarn
  double low_freq_factor = 1.0;       // llama3
  double high_freq_factor = 4.0;      // llama3
  int64_t original_max_position_embeddings = 8192;  // llama3, yarn
  double beta_fast = 32.0;            // yarn: ramp boundaries in rotations (transformers' defaults)
  double beta_slow = 1.0;
  bool truncate = true;               // yarn: floor/ceil the correction range
  // yarn: cos and sin are multiplied by this (given, or resolved from factor / mscale /
  // mscale_all_dim as transformers does); 1 for every other type. q.k then carries its square,
  // which the attention applies through ModelConfig::attention_scale().
  double attention_factor = 1.0;
};

struct ModelConfig {
  Architecture arch = Architecture::Qwen3;
  std::string model_type;             // "qwen3", "qwen2", "llama"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;    // defaults to num_attention_heads
  int64_t head_dim = 0;               // defaults to hidden_size / num_attention_heads
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;        // also read from rope_parameters.rope_theta (transformers 5)
  RopeScaling rope_scaling;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;        // q/k/v bias: always true for Qwen2, config field otherwise
  bool qk_norm = false;               // per-head RMSNorm on q and k: Qwen3
  std::string torch_dtype;            // "bfloat16", "float32", ... ("" when absent)
  std::vector<int64_t> eos_token_ids; // eos_token_id as int or list ([] when absent)
  int64_t bos_token_id = -1;
  std::string hidden_act = "silu";    // "silu" or its alias "swish" (transformers' ACT2FN: both SiLU)

  // o_proj bias: transformers gives Llama and Qwen3 an o_proj bias exactly when
  // attention_bias is set; Qwen2 has q/k/v biases but never an o_proj bias.
  bool o_proj_bias() const { return attention_bias && arch != Architecture::Qwen2; }

  // Softmax scale of the attention scores: 1/sqrt(head_dim), times attention_factor^2 for YaRN
  // (transformers multiplies cos and sin, hence rotated q and k, by attention_factor; opd
  // rotates unscaled q and k and applies the product here, in every forward and backward).
  double attention_scale() const;

  // Parameter counts for `opd info`, as transformers' model.num_parameters() counts them
  // (a tied lm_head is the embedding, counted once).
  int64_t num_parameters() const;
  int64_t num_embedding_parameters() const;  // input embedding (+ lm_head when untied)
};

// Parse config.json text; `source` names the file in error messages.
// Most layers a config may declare: per-layer work (parameter_shapes, layer lists) happens before
// any tensor is read, so 2^31 layers from a hostile config.json or GGUF would allocate terabytes.
// The deepest public LLMs have ~200 layers.
constexpr int64_t kMaxModelLayers = 4096;

ModelConfig parse_model_config(const std::string& json_text, const std::string& source);
// Read <dir>/config.json.
ModelConfig load_model_config(const std::string& model_dir);
// Serialize back to a config.json that transformers loads (used when saving checkpoints).
std::string model_config_to_json(const ModelConfig& config);

}  // namespace opd
