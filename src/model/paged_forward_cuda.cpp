// The incremental forward of model/paged_forward.h on CUDA: the same layer sequence as
// PagedForward::step's CPU composition (formulas in model/transformer.h), written on the
// raw-pointer kernels of kernels/cuda/cuda_ops.h over fixed workspace buffers, so that a step
// issues no host synchronization and no allocation and can be captured in a CUDA graph.
//
// What differs from the CPU composition, and why:
// - Indices are validated once per step on the host (plan_paged_step) and uploaded in one copy;
//   the Tensor-level paged ops would read device index tensors back in every layer (two host
//   syncs per layer). The kernels still guard every index and report through an error flag.
// - Each residual add is fused with the RMSNorm that follows it (as transformer_cuda.cpp):
//   x2 = x + o with h2 = norm(x2), x_next = x2 + m with the next layer's input norm (or the
//   final norm), so the logits of a row equal the full CUDA forward's up to kernel shapes.
// - The final norm runs over all T rows (fused with the last residual add) and the B last rows
//   are gathered after it (the CPU gathers before the norm: the same per-row values).
// - With set_pdl (decode steps), opd's kernels that follow a kernel (the norms, q/k norm + RoPE +
//   store, the decode attention, SwiGLU) are launched with programmatic dependent launch
//   (kernels/cuda/pdl.cuh): their independent prologue overlaps the predecessor's tail; results
//   are bit-identical (tests/cuda/test_cuda_rollout.cpp).
#include "model/paged_forward.h"

#ifdef OPD_WITH_CUDA
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>

#include "core/cuda/allocator.h"    // current_stream, DeviceBuffer
#include "core/cuda/stream.h"       // OPD_CUDA_CHECK
#include "kernels/cuda/cuda_ops.h"  // raw kernels: embedding, rmsnorm, rope, paged ops, rows
#include "kernels/cuda/decode_linear.h"
#include "kernels/cuda/gemm.h"      // linear_forward (cuBLASLt)

namespace opd {

// Steps of at most this many tokens count as decode-shaped for GEMM tuning (a decode bucket).
constexpr int64_t kTunedRows = 256;

PagedWorkspace::PagedWorkspace(const ModelConfig& c, DType dt, int64_t max_tokens)
    : max_tokens_(std::max<int64_t>(1, max_tokens)) {
  const int64_t T = max_tokens_, H = c.hidden_size, D = c.head_dim, I = c.intermediate_size;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  auto e = [&](int64_t n, DType t) { return Tensor::empty({n}, t, Device::CUDA); };
  x = e(T * H, dt);
  x2 = e(T * H, dt);
  h = e(T * H, dt);
  o = e(T * H, dt);
  last = e(T * H, dt);
  q = e(T * Hq * D, dt);
  qn = e(T * Hq * D, dt);
  attn = e(T * Hq * D, dt);
  k = e(T * Hkv * D, dt);
  kn = e(T * Hkv * D, dt);
  v = e(T * Hkv * D, dt);
  gate = e(T * I, dt);
  up = e(T * I, dt);
  act = e(T * I, dt);
  qkv = e(T * (Hq + 2 * Hkv) * D, dt);
  gu = e(T * 2 * I, dt);
  rstd = e(T, DType::F32);
  rstd_q = e(T * Hq, DType::F32);
  rstd_k = e(T * Hkv, DType::F32);
}

void* PagedWorkspace::split_workspace(size_t bytes) {
  if (bytes == 0) return nullptr;
  if (!split.defined() || split.nbytes() < bytes) {
    // Grow with headroom so that a few larger steps do not each move it.
    const size_t grown = bytes + bytes / 2;
    split = Tensor::empty({static_cast<int64_t>((grown + 7) / 8)}, DType::I64, Device::CUDA);
    ++generation_;
  }
  return split.raw();
}

namespace {

// True when the tensors lie back to back in this order (their concatenation needs no copy).
bool contiguous(std::initializer_list<const Tensor*> parts) {
  const char* at = nullptr;
  for (const Tensor* p : parts) {
    if (at && static_cast<const char*>(p->raw()) != at) return false;
    at = static_cast<const char*>(p->raw()) + p->nbytes();
  }
  return true;
}

// Row-concatenation of [out_i, in] matrices (and [out_i] biases) = byte concatenation.
int64_t copy_parts(Tensor& out, std::initializer_list<const Tensor*> parts, cudaStream_t stream) {
  size_t at = 0;
  for (const Tensor* p : parts) {
    OPD_CHECK(p->dtype() == out.dtype() && p->device() == Device::CUDA, Internal,
              "PagedForward: packing ", p->describe());
    OPD_CHECK(at + p->nbytes() <= out.nbytes(), Internal, "PagedForward: packing overflows");
    if (p->nbytes() > 0)
      OPD_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(out.raw()) + at, p->raw(), p->nbytes(),
                                     cudaMemcpyDeviceToDevice, stream));
    at += p->nbytes();
  }
  OPD_CHECK(at == out.nbytes(), Internal, "PagedForward: packed ", at, " of ", out.nbytes(), " bytes");
  return static_cast<int64_t>(at);
}

}  // namespace

