// The transformer's forward and backward on CUDA tensors (formulas in model/transformer.h):
// bf16 (or f32) weights and activations, f32 accumulation in every GEMM and reduction, f32
// rstd/lse, f32 parameter gradients accumulated in place (micro-batches add up).
//
// What differs from the CPU composition in transformer.cpp, and why:
// - Each residual add is fused with the RMSNorm that follows it (ops::rmsnorm_residual_*):
//   x2 = x + o with h2 = norm(x2), and x_next = x2 + m with the *next* layer's input norm (or
//   the final norm), so the residual stream is read once per norm instead of three times.
//   Layer i's cached x is that stored sum; the backward's ds = dnorm + dres carries the
//   residual gradient in the same pass (in place).
// - Token ids, positions and cu_seqlens are checked once per batch (prepare_batch), and the
//   attention plan of cu_seqlens is built once and used by every layer forward and backward:
//   the per-op paths of kernels/ops.h would check (and read back) them in every call.
// - dx of projections that share an input (q/k/v; gate/up) accumulates into one buffer with
//   beta = 1 GEMMs instead of separate buffers and adds.
// - Recompute::PerLayer recomputes a layer from its cached x with the same kernels: the plain
//   RMSNorm of the stored sum gives the same bits as the fused kernel did (same code on the
//   same rounded values), so gradients with and without recompute are bit-identical.
//   Recompute::Elementwise keeps the GEMM/attention outputs and rebuilds only the norm outputs,
//   the normed+RoPE'd q/k and the SwiGLU product in the backward (LayerRun::restore_elementwise),
//   also bit-identical.
#include <cmath>
#include <map>
#include <string>

#include "kernels/ops.h"
#include "model/transformer.h"

#ifdef OPD_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/allocator.h"    // current_stream
#include "core/cuda/stream.h"       // OPD_CUDA_CHECK
#include "kernels/cpu/cpu_ops.h"    // the host index checks (same messages as the ops)
#include "kernels/cuda/cuda_ops.h"  // raw kernels: embedding, rope, attention, index checks
#include "kernels/cuda/gemm.h"      // beta = 1 GEMMs for accumulated dx
#endif

