// Parameter naming, shapes, allocation and loading for the decoder-only families.
#include "model/weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/log.h"
#include "kernels/ops.h"  // ops::convert: device-side dtype conversion
#include "model/safetensors.h"

namespace opd {
namespace {

std::string layer_prefix(size_t i) { return cat("model.layers.", i, "."); }

template <typename W, typename Fn>
void visit(W& w, Fn&& fn) {
  fn("model.embed_tokens.weight", w.embed_tokens);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    auto& l = w.layers[i];
    const std::string p = layer_prefix(i);
    fn(p + "input_layernorm.weight", l.input_norm);
    fn(p + "self_attn.q_proj.weight", l.q_proj);
    if (l.q_bias.defined()) fn(p + "self_attn.q_proj.bias", l.q_bias);
    fn(p + "self_attn.k_proj.weight", l.k_proj);
    if (l.k_bias.defined()) fn(p + "self_attn.k_proj.bias", l.k_bias);
    fn(p + "self_attn.v_proj.weight", l.v_proj);
    if (l.v_bias.defined()) fn(p + "self_attn.v_proj.bias", l.v_bias);
    fn(p + "self_attn.o_proj.weight", l.o_proj);
    if (l.o_bias.defined()) fn(p + "self_attn.o_proj.bias", l.o_bias);
    if (l.q_norm.defined()) fn(p + "self_attn.q_norm.weight", l.q_norm);
    if (l.k_norm.defined()) fn(p + "self_attn.k_norm.weight", l.k_norm);
    fn(p + "post_attention_layernorm.weight", l.post_norm);
    fn(p + "mlp.gate_proj.weight", l.gate_proj);
    fn(p + "mlp.up_proj.weight", l.up_proj);
    fn(p + "mlp.down_proj.weight", l.down_proj);
  }
  fn("model.norm.weight", w.final_norm);
  if (!w.tied) fn("lm_head.weight", w.lm_head);
}

}  // namespace

void ModelWeights::for_each(const std::function<void(const std::string&, Tensor&)>& fn) {
  visit(*this, fn);
}
void ModelWeights::for_each(
    const std::function<void(const std::string&, const Tensor&)>& fn) const {
  visit(*this, fn);
}

int64_t ModelWeights::num_parameters() const {
  int64_t n = 0;
  for_each([&](const std::string&, const Tensor& t) { n += t.numel(); });
  return n;
}

std::vector<std::pair<std::string, Shape>> parameter_shapes(const ModelConfig& c) {
  std::vector<std::pair<std::string, Shape>> out;
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.intermediate_size;
  const int64_t q_dim = c.num_attention_heads * D, kv_dim = c.num_key_value_heads * D;
  out.push_back({"model.embed_tokens.weight", {c.vocab_size, H}});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = layer_prefix(static_cast<size_t>(i));
    out.push_back({p + "input_layernorm.weight", {H}});
    out.push_back({p + "self_attn.q_proj.weight", {q_dim, H}});
    if (c.attention_bias) out.push_back({p + "self_attn.q_proj.bias", {q_dim}});
    out.push_back({p + "self_attn.k_proj.weight", {kv_dim, H}});
    if (c.attention_bias) out.push_back({p + "self_attn.k_proj.bias", {kv_dim}});
    out.push_back({p + "self_attn.v_proj.weight", {kv_dim, H}});
    if (c.attention_bias) out.push_back({p + "self_attn.v_proj.bias", {kv_dim}});
    out.push_back({p + "self_attn.o_proj.weight", {H, q_dim}});
    if (c.o_proj_bias()) out.push_back({p + "self_attn.o_proj.bias", {H}});
    if (c.qk_norm) {
      out.push_back({p + "self_attn.q_norm.weight", {D}});
      out.push_back({p + "self_attn.k_norm.weight", {D}});
    }
    out.push_back({p + "post_attention_layernorm.weight", {H}});
    out.push_back({p + "mlp.gate_proj.weight", {I, H}});
    out.push_back({p + "mlp.up_proj.weight", {I, H}});
    out.push_back({p + "mlp.down_proj.weight", {H, I}});
  }
  out.push_back({"model.norm.weight", {H}});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", {c.vocab_size, H}});
  return out;
}

namespace {

// Builds a ModelWeights whose tensors come from `make(name, shape)`.
template <typename Make>
ModelWeights build(const ModelConfig& c, Make&& make) {
  ModelWeights w;
  w.tied = c.tie_word_embeddings;
  w.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  // Allocate through the shape table so names and shapes have exactly one definition.
  auto shapes = parameter_shapes(c);
  std::map<std::string, Tensor> by_name;
  for (auto& [name, shape] : shapes) by_name[name] = make(name, shape);
  auto take = [&](const std::string& name) {
    auto it = by_name.find(name);
    return it == by_name.end() ? Tensor() : it->second;
  };
  w.embed_tokens = take("model.embed_tokens.weight");
  for (size_t i = 0; i < w.layers.size(); ++i) {
    auto& l = w.layers[i];
    const std::string p = layer_prefix(i);
    l.input_norm = take(p + "input_layernorm.weight");
    l.q_proj = take(p + "self_attn.q_proj.weight");
    l.k_proj = take(p + "self_attn.k_proj.weight");
    l.v_proj = take(p + "self_attn.v_proj.weight");
    l.o_proj = take(p + "self_attn.o_proj.weight");
    l.q_bias = take(p + "self_attn.q_proj.bias");
    l.k_bias = take(p + "self_attn.k_proj.bias");
    l.v_bias = take(p + "self_attn.v_proj.bias");
    l.o_bias = take(p + "self_attn.o_proj.bias");
    l.q_norm = take(p + "self_attn.q_norm.weight");
    l.k_norm = take(p + "self_attn.k_norm.weight");
    l.post_norm = take(p + "post_attention_layernorm.weight");
    l.gate_proj = take(p + "mlp.gate_proj.weight");
    l.up_proj = take(p + "mlp.up_proj.weight");
    l.down_proj = take(p + "mlp.down_proj.weight");
  }
  w.final_norm = take("model.norm.weight");
  w.lm_head = w.tied ? w.embed_tokens : take("lm_head.weight");
  return w;
}

}  // namespace

