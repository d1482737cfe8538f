// Incremental transformer forward for generation: one step runs the new tokens of a batch of
// sequences (a prefill chunk of any length, or one decode token each), appends their keys and
// values to the paged KV cache (model/kv_cache.h) and returns the logits of each sequence's
// last new token. Same layer math as Transformer::forward (transformer.h) with attention
// replaced by kv_cache_store + paged_attention, so the logits of a token equal the
// corresponding row of a full forward over the whole sequence (tests/model/test_paged_forward).
//
// CUDA models (weights on the device, bf16 or f32) run paged_forward_cuda.cpp: every index of a
// step is validated once on the host (plan_paged_step), uploaded in one copy, and the layers call
// the raw-pointer kernels (kernels/cuda/cuda_ops.h) with a device error flag instead of the
// Tensor-level paged ops (which read device indices back: a host sync per layer). step_device()
// is that path without any host sync or allocation, on caller-owned fixed buffers, so a decode
// step can be captured in a CUDA graph (rollout/engine_cuda.h).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/kv_cache.h"
#include "model/transformer.h"

typedef struct CUstream_st* cudaStream_t;

namespace opd {
#ifdef OPD_WITH_CUDA
namespace cuda {
class AttentionPlan;  // kernels/cuda/cuda_ops.h
class DeviceBuffer;   // core/cuda/allocator.h
}
#endif

// The new tokens of one step, packed. Sequence b contributes ids at positions
// [context_lens[b], context_lens[b] + len_b): context_lens[b] tokens of it are already in the
// cache; its block table must hold ceil((context + len) / block_size) blocks.
struct PagedStep {
  std::vector<int32_t> ids;                      // all new tokens, sequence after sequence
  std::vector<int32_t> cu_seqlens = {0};         // [B+1] rows of each sequence in ids
  std::vector<int32_t> context_lens;             // [B]
  std::vector<std::span<const int32_t>> block_tables;  // [B], views of the callers' tables

