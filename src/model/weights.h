// The parameters of a decoder-only transformer, named exactly as Hugging Face names them
// (model.layers.{i}.self_attn.q_proj.weight, ...), so loading, saving and gradient
// fixtures all speak one vocabulary. The same struct holds gradients (zeros_like).
// Tied embeddings: lm_head aliases embed_tokens (one tensor, one gradient), as in transformers.
#pragma once

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace opd {

class WeightStore;

struct LayerWeights {
  Tensor input_norm;          // [H]
  Tensor q_proj, k_proj, v_proj, o_proj;  // [Hq*D, H], [Hkv*D, H], [Hkv*D, H], [H, Hq*D]
  Tensor q_bias, k_bias, v_bias;          // [Hq*D], [Hkv*D], [Hkv*D] when attention_bias
  Tensor o_bias;                          // [H] when config.o_proj_bias() (Llama/Qwen3)
  Tensor q_norm, k_norm;      // [D] when qk_norm (Qwen3)
  Tensor post_norm;           // [H]
  Tensor gate_proj, up_proj;  // [I, H]
  Tensor down_proj;           // [H, I]
};

struct ModelWeights {
  Tensor embed_tokens;  // [V, H]
  std::vector<LayerWeights> layers;
  Tensor final_norm;    // [H]
  Tensor lm_head;       // [V, H]; the same tensor as embed_tokens when tied
  bool tied = false;

  // Visits every distinct parameter with its Hugging Face name (lm_head skipped when tied).
  void for_each(const std::function<void(const std::string&, Tensor&)>& fn);
  void for_each(const std::function<void(const std::string&, const Tensor&)>& fn) const;
  int64_t num_parameters() const;
};

// The expected shape of every parameter, by Hugging Face name, in for_each order.
std::vector<std::pair<std::string, Shape>> parameter_shapes(const ModelConfig& config);

// Zero-initialized weights (or gradients) of the config's shapes.
ModelWeights zeros_weights(const ModelConfig& config, DType dtype = DType::F32,
                           Device device = Device::CPU);
// A copy of `t` in `dtype` on `device` (always a new tensor). Device to device converts on the
// GPU (f32 <-> bf16); otherwise the conversion happens on the host (f32, f64, bf16).
Tensor tensor_to(const Tensor& t, Device device, DType dtype);
// Copies of every parameter (tied embeddings stay one tensor): the bf16 CUDA model of an f32
// host model, the f32 device master weights of the optimizer, host copies for checkpoints.
ModelWeights weights_to(const ModelWeights& w, Device device, DType dtype);
// Load f32 copies from a model directory's safetensors; every tensor's presence, shape and
// dtype is checked (errors name the tensor and the directory). A tied model may still store
// lm_head.weight when it equals the embedding (check_stored_tied_lm_head).
ModelWeights load_weights(const ModelConfig& config, const WeightStore& store);
// A tied model (tie_word_embeddings true) whose files also store an lm_head.weight that differs
// from model.embed_tokens.weight is InvalidData naming the directory: transformers 5 then unties
// them (modeling_utils: "both are present in the checkpoints with different values, so we will
// NOT tie them") while transformers 4 and vLLM use the embedding, so no reading is the model's.
// Equal values (torch .bin exports store both) are fine. `embed_f32`: the embedding already
// read as f32, or an undefined tensor to read it from the store.
void check_stored_tied_lm_head(const ModelConfig& config, const WeightStore& store,
                               const Tensor& embed_f32);
// The stored tensors a model does not read (`used`: the parameter names it asks for): a
// config and weights that disagree (num_hidden_layers, attention_bias, ...). A tied model's
// lm_head.weight and rotary inv_freq buffers are expected leftovers, not listed. load_weights and
// `opd info` warn with warn_unused_tensors (names the first five and the count).
std::vector<std::string> unused_tensors(const WeightStore& store, const std::set<std::string>& used,
                                        bool tied);
void warn_unused_tensors(const WeightStore& store, const std::vector<std::string>& unused);

}  // namespace opd