void PagedForward::pack_weights() {
  const ModelConfig& c = model_->config();
  const ModelWeights& W = model_->weights();
  const DType dt = model_->dtype();
  cudaStream_t stream = cuda::current_stream();
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.intermediate_size;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, R = (Hq + 2 * Hkv) * D;
  for (const LayerWeights& L : W.layers) {
    if (contiguous({&L.q_proj, &L.k_proj, &L.v_proj})) {
      qkv_w_.push_back(Tensor());
      qkv_ptr_.push_back(L.q_proj.raw());
    } else {
      qkv_w_.push_back(Tensor::empty({R, H}, dt, Device::CUDA));
      copy_parts(qkv_w_.back(), {&L.q_proj, &L.k_proj, &L.v_proj}, stream);
      qkv_ptr_.push_back(qkv_w_.back().raw());
    }
    if (L.q_bias.defined() || L.k_bias.defined() || L.v_bias.defined()) {
      // A missing bias among present ones is zeros (the GEMM epilogue adds one vector).
      Tensor zq = Tensor::zeros({Hq * D}, dt, Device::CUDA), zk = Tensor::zeros({Hkv * D}, dt, Device::CUDA);
      const Tensor& bq = L.q_bias.defined() ? L.q_bias : zq;
      const Tensor& bk = L.k_bias.defined() ? L.k_bias : zk;
      const Tensor& bv = L.v_bias.defined() ? L.v_bias : zk;
      qkv_b_.push_back(Tensor::empty({R}, dt, Device::CUDA));
      copy_parts(qkv_b_.back(), {&bq, &bk, &bv}, stream);
    } else {
      qkv_b_.push_back(Tensor());
    }
    if (contiguous({&L.gate_proj, &L.up_proj})) {
      gu_w_.push_back(Tensor());
      gu_ptr_.push_back(L.gate_proj.raw());
    } else {
      gu_w_.push_back(Tensor::empty({2 * I, H}, dt, Device::CUDA));
      copy_parts(gu_w_.back(), {&L.gate_proj, &L.up_proj}, stream);
      gu_ptr_.push_back(gu_w_.back().raw());
    }
  }
  fused_ = true;
}

int64_t PagedForward::refresh_packed(cudaStream_t stream) {
  if (!fused_) return 0;
  const ModelConfig& c = model_->config();
  const ModelWeights& W = model_->weights();
  const DType dt = model_->dtype();
  int64_t bytes = 0;
  for (size_t li = 0; li < W.layers.size(); ++li) {
    const LayerWeights& L = W.layers[li];
    if (qkv_w_[li].defined()) bytes += copy_parts(qkv_w_[li], {&L.q_proj, &L.k_proj, &L.v_proj}, stream);
    if (qkv_b_[li].defined()) {
      // Zeros for missing biases are constant: copy only the present ones, at their offsets.
      const int64_t qb = c.num_attention_heads * c.head_dim * dtype_size(dt);
      const int64_t kb = c.num_key_value_heads * c.head_dim * dtype_size(dt);
      char* out = static_cast<char*>(qkv_b_[li].raw());
      const std::pair<const Tensor*, int64_t> parts[] = {{&L.q_bias, 0}, {&L.k_bias, qb}, {&L.v_bias, qb + kb}};
      for (const auto& [t, off] : parts) {
        if (!t->defined() || t->nbytes() == 0) continue;
        OPD_CUDA_CHECK(cudaMemcpyAsync(out + off, t->raw(), t->nbytes(), cudaMemcpyDeviceToDevice, stream));
        bytes += static_cast<int64_t>(t->nbytes());
      }
    }
    if (gu_w_[li].defined()) bytes += copy_parts(gu_w_[li], {&L.gate_proj, &L.up_proj}, stream);
  }
  return bytes;
}

