// PagedForward::step_hidden (contract in model/paged_forward.h): one incremental step that
// returns the final normed hidden states h = final_norm(x_L) [T, H] of every new token instead of
// the last rows' logits, for the teacher scorer's shared-prompt path (a prompt's K/V computed
// once, its completions run over it). The layer math is PagedForward::step's (paged_forward.cpp,
// which mirrors Transformer::forward); it is a separate function so the generation step stays
// untouched. CPU: the same op sequence; CUDA: step_device over a workspace sized to the step,
// then the workspace's final-norm rows (step_device leaves final_norm(x) of all T rows in ws.h
// before its lm_head; the B-row lm_head it also runs is B x H x V, negligible next to the step).
#include <cmath>

#include "kernels/ops.h"
#include "model/paged_forward.h"

#ifdef OPD_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/allocator.h"  // current_stream, DeviceBuffer
#include "core/cuda/stream.h"     // OPD_CUDA_CHECK
#endif

namespace opd {

Tensor PagedForward::step_hidden(const PagedStep& s, KvCache& cache) const {
  const ModelConfig& c = model_->config();
  const ModelWeights& W = model_->weights();
  const int64_t T = s.num_tokens();
  const int64_t H = c.hidden_size, D = c.head_dim;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const double eps = c.rms_norm_eps, scale = 1.0 / std::sqrt(static_cast<double>(D));
  OPD_CHECK(s.num_sequences() >= 1, InvalidArgument, "PagedForward::step_hidden: empty step");
  OPD_CHECK(cache.num_layers() == c.num_hidden_layers, InvalidArgument,
            "PagedForward::step_hidden: cache has ", cache.num_layers(), " layers, model ",
            c.num_hidden_layers);
  const PagedStepPlan plan = plan_paged_step(s, c.vocab_size, cache);
#ifdef OPD_WITH_CUDA
  if (model_->device() == Device::CUDA) return step_hidden_cuda(s, plan, cache);
#endif
  const int64_t B = plan.batch;
  const Tensor& emb = W.embed_tokens;
  const Device dev = emb.device();
  auto idx = [&](const std::vector<int32_t>& v, const Shape& shape) {
    return Tensor::from_vector(v, shape).to(dev);
  };
  const Tensor ids_t = idx(s.ids, {T}), pos_t = idx(plan.positions, {T});
  const Tensor slot_t = idx(plan.slots, {T}), cu_t = idx(s.cu_seqlens, {B + 1});
  const Tensor lens_t = idx(plan.seq_lens, {B}), tables_t = idx(plan.tables, {B, plan.width});
  auto empty = [&](const Shape& shape) { return Tensor::empty(shape, emb.dtype(), dev); };
  const Tensor none;

  Tensor x = empty({T, H});
  ops::embedding_forward(ids_t, emb, x);
  for (size_t li = 0; li < W.layers.size(); ++li) {
    const LayerWeights& L = W.layers[li];
    const int64_t l = static_cast<int64_t>(li);
    Tensor h1 = empty({T, H}), rstd = empty({T});
    ops::rmsnorm_forward(x, L.input_norm, eps, h1, rstd);
    Tensor q = empty({T, Hq * D}), k = empty({T, Hkv * D}), v = empty({T, Hkv * D});
    ops::linear_forward(h1, L.q_proj, L.q_bias, q);
    ops::linear_forward(h1, L.k_proj, L.k_bias, k);
    ops::linear_forward(h1, L.v_proj, L.v_bias, v);
    if (c.qk_norm) {  // per-head RMSNorm of q and k (Qwen3), before RoPE
      Tensor qn = empty({T, Hq * D}), kn = empty({T, Hkv * D});
      Tensor rq = empty({T * Hq}), rk = empty({T * Hkv});
      Tensor qn_v = qn.reshape({T * Hq, D}), kn_v = kn.reshape({T * Hkv, D});
      ops::rmsnorm_forward(q.reshape({T * Hq, D}), L.q_norm, eps, qn_v, rq);
      ops::rmsnorm_forward(k.reshape({T * Hkv, D}), L.k_norm, eps, kn_v, rk);
      q = qn;
      k = kn;
    }
    Tensor q3 = q.reshape({T, Hq, D}), k3 = k.reshape({T, Hkv, D}), v3 = v.reshape({T, Hkv, D});
    ops::rope_forward(q3, pos_t, inv_freq_);
    ops::rope_forward(k3, pos_t, inv_freq_);
    ops::kv_cache_store(k3, v3, slot_t, cache.k(l), cache.v(l));
    Tensor attn = empty({T, Hq, D});
    ops::paged_attention(q3, cache.k(l), cache.v(l), cu_t, lens_t, tables_t, scale, attn);
    Tensor o = empty({T, H});
    ops::linear_forward(attn.reshape({T, Hq * D}), L.o_proj, L.o_bias, o);
    Tensor x2 = empty({T, H});
    ops::add(x, o, x2);
    Tensor h2 = empty({T, H}), rstd2 = empty({T});
    ops::rmsnorm_forward(x2, L.post_norm, eps, h2, rstd2);
    const int64_t I = c.intermediate_size;
    Tensor gate = empty({T, I}), up = empty({T, I}), act = empty({T, I});
    ops::linear_forward(h2, L.gate_proj, none, gate);
    ops::linear_forward(h2, L.up_proj, none, up);
    ops::swiglu_forward(gate, up, act);
    Tensor m = empty({T, H});
    ops::linear_forward(act, L.down_proj, none, m);
    Tensor x_next = empty({T, H});
    ops::add(x2, m, x_next);
    x = x_next;
  }
  Tensor h = empty({T, H}), rstd = empty({T});
  ops::rmsnorm_forward(x, W.final_norm, eps, h, rstd);
  return h;
}

#ifdef OPD_WITH_CUDA
Tensor PagedForward::step_hidden_cuda(const PagedStep& s, const PagedStepPlan& p,
                                      KvCache& cache) const {
  const int64_t B = p.batch, T = p.tokens;
  const ModelConfig& c = model_->config();
  const int64_t H = c.hidden_size, V = c.vocab_size;
  const DType dt = model_->dtype();
  // One upload, the layout of step_cuda: ids, positions, slots, cu_seqlens, seq_lens, last rows,
  // tables, then the error flag.
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
  PagedWorkspace ws(c, dt, T);
  Tensor logits = Tensor::empty({B, V}, DType::F32, Device::CUDA);
  step_device(ds, cache, ws, logits.data<float>(), stream);
  // ws.h is final_norm(x) of all T rows (the rows step_device's lm_head reads from).
  Tensor hidden = Tensor::empty({T, H}, dt, Device::CUDA);
  OPD_CUDA_CHECK(cudaMemcpyAsync(hidden.raw(), ws.h.raw(),
                                 static_cast<size_t>(T * H) * dtype_size(dt),
                                 cudaMemcpyDeviceToDevice, stream));
  unsigned flag = 0;
  OPD_CUDA_CHECK(cudaMemcpyAsync(&flag, ds.error_flag, sizeof(flag), cudaMemcpyDeviceToHost, stream));
  OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
  OPD_CHECK(flag == 0xffffffffu, Internal, "PagedForward::step_hidden: the paged kernels rejected "
            "row or sequence ", flag, " although the host validated every index");
  return hidden;
}
#endif

}  // namespace opd
