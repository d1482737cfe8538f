// Decoder-only transformer (Llama / Qwen2 / Qwen3 families): forward to logits and backward
// to the gradient of every parameter, over a packed batch of sequences of different lengths.
//
// Per layer (pre-norm):  h = RMSNorm(x); q,k,v = h Wq (+bq), h Wk (+bk), h Wv (+bv);
// Qwen3: q,k = RMSNorm_head(q), RMSNorm_head(k); RoPE(q, k); o = causal GQA attention;
// x += o Wo; x += down(silu(gate(RMSNorm(x))) * up(RMSNorm(x))).  Then logits = RMSNorm(x) W_lm.
// The backward uses the activations of the forward (ForwardCache): all of them, or with
// Recompute::PerLayer only each layer's input x, the layer's forward being recomputed from it
// during the backward (activation checkpointing per layer: memory T x H per layer instead of
// ~21 T x H, for one extra forward of the layers), or with Recompute::Elementwise (CUDA) every
// GEMM and attention output but not what one elementwise pass rebuilds from them: the two norm
// outputs h1 = RMSNorm(x), h2 = RMSNorm(x2), Qwen3's normed+RoPE'd q and k, and
// act = silu(gate) * up (5 H + I of the 13 H + 3 I values per token and layer; at the Qwen3-0.6B
// shape 36% of the activations, for ~2% more backward time and no extra GEMM).
//
// Devices: a model whose weights are host tensors (f32/f64) runs the CPU reference ops; a model
// whose weights are CUDA tensors (Transformer::to(Device::CUDA, DType::BF16), or f32) runs
// transformer_cuda.cpp: activations in the weights' dtype, f32 accumulation in every op, f32
// rstd/lse, f32 parameter gradients (the optimizer's f32 master weights are separate:
// train/optimizer.h), each residual add fused with the RMSNorm that follows it, and token ids,
// positions and cu_seqlens checked once per batch when the forward starts (no host round trip
// inside the forward or the backward).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/weights.h"

typedef struct CUstream_st* cudaStream_t;

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

// Activation recompute (see the top of this file). Off keeps every activation. On the CPU
// Elementwise keeps everything too (the CPU path is the readable reference; its memory is not
// the constraint), so it computes exactly what Off computes.
enum class Recompute { Off, Elementwise, PerLayer };
// "none" | "elementwise" | "layer" (what --recompute-granularity takes); throws InvalidArgument.
Recompute parse_recompute(const std::string& name);
const char* recompute_name(Recompute mode);

// The device-side form of a Batch for the CUDA path (transformer_cuda.cpp): validated ids and
// positions on the device and the attention work plan of cu_seqlens, built once per forward.
struct CudaBatchPlan;

struct LayerCache {
  Tensor x, h1, rstd1;                 // layer input, its norm, 1/rms
  Tensor q_raw, k_raw, rstd_q, rstd_k; // Qwen3: q/k before the per-head norm
  Tensor q, k, v, attn, lse;           // q/k after norm+RoPE, attention output and its LSE
  Tensor x2, h2, rstd2;                // after the attention residual, its norm
  Tensor gate, up, act;                // MLP pre-activations and silu(gate)*up
};

// With Recompute::PerLayer only LayerCache::x is kept (the rest is undefined until the backward
// recomputes it). On CUDA, layer i's x is the residual stream x_i = x_{i-1}2 + mlp_{i-1} as the
// fused residual RMSNorm stored it.
struct ForwardCache {
  std::vector<LayerCache> layers;
  Tensor x_final, h_final, rstd_final;
  std::shared_ptr<const CudaBatchPlan> device_batch;  // CUDA models: reused by the backward
};

// Backward progress, for overlapping gradient communication with the rest of the backward
// (ZeRO-2, train/trainer.cpp): the hook is called when the gradients of a group of parameters
// are final for this backward call, in this order: FinalNorm (model.norm), Layer L-1, ..., Layer 0
// (every parameter of that layer), Embedding (embed_tokens; with tied embeddings that is also the
// lm_head gradient, which the caller's loss accumulated before the backward). CUDA: called on
// the host as soon as the group's kernels are queued on the current stream, so a caller records
// an event there to order another stream after them; nothing in the rest of this backward call
// touches those gradients again.
struct GradsReady {
  enum class Part { FinalNorm, Layer, Embedding };
  Part part = Part::Layer;
  int layer = -1;  // Part::Layer only
};
using GradsReadyHook = std::function<void(const GradsReady&)>;

