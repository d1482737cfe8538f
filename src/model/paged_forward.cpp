// Incremental forward over a paged KV cache (contract in paged_forward.h). The layer sequence
// mirrors Transformer::forward line for line; only attention differs.
#include "model/paged_forward.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "kernels/ops.h"
#include "model/rope.h"

#ifdef OPD_WITH_CUDA
#include "core/cuda/allocator.h"  // current_stream
#endif

namespace opd {

void PagedStep::add(std::span<const int32_t> new_ids, int64_t context_len,
                    std::span<const int32_t> block_table) {
  OPD_CHECK(!new_ids.empty(), InvalidArgument, "PagedStep::add: sequence ", num_sequences(),
            " has no new token");
  OPD_CHECK(context_len >= 0 && context_len + static_cast<int64_t>(new_ids.size()) <= INT32_MAX,
            InvalidArgument, "PagedStep::add: sequence ", num_sequences(), " context length ",
            context_len, " is out of range");
  ids.insert(ids.end(), new_ids.begin(), new_ids.end());
  cu_seqlens.push_back(static_cast<int32_t>(ids.size()));
  context_lens.push_back(static_cast<int32_t>(context_len));
  block_tables.push_back(block_table);
}

PagedForward::PagedForward(const Transformer& model, bool fused)
    : model_(&model), inv_freq_(rope_inv_freq(model.config())) {
  if (model.device() == Device::CUDA) {
    inv_freq_device_ = inv_freq_.to(Device::CUDA);
#ifdef OPD_WITH_CUDA
    // Weights still being copied (WeightOffload::upload_layered): every step reads them all.
    model.wait_for_weights(cuda::current_stream());
    if (fused) pack_weights();
#endif
  }
  (void)fused;
}

PagedStepPlan plan_paged_step(const PagedStep& s, int64_t vocab, const KvCache& cache,
                              int64_t table_width) {
  const int64_t B = s.num_sequences(), T = s.num_tokens(), bs = cache.block_size();
  OPD_CHECK(B >= 1, InvalidArgument, "PagedForward::step: empty step");
  PagedStepPlan p;
  p.batch = B;
  p.tokens = T;
  p.positions.resize(static_cast<size_t>(T));
  p.slots.resize(static_cast<size_t>(T));
  p.seq_lens.resize(static_cast<size_t>(B));
  p.last_rows.resize(static_cast<size_t>(B));
  p.width = std::max<int64_t>(1, table_width);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t r0 = s.cu_seqlens[b], r1 = s.cu_seqlens[b + 1];
    const int64_t total = s.context_lens[b] + (r1 - r0);
    const auto& table = s.block_tables[b];
    OPD_CHECK(static_cast<int64_t>(table.size()) * bs >= total, InvalidArgument,
              "PagedForward::step: sequence ", b, " needs ", total, " cache slots but its block table has ",
              table.size(), " blocks of ", bs);
    // Every block the sequence reads (its context too), not only the ones written.
    for (int64_t i = 0; i < (total + bs - 1) / bs; ++i) {
      const int32_t blk = table[static_cast<size_t>(i)];
      OPD_CHECK(blk >= 0 && blk < cache.num_blocks(), InvalidArgument,
                "PagedForward::step: sequence ", b, " block ", i, " = ", blk,
                " is outside the cache [0, ", cache.num_blocks(), ")");
    }
    p.width = std::max<int64_t>(p.width, static_cast<int64_t>(table.size()));
    p.max_q_len = std::max<int64_t>(p.max_q_len, r1 - r0);
    p.max_seq_len = std::max<int64_t>(p.max_seq_len, total);
    p.seq_lens[b] = static_cast<int32_t>(total);
    p.last_rows[b] = static_cast<int32_t>(r1 - 1);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t pos = s.context_lens[b] + (r - r0);
      const int32_t id = s.ids[r];
      if (id < 0 || id >= vocab)
        OPD_FAIL(InvalidData, "token id ", id, " at sequence ", b, " position ", pos,
                 " is outside the vocabulary [0, ", vocab, ")");
      p.positions[r] = static_cast<int32_t>(pos);
      const int32_t blk = table[static_cast<size_t>(pos / bs)];
      p.slots[r] = static_cast<int32_t>(blk * bs + pos % bs);
    }
  }
  OPD_CHECK(table_width == 0 || p.width == table_width, InvalidArgument,
            "PagedForward::step: a block table has ", p.width, " blocks, more than the width ",
            table_width);
  p.tables.assign(static_cast<size_t>(B * p.width), 0);
  for (int64_t b = 0; b < B; ++b)
    std::copy(s.block_tables[b].begin(), s.block_tables[b].end(), p.tables.begin() + b * p.width);
  return p;
}

Tensor PagedForward::step(const PagedStep& s, KvCache& cache) const {
  return run_step(s, cache, false);
}

Tensor PagedForward::step_hidden(const PagedStep& s, KvCache& cache) const {
  return run_step(s, cache, true);
}