namespace opd {

#ifdef OPD_WITH_CUDA

struct CudaBatchPlan {
  int64_t tokens = 0;
  Tensor ids, positions;  // i32 [T] on the device, validated
  std::unique_ptr<cuda::AttentionPlan> attention;
};

namespace {

cudaStream_t stream() { return cuda::current_stream(); }

Tensor empty_dev(const Shape& s, DType dt) { return Tensor::empty(s, dt, Device::CUDA); }

// ids in [0, V), positions >= 0, cu_seqlens well formed: checked here, once per batch. Host
// batches are checked on the host and uploaded with one asynchronous copy (no stream sync);
// device batches are checked on the device (two small read-backs) and cu_seqlens is read back
// (the attention plan is built on the host).
std::shared_ptr<CudaBatchPlan> prepare_batch(const Batch& b, int64_t vocab) {
  const char* op = "transformer forward (CUDA)";
  for (const Tensor* t : {&b.ids, &b.positions, &b.cu_seqlens}) {
    OPD_CHECK(t->defined() && t->dtype() == DType::I32 && t->ndim() == 1, InvalidArgument, op,
              ": batch tensors must be i32 vectors, got ", t->defined() ? t->describe() : "none");
  }
  const int64_t T = b.ids.numel();
  OPD_CHECK(b.positions.numel() == T && b.cu_seqlens.numel() >= 1, InvalidArgument, op,
            ": positions ", b.positions.describe(), " and cu_seqlens ", b.cu_seqlens.describe(),
            " do not match ids ", b.ids.describe());
  OPD_CHECK(b.ids.device() == b.positions.device(), InvalidArgument, op,
            ": ids and positions must be on one device");
  auto plan = std::make_shared<CudaBatchPlan>();
  plan->tokens = T;
  plan->ids = empty_dev({T}, DType::I32);
  plan->positions = empty_dev({T}, DType::I32);
  if (b.ids.device() == Device::CPU) {
    cpu::check_token_ids(op, b.ids.data<int32_t>(), T, vocab);
    cpu::check_positions(op, b.positions.data<int32_t>(), T);
    if (T > 0) {
      // Pageable sources: the calls return once the bytes are staged (the batch may go away).
      OPD_CUDA_CHECK(cudaMemcpyAsync(plan->ids.raw(), b.ids.raw(), T * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, stream()));
      OPD_CUDA_CHECK(cudaMemcpyAsync(plan->positions.raw(), b.positions.raw(),
                                     T * sizeof(int32_t), cudaMemcpyHostToDevice, stream()));
    }
  } else {
    cuda::IndexCheckResult r =
        cuda::check_indices(b.ids.data<int32_t>(), T, cuda::IndexRule::InRange, vocab, stream());
    if (r.first_bad_row >= 0) {
      OPD_FAIL(InvalidData, op, ": token id ", r.value, " at row ", r.first_bad_row,
               " is outside the vocabulary [0, ", vocab, ")");
    }
    r = cuda::check_indices(b.positions.data<int32_t>(), T, cuda::IndexRule::NonNegative, 0,
                            stream());
    if (r.first_bad_row >= 0) {
      OPD_FAIL(InvalidData, op, ": position ", r.value, " at row ", r.first_bad_row,
               " is negative (positions must be >= 0)");
    }
    if (T > 0) {
      OPD_CUDA_CHECK(cudaMemcpyAsync(plan->ids.raw(), b.ids.raw(), T * sizeof(int32_t),
                                     cudaMemcpyDeviceToDevice, stream()));
      OPD_CUDA_CHECK(cudaMemcpyAsync(plan->positions.raw(), b.positions.raw(),
                                     T * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream()));
    }
  }
  Tensor cu = b.cu_seqlens.to(Device::CPU);  // host already: no copy
  // Validates cu_seqlens (starts at 0, non-decreasing, ends at T) with the CPU's messages.
  plan->attention = std::make_unique<cuda::AttentionPlan>(cu.data<int32_t>(), cu.numel() - 1, T,
                                                          stream());
  return plan;
}

// dx (+)= dy W, dW += dy^T x, dbias += colsum(dy): a dense layer's backward where dx already
// holds the gradient from another projection of the same input (beta = 1).
void linear_backward_accumulate(const Tensor& dy, const Tensor& x, const Tensor& w, Tensor& dx,
                                Tensor& dw, Tensor& dbias) {
  const int64_t n = x.dim(0), in = x.dim(1), out = w.dim(0);
  OPD_CHECK(dy.shape() == Shape({n, out}) && dx.shape() == Shape({n, in}) &&
                dw.shape() == w.shape() && dw.dtype() == DType::F32 && dy.dtype() == x.dtype() &&
                dx.dtype() == x.dtype() && w.dtype() == x.dtype(),
            InvalidArgument, "linear_backward_accumulate: dy ", dy.describe(), ", x ",
            x.describe(), ", w ", w.describe(), ", dx ", dx.describe(), ", dw ", dw.describe());
  if (n == 0 || in == 0 || out == 0) return;
  cuda::GemmArgs g;  // dx^T [in, n] += W^T [in, out] dy^T [out, n] (see gemm.h)
  g.m = in, g.n = n, g.k = out;
  g.a = w.raw(), g.lda = in;
  g.b = dy.raw(), g.ldb = out;
  g.d = dx.raw(), g.ldd = in;
  g.ab_dtype = x.dtype(), g.d_dtype = x.dtype();
  g.beta = 1.0f;
  cuda::gemm(g, stream());
  cuda::linear_backward_weight(dy.raw(), x.raw(), n, in, out, x.dtype(), DType::F32, dw.raw(),
                               stream());
  if (dbias.defined()) {
    OPD_CHECK(dbias.dtype() == DType::F32 && dbias.numel() == out, InvalidArgument,
              "linear_backward_accumulate: dbias ", dbias.describe());
    cuda::column_sum_accumulate(dy.raw(), n, out, x.dtype(), dbias.data<float>(), stream());
  }
}

// Every gradient tensor must be an f32 CUDA tensor of its parameter's shape.
void check_grads(const ModelWeights& weights, ModelWeights& grads) {
  std::map<std::string, Shape> shapes;
  weights.for_each([&](const std::string& n, const Tensor& t) { shapes[n] = t.shape(); });
  int64_t seen = 0;
  grads.for_each([&](const std::string& n, const Tensor& g) {
    auto it = shapes.find(n);
    OPD_CHECK(it != shapes.end() && g.defined() && g.device() == Device::CUDA &&
                  g.dtype() == DType::F32 && g.shape() == it->second && g.writable(),
              InvalidArgument, "transformer backward (CUDA): gradient ", n, " must be an f32 CUDA ",
              "tensor of shape ", it == shapes.end() ? "?" : shape_str(it->second), ", got ",
              g.defined() ? g.describe() : "none");
    ++seen;
  });
  OPD_CHECK(seen == static_cast<int64_t>(shapes.size()), InvalidArgument,
            "transformer backward (CUDA): ", seen, " gradients for ", shapes.size(), " parameters");
}

}  // namespace

namespace {

// One layer up to the MLP output m (the caller fuses x_next = x2 + m with the next norm).
// h1/rstd1: the layer's input norm when the previous fused norm produced it, else computed.
struct LayerRun {
  const ModelConfig& c;
  const LayerWeights& L;
  const CudaBatchPlan& plan;
  const Tensor& inv_freq;