ModelWeights zeros_weights(const ModelConfig& config, DType dtype, Device device) {
  return build(config,
               [&](const std::string&, const Shape& s) { return Tensor::zeros(s, dtype, device); });
}

Tensor tensor_to(const Tensor& t, Device device, DType dtype) {
  if (t.device() == Device::CUDA && device == Device::CUDA) {
    Tensor out = Tensor::empty(t.shape(), dtype, device);
    ops::convert(t, out);  // same dtype included: a device copy without a host round trip
    return out;
  }
  Tensor host = t.to(Device::CPU);
  if (host.dtype() != dtype) host = host.to_dtype(dtype);
  else if (device == Device::CPU && t.device() == Device::CPU) host = host.clone();
  return host.to(device);
}

ModelWeights weights_to(const ModelWeights& w, Device device, DType dtype) {
  ModelWeights out = w;
  out.for_each([&](const std::string&, Tensor& t) {
    if (t.defined()) t = tensor_to(t, device, dtype);
  });
  if (out.tied) out.lm_head = out.embed_tokens;  // one tensor, as in the source
  return out;
}

std::vector<std::string> unused_tensors(const WeightStore& store, const std::set<std::string>& used,
                                        bool tied) {
  // A tied lm_head stored anyway and the rotary inv_freq buffers of older checkpoints are
  // expected leftovers.
  std::vector<std::string> unused;
  for (const std::string& n : store.names()) {
    if (used.count(n) || (tied && n == "lm_head.weight")) continue;
    if (n.size() >= 19 && n.compare(n.size() - 19, 19, "rotary_emb.inv_freq") == 0) continue;
    unused.push_back(n);
  }
  return unused;
}

void warn_unused_tensors(const WeightStore& store, const std::vector<std::string>& unused) {
  if (unused.empty()) return;
  std::string list;
  for (size_t i = 0; i < unused.size() && i < 5; ++i) list += (i ? ", " : "") + unused[i];
  log_warn(store.dir(), ": ", unused.size(), " stored tensor", unused.size() > 1 ? "s are" : " is",
           " not used by its config.json (", list, unused.size() > 5 ? ", ..." : "",
           "): the config and the weights disagree (num_hidden_layers, attention_bias, "
           "tie_word_embeddings, a tensor's name?); the model runs without them");
}

void check_stored_tied_lm_head(const ModelConfig& config, const WeightStore& store,
                               const Tensor& embed_f32) {
  if (!config.tie_word_embeddings || !store.contains("lm_head.weight")) return;
  const Shape shape{config.vocab_size, config.hidden_size};
  Tensor head = store.get_f32("lm_head.weight", shape);
  Tensor embed = embed_f32.defined() ? embed_f32 : store.get_f32("model.embed_tokens.weight", shape);
  const float* a = head.data<float>();
  const float* b = embed.data<float>();
  int64_t differ = 0;
  double max_diff = 0;
  for (int64_t i = 0; i < head.numel(); ++i) {
    if (std::memcmp(a + i, b + i, sizeof(float)) == 0) continue;
    ++differ;
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  }
  OPD_CHECK(differ == 0, InvalidData, store.dir(),
            ": config.json has tie_word_embeddings true, but the safetensors files also store "
            "lm_head.weight and it differs from model.embed_tokens.weight (", differ, " of ",
            head.numel(), " values, max |diff| ", max_diff,
            "): transformers 5 would use it as a separate output layer, transformers 4 and vLLM "
            "the embedding. Set tie_word_embeddings to false in config.json to use lm_head.weight, "
            "or delete lm_head.weight to tie");
}

ModelWeights load_weights(const ModelConfig& config, const WeightStore& store) {
  std::set<std::string> used;
  ModelWeights w = build(config, [&](const std::string& name, const Shape& s) {
    used.insert(name);
    return store.get_f32(name, s);
  });
  check_stored_tied_lm_head(config, store, w.embed_tokens);
  // Tensors the config does not ask for mean the config and the weights disagree (a layer count
  // below the stored one, biases with attention_bias false, a renamed tensor): the model then
  // computes something else than its checkpoint, so say which (transformers warns as well).
  warn_unused_tensors(store, unused_tensors(store, used, w.tied));
  return w;
}

}  // namespace opd