std::vector<const void*> PagedForward::weight_addresses() const {
  std::vector<const void*> out;
  const ModelWeights& W = model_->weights();
  W.for_each([&](const std::string&, const Tensor& t) {
    out.push_back(t.defined() ? t.raw() : nullptr);
  });
  out.push_back(W.lm_head.defined() ? W.lm_head.raw() : nullptr);
  for (const void* p : qkv_ptr_) out.push_back(p);
  for (const void* p : gu_ptr_) out.push_back(p);
  for (const Tensor& b : qkv_b_) out.push_back(b.defined() ? b.raw() : nullptr);
  out.push_back(inv_freq_device_.defined() ? inv_freq_device_.raw() : nullptr);
  return out;
}

void PagedForward::step_device(const PagedDeviceStep& s, KvCache& cache, PagedWorkspace& ws,
                               float* logits, cudaStream_t stream) const {
  const ModelConfig& c = model_->config();
  const ModelWeights& W = model_->weights();
  const int64_t T = s.tokens, B = s.batch, H = c.hidden_size, D = c.head_dim;
  const int64_t I = c.intermediate_size, V = c.vocab_size;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const double eps = c.rms_norm_eps, scale = c.attention_scale();  // 1/sqrt(D), x attention_factor^2 for YaRN
  const DType dt = model_->dtype();
  OPD_CHECK(model_->device() == Device::CUDA && (dt == DType::BF16 || dt == DType::F32),
            Unsupported, "PagedForward::step_device: the model must be bf16 or f32 on CUDA");
  OPD_CHECK(T >= 1 && B >= 1 && T <= ws.max_tokens() && (s.last_rows || T == B), InvalidArgument,
            "PagedForward::step_device: ", T, " tokens, ", B, " sequences, workspace for ",
            ws.max_tokens(), " tokens");
  OPD_CHECK(cache.num_layers() == c.num_hidden_layers && cache.num_layers() >= 1 &&
                cache.k(0).dtype() == dt && cache.k(0).device() == Device::CUDA,
            InvalidArgument, "PagedForward::step_device: the cache must hold ",
            c.num_hidden_layers, " layers of ", dtype_name(dt), " on the device");
  OPD_CHECK(s.fresh_batch == 0 ||
                (s.fresh_batch <= B && s.fresh_row0 < T && s.fresh_plan != nullptr &&
                 s.fresh_plan->batch() == s.fresh_batch &&
                 s.fresh_plan->total_rows() == T - s.fresh_row0),
            InvalidArgument, "PagedForward::step_device: a fresh tail of ", s.fresh_batch,
            " sequences from row ", s.fresh_row0, " does not fit the step (", B, " sequences, ", T,
            " tokens) or its plan");
  OPD_CHECK(s.fresh_batch == 0 ||
                (s.fresh_kv_rows == 0
                     ? !s.fresh_plan->has_context()
                     : (s.fresh_plan->has_context() &&
                        s.fresh_plan->total_k_rows() == s.fresh_kv_rows &&
                        s.fresh_kv_slots != nullptr && s.fresh_k != nullptr && s.fresh_v != nullptr)),
            InvalidArgument, "PagedForward::step_device: the fresh tail's plan and its ",
            s.fresh_kv_rows, " gathered key rows do not match");
  const int64_t num_blocks = cache.num_blocks(), bs = cache.block_size();
  const float* inv_freq = inv_freq_device_.data<float>();
  const bool tune = tuned_gemm_ && T <= kTunedRows;  // decode-shaped GEMMs (gemm.h GemmArgs::tune)
  // Programmatic dependent launch of opd's kernels that follow a kernel (pdl.cuh): decode-sized
  // steps only (prefill steps are long enough that the gaps do not matter, and run the general
  // attention kernel, which is never launched early).
  const bool pdl = pdl_ && s.max_q_len <= 1;
  // set_skip_stages (measurement only): decode steps leave these kernels out.
  const unsigned skipped = s.max_q_len <= 1 ? skip_stages_ : 0u;
  auto skip = [&](unsigned stage) { return (skipped & stage) != 0; };
  // y [rows, n] = in [rows, k] W [n, k]^T (+ bias): opd's decode linear for decode-sized bf16
  // steps when switched on (set_decode_linear; it streams W under the PDL wait), else cuBLASLt.
  // (Three earlier decode GEMMs of opd were slower than cuBLASLt: docs/rollout.md.)
  auto linear = [&](unsigned which, const void* in, const void* w, const void* b, int64_t rows,
                    int64_t k, int64_t n, DType out_dt, void* out, bool tuned) {
    if ((decode_linear_ & which) != 0 && out_dt == dt &&
        cuda::try_decode_linear(in, w, b, rows, k, n, dt, out, stream, pdl))
      return;
    cuda::linear_forward(in, w, b, rows, k, n, dt, out_dt, out, stream, tuned);
  };
  void* x = ws.x.raw();
  void* x2 = ws.x2.raw();
  void* h = ws.h.raw();

  cuda::embedding_forward(s.ids, W.embed_tokens.raw(), T, V, H, dt, x, stream);
  if (W.layers.empty()) {
    cuda::rmsnorm_forward(x, W.final_norm.raw(), eps, T, H, dt, h, ws.rstd.data<float>(), stream,
                          pdl);
  } else {
    cuda::rmsnorm_forward(x, W.layers[0].input_norm.raw(), eps, T, H, dt, h,
                          ws.rstd.data<float>(), stream, pdl);
  }
  auto bias = [](const Tensor& b) -> const void* { return b.defined() ? b.raw() : nullptr; };
  // Attention of this step's queries q [T, Hq, D] over layer li's cache -> ws.attn. The fresh
  // tail (s.fresh_batch > 0) reads its keys/values as contiguous rows: k_rows/v_rows [T, Hkv D]
  // when the caller has them (the unfused path), else gathered from the cache by slot.
  const size_t es = dtype_size(dt);
  auto attend = [&](size_t li, const void* q, const void* k_rows, const void* v_rows) {
    const int64_t paged_batch = B - s.fresh_batch, paged_rows = s.fresh_batch ? s.fresh_row0 : T;
    if (s.fresh_batch > 0) {
      const int64_t r0 = s.fresh_row0, n = T - r0, kvw = Hkv * D;
      const char* kf = static_cast<const char*>(k_rows);
      const char* vf = static_cast<const char*>(v_rows);
      if (s.fresh_kv_rows > 0) {  // context tail: context + new rows of each sequence, by slot
        // After this layer's K/V store (both paths store before attending), so the new rows
        // are in the cache too; slots were computed from validated tables.
        const int64_t num_slots = num_blocks * bs;
        cuda::gather_rows(cache.k(static_cast<int64_t>(li)).raw(), dt, num_slots,
                          s.fresh_kv_slots, s.fresh_kv_rows, kvw, s.fresh_k, dt, stream);
        cuda::gather_rows(cache.v(static_cast<int64_t>(li)).raw(), dt, num_slots,
                          s.fresh_kv_slots, s.fresh_kv_rows, kvw, s.fresh_v, dt, stream);
        kf = static_cast<const char*>(s.fresh_k);
        vf = static_cast<const char*>(s.fresh_v);
      } else if (kf) {
        kf += r0 * kvw * es;
        vf += r0 * kvw * es;
      } else {  // k(li), v(li) are [num_blocks * bs, Hkv D] rows; slots were validated
        const int64_t num_slots = num_blocks * bs;
        cuda::gather_rows(cache.k(static_cast<int64_t>(li)).raw(), dt, num_slots, s.slots + r0, n,
                          kvw, ws.k.raw(), dt, stream);
        cuda::gather_rows(cache.v(static_cast<int64_t>(li)).raw(), dt, num_slots, s.slots + r0, n,
                          kvw, ws.v.raw(), dt, stream);
        kf = static_cast<const char*>(ws.k.raw());
        vf = static_cast<const char*>(ws.v.raw());
      }
      cuda::attention_forward(*s.fresh_plan, static_cast<const char*>(q) + r0 * Hq * D * es, kf,
                              vf, Hq, Hkv, D, scale, dt,
                              static_cast<char*>(ws.attn.raw()) + r0 * Hq * D * es,
                              ws.rstd_q.data<float>(), stream);  // lse: scratch, unused
    }
    if (paged_batch == 0) return;
    cuda::PagedAttentionArgs a;
    a.q = q;
    a.k_cache = cache.k(static_cast<int64_t>(li)).raw();
    a.v_cache = cache.v(static_cast<int64_t>(li)).raw();
    a.out = ws.attn.raw();
    a.cu_seqlens_q = s.cu_seqlens;
    a.seq_lens = s.seq_lens;
    a.block_tables = s.block_tables;
    a.batch = paged_batch;
    a.total_q = paged_rows;
    a.hq = Hq;
    a.hkv = Hkv;
    a.head_dim = D;
    a.num_blocks = num_blocks;
    a.block_size = bs;
    a.max_blocks = s.width;
    a.max_q_len = s.fresh_batch ? s.paged_max_q_len : s.max_q_len;
    a.max_seq_len = s.max_seq_len;
    a.scale = scale;
    a.dtype = dt;
    a.error_flag = s.error_flag;
    a.pdl = pdl;
    a.skip_combine = skip(PagedForward::kStageCombine);  // measurement only
    const cuda::PagedAttentionLaunch launch = cuda::paged_attention_launch(a);
    cuda::paged_attention(a, ws.split_workspace(launch.workspace_bytes), stream);
  };

  for (size_t li = 0; li < W.layers.size(); ++li) {
    const LayerWeights& L = W.layers[li];
    if (fused_) {  // 10 kernels per layer (decode_fused.cu)
      const int64_t R = (Hq + 2 * Hkv) * D;
      if (!skip(PagedForward::kStageQkv))
        linear(kDecodeLinearQkv, h, qkv_ptr_[li], bias(qkv_b_[li]), T, H, R, dt, ws.qkv.raw(), tune);
      cuda::QkvNormRopeStoreArgs f;
      f.set_packed_qkv(ws.qkv.raw(), Hq, Hkv, D, dt);
      f.q_norm = c.qk_norm ? L.q_norm.raw() : nullptr;
      f.k_norm = c.qk_norm ? L.k_norm.raw() : nullptr;
      f.eps = static_cast<float>(eps);
      f.positions = s.positions;
      f.inv_freq = inv_freq;
      f.slot_mapping = s.slots;
      f.n = T;
      f.hq = Hq;
      f.hkv = Hkv;
      f.head_dim = D;
      f.num_slots = num_blocks * bs;
      f.dtype = dt;
      f.q_out = ws.qn.raw();
      f.k_cache = cache.k(static_cast<int64_t>(li)).raw();
      f.v_cache = cache.v(static_cast<int64_t>(li)).raw();
      f.error_flag = s.error_flag;
      f.pdl = pdl;
      if (!skip(PagedForward::kStageRope)) cuda::qkv_norm_rope_store(f, stream);
      if (!skip(PagedForward::kStageAttention)) attend(li, ws.qn.raw(), nullptr, nullptr);
      if (!skip(PagedForward::kStageO))
        linear(kDecodeLinearO, ws.attn.raw(), L.o_proj.raw(), bias(L.o_bias), T, Hq * D, H, dt,
             ws.o.raw(), tune);
      if (!skip(PagedForward::kStagePostNorm))
        cuda::rmsnorm_residual_forward(x, ws.o.raw(), L.post_norm.raw(), eps, T, H, dt, x2, h,
                                       ws.rstd.data<float>(), stream, pdl);
      if (!skip(PagedForward::kStageGateUp))
        linear(kDecodeLinearGateUp, h, gu_ptr_[li], nullptr, T, H, 2 * I, dt, ws.gu.raw(), tune);
      if (!skip(PagedForward::kStageSwiglu))
        cuda::swiglu_packed_forward(ws.gu.raw(), T, I, dt, ws.act.raw(), stream, pdl);
      if (!skip(PagedForward::kStageDown))
        linear(kDecodeLinearDown, ws.act.raw(), L.down_proj.raw(), nullptr, T, I, H, dt, ws.o.raw(),
             tune);
      const Tensor& nw = li + 1 < W.layers.size() ? W.layers[li + 1].input_norm : W.final_norm;
      if (!skip(PagedForward::kStageNextNorm))
        cuda::rmsnorm_residual_forward(x2, ws.o.raw(), nw.raw(), eps, T, H, dt, x, h,
                                       ws.rstd.data<float>(), stream, pdl);
      continue;
    }
    cuda::linear_forward(h, L.q_proj.raw(), bias(L.q_bias), T, H, Hq * D, dt, dt, ws.q.raw(), stream);
    cuda::linear_forward(h, L.k_proj.raw(), bias(L.k_bias), T, H, Hkv * D, dt, dt, ws.k.raw(), stream);
    cuda::linear_forward(h, L.v_proj.raw(), bias(L.v_bias), T, H, Hkv * D, dt, dt, ws.v.raw(), stream);
    void* q = ws.q.raw();
    void* k = ws.k.raw();
    if (c.qk_norm) {  // per-head RMSNorm (Qwen3), before RoPE
      cuda::rmsnorm_forward(q, L.q_norm.raw(), eps, T * Hq, D, dt, ws.qn.raw(),
                            ws.rstd_q.data<float>(), stream);
      cuda::rmsnorm_forward(k, L.k_norm.raw(), eps, T * Hkv, D, dt, ws.kn.raw(),
                            ws.rstd_k.data<float>(), stream);
      q = ws.qn.raw();
      k = ws.kn.raw();
    }
    cuda::rope(q, s.positions, inv_freq, T, Hq, D, dt, false, stream);
    cuda::rope(k, s.positions, inv_freq, T, Hkv, D, dt, false, stream);

    cuda::PagedStoreArgs st;
    st.k = k;
    st.v = ws.v.raw();
    st.slot_mapping = s.slots;
    st.n = T;
    st.num_blocks = num_blocks;
    st.block_size = bs;
    st.hkv = Hkv;
    st.head_dim = D;
    st.dtype = dt;
    st.k_cache = cache.k(static_cast<int64_t>(li)).raw();
    st.v_cache = cache.v(static_cast<int64_t>(li)).raw();
    st.error_flag = s.error_flag;
    cuda::kv_cache_store(st, stream);

    attend(li, q, k, ws.v.raw());

    cuda::linear_forward(ws.attn.raw(), L.o_proj.raw(), bias(L.o_bias), T, Hq * D, H, dt, dt,
                         ws.o.raw(), stream);
    // x2 = x + o, h = post_norm(x2)
    cuda::rmsnorm_residual_forward(x, ws.o.raw(), L.post_norm.raw(), eps, T, H, dt, x2, h,
                                   ws.rstd.data<float>(), stream, pdl);
    cuda::linear_forward(h, L.gate_proj.raw(), nullptr, T, H, I, dt, dt, ws.gate.raw(), stream);
    cuda::linear_forward(h, L.up_proj.raw(), nullptr, T, H, I, dt, dt, ws.up.raw(), stream);
    cuda::swiglu_forward(ws.gate.raw(), ws.up.raw(), T * I, dt, ws.act.raw(), stream);
    cuda::linear_forward(ws.act.raw(), L.down_proj.raw(), nullptr, T, I, H, dt, dt, ws.o.raw(),
                         stream);
    // x = x2 + m, h = the next layer's input norm (or the final norm) of it.
    const Tensor& next_w = li + 1 < W.layers.size() ? W.layers[li + 1].input_norm : W.final_norm;
    cuda::rmsnorm_residual_forward(x2, ws.o.raw(), next_w.raw(), eps, T, H, dt, x, h,
                                   ws.rstd.data<float>(), stream, pdl);
  }
  const void* rows = h;
  if (s.last_rows) {  // only each sequence's last new row needs logits
    cuda::gather_rows(h, dt, T, s.last_rows, B, H, ws.last.raw(), dt, stream);
    rows = ws.last.raw();
  }
  // The lm_head at W1 runs at ~3.7 TB/s on cuBLASLt (docs/rollout.md).
  cuda::linear_forward(rows, W.lm_head.raw(), nullptr, B, H, V, dt, DType::F32, logits, stream,
                       tuned_gemm_ && B <= kTunedRows);
}

