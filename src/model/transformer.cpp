// Transformer forward/backward composed from kernels/ops.h (formulas in transformer.h).
#include "model/transformer.h"

#include <cmath>

#include "kernels/ops.h"
#include "model/rope.h"
#include "model/safetensors.h"

namespace opd {

Recompute parse_recompute(const std::string& name) {
  if (name == "none" || name == "off") return Recompute::Off;
  if (name == "elementwise") return Recompute::Elementwise;
  if (name == "layer") return Recompute::PerLayer;
  OPD_FAIL(InvalidArgument, "recompute granularity '", name,
            "' is not one of none, elementwise, layer");
}

const char* recompute_name(Recompute mode) {
  switch (mode) {
    case Recompute::Off: return "none";
    case Recompute::Elementwise: return "elementwise";
    case Recompute::PerLayer: return "layer";
  }
  return "?";
}

Batch make_batch(const std::vector<std::vector<int32_t>>& sequences, int64_t vocab_size) {
  int64_t total = 0;
  for (const auto& s : sequences) total += static_cast<int64_t>(s.size());
  OPD_CHECK(total <= INT32_MAX, InvalidArgument, "batch of ", total, " tokens exceeds int32 rows");
  Batch b;
  b.ids = Tensor::empty({total}, DType::I32);
  b.positions = Tensor::empty({total}, DType::I32);
  b.cu_seqlens = Tensor::empty({static_cast<int64_t>(sequences.size()) + 1}, DType::I32);
  int32_t* ids = b.ids.data<int32_t>();
  int32_t* pos = b.positions.data<int32_t>();
  int32_t* cu = b.cu_seqlens.data<int32_t>();
  int64_t row = 0;
  cu[0] = 0;
  for (size_t s = 0; s < sequences.size(); ++s) {
    for (size_t p = 0; p < sequences[s].size(); ++p) {
      int32_t id = sequences[s][p];
      if (id < 0 || id >= vocab_size)
        OPD_FAIL(InvalidData, "token id ", id, " at sequence ", s, " position ", p,
                 " is outside the vocabulary [0, ", vocab_size, ")");
      ids[row] = id;
      pos[row] = static_cast<int32_t>(p);
      ++row;
    }
    cu[s + 1] = static_cast<int32_t>(row);
  }
  return b;
}

Transformer::Transformer(ModelConfig config, ModelWeights weights)
    : config_(std::move(config)), weights_(std::move(weights)), inv_freq_(rope_inv_freq(config_)) {
  check_weights();
  // The CUDA rope reads f32 frequencies from device memory: uploaded once, here.
  if (device() == Device::CUDA) inv_freq_ = inv_freq_.to(Device::CUDA);
}

void Transformer::check_weights() const {
  OPD_CHECK(weights_.embed_tokens.defined(), InvalidArgument, "transformer: no embed_tokens");
  const Device dev = device();
  const DType dt = dtype();
  weights_.for_each([&](const std::string& name, const Tensor& t) {
    if (!t.defined()) return;
    OPD_CHECK(t.device() == dev && t.dtype() == dt, InvalidArgument, "transformer: parameter ",
              name, " is ", t.describe(), " but embed_tokens is ",
              weights_.embed_tokens.describe(), " (one device and dtype for all weights)");
  });
  OPD_CHECK(weights_.lm_head.defined() && weights_.lm_head.device() == dev &&
                weights_.lm_head.dtype() == dt,
            InvalidArgument, "transformer: lm_head must be on the device/dtype of the weights");
}

Transformer Transformer::to(Device device, DType dtype) const {
  Transformer t(config_, weights_to(weights_, device, dtype));
  t.recompute_ = recompute_;
  return t;
}

Transformer Transformer::load(const std::string& model_dir) {
  ModelConfig config = load_model_config(model_dir);
  WeightStore store = WeightStore::open_dir(model_dir);
  ModelWeights weights = load_weights(config, store);
  return Transformer(std::move(config), std::move(weights));
}

namespace {

Tensor empty_like(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), t.device()); }
Tensor empty_f(const Shape& s, const Tensor& like) { return Tensor::empty(s, like.dtype(), like.device()); }
Tensor none() { return Tensor(); }