  Tensor forward(const Tensor& x, const Tensor& h1, const Tensor& rstd1, LayerCache& lc) const {
    const int64_t T = plan.tokens, H = c.hidden_size, D = c.head_dim, I = c.intermediate_size;
    const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
    const double eps = c.rms_norm_eps, scale = c.attention_scale();  // 1/sqrt(D), x attention_factor^2 for YaRN
    const DType dt = x.dtype();
    lc.x = x;
    if (h1.defined()) {
      lc.h1 = h1;
      lc.rstd1 = rstd1;
    } else {
      lc.h1 = empty_dev({T, H}, dt);
      lc.rstd1 = empty_dev({T}, DType::F32);
      ops::rmsnorm_forward(x, L.input_norm, eps, lc.h1, lc.rstd1);
    }
    Tensor q = empty_dev({T, Hq * D}, dt), k = empty_dev({T, Hkv * D}, dt),
           v = empty_dev({T, Hkv * D}, dt);
    ops::linear_forward(lc.h1, L.q_proj, L.q_bias, q);  // bias rides the GEMM epilogue
    ops::linear_forward(lc.h1, L.k_proj, L.k_bias, k);
    ops::linear_forward(lc.h1, L.v_proj, L.v_bias, v);
    if (c.qk_norm) {
      lc.q_raw = q;
      lc.k_raw = k;
      q = empty_dev({T, Hq * D}, dt);
      k = empty_dev({T, Hkv * D}, dt);
      lc.rstd_q = empty_dev({T * Hq}, DType::F32);
      lc.rstd_k = empty_dev({T * Hkv}, DType::F32);
      Tensor qv = q.reshape({T * Hq, D}), kv = k.reshape({T * Hkv, D});
      ops::rmsnorm_forward(lc.q_raw.reshape({T * Hq, D}), L.q_norm, eps, qv, lc.rstd_q);
      ops::rmsnorm_forward(lc.k_raw.reshape({T * Hkv, D}), L.k_norm, eps, kv, lc.rstd_k);
    }
    lc.q = q.reshape({T, Hq, D});
    lc.k = k.reshape({T, Hkv, D});
    lc.v = v.reshape({T, Hkv, D});
    const int32_t* pos = plan.positions.data<int32_t>();
    cuda::rope(lc.q.raw(), pos, inv_freq.data<float>(), T, Hq, D, dt, false, stream());
    cuda::rope(lc.k.raw(), pos, inv_freq.data<float>(), T, Hkv, D, dt, false, stream());

    lc.attn = empty_dev({T, Hq, D}, dt);
    lc.lse = empty_dev({T, Hq}, DType::F32);
    cuda::attention_forward(*plan.attention, lc.q.raw(), lc.k.raw(), lc.v.raw(), Hq, Hkv, D, scale,
                            dt, lc.attn.raw(), lc.lse.data<float>(), stream());
    Tensor o = empty_dev({T, H}, dt);
    ops::linear_forward(lc.attn.reshape({T, Hq * D}), L.o_proj, L.o_bias, o);
    lc.x2 = empty_dev({T, H}, dt);
    lc.h2 = empty_dev({T, H}, dt);
    lc.rstd2 = empty_dev({T}, DType::F32);
    ops::rmsnorm_residual_forward(x, o, L.post_norm, eps, lc.x2, lc.h2, lc.rstd2);

    lc.gate = empty_dev({T, I}, dt);
    lc.up = empty_dev({T, I}, dt);
    ops::linear_forward(lc.h2, L.gate_proj, Tensor(), lc.gate);
    ops::linear_forward(lc.h2, L.up_proj, Tensor(), lc.up);
    lc.act = empty_dev({T, I}, dt);
    ops::swiglu_forward(lc.gate, lc.up, lc.act);
    Tensor m = empty_dev({T, H}, dt);
    ops::linear_forward(lc.act, L.down_proj, Tensor(), m);
    return m;
  }

