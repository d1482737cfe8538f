// Decoder-only transformer (Llama / Qwen2 / Qwen3 families): forward to logits and backward
// to the gradient of every parameter, over a packed batch of sequences of different lengths.
//
// Per layer (pre-norm):  h = RMSNorm(x); q,k,v = h Wq (+bq), h Wk (+bk), h Wv (+bv);
// Qwen3: q,k = RMSNorm_head(q), RMSNorm_head(k); RoPE(q, k); o = causal GQA attention;
// x += o Wo; x += down(silu(gate(RMSNorm(x))) * up(RMSNorm(x))).  Then logits = RMSNorm(x) W_lm.
// The backward keeps every activation of the forward (ForwardCache); activation recompute
// comes with the CUDA training step.
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/weights.h"

namespace opd {

// A packed batch: sequence b is rows [cu_seqlens[b], cu_seqlens[b+1]) of ids; positions
// restart at 0 in every sequence.
struct Batch {
  Tensor ids;         // i32 [T]
  Tensor cu_seqlens;  // i32 [B+1]
  Tensor positions;   // i32 [T]
  int64_t num_tokens() const { return ids.numel(); }
  int64_t num_sequences() const { return cu_seqlens.numel() - 1; }
};

// Packs sequences; every id is checked against vocab_size (error names sequence, position,
// value and limit), empty sequences are allowed.
Batch make_batch(const std::vector<std::vector<int32_t>>& sequences, int64_t vocab_size);

struct LayerCache {
  Tensor x, h1, rstd1;                 // layer input, its norm, 1/rms
  Tensor q_raw, k_raw, rstd_q, rstd_k; // Qwen3: q/k before the per-head norm
  Tensor q, k, v, attn, lse;           // q/k after norm+RoPE, attention output and its LSE
  Tensor x2, h2, rstd2;                // after the attention residual, its norm
  Tensor gate, up, act;                // MLP pre-activations and silu(gate)*up
};

struct ForwardCache {
  std::vector<LayerCache> layers;
  Tensor x_final, h_final, rstd_final;
};

class Transformer {
 public:
  Transformer(ModelConfig config, ModelWeights weights);
  // Reads config.json and the safetensors weights of a Hugging Face model directory (f32).
  static Transformer load(const std::string& model_dir);

  const ModelConfig& config() const { return config_; }
  ModelWeights& weights() { return weights_; }
  const ModelWeights& weights() const { return weights_; }

  // Logits f32 [T, V]. With a cache, keeps what backward() needs.
  Tensor forward(const Batch& batch, ForwardCache* cache = nullptr) const;
  // Accumulates d(loss)/d(parameter) into grads given d(loss)/d(logits).
  void backward(const Batch& batch, const ForwardCache& cache, const Tensor& dlogits,
                ModelWeights& grads) const;

  // The same without the lm_head: final hidden states RMSNorm(x) [T, H] (what the fused
  // lm_head + loss consumes, so no [T, V] logits exist), and the backward from d(hidden).
  // The lm_head gradient is the caller's (the fused loss accumulates it).
  Tensor forward_hidden(const Batch& batch, ForwardCache* cache = nullptr) const;
  void backward_hidden(const Batch& batch, const ForwardCache& cache, const Tensor& dhidden,
                       ModelWeights& grads) const;

 private:
  ModelConfig config_;
  ModelWeights weights_;
  Tensor inv_freq_;
};

// Next-token cross-entropy over a packed batch: row t predicts ids[t+1] within its sequence
// (the last row of each sequence predicts nothing). Returns the mean over predicted tokens
// (0 when there are none); fills dlogits (same shape as logits) when given.
double causal_lm_loss(const Batch& batch, const Tensor& logits, Tensor* dlogits);

}  // namespace opd