// Weights of a CUDA model that are still on their way to the device, group by group
// (WeightOffload::upload_layered): group 0 is the embedding, 1 + l layer l, num_layers + 1 the
// final norm and an untied lm_head. wait(g, stream) orders `stream` after group g's copy;
// wait_all after every group's. host_embedding(): where the forward may look its tokens up
// without waiting for group 0 (the embedding is copied last: a tied one is needed again only by
// the lm_head, after every layer): the embedding's pinned host copy, which kernels read over the
// bus, for the first forward after an upload; nullptr afterwards (then wait(0)).
class WeightArrival {
 public:
  virtual ~WeightArrival() = default;
  virtual void wait(int64_t group, cudaStream_t stream) const = 0;
  virtual void wait_all(cudaStream_t stream) const = 0;
  virtual const void* host_embedding() const { return nullptr; }
};

class Transformer {
 public:
  Transformer(ModelConfig config, ModelWeights weights);
  // Reads config.json and the safetensors weights of a Hugging Face model directory (f32).
  static Transformer load(const std::string& model_dir);

  const ModelConfig& config() const { return config_; }
  ModelWeights& weights() { return weights_; }
  const ModelWeights& weights() const { return weights_; }

  // A copy of this model with every parameter converted to `dtype` on `device` (e.g. the bf16
  // CUDA model of a loaded f32 model; the trainer, rollout and scorer run on it). Tied
  // embeddings stay one tensor; the recompute setting is kept.
  Transformer to(Device device, DType dtype) const;
  Device device() const { return weights_.embed_tokens.device(); }
  DType dtype() const { return weights_.embed_tokens.dtype(); }

  void set_recompute(Recompute mode) { recompute_ = mode; }
  Recompute recompute() const { return recompute_; }

  // Weights in flight (CUDA; nullptr: all resident, the default). The CUDA forward then makes
  // its stream wait for each group right before its first use, so a forward can start while
  // later layers are still being copied. Not carried over by to().
  void set_weight_arrival(const WeightArrival* arrival) { arrival_ = arrival; }
  // Orders `stream` after every weight's arrival (no-op when all are resident): for readers
  // other than forward_hidden (PagedForward).
  void wait_for_weights(cudaStream_t stream) const {
    if (arrival_) arrival_->wait_all(stream);
  }

  // Logits f32 [T, V] (CPU: the weights' dtype). With a cache, keeps what backward() needs.
  // The batch may be on the host or (CUDA models) on the device.
  Tensor forward(const Batch& batch, ForwardCache* cache = nullptr) const;
  // Accumulates d(loss)/d(parameter) into grads given d(loss)/d(logits). CUDA models: grads are
  // f32 CUDA tensors (zeros_weights(config, F32, Device::CUDA)); dlogits f32 or the model dtype.
  void backward(const Batch& batch, const ForwardCache& cache, const Tensor& dlogits,
                ModelWeights& grads, const GradsReadyHook& on_ready = {}) const;

  // The same without the lm_head: final hidden states RMSNorm(x) [T, H] (what the fused
  // lm_head + loss consumes, so no [T, V] logits exist), and the backward from d(hidden).
  // The lm_head gradient is the caller's (the fused loss accumulates it). CUDA: hidden is in the
  // model dtype; dhidden may be f32 (the fused loss's d_hidden) or the model dtype.
  Tensor forward_hidden(const Batch& batch, ForwardCache* cache = nullptr) const;
  // on_ready (optional): see GradsReady.
  void backward_hidden(const Batch& batch, const ForwardCache& cache, const Tensor& dhidden,
                       ModelWeights& grads, const GradsReadyHook& on_ready = {}) const;

 private:
  // CPU: one layer's forward from its input x; fills every field of lc and returns x_next.
  Tensor layer_forward(size_t li, const Tensor& x, const Batch& batch, LayerCache& lc) const;
  // CUDA (transformer_cuda.cpp).
  Tensor forward_hidden_cuda(const Batch& batch, ForwardCache* cache) const;
  void backward_hidden_cuda(const ForwardCache& cache, const Tensor& dhidden,
                            ModelWeights& grads, const GradsReadyHook& on_ready) const;
  void check_weights() const;

  ModelConfig config_;
  ModelWeights weights_;
  Tensor inv_freq_;  // f32 on the weights' device
  Recompute recompute_ = Recompute::Off;
  const WeightArrival* arrival_ = nullptr;
};

// Next-token cross-entropy over a packed batch: row t predicts ids[t+1] within its sequence
// (the last row of each sequence predicts nothing). Returns the mean over predicted tokens
// (0 when there are none); fills dlogits (same shape as logits) when given.
double causal_lm_loss(const Batch& batch, const Tensor& logits, Tensor* dlogits);

}  // namespace opd