FreshPrefill::FreshPrefill() = default;
FreshPrefill::FreshPrefill(FreshPrefill&&) noexcept = default;
FreshPrefill& FreshPrefill::operator=(FreshPrefill&&) noexcept = default;
FreshPrefill::~FreshPrefill() = default;

void FreshPrefill::apply(PagedDeviceStep& s) const {
  s.fresh_batch = batch;
  s.fresh_row0 = row0;
  s.paged_max_q_len = paged_max_q_len;
  s.fresh_plan = plan.get();
  s.fresh_kv_rows = kv_rows;
  s.fresh_kv_slots = kv_slots;
  s.fresh_k = k;
  s.fresh_v = v;
}

FreshPrefill PagedForward::plan_fresh_prefill(const int32_t* cu_seqlens, const int32_t* seq_lens,
                                              int64_t batch, cudaStream_t stream,
                                              const int32_t* tables, int64_t width,
                                              int64_t block_size) const {
  FreshPrefill f;
  const ModelConfig& c = model_->config();
  if (!fresh_prefill_ || batch <= 0 || !cuda::attention_has_fast_path(model_->dtype(), c.head_dim))
    return f;
  // The trailing run of sequences whose new rows are the whole sequence (context 0). The
  // scheduler appends admitted prompts after the running sequences, so that is where they are.
  // With context prefill, chunks of >= kContextPrefillMinRows rows over cached context join it
  // (the scheduler places continuing prompt chunks among the prefill sequences after decodes).
  const bool with_context = context_prefill_ && tables != nullptr && width >= 1 && block_size >= 1;
  auto joins = [&](int64_t b) {
    const int64_t len_q = cu_seqlens[b + 1] - cu_seqlens[b];
    return seq_lens[b] == len_q || (with_context && len_q >= kContextPrefillMinRows);
  };
  int64_t first = batch;
  while (first > 0 && joins(first - 1)) --first;
  if (first == batch) return f;
  f.batch = batch - first;
  f.row0 = cu_seqlens[first];
  for (int64_t b = 0; b < first; ++b)
    f.paged_max_q_len = std::max<int64_t>(f.paged_max_q_len, cu_seqlens[b + 1] - cu_seqlens[b]);
  std::vector<int32_t> cu(static_cast<size_t>(f.batch + 1)), cu_k(static_cast<size_t>(f.batch + 1));
  bool any_context = false;
  for (int64_t b = 0; b <= f.batch; ++b) {
    cu[static_cast<size_t>(b)] = cu_seqlens[first + b] - cu_seqlens[first];
    if (b < f.batch) {
      cu_k[static_cast<size_t>(b + 1)] = cu_k[static_cast<size_t>(b)] + seq_lens[first + b];
      any_context = any_context || seq_lens[first + b] != cu_seqlens[first + b + 1] - cu_seqlens[first + b];
    }
  }
  if (!any_context) {  // fresh prompts only: the square plan, keys = the new rows
    f.plan = std::make_unique<cuda::AttentionPlan>(cu.data(), f.batch, cu.back(), stream);
    return f;
  }
  f.plan = std::make_unique<cuda::AttentionPlan>(cu.data(), cu_k.data(), f.batch, cu.back(),
                                                 cu_k.back(), stream);
  // Key slots of every tail sequence's positions 0 .. seq_len - 1 (its table covers them:
  // plan_paged_step checked it, and every block in it against the cache).
  f.kv_rows = cu_k.back();
  std::vector<int32_t> slots(static_cast<size_t>(f.kv_rows));
  for (int64_t b = 0; b < f.batch; ++b) {
    const int32_t* table = tables + (first + b) * width;
    for (int64_t pos = 0; pos < seq_lens[first + b]; ++pos) {
      slots[static_cast<size_t>(cu_k[static_cast<size_t>(b)] + pos)] =
          static_cast<int32_t>(table[pos / block_size] * block_size + pos % block_size);
    }
  }
  const ModelConfig& mc = model_->config();
  const size_t row_bytes = static_cast<size_t>(mc.num_key_value_heads * mc.head_dim) *
                           dtype_size(model_->dtype());
  auto round_up = [](size_t x) { return (x + 255) / 256 * 256; };  // 16-byte cp.async rows
  const size_t slot_bytes = round_up(slots.size() * sizeof(int32_t));
  const size_t kv_bytes = round_up(static_cast<size_t>(f.kv_rows) * row_bytes);
  f.kv = std::make_unique<cuda::DeviceBuffer>(slot_bytes + 2 * kv_bytes, stream);
  char* base = static_cast<char*>(f.kv->get());
  OPD_CUDA_CHECK(cudaMemcpyAsync(base, slots.data(), slots.size() * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, stream));  // pageable: staged on return
  f.kv_slots = reinterpret_cast<const int32_t*>(base);
  f.k = base + slot_bytes;
  f.v = base + slot_bytes + kv_bytes;
  return f;
}