// Per-head RMSNorm on [T, heads*D] viewed as [T*heads, D].
void head_norm(const Tensor& x, const Tensor& w, double eps, int64_t heads, Tensor& y,
               Tensor& rstd) {
  const int64_t T = x.dim(0), D = w.numel();
  y = empty_like(x);
  rstd = empty_f({T * heads}, x);
  Tensor yv = y.reshape({T * heads, D});
  Tensor rv = rstd;
  ops::rmsnorm_forward(x.reshape({T * heads, D}), w, eps, yv, rv);
}

}  // namespace

Tensor Transformer::forward(const Batch& batch, ForwardCache* cache) const {
  Tensor h = forward_hidden(batch, cache);
  // CUDA: f32 logits straight from the GEMM's f32 accumulator (bf16 operands).
  const DType logits_dtype = h.device() == Device::CUDA ? DType::F32 : h.dtype();
  Tensor logits = Tensor::empty({h.dim(0), config_.vocab_size}, logits_dtype, h.device());
  ops::linear_forward(h, weights_.lm_head, none(), logits);
  return logits;
}

Tensor Transformer::layer_forward(size_t li, const Tensor& x, const Batch& batch,
                                  LayerCache& lc) const {
  const ModelConfig& c = config_;
  const int64_t T = batch.num_tokens(), H = c.hidden_size, D = c.head_dim;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const double eps = c.rms_norm_eps, scale = c.attention_scale();  // 1/sqrt(D), x attention_factor^2 for YaRN
  const LayerWeights& L = weights_.layers[li];
  lc.x = x;
  lc.h1 = empty_like(x);
  lc.rstd1 = empty_f({T}, x);
  ops::rmsnorm_forward(x, L.input_norm, eps, lc.h1, lc.rstd1);

  Tensor q = empty_f({T, Hq * D}, x), k = empty_f({T, Hkv * D}, x), v = empty_f({T, Hkv * D}, x);
  ops::linear_forward(lc.h1, L.q_proj, L.q_bias, q);
  ops::linear_forward(lc.h1, L.k_proj, L.k_bias, k);
  ops::linear_forward(lc.h1, L.v_proj, L.v_bias, v);
  if (c.qk_norm) {
    lc.q_raw = q;
    lc.k_raw = k;
    head_norm(lc.q_raw, L.q_norm, eps, Hq, q, lc.rstd_q);
    head_norm(lc.k_raw, L.k_norm, eps, Hkv, k, lc.rstd_k);
  }
  lc.q = q.reshape({T, Hq, D});
  lc.k = k.reshape({T, Hkv, D});
  lc.v = v.reshape({T, Hkv, D});
  ops::rope_forward(lc.q, batch.positions, inv_freq_);
  ops::rope_forward(lc.k, batch.positions, inv_freq_);

  lc.attn = empty_f({T, Hq, D}, x);
  lc.lse = Tensor::empty({T, Hq}, x.dtype(), x.device());
  ops::attention_forward(lc.q, lc.k, lc.v, batch.cu_seqlens, scale, lc.attn, lc.lse);

  Tensor o = empty_f({T, H}, x);
  ops::linear_forward(lc.attn.reshape({T, Hq * D}), L.o_proj, L.o_bias, o);
  lc.x2 = empty_f({T, H}, x);
  ops::add(x, o, lc.x2);

  lc.h2 = empty_f({T, H}, x);
  lc.rstd2 = empty_f({T}, x);
  ops::rmsnorm_forward(lc.x2, L.post_norm, eps, lc.h2, lc.rstd2);
  const int64_t I = c.intermediate_size;
  lc.gate = empty_f({T, I}, x);
  lc.up = empty_f({T, I}, x);
  ops::linear_forward(lc.h2, L.gate_proj, none(), lc.gate);
  ops::linear_forward(lc.h2, L.up_proj, none(), lc.up);
  lc.act = empty_f({T, I}, x);
  ops::swiglu_forward(lc.gate, lc.up, lc.act);
  Tensor m = empty_f({T, H}, x);
  ops::linear_forward(lc.act, L.down_proj, none(), m);
  Tensor x_next = empty_f({T, H}, x);
  ops::add(lc.x2, m, x_next);
  return x_next;
}