  void add(std::span<const int32_t> new_ids, int64_t context_len,
           std::span<const int32_t> block_table);
  int64_t num_sequences() const { return static_cast<int64_t>(context_lens.size()); }
  int64_t num_tokens() const { return static_cast<int64_t>(ids.size()); }
};

// The host-side indices of one step, validated against the model and the cache: every id in
// [0, vocab) (InvalidData naming sequence, position, value and limit), every block a sequence
// uses in [0, num_blocks) and its table long enough (InvalidArgument). tables is [batch, width]
// with width = max(table_width, longest table); unused entries are 0.
struct PagedStepPlan {
  int64_t batch = 0, tokens = 0, width = 1, max_q_len = 1, max_seq_len = 1;
  std::vector<int32_t> positions, slots;           // [tokens]
  std::vector<int32_t> seq_lens, last_rows;        // [batch]
  std::vector<int32_t> tables;                     // [batch, width]
};
PagedStepPlan plan_paged_step(const PagedStep& step, int64_t vocab, const KvCache& cache,
                              int64_t table_width = 0);

#ifdef OPD_WITH_CUDA
// One step's indices as device pointers (CUDA models), validated by plan_paged_step before
// upload. Their addresses may stay fixed across steps (a CUDA graph captures them).
struct PagedDeviceStep {
  int64_t batch = 0, tokens = 0, width = 1;  // width: columns of block_tables
  // Grid bounds (host-known): every sequence's new tokens <= max_q_len, total <= max_seq_len.
  int64_t max_q_len = 1, max_seq_len = 1;
  const int32_t* ids = nullptr;           // [tokens]
  const int32_t* positions = nullptr;     // [tokens]
  const int32_t* slots = nullptr;         // [tokens]
  const int32_t* cu_seqlens = nullptr;    // [batch + 1]
  const int32_t* seq_lens = nullptr;      // [batch]
  const int32_t* block_tables = nullptr;  // [batch, width]
  const int32_t* last_rows = nullptr;     // [batch]; nullptr: tokens == batch, row b is sequence b's
  // Optional: the paged kernels atomicMin the first bad row/sequence into it (0xffffffff = none).
  unsigned* error_flag = nullptr;
  // Fresh prefill (eager steps only; PagedForward::plan_fresh_prefill fills these): the last
  // fresh_batch sequences start at position 0, in rows [fresh_row0, tokens), so their keys are
  // their own new rows and their attention runs on the tensor-core varlen kernel
  // (cuda::attention_forward over fresh_plan) instead of the paged kernel, which then takes only
  // the first batch - fresh_batch sequences (rows [0, fresh_row0), <= paged_max_q_len each).
  int64_t fresh_batch = 0, fresh_row0 = 0, paged_max_q_len = 1;
  const cuda::AttentionPlan* fresh_plan = nullptr;
  // Context prefill (PagedForward::set_context_prefill): the tail also holds chunks with cached
  // context, so fresh_plan is a context plan over fresh_kv_rows key rows (every tail
  // sequence's context + new rows, in order); each layer gathers them from its cache by slot
  // (fresh_kv_slots, host-computed from the validated block tables) into fresh_k / fresh_v
  // [fresh_kv_rows, Hkv D] after the step's K/V store, and attends over those.
  // fresh_kv_rows = 0: a square plan whose keys are the new rows (the fresh-only tail).
  int64_t fresh_kv_rows = 0;
  const int32_t* fresh_kv_slots = nullptr;
  void* fresh_k = nullptr;
  void* fresh_v = nullptr;
};

// What plan_fresh_prefill found for one step; apply() writes it into the step (the plan must
// outlive the step's kernels: its device buffer is freed stream-ordered).
struct FreshPrefill {
  int64_t batch = 0, row0 = 0, paged_max_q_len = 1;
  std::unique_ptr<cuda::AttentionPlan> plan;
  // Context tails only: kv_rows key rows; kv holds their slots (int32) and the K and V gather
  // scratch, 2 x kv_rows x Hkv x D x dtype bytes (freed stream-ordered with the step).
  int64_t kv_rows = 0;
  std::unique_ptr<cuda::DeviceBuffer> kv;
  const int32_t* kv_slots = nullptr;
  void* k = nullptr;
  void* v = nullptr;
  FreshPrefill();
  FreshPrefill(FreshPrefill&&) noexcept;
  FreshPrefill& operator=(FreshPrefill&&) noexcept;
  ~FreshPrefill();
  void apply(PagedDeviceStep& s) const;
};

// Activation buffers of the CUDA step for up to max_tokens new tokens and max_rows logits rows,
// allocated once on the current stream and reused by every step (fixed addresses). Memory:
// max_tokens x (3 H + 2 (Hq + Hkv) D + Hq D + 3 I) x dtype + f32 statistics, plus the split-KV
// attention workspace (grown on demand; generation() counts the moves so captured graphs that
// hold the old address can be re-captured).
class PagedWorkspace {
 public:
  PagedWorkspace(const ModelConfig& config, DType dtype, int64_t max_tokens);
  int64_t max_tokens() const { return max_tokens_; }
  int64_t generation() const { return generation_; }
  // A device buffer of at least `bytes` for the split-KV attention (nullptr for 0). Never
  // allocates when the current one is large enough (the case inside a graph capture).
  void* split_workspace(size_t bytes);

 private:
  friend class PagedForward;
  int64_t max_tokens_ = 0, generation_ = 0;
  Tensor x, x2, h, q, k, v, qn, kn, attn, o, gate, up, act, last;  // model dtype
  Tensor qkv, gu;  // packed projections of the fused path: [T, (Hq + 2 Hkv) D], [T, 2 I]
  Tensor rstd, rstd_q, rstd_k;                                      // f32
  Tensor split;                                                     // split-KV partials (i64 storage)
};
#endif

class PagedForward {
 public:
  // fused (CUDA models): q/k/v as one GEMM over a packed weight, q/k norm + RoPE + the K/V store
  // as one kernel, gate/up as one GEMM with SwiGLU over the packed output (decode_fused.cu):
  // 10 kernels per layer instead of 18. The packed weights are copied from the model's at
  // construction: 2 x (Hq + 2 Hkv) D H + 2 x 2 I H bytes per layer in bf16 (W1: 577 MB), except
  // where the model's q|k|v or gate|up matrices already lie back to back in memory (a flat
  // parameter buffer, e.g. ZeRO's): those are used in place, no copy. Ignored for CPU models.
  explicit PagedForward(const Transformer& model, bool fused = true);