  // Recompute::Elementwise: the forward drops what one elementwise pass rebuilds from the kept
  // tensors (h1, h2, act, and the normed+RoPE'd q and k when the model has q/k norms).
  static void drop_elementwise(LayerCache& lc) {
    lc.h1 = Tensor();
    lc.h2 = Tensor();
    lc.act = Tensor();
    if (lc.q_raw.defined()) {  // q/k norm models: q, k are rebuilt from q_raw, k_raw
      lc.q = Tensor();
      lc.k = Tensor();
    }
  }

  // The inverse of drop_elementwise, with the forward's own kernels on the same stored values, so
  // the rebuilt tensors are bit-identical: h1 = RMSNorm(x) (the fused residual norm that first
  // produced it normalizes the same stored sum), h2 = RMSNorm(x2), q/k = RoPE(RMSNorm_head(raw)),
  // act = silu(gate) * up. Memory: one layer's worth, freed after its backward.
  void restore_elementwise(const LayerCache& saved, LayerCache& lc) const {
    const int64_t T = plan.tokens, H = c.hidden_size, D = c.head_dim;
    const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
    const double eps = c.rms_norm_eps;
    const DType dt = saved.x.dtype();
    lc = saved;
    Tensor rstd = empty_dev({T}, DType::F32);  // recomputed rstds equal the kept ones; unused
    lc.h1 = empty_dev({T, H}, dt);
    ops::rmsnorm_forward(saved.x, L.input_norm, eps, lc.h1, rstd);
    lc.h2 = empty_dev({T, H}, dt);
    ops::rmsnorm_forward(saved.x2, L.post_norm, eps, lc.h2, rstd);
    lc.act = empty_dev(saved.gate.shape(), dt);
    ops::swiglu_forward(saved.gate, saved.up, lc.act);
    if (!saved.q.defined()) {
      Tensor q = empty_dev({T, Hq * D}, dt), k = empty_dev({T, Hkv * D}, dt);
      Tensor qv = q.reshape({T * Hq, D}), kv = k.reshape({T * Hkv, D});
      Tensor rq = empty_dev({T * Hq}, DType::F32), rk = empty_dev({T * Hkv}, DType::F32);
      ops::rmsnorm_forward(saved.q_raw.reshape({T * Hq, D}), L.q_norm, eps, qv, rq);
      ops::rmsnorm_forward(saved.k_raw.reshape({T * Hkv, D}), L.k_norm, eps, kv, rk);
      lc.q = q.reshape({T, Hq, D});
      lc.k = k.reshape({T, Hkv, D});
      const int32_t* pos = plan.positions.data<int32_t>();
      cuda::rope(lc.q.raw(), pos, inv_freq.data<float>(), T, Hq, D, dt, false, stream());
      cuda::rope(lc.k.raw(), pos, inv_freq.data<float>(), T, Hkv, D, dt, false, stream());
    }
  }