Tensor Transformer::forward_hidden(const Batch& batch, ForwardCache* cache) const {
  OPD_CHECK(weights_.embed_tokens.defined(), InvalidArgument,
            "transformer: the weights are not loaded (offloaded to the host: upload them first)");
  if (device() == Device::CUDA) return forward_hidden_cuda(batch, cache);
  const ModelConfig& c = config_;
  const int64_t T = batch.num_tokens(), H = c.hidden_size;
  const double eps = c.rms_norm_eps;
  const Tensor& emb = weights_.embed_tokens;

  Tensor x = empty_f({T, H}, emb);
  ops::embedding_forward(batch.ids, emb, x);
  if (cache) cache->layers.assign(weights_.layers.size(), LayerCache{});

  for (size_t li = 0; li < weights_.layers.size(); ++li) {
    LayerCache lc;
    Tensor x_next = layer_forward(li, x, batch, lc);
    if (cache) {
      if (recompute_ == Recompute::PerLayer) cache->layers[li].x = x;  // the rest is recomputed
      else cache->layers[li] = std::move(lc);
    }
    x = x_next;
  }

  Tensor h = empty_like(x);
  Tensor rstd = empty_f({T}, x);
  ops::rmsnorm_forward(x, weights_.final_norm, eps, h, rstd);
  if (cache) {
    cache->x_final = x;
    cache->h_final = h;
    cache->rstd_final = rstd;
  }
  return h;
}

void Transformer::backward(const Batch& batch, const ForwardCache& cache, const Tensor& dlogits,
                           ModelWeights& grads, const GradsReadyHook& on_ready) const {
  Tensor none_t;
  OPD_CHECK(cache.h_final.defined(), InvalidArgument, "backward needs the cache of a forward");
  Tensor dl = dlogits;
  if (device() == Device::CUDA && dl.dtype() != dtype()) {  // GEMM operands share one dtype
    dl = Tensor::empty(dlogits.shape(), dtype(), Device::CUDA);
    ops::convert(dlogits, dl);
  }
  // lm_head. With tied embeddings grads.lm_head is grads.embed_tokens.
  Tensor dh = empty_like(cache.h_final);
  ops::linear_backward(dl, cache.h_final, weights_.lm_head, dh, grads.lm_head, none_t);
  backward_hidden(batch, cache, dh, grads, on_ready);
}