  // Prompt chunks WITH cached context (later chunks of a long prompt; the scorer's completions
  // over their shared prompt) of at least kContextPrefillMinRows new rows also attend with the
  // tensor-core kernel (bf16 head_dim 64/128; eager steps): each layer gathers the chunk's
  // context + new K/V rows from the cache by slot into contiguous scratch and runs
  // cuda::attention_forward over a context plan (query rows = the last rows of the keys)
  // instead of the paged kernel's CUDA-core loop. Extra memory per step: 2 x (sum of those
  // sequences' lengths) x Hkv x D x dtype. Needs fresh_prefill on. Off by default here; the
  // rollout engine and the CUDA scorer turn it on (measured on the H200, docs/perf.md session 7).
  // CPU models ignore it.
  void set_context_prefill(bool on) { context_prefill_ = on; }
  bool context_prefill() const { return context_prefill_; }
  // Shorter chunks stay on the paged kernel, which reads the context once per 8 query rows:
  // below this the gather (read + write + read of the context) costs more than it saves.
  static constexpr int64_t kContextPrefillMinRows = 16;

#ifdef OPD_WITH_CUDA
  // Copies the live weights into the packed buffers again (same addresses; stream-ordered on
  // `stream`): a forward kept across rollouts sees weights updated in place since. Returns the
  // bytes copied (0 when nothing is packed).
  int64_t refresh_packed(cudaStream_t stream);
  // Device addresses of every weight the forward reads (the model's and the packed ones): a
  // forward (and the CUDA graphs captured from it) can be reused while this is unchanged.
  std::vector<const void*> weight_addresses() const;
  // Decode-shaped GEMMs (steps of <= 256 tokens) pick their cuBLASLt algorithm by timing
  // (kernels/cuda/gemm.h GemmArgs::tune) instead of the heuristic's first choice.
  void set_tuned_gemm(bool on) { tuned_gemm_ = on; }
  // Decode steps (max_q_len <= 1) launch opd's kernels that follow another kernel (RMSNorms,
  // q/k norm + RoPE + K/V store, the decode attention, SwiGLU) with programmatic dependent
  // launch (kernels/cuda/pdl.cuh): each may start while its predecessor finishes, loads what
  // does not depend on it (norm weights, block tables, positions, RoPE terms, the attention's
  // first K/V of earlier positions) and then waits for it. Bit-identical results; cuBLASLt's GEMMs are launched as before (opd's decode linear,
  // set_decode_linear, is PDL-launched too).
  void set_pdl(bool on) { pdl_ = on; }
  // Decode-sized bf16 steps (<= 64 tokens) run the per-layer GEMMs named in `gemms` (bits
  // kDecodeLinear*) on opd's decode linear (kernels/cuda/decode_linear.h) instead of cuBLASLt:
  // with PDL on, each streams its weights while the kernel before it runs. Shapes it has no
  // plan for stay on cuBLASLt. Results differ from cuBLASLt's in the f32 summation order only.
  static constexpr unsigned kDecodeLinearQkv = 1, kDecodeLinearO = 2, kDecodeLinearGateUp = 4,
                            kDecodeLinearDown = 8;
  void set_decode_linear(unsigned gemms) { decode_linear_ = gemms; }
  // Measurement only (`opd bench rollout --skip-stages`): decode steps (max_q_len <= 1) of the
  // fused layer path launch none of the kernels named by these bits, so a step timed without
  // them attributes the step's time to its stages (METHOD: time variants that leave one stage
  // out). The outputs are then not the model's; nothing but that bench sets it.
  void set_skip_stages(unsigned bits) { skip_stages_ = bits; }
  // Prompt chunks that start at position 0 (no cached context) attend with the tensor-core
  // varlen attention (kernels/cuda/attention_fwd.cu, bf16 with head_dim 64/128) instead of the
  // paged kernel, whose CUDA-core loop reads a chunk's K/V once per 8 rows (W1 prefill: 0.136 s
  // of a 1.33 s rollout). On by default; off runs every row through the paged kernel.
  void set_fresh_prefill(bool on) { fresh_prefill_ = on; }
  bool fresh_prefill() const { return fresh_prefill_; }
  // The fresh tail of an eager step from its host cu_seqlens [batch + 1] and seq_lens [batch]
  // (a sequence is fresh when its new rows are all of it): batch 0 when there is none, when
  // fresh_prefill is off, or when the model's dtype/head_dim has no tensor-core kernel. The
  // plan's tile list is uploaded on `stream`. With context_prefill on and the step's validated
  // block tables given (tables [batch, width], the cache's block_size), the tail is the
  // trailing run of sequences that are fresh or have >= kContextPrefillMinRows new rows; when
  // one of them has context, the plan is a context plan and the key slots are uploaded too.
  FreshPrefill plan_fresh_prefill(const int32_t* cu_seqlens, const int32_t* seq_lens,
                                  int64_t batch, cudaStream_t stream,
                                  const int32_t* tables = nullptr, int64_t width = 0,
                                  int64_t block_size = 0) const;
#endif