Tensor PagedForward::run_step(const PagedStep& s, KvCache& cache, bool all_hidden) const {
  const ModelConfig& c = model_->config();
  const ModelWeights& W = model_->weights();
  const int64_t B = s.num_sequences(), T = s.num_tokens();
  const int64_t H = c.hidden_size, D = c.head_dim;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  const double eps = c.rms_norm_eps, scale = c.attention_scale();  // 1/sqrt(D), x attention_factor^2 for YaRN
  OPD_CHECK(B >= 1, InvalidArgument, "PagedForward::step: empty step");
  OPD_CHECK(cache.num_layers() == c.num_hidden_layers, InvalidArgument,
            "PagedForward::step: cache has ", cache.num_layers(), " layers, model ",
            c.num_hidden_layers);

  // Host-side index tensors: positions, slots, per-sequence lengths, the padded block table,
  // and the row of each sequence's last token. Ids are checked here (they index the
  // embedding), block ids here and again by the ops that use them.
  const PagedStepPlan plan = plan_paged_step(s, c.vocab_size, cache);
#ifdef OPD_WITH_CUDA
  if (model_->device() == Device::CUDA) return step_cuda(s, plan, cache, all_hidden);
#endif
  const int64_t max_blocks = plan.width;
  const std::vector<int32_t>&positions = plan.positions, &slots = plan.slots,
                          &seq_lens = plan.seq_lens, &last_rows = plan.last_rows,
                          &tables = plan.tables;

  const Tensor& emb = W.embed_tokens;
  const Device dev = emb.device();
  auto idx = [&](const std::vector<int32_t>& v, const Shape& shape) {
    return Tensor::from_vector(v, shape).to(dev);
  };
  const Tensor ids_t = idx(s.ids, {T}), pos_t = idx(positions, {T}), slot_t = idx(slots, {T});
  const Tensor cu_t = idx(s.cu_seqlens, {B + 1}), lens_t = idx(seq_lens, {B});
  const Tensor tables_t = idx(tables, {B, max_blocks}), last_t = idx(last_rows, {B});
  auto empty = [&](const Shape& shape) { return Tensor::empty(shape, emb.dtype(), dev); };
  const Tensor none;

  Tensor x = empty({T, H});
  ops::embedding_forward(ids_t, emb, x);
  for (size_t li = 0; li < W.layers.size(); ++li) {
    const LayerWeights& L = W.layers[li];
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
    ops::kv_cache_store(k3, v3, slot_t, cache.k(static_cast<int64_t>(li)),
                        cache.v(static_cast<int64_t>(li)));
    Tensor attn = empty({T, Hq, D});
    ops::paged_attention(q3, cache.k(static_cast<int64_t>(li)), cache.v(static_cast<int64_t>(li)),
                         cu_t, lens_t, tables_t, scale, attn);
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
  if (all_hidden) {  // step_hidden: the final norm of every new row, no lm_head
    Tensor h = empty({T, H}), rstd = empty({T});
    ops::rmsnorm_forward(x, W.final_norm, eps, h, rstd);
    return h;
  }
  // Only the last new row of each sequence needs logits: gather those B rows first (an
  // embedding lookup with the hidden states as the table), then final norm and lm_head.
  Tensor last = empty({B, H});
  ops::embedding_forward(last_t, x, last);
  Tensor h = empty({B, H}), rstd = empty({B});
  ops::rmsnorm_forward(last, W.final_norm, eps, h, rstd);
  Tensor logits = empty({B, c.vocab_size});
  ops::linear_forward(h, W.lm_head, none, logits);
  return logits;
}

namespace {
const std::pair<const char*, unsigned> kStageNames[] = {
    {"qkv", PagedForward::kStageQkv},         {"rope", PagedForward::kStageRope},
    {"attention", PagedForward::kStageAttention}, {"combine", PagedForward::kStageCombine},
    {"o", PagedForward::kStageO},             {"postnorm", PagedForward::kStagePostNorm},
    {"gateup", PagedForward::kStageGateUp},   {"swiglu", PagedForward::kStageSwiglu},
    {"down", PagedForward::kStageDown},       {"nextnorm", PagedForward::kStageNextNorm}};
}  // namespace

std::string PagedForward::stage_names() {
  std::string known;
  for (const auto& [n, b] : kStageNames) known += std::string(known.empty() ? "" : ", ") + n;
  return known;
}

unsigned PagedForward::parse_stages(const std::string& names) {
  unsigned bits = 0;
  size_t at = 0;
  while (at < names.size()) {
    size_t end = names.find(',', at);
    if (end == std::string::npos) end = names.size();
    const std::string name = names.substr(at, end - at);
    at = end + 1;
    if (name.empty()) continue;
    unsigned bit = 0;
    for (const auto& [n, b] : kStageNames)
      if (name == n) bit = b;
    OPD_CHECK(bit != 0, InvalidArgument, "unknown decode stage '", name, "' (the stages: ",
              stage_names(), ")");
    bits |= bit;
  }
  return bits;
}

}  // namespace opd