  // dx: d(loss)/d(x_next) on entry (the residual stream after this layer); on return
  // d(loss)/d(x), the gradient at this layer's input (computed in place: no new [T, H]).
  void backward(const LayerCache& lc, Tensor& dx, LayerWeights& G) const {
    const int64_t T = plan.tokens, H = c.hidden_size, D = c.head_dim;
    const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
    const double scale = c.attention_scale();  // 1/sqrt(D), x attention_factor^2 for YaRN
    const DType dt = dx.dtype();
    Tensor none;
    // MLP: x_next = x2 + down(swiglu(gate(h2), up(h2))), h2 = norm(x2).
    Tensor dact = empty_dev(lc.act.shape(), dt);
    ops::linear_backward(dx, lc.act, L.down_proj, dact, G.down_proj, none);
    Tensor dgate = empty_dev(lc.gate.shape(), dt), dup = empty_dev(lc.up.shape(), dt);
    ops::swiglu_backward(dact, lc.gate, lc.up, dgate, dup);
    dact = Tensor();
    Tensor dh2 = empty_dev({T, H}, dt);
    ops::linear_backward(dgate, lc.h2, L.gate_proj, dh2, G.gate_proj, none);
    linear_backward_accumulate(dup, lc.h2, L.up_proj, dh2, G.up_proj, none);
    // d(x2) = norm_backward(dh2) + d(x_next): in place into dx.
    ops::rmsnorm_residual_backward(dh2, lc.x2, L.post_norm, lc.rstd2, dx, dx, G.post_norm);

    // Attention: x2 = x + o_proj(attn).
    Tensor dattn = empty_dev({T, Hq * D}, dt);
    ops::linear_backward(dx, lc.attn.reshape({T, Hq * D}), L.o_proj, dattn, G.o_proj, G.o_bias);
    Tensor dq = empty_dev({T, Hq, D}, dt), dk = empty_dev({T, Hkv, D}, dt),
           dv = empty_dev({T, Hkv, D}, dt);
    cuda::attention_backward(*plan.attention, dattn.raw(), lc.q.raw(), lc.k.raw(), lc.v.raw(),
                             lc.attn.raw(), lc.lse.data<float>(), Hq, Hkv, D, scale, dt, dq.raw(),
                             dk.raw(), dv.raw(), stream());
    dattn = Tensor();
    const int32_t* pos = plan.positions.data<int32_t>();
    cuda::rope(dq.raw(), pos, inv_freq.data<float>(), T, Hq, D, dt, true, stream());
    cuda::rope(dk.raw(), pos, inv_freq.data<float>(), T, Hkv, D, dt, true, stream());
    Tensor dq_lin = dq.reshape({T, Hq * D}), dk_lin = dk.reshape({T, Hkv * D});
    if (c.qk_norm) {
      Tensor dq_raw = empty_dev({T, Hq * D}, dt), dk_raw = empty_dev({T, Hkv * D}, dt);
      Tensor dq_raw_v = dq_raw.reshape({T * Hq, D}), dk_raw_v = dk_raw.reshape({T * Hkv, D});
      ops::rmsnorm_backward(dq_lin.reshape({T * Hq, D}), lc.q_raw.reshape({T * Hq, D}), L.q_norm,
                            lc.rstd_q, dq_raw_v, G.q_norm);
      ops::rmsnorm_backward(dk_lin.reshape({T * Hkv, D}), lc.k_raw.reshape({T * Hkv, D}),
                            L.k_norm, lc.rstd_k, dk_raw_v, G.k_norm);
      dq_lin = dq_raw;
      dk_lin = dk_raw;
    }
    Tensor dh1 = dh2;  // [T, H], free again: reuse it
    ops::linear_backward(dq_lin, lc.h1, L.q_proj, dh1, G.q_proj, G.q_bias);
    linear_backward_accumulate(dk_lin, lc.h1, L.k_proj, dh1, G.k_proj, G.k_bias);
    linear_backward_accumulate(dv.reshape({T, Hkv * D}), lc.h1, L.v_proj, dh1, G.v_proj,
                               G.v_bias);
    // d(x) = norm_backward(dh1) + d(x2): in place into dx.
    ops::rmsnorm_residual_backward(dh1, lc.x, L.input_norm, lc.rstd1, dx, dx, G.input_norm);
  }
};

}  // namespace

Tensor Transformer::forward_hidden_cuda(const Batch& batch, ForwardCache* cache) const {
  const ModelConfig& c = config_;
  const DType dt = dtype();
  OPD_CHECK(dt == DType::BF16 || dt == DType::F32, Unsupported,
            "transformer on CUDA: weights must be bf16 or f32, got ", dtype_name(dt));
  std::shared_ptr<CudaBatchPlan> plan = prepare_batch(batch, c.vocab_size);
  const int64_t T = plan->tokens, H = c.hidden_size;
  const double eps = c.rms_norm_eps;

  // Weights in flight (set_weight_arrival): each group is waited for right before its use.
  const int64_t L = static_cast<int64_t>(weights_.layers.size());
  auto arrive = [&](int64_t group) {
    if (arrival_) arrival_->wait(group, stream());
  };
  // The embedding arrives last (WeightArrival): the first forward after an upload reads its
  // rows from the pinned host copy, the next ones wait for the device copy.
  const void* host_table = arrival_ ? arrival_->host_embedding() : nullptr;
  if (!host_table) arrive(0);
  Tensor x = empty_dev({T, H}, dt);
  cuda::embedding_forward(plan->ids.data<int32_t>(),
                          host_table ? host_table : weights_.embed_tokens.raw(), T, c.vocab_size,
                          H, dt, x.raw(), stream(), host_table != nullptr);
  if (cache) {
    cache->layers.assign(weights_.layers.size(), LayerCache{});
    cache->device_batch = plan;
  }
  Tensor h1, rstd1;  // the current layer's input norm, from the previous fused norm
  for (size_t li = 0; li < weights_.layers.size(); ++li) {
    arrive(static_cast<int64_t>(li) + 1);
    if (static_cast<int64_t>(li) + 1 == L) arrive(L + 1);  // the final norm follows this layer
    LayerRun run{c, weights_.layers[li], *plan, inv_freq_};
    LayerCache lc;
    Tensor m = run.forward(x, h1, rstd1, lc);
    const Tensor& next_w =
        li + 1 < weights_.layers.size() ? weights_.layers[li + 1].input_norm : weights_.final_norm;
    Tensor x_next = empty_dev({T, H}, dt);
    h1 = empty_dev({T, H}, dt);
    rstd1 = empty_dev({T}, DType::F32);
    ops::rmsnorm_residual_forward(lc.x2, m, next_w, eps, x_next, h1, rstd1);
    if (cache) {
      if (recompute_ == Recompute::PerLayer) {
        cache->layers[li].x = x;  // the rest is recomputed
      } else {
        if (recompute_ == Recompute::Elementwise) LayerRun::drop_elementwise(lc);
        cache->layers[li] = std::move(lc);
      }
    }
    x = x_next;
  }
  if (weights_.layers.empty()) {
    arrive(L + 1);
    h1 = empty_dev({T, H}, dt);
    rstd1 = empty_dev({T}, DType::F32);
    ops::rmsnorm_forward(x, weights_.final_norm, eps, h1, rstd1);
  }
  if (cache) {
    cache->x_final = x;
    cache->h_final = h1;
    cache->rstd_final = rstd1;
  }
  // What follows the hidden states (an lm_head: a tied one is the embedding, copied last) reads
  // weights: the stream waits for every group (by now normally long arrived).
  if (arrival_) arrival_->wait_all(stream());
  return h1;
}

void Transformer::backward_hidden_cuda(const ForwardCache& cache, const Tensor& dhidden,
                                       ModelWeights& grads, const GradsReadyHook& on_ready) const {
  // on_ready runs right after a group's kernels are queued on the current stream (GradsReady).
  auto ready = [&](GradsReady::Part part, int layer) {
    if (on_ready) on_ready(GradsReady{part, layer});
  };
  const ModelConfig& c = config_;
  const DType dt = dtype();
  OPD_CHECK(cache.device_batch != nullptr, InvalidArgument,
            "transformer backward (CUDA) needs the cache of a CUDA forward");
  const CudaBatchPlan& plan = *cache.device_batch;
  const int64_t T = plan.tokens, H = c.hidden_size;
  OPD_CHECK(dhidden.device() == Device::CUDA && dhidden.shape() == Shape({T, H}) &&
                (dhidden.dtype() == dt || dhidden.dtype() == DType::F32),
            InvalidArgument, "transformer backward (CUDA): dhidden must be [", T, ", ", H, "] in ",
            dtype_name(dt), " or f32 on CUDA, got ", dhidden.describe());
  check_grads(weights_, grads);
  Tensor dh = dhidden;
  if (dh.dtype() != dt) {  // the fused loss's f32 d_hidden: one rounding to the model dtype
    dh = empty_dev({T, H}, dt);
    ops::convert(dhidden, dh);
  }
  Tensor dx = empty_dev({T, H}, dt);
  ops::rmsnorm_backward(dh, cache.x_final, weights_.final_norm, cache.rstd_final, dx,
                        grads.final_norm);
  ready(GradsReady::Part::FinalNorm, -1);
  dh = Tensor();
  for (size_t li = weights_.layers.size(); li-- > 0;) {
    LayerRun run{c, weights_.layers[li], plan, inv_freq_};
    const LayerCache& saved = cache.layers[li];
    LayerCache recomputed;
    if (!saved.h1.defined() && saved.gate.defined()) {
      run.restore_elementwise(saved, recomputed);  // Recompute::Elementwise
    } else if (!saved.h1.defined()) {
      OPD_CHECK(saved.x.defined(), InvalidArgument,
                "backward: the forward cache has no input for layer ", li);
      run.forward(saved.x, Tensor(), Tensor(), recomputed);  // m is dropped at once
    }
    run.backward(recomputed.h1.defined() ? recomputed : saved, dx, grads.layers[li]);
    ready(GradsReady::Part::Layer, static_cast<int>(li));
  }
  cuda::embedding_backward(plan.ids.data<int32_t>(), dx.raw(), T, c.vocab_size, H, dt,
                           grads.embed_tokens.data<float>(), stream());
  ready(GradsReady::Part::Embedding, -1);
}

#else  // builds without CUDA: no CUDA tensor can exist, so these are never reached

struct CudaBatchPlan {};

Tensor Transformer::forward_hidden_cuda(const Batch&, ForwardCache*) const {
  OPD_FAIL(Unsupported, "transformer on CUDA: this build has no CUDA backend");
}
void Transformer::backward_hidden_cuda(const ForwardCache&, const Tensor&, ModelWeights&,
                                       const GradsReadyHook&) const {
  OPD_FAIL(Unsupported, "transformer on CUDA: this build has no CUDA backend");
}

#endif

}  // namespace opd