  // Runs one step: ids validated against the vocabulary (error names sequence, position, value
  // and limit), K/V stored into `cache` at their slots, returns logits f32 [B, V] of the last
  // new token of every sequence (sequences with no new token are not allowed).
  // Memory besides the cache: activations of the step, O(num_tokens x max(H, I, Hq*D)), and
  // B x V logits (never num_tokens x V).
  // CUDA models: the logits are a CUDA tensor; indices are checked on the host, uploaded in one
  // copy, the kernels' error flag is read once at the end (one synchronization per step).
  Tensor step(const PagedStep& step, KvCache& cache) const;

  // The same step returning the final (normed) hidden states [num_tokens, H] of every new token
  // (model dtype, on the model's device) instead of logits: the rows the lm_head would read. For
  // the teacher scorer's shared-prompt path (teacher/score_plan.h: completions run over the
  // cached K/V of their common prompt). Memory: the step's activations and T x H outputs.
  // Same layers as step() (one code path: run_step); CUDA: step_device, then its final-norm rows
  // (its lm_head over the B last rows also runs, B x H x V, negligible next to the step).
  Tensor step_hidden(const PagedStep& step, KvCache& cache) const;

#ifdef OPD_WITH_CUDA
  // CUDA models: the step's kernels on `stream`, no host synchronization and no allocation
  // (except a first-time growth of ws's split workspace): f32 logits [batch, V] into `logits`.
  // Indices must have been validated (plan_paged_step); the kernels guard them again and report
  // through s.error_flag instead of faulting. Capturable in a CUDA graph.
  void step_device(const PagedDeviceStep& s, KvCache& cache, PagedWorkspace& ws, float* logits,
                   cudaStream_t stream) const;
#endif

  const Transformer& model() const { return *model_; }

  // The per-layer kernels of a fused decode step, for set_skip_stages (bits) and their names
  // ("qkv", "rope", "attention", "combine", "o", "postnorm", "gateup", "swiglu", "down",
  // "nextnorm": the order a layer launches them).
  static constexpr unsigned kStageQkv = 1, kStageRope = 2, kStageAttention = 4,
                            kStageCombine = 8, kStageO = 16, kStagePostNorm = 32,
                            kStageGateUp = 64, kStageSwiglu = 128, kStageDown = 256,
                            kStageNextNorm = 512;
  // "qkv,swiglu" -> bits ("" -> 0); an unknown name throws InvalidArgument listing the names.
  static unsigned parse_stages(const std::string& names);
  static std::string stage_names();  // "qkv, rope, ..., nextnorm"

 private:
  // step() and step_hidden(): the checks, the plan, then CPU ops or step_cuda.
  Tensor run_step(const PagedStep& step, KvCache& cache, bool all_hidden) const;
#ifdef OPD_WITH_CUDA
  // all_hidden: the final-norm rows of every new token [T, H] instead of the last rows' logits.
  Tensor step_cuda(const PagedStep& step, const PagedStepPlan& plan, KvCache& cache,
                   bool all_hidden) const;
  void pack_weights();
#endif
  const Transformer* model_;
  Tensor inv_freq_;         // f32, host
  Tensor inv_freq_device_;  // f32 on the device (CUDA models)
  bool fused_ = false;      // CUDA models with packed weights below
  bool tuned_gemm_ = false;
  bool pdl_ = false;
  unsigned decode_linear_ = 0;  // kDecodeLinear* bits
  unsigned skip_stages_ = 0;    // kStage* bits (measurement only)
  bool fresh_prefill_ = true;
  bool context_prefill_ = false;
  std::vector<Tensor> qkv_w_, qkv_b_, gu_w_;  // per layer: [(Hq + 2 Hkv) D, H], [..] or none, [2 I, H]
  // What the fused layers read: the packed tensors above, or the model's own q_proj / gate_proj
  // when the parts are contiguous (then the packed tensor is empty).
  std::vector<const void*> qkv_ptr_, gu_ptr_;
};

}  // namespace opd