void Transformer::backward_hidden(const Batch& batch, const ForwardCache& cache,
                                  const Tensor& dh, ModelWeights& grads,
                                  const GradsReadyHook& on_ready) const {
  const ModelConfig& c = config_;
  const int64_t T = batch.num_tokens(), D = c.head_dim;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const double scale = c.attention_scale();  // 1/sqrt(D), x attention_factor^2 for YaRN
  OPD_CHECK(cache.layers.size() == weights_.layers.size(), InvalidArgument,
            "backward needs a forward cache with every layer");
  if (device() == Device::CUDA) return backward_hidden_cuda(cache, dh, grads, on_ready);
  auto ready = [&](GradsReady::Part part, int layer) {
    if (on_ready) on_ready(GradsReady{part, layer});
  };
  Tensor none_t;
  Tensor dx = empty_like(cache.x_final);
  ops::rmsnorm_backward(dh, cache.x_final, weights_.final_norm, cache.rstd_final, dx,
                        grads.final_norm);
  ready(GradsReady::Part::FinalNorm, -1);

  for (size_t li = weights_.layers.size(); li-- > 0;) {
    const LayerWeights& L = weights_.layers[li];
    LayerWeights& G = grads.layers[li];
    // Recompute: the layer's forward again from its saved input (same ops, same inputs, so the
    // same activations bit for bit); the recomputed cache lives for this layer's backward only.
    LayerCache recomputed;
    if (!cache.layers[li].h1.defined()) {
      OPD_CHECK(cache.layers[li].x.defined(), InvalidArgument,
                "backward: the forward cache has no input for layer ", li);
      layer_forward(li, cache.layers[li].x, batch, recomputed);
    }
    const LayerCache& lc = recomputed.h1.defined() ? recomputed : cache.layers[li];

    // MLP: x_next = x2 + down(act); dx is d(x_next).
    Tensor dact = empty_like(lc.act);
    ops::linear_backward(dx, lc.act, L.down_proj, dact, G.down_proj, none_t);
    Tensor dgate = empty_like(lc.gate), dup = empty_like(lc.up);
    ops::swiglu_backward(dact, lc.gate, lc.up, dgate, dup);
    Tensor dh2 = empty_like(lc.h2), dh2_up = empty_like(lc.h2);
    ops::linear_backward(dgate, lc.h2, L.gate_proj, dh2, G.gate_proj, none_t);
    ops::linear_backward(dup, lc.h2, L.up_proj, dh2_up, G.up_proj, none_t);
    ops::add_inplace(dh2, dh2_up);
    Tensor dx2 = empty_like(lc.x2);
    ops::rmsnorm_backward(dh2, lc.x2, L.post_norm, lc.rstd2, dx2, G.post_norm);
    ops::add_inplace(dx2, dx);  // residual

    // Attention: x2 = x + o_proj(attn).
    Tensor dattn = empty_f({T, Hq * D}, dx);
    ops::linear_backward(dx2, lc.attn.reshape({T, Hq * D}), L.o_proj, dattn, G.o_proj, G.o_bias);
    Tensor dq = empty_f({T, Hq, D}, dx), dk = empty_f({T, Hkv, D}, dx), dv = empty_f({T, Hkv, D}, dx);
    ops::attention_backward(dattn.reshape({T, Hq, D}), lc.q, lc.k, lc.v, lc.attn, lc.lse,
                            batch.cu_seqlens, scale, dq, dk, dv);
    ops::rope_backward(dq, batch.positions, inv_freq_);
    ops::rope_backward(dk, batch.positions, inv_freq_);
    Tensor dq_lin = dq.reshape({T, Hq * D}), dk_lin = dk.reshape({T, Hkv * D});
    if (c.qk_norm) {
      Tensor dq_raw = empty_like(lc.q_raw), dk_raw = empty_like(lc.k_raw);
      Tensor dq_raw_v = dq_raw.reshape({T * Hq, D}), dk_raw_v = dk_raw.reshape({T * Hkv, D});
      ops::rmsnorm_backward(dq_lin.reshape({T * Hq, D}), lc.q_raw.reshape({T * Hq, D}), L.q_norm,
                            lc.rstd_q, dq_raw_v, G.q_norm);
      ops::rmsnorm_backward(dk_lin.reshape({T * Hkv, D}), lc.k_raw.reshape({T * Hkv, D}),
                            L.k_norm, lc.rstd_k, dk_raw_v, G.k_norm);
      dq_lin = dq_raw;
      dk_lin = dk_raw;
    }
    Tensor dh1 = empty_like(lc.h1), dh1_k = empty_like(lc.h1), dh1_v = empty_like(lc.h1);
    ops::linear_backward(dq_lin, lc.h1, L.q_proj, dh1, G.q_proj, G.q_bias);
    ops::linear_backward(dk_lin, lc.h1, L.k_proj, dh1_k, G.k_proj, G.k_bias);
    ops::linear_backward(dv.reshape({T, Hkv * D}), lc.h1, L.v_proj, dh1_v, G.v_proj, G.v_bias);
    ops::add_inplace(dh1, dh1_k);
    ops::add_inplace(dh1, dh1_v);
    Tensor dx_in = empty_like(lc.x);
    ops::rmsnorm_backward(dh1, lc.x, L.input_norm, lc.rstd1, dx_in, G.input_norm);
    ops::add_inplace(dx_in, dx2);  // residual
    dx = dx_in;
    ready(GradsReady::Part::Layer, static_cast<int>(li));
  }
  ops::embedding_backward(batch.ids, dx, grads.embed_tokens);
  ready(GradsReady::Part::Embedding, -1);
}

double causal_lm_loss(const Batch& batch, const Tensor& logits, Tensor* dlogits) {
  const int64_t T = batch.num_tokens();
  Tensor targets = Tensor::empty({T}, DType::I32);
  const int32_t* ids = batch.ids.data<int32_t>();
  const int32_t* cu = batch.cu_seqlens.data<int32_t>();
  int32_t* tg = targets.data<int32_t>();
  for (int64_t b = 0; b < batch.num_sequences(); ++b)
    for (int32_t t = cu[b]; t < cu[b + 1]; ++t) tg[t] = t + 1 < cu[b + 1] ? ids[t + 1] : -100;
  Tensor losses = Tensor::empty({T}, logits.dtype(), logits.device());
  Tensor lse = Tensor::empty({T}, logits.dtype(), logits.device());
  int64_t n = ops::cross_entropy_forward(logits, targets, losses, lse);
  double sum = 0;
  Tensor host = losses.to(Device::CPU);
  for (int64_t t = 0; t < T; ++t)
    sum += host.dtype() == DType::F64 ? host.data<double>()[t] : host.data<float>()[t];
  if (dlogits) {
    *dlogits = empty_like(logits);
    ops::cross_entropy_backward(logits, targets, lse, n > 0 ? 1.0 / static_cast<double>(n) : 0.0,
                                *dlogits);
  }
  return n > 0 ? sum / static_cast<double>(n) : 0.0;
}

}  // namespace opd