Tensor PagedForward::step_cuda(const PagedStep& s, const PagedStepPlan& p, KvCache& cache,
                               bool all_hidden) const {
  const int64_t B = p.batch, T = p.tokens, V = model_->config().vocab_size;
  // One upload: ids, positions, slots, cu_seqlens, seq_lens, last rows, tables, then the flag.
  std::vector<int32_t> host;
  auto put = [&](const std::vector<int32_t>& v) {
    const size_t at = host.size();
    host.insert(host.end(), v.begin(), v.end());
    return at;
  };
  const size_t o_ids = put(s.ids), o_pos = put(p.positions), o_slots = put(p.slots);
  const size_t o_cu = put(s.cu_seqlens), o_lens = put(p.seq_lens), o_last = put(p.last_rows);
  const size_t o_tables = put(p.tables);
  const size_t o_flag = host.size();
  host.push_back(-1);  // 0xffffffff: no error
  cudaStream_t stream = cuda::current_stream();
  cuda::DeviceBuffer buf(host.size() * sizeof(int32_t), stream);
  OPD_CUDA_CHECK(cudaMemcpyAsync(buf.get(), host.data(), host.size() * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, stream));
  const int32_t* d = buf.as<int32_t>();
  PagedDeviceStep ds;
  ds.batch = B;
  ds.tokens = T;
  ds.width = p.width;
  ds.max_q_len = p.max_q_len;
  ds.max_seq_len = p.max_seq_len;
  ds.ids = d + o_ids;
  ds.positions = d + o_pos;
  ds.slots = d + o_slots;
  ds.cu_seqlens = d + o_cu;
  ds.seq_lens = d + o_lens;
  ds.last_rows = d + o_last;
  ds.block_tables = d + o_tables;
  ds.error_flag = reinterpret_cast<unsigned*>(buf.as<int32_t>() + o_flag);
  const FreshPrefill fresh = plan_fresh_prefill(s.cu_seqlens.data(), p.seq_lens.data(), B, stream,
                                                p.tables.data(), p.width, cache.block_size());
  fresh.apply(ds);
  PagedWorkspace ws(model_->config(), model_->dtype(), T);
  Tensor logits = Tensor::empty({B, V}, DType::F32, Device::CUDA);
  step_device(ds, cache, ws, logits.data<float>(), stream);
  Tensor out = logits;
  if (all_hidden) {
    // ws.h holds final_norm(x) of all T rows (the rows step_device's lm_head gathers from).
    const int64_t H = model_->config().hidden_size;
    out = Tensor::empty({T, H}, model_->dtype(), Device::CUDA);
    OPD_CUDA_CHECK(cudaMemcpyAsync(out.raw(), ws.h.raw(), out.nbytes(), cudaMemcpyDeviceToDevice,
                                   stream));
  }
  unsigned flag = 0;
  OPD_CUDA_CHECK(cudaMemcpyAsync(&flag, ds.error_flag, sizeof(flag), cudaMemcpyDeviceToHost, stream));
  OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
  OPD_CHECK(flag == 0xffffffffu, Internal, "PagedForward::", all_hidden ? "step_hidden" : "step",
            ": the paged kernels rejected row or sequence ", flag,
            " although the host validated every index");
  return out;
}

}  // namespace opd

#endif  // OPD_WITH_CUDA
