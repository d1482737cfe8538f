// Declarations of the CUDA kernels behind kernels/ops.h (only in builds with OPD_WITH_CUDA).
// Raw device pointers + a stream; shapes were validated by the Tensor-level dispatcher.
// Storage dtypes: activations and weights in `dtype` (f32 or bf16), arithmetic in f32;
// statistics (rstd, lse, losses) and parameter gradients (dw, dtable, dbias) in f32, the
// master-gradient precision. Formulas are stated once, in kernels/ops.h.
#pragma once

#include <cstdint>

#include "core/dtype.h"

typedef struct CUstream_st* cudaStream_t;

namespace opd {
class Tensor;  // core/tensor.h (C++20) stays out of the C++17 .cu files that include this
}

namespace opd::cuda {

// ---- index_check.cu: data-carried indices, checked on the device before an op uses them.
enum class IndexRule {
  InRange,          // 0 <= v < limit (token ids)
  InRangeOrIgnore,  // v == -100 or 0 <= v < limit (cross-entropy targets)
  NonNegative,      // v >= 0 (positions)
  InRangeOrNone,    // v == -1 or 0 <= v < limit (a scored row's actual token / a gather_rows map; -1 = none)
};
struct IndexCheckResult {
  int64_t first_bad_row = -1;  // -1: all valid
  int32_t value = 0;           // values[first_bad_row]
  int64_t counted = 0;         // rows with v != -100 (InRangeOrIgnore), else n
};
// One pass over values[0, n) with a device error flag (atomicMin of the row, so the report
// names the first bad row like the CPU check), read back synchronously.
IndexCheckResult check_indices(const int32_t* values, int64_t n, IndexRule rule, int64_t limit,
                               cudaStream_t stream);

// ---- rmsnorm.cu (plain and fused with the residual add) ----
// RMSNorm forward over rows of H: y = x * rstd * w. x/y/w share `dtype` (f32 or bf16),
// rstd is f32 [N]; accumulation in f32. pdl (decode steps): launched with programmatic
// dependent launch where the fast path runs (kernels/cuda/pdl.cuh); same results.
void rmsnorm_forward(const void* x, const void* w, double eps, int64_t n, int64_t h, DType dtype,
                     void* y, float* rstd, cudaStream_t stream, bool pdl = false);
// dx written, dw (f32) accumulated, deterministically (fixed-order two-stage column sums).
void rmsnorm_backward(const void* dy, const void* x, const void* w, const float* rstd, int64_t n,
                      int64_t h, DType dtype, void* dx, float* dw, cudaStream_t stream);
// sum = x + r (rounded to dtype), y = rmsnorm(sum) * w from the rounded sum.
void rmsnorm_residual_forward(const void* x, const void* r, const void* w, double eps, int64_t n,
                              int64_t h, DType dtype, void* sum, void* y, float* rstd,
                              cudaStream_t stream, bool pdl = false);
// ds = rmsnorm_dx(dy; sum) + dres (ds may alias dres); dw accumulated.
void rmsnorm_residual_backward(const void* dy, const void* sum, const void* w, const float* rstd,
                               const void* dres, int64_t n, int64_t h, DType dtype, void* ds,
                               float* dw, cudaStream_t stream);

// ---- embedding.cu ---- ids already validated (check_indices). table/out in dtype; dtable f32.
// host_table: `table` is pinned host memory (readable by kernels under unified addressing), read
// with plain loads: the first lookup of a weight upload still in flight (model/offload.h).
void embedding_forward(const int32_t* ids, const void* table, int64_t n, int64_t vocab,
                       int64_t hidden, DType dtype, void* out, cudaStream_t stream,
                       bool host_table = false);
// dtable[v, :] += sum over rows t with ids[t] == v of dout[t, :], rows in ascending order:
// a stable radix sort of (id, row) makes each id a segment summed by one block (no atomics).
void embedding_backward(const int32_t* ids, const void* dout, int64_t n, int64_t vocab,
                        int64_t hidden, DType dtype, float* dtable, cudaStream_t stream);

// ---- rope.cu ---- x [n, heads, head_dim] in place; positions validated; inv_freq f32.
// angle = (float)positions[t] * inv_freq[i] in f32 (as the CPU f32 path and transformers).
void rope(void* x, const int32_t* positions, const float* inv_freq, int64_t n, int64_t heads,
          int64_t head_dim, DType dtype, bool inverse, cudaStream_t stream);

// ---- swiglu.cu ---- all [n] in dtype.
void swiglu_forward(const void* gate, const void* up, int64_t n, DType dtype, void* out,
                    cudaStream_t stream);
void swiglu_backward(const void* dout, const void* gate, const void* up, int64_t n, DType dtype,
                     void* dgate, void* dup, cudaStream_t stream);

// ---- elementwise.cu ---- all [n] in dtype; out may alias a or b.
void add(const void* a, const void* b, int64_t n, DType dtype, void* out, cudaStream_t stream);

// ---- rows.cu ---- in [n_in, h] -> out [n_out, h], each in f32 or bf16 (may differ):
// out[i, :] = rows[i] == -1 ? 0 : in[rows[i], :] (rows validated; others read as -1).
void gather_rows(const void* in, DType in_dtype, int64_t n_in, const int32_t* rows, int64_t n_out,
                 int64_t h, void* out, DType out_dtype, cudaStream_t stream);
// out[i] = in[i] converted (f32 <-> bf16, round to nearest even), n elements.
void convert(const void* in, DType in_dtype, int64_t n, void* out, DType out_dtype,
             cudaStream_t stream);

// ---- cross_entropy.cu ---- logits/dlogits [n, vocab] in dtype; targets validated;
// losses, lse f32 [n]. One block per row, online log-sum-exp (one read of the logits).
void cross_entropy_forward(const void* logits, const int32_t* targets, int64_t n, int64_t vocab,
                           DType dtype, float* losses, float* lse, cudaStream_t stream);
void cross_entropy_backward(const void* logits, const int32_t* targets, const float* lse,
                            int64_t n, int64_t vocab, double scale, DType dtype, void* dlogits,
                            cudaStream_t stream);

// ---- reduce.cu ---- deterministic column sums (fixed order for a given shape).
// out[c] += sum_r x[r, c] for x [n, h] in dtype, out f32 [h].
void column_sum_accumulate(const void* x, int64_t n, int64_t h, DType dtype, float* out,
                           cudaStream_t stream);
// out[c] += sum_g partial[g, c] for f32 partial [groups, h] (second stage of two-stage sums).
void reduce_partials_accumulate(const float* partial, int64_t groups, int64_t h, float* out,
                                cudaStream_t stream);

// ---- philox.cu ---- out[i] = philox_uniform(seed, stream_id, i) for i < n (same as the CPU).
void philox_uniform_fill(float* out, int64_t n, uint64_t seed, uint64_t stream_id,
                         cudaStream_t stream);

// ---- attention (attention_fwd.cu, attention_bwd.cu, attention_dispatch.cpp) ----
// FlashAttention-2 style causal GQA over a packed batch (formulas in kernels/ops.h).
//
// The work schedule of one packed batch, built on the host from cu_seqlens (validated like the
// CPU op: InvalidData naming the entry) and uploaded once. cu_seqlens is the same for every
// layer of a micro-batch, forward and backward, so the model builds one plan per micro-batch
// and no attention call has to read cu_seqlens back from the device. Tiles are 128-row blocks
// of one sequence, listed heaviest first (the longest key loop, resp. query loop) so that the
// diagonal's imbalance does not leave a tail of long CTAs at the end of the grid.
// Device memory: (B + 1) + 8 x (number of tiles) int32, freed stream-ordered on destruction.
class AttentionPlan {
 public:
  static constexpr int kTileRows = 128;
  AttentionPlan(const int32_t* cu_seqlens_host, int64_t batch, int64_t total_rows,
                cudaStream_t stream);
  // Query rows over cached context (forward only): sequence b's len_q = cu_q[b+1] - cu_q[b]
  // query rows are the LAST len_q of its len_k = cu_k[b+1] - cu_k[b] keys (causal, bottom-right
  // aligned: query i sees keys 0 .. len_k - len_q + i); q/out/lse are packed by cu_q, k/v by
  // cu_k. Validated like the CPU op (cpu::check_cu_seqlens_context: InvalidData when a
  // sequence has len_k < len_q). The forward runs the mma.sync or the f32 kernel (the wgmma
  // kernel is skipped); attention_backward does not take such a plan. Device memory: the
  // plan above plus 2 x (number of tiles) + (B + 1) int32.
  AttentionPlan(const int32_t* cu_seqlens_q_host, const int32_t* cu_seqlens_k_host,
                int64_t batch, int64_t total_q_rows, int64_t total_k_rows, cudaStream_t stream);
  ~AttentionPlan();
  AttentionPlan(const AttentionPlan&) = delete;
  AttentionPlan& operator=(const AttentionPlan&) = delete;

  int64_t batch() const { return batch_; }
  int64_t total_rows() const { return total_rows_; }
  int64_t num_tiles() const { return num_tiles_; }
  int64_t max_seqlen() const { return max_seqlen_; }
  // int32 quadruples {start, len, block, 0}: query blocks ordered by keys to visit (desc).
  const int32_t* q_tiles() const { return q_tiles_; }
  // The same blocks as key blocks ordered by queries to visit (desc).
  const int32_t* k_tiles() const { return k_tiles_; }
  const int32_t* device_cu_seqlens() const { return cu_; }
  // Context plans (second constructor): true, and per q_tiles() entry the int32 pair
  // {key start in the packed k/v, len_k - len_q of its sequence}; cu_seqlens of the keys.
  // Plans of the first constructor: false, nullptr, device_cu_seqlens(), total_rows().
  bool has_context() const { return key_ranges_ != nullptr; }
  const int32_t* key_ranges() const { return key_ranges_; }
  const int32_t* device_cu_seqlens_k() const { return cu_k_ ? cu_k_ : cu_; }
  int64_t total_k_rows() const { return total_k_rows_; }

 private:
  void build(const int32_t* cu_q, const int32_t* cu_k, int64_t batch, int64_t total_q,
             int64_t total_k);
  int64_t batch_ = 0, total_rows_ = 0, num_tiles_ = 0, max_seqlen_ = 0, total_k_rows_ = 0;
  const int32_t* key_ranges_ = nullptr;
  const int32_t* cu_k_ = nullptr;
  void* buffer_ = nullptr;
  const int32_t* q_tiles_ = nullptr;
  const int32_t* k_tiles_ = nullptr;
  const int32_t* cu_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// True when (dtype, head_dim) runs the tensor-core kernels (bf16, head_dim 64 or 128); other
// head_dim <= 256 and f32 run a simple f32-arithmetic kernel (correct, slow: for testing).
bool attention_has_fast_path(DType dtype, int64_t head_dim);

// q/out [T, hq, d], k/v [T, hkv, d] in `dtype` (bf16 or f32); lse f32 [T, hq]. Context plans:
// q/out/lse over plan.total_rows() rows, k/v [plan.total_k_rows(), hkv, d].
void attention_forward(const AttentionPlan& plan, const void* q, const void* k, const void* v,
                       int64_t hq, int64_t hkv, int64_t d, double scale, DType dtype, void* out,
                       float* lse, cudaStream_t stream);
// Backward tile sizes for the bf16 kernels (benchmark knobs; each 32 or 64): queries per step
// of the dK/dV kernel's loop and keys per step of the dQ kernel's loop. Larger steps mean
// fewer barriers and fragment reloads but more registers (head_dim 128, 64 queries: 255
// registers and a 16-byte spill in ptxas -v).
struct AttentionBwdTiles {
  int dkdv_queries = 64;
  int dq_keys = 64;
};

// dq [T, hq, d], dk/dv [T, hkv, d] written (not accumulated). Deterministic: every output
// element is computed by one thread in a fixed order (no atomics), so two runs on the same
// inputs are bit-identical. Allocates T x hq f32 scratch (rowsum(dout * out)) stream-ordered.
void attention_backward(const AttentionPlan& plan, const void* dout, const void* q, const void* k,
                        const void* v, const void* out, const float* lse, int64_t hq, int64_t hkv,
                        int64_t d, double scale, DType dtype, void* dq, void* dk, void* dv,
                        cudaStream_t stream, const AttentionBwdTiles& tiles = {});

// Tensor-level routing for kernels/ops.cpp (CUDA tensors): validates dtypes and shapes, reads
// cu_seqlens to the host (a synchronizing copy when it lives on the device), builds a plan
// and runs the kernels above on the default stream.
void attention_forward_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& cu_seqlens, double scale, Tensor& out, Tensor& lse);
void attention_backward_cuda(const Tensor& dout, const Tensor& q, const Tensor& k,
                             const Tensor& v, const Tensor& out, const Tensor& lse,
                             const Tensor& cu_seqlens, double scale, Tensor& dq, Tensor& dk,
                             Tensor& dv);
// ---- paged_attention.cu (kernels) + paged_dispatch.cpp (Tensor routing) ----
// The paged KV cache ops of kernels/ops.h on raw device pointers, usable inside CUDA graphs:
// no host synchronization, no allocation (the split workspace is the caller's), and every
// data-carried index checked in the kernel. A bad index is skipped (never dereferenced) and
// reported by atomicMin into *error_flag (optional; the caller sets it to 0xffffffff = none
// before, and reads it when convenient, e.g. with the sampled ids of the step): the first bad
// sequence for paged_attention, the first bad row for kv_cache_store.
struct PagedStoreArgs {
  const void* k = nullptr;  // [n, hkv, head_dim]
  const void* v = nullptr;
  const int32_t* slot_mapping = nullptr;  // [n], device
  int64_t n = 0, num_blocks = 0, block_size = 0, hkv = 0, head_dim = 0;
  DType dtype = DType::BF16;
  void* k_cache = nullptr;  // [num_blocks, block_size, hkv, head_dim]
  void* v_cache = nullptr;
  unsigned* error_flag = nullptr;
};
void kv_cache_store(const PagedStoreArgs& args, cudaStream_t stream);

struct PagedAttentionArgs {
  const void* q = nullptr;        // [total_q, hq, head_dim]
  const void* k_cache = nullptr;  // [num_blocks, block_size, hkv, head_dim]
  const void* v_cache = nullptr;
  void* out = nullptr;            // [total_q, hq, head_dim]
  const int32_t* cu_seqlens_q = nullptr;  // [batch + 1], device
  const int32_t* seq_lens = nullptr;      // [batch], device
  const int32_t* block_tables = nullptr;  // [batch, max_blocks], device
  int64_t batch = 0, total_q = 0, hq = 0, hkv = 0, head_dim = 0;
  int64_t num_blocks = 0, block_size = 0, max_blocks = 0;
  // Host-known bounds that size the grid (a graph captures them): every q_len <= max_q_len
  // (1 for decode) and every seq_len <= max_seq_len; a sequence beyond them is reported.
  int64_t max_q_len = 1, max_seq_len = 0;
  double scale = 1.0;
  DType dtype = DType::BF16;
  unsigned* error_flag = nullptr;
  int sm_count = 0;      // 0: the current device's
  int force_splits = 0;  // > 0: this many position splits (tests of the combine path)
  // Decode calls (max_q_len <= 1) launch the decode kernel with programmatic dependent launch
  // (kernels/cuda/pdl.cuh): sequence checks and block-table staging overlap the predecessor,
  // q and K/V are read after it completed. Ignored by the general kernel. Same results.
  bool pdl = false;
  // Measurement only (PagedForward::set_skip_stages): the splits are not combined, `out` is
  // left as it was.
  bool skip_combine = false;
};
// The grid a call will use: query rows (pairs (row, head) of one kv head) per CTA, tiles per
// sequence, position splits and the f32 workspace they need:
//   splits x total_q x hq x (head_dim + 2) x 4 bytes (0 with one split).
// decode: max_q_len <= 1 runs the decode-only kernel (all query heads of a kv head in one CTA,
// block ids staged in shared memory, double-buffered 16-byte K/V loads; splits only when
// batch x kv heads would not fill the GPU); longer query rows (prefill chunks) the general one.
struct PagedAttentionLaunch {
  int rows_per_cta = 1, tiles_per_seq = 1, num_splits = 1, split_tokens = 0;
  size_t workspace_bytes = 0;
  bool decode = false;
};
PagedAttentionLaunch paged_attention_launch(const PagedAttentionArgs& args);
bool paged_attention_supports(DType dtype, int64_t head_dim);
// workspace: paged_attention_launch(args).workspace_bytes bytes of device memory (or nullptr
// when that is 0), stream-ordered with this call.
void paged_attention(const PagedAttentionArgs& args, void* workspace, cudaStream_t stream);

// Tensor-level routing for kernels/paged_ops.cpp (CUDA float tensors; index tensors on the CPU
// or the GPU): the index checks of the CPU op with its messages (device index tensors are read
// back, one synchronizing copy), then the kernels above on cuda::current_stream().
void kv_cache_store_cuda(const Tensor& k, const Tensor& v, const Tensor& slot_mapping,
                         Tensor& k_cache, Tensor& v_cache);
void paged_attention_cuda(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                          const Tensor& cu_seqlens_q, const Tensor& seq_lens,
                          const Tensor& block_tables, double scale, Tensor& out);

// ---- decode_fused.cu ---- kernels that merge ops of the incremental forward (formulas there).
// q/k/v: row-strided views of T tokens (q [T, q_stride] holding Hq heads of head_dim, etc.);
// q_norm/k_norm: [head_dim] in dtype, or null (no q/k norm); q_out [T, Hq, head_dim]; k/v go to
// the caches [num_blocks * block_size = num_slots, Hkv, head_dim] at slot_mapping[t]; a bad slot
// is skipped and reported through error_flag (optional). positions validated (>= 0).
struct QkvNormRopeStoreArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;  // elements between token rows
  const void* q_norm = nullptr;
  const void* k_norm = nullptr;
  float eps = 1e-6f;
  const int32_t* positions = nullptr;
  const float* inv_freq = nullptr;  // [head_dim / 2], f32
  const int32_t* slot_mapping = nullptr;
  int64_t n = 0, hq = 0, hkv = 0, head_dim = 0, num_slots = 0;
  DType dtype = DType::BF16;
  void* q_out = nullptr;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  unsigned* error_flag = nullptr;
  // Launch with programmatic dependent launch (kernels/cuda/pdl.cuh): positions, slots, norm
  // weights and RoPE terms are read before waiting for the predecessor (the q|k|v GEMM); the
  // successor may start its prologue at once. Same results either way.
  bool pdl = false;
  // q, k, v (and their strides) as the column blocks of one packed [n, (hq + 2 hkv) d] row
  // buffer of `dt` (the fused q|k|v GEMM's output).
  void set_packed_qkv(const void* qkv, int64_t hq_, int64_t hkv_, int64_t d, DType dt) {
    const size_t es = dtype_size(dt);
    q = qkv;
    k = static_cast<const char*>(qkv) + hq_ * d * es;
    v = static_cast<const char*>(qkv) + (hq_ + hkv_) * d * es;
    q_stride = k_stride = v_stride = (hq_ + 2 * hkv_) * d;
  }
};
void qkv_norm_rope_store(const QkvNormRopeStoreArgs& args, cudaStream_t stream);
// out [n, inter] = silu(gu[:, :inter]) * gu[:, inter:] for gu [n, 2 inter] (one gate|up GEMM).
// pdl: launched with programmatic dependent launch (pdl.cuh), same results.
void swiglu_packed_forward(const void* gu, int64_t n, int64_t inter, DType dtype, void* out,
                           cudaStream_t stream, bool pdl = false);

// ---- bench_util.cu ---- uniform [lo, hi) fill in f32 or bf16, ints in [lo, hi), and a
// kernel that occupies `stream` for the given time (timed loops queue up behind it).
void fill_uniform(void* out, int64_t n, DType dtype, uint64_t seed, float lo, float hi,
                  cudaStream_t stream);
void fill_ints(int32_t* out, int64_t n, uint64_t seed, int32_t lo, int32_t hi,
               cudaStream_t stream);
// Normal(mean, std) by Box-Muller (random initialization of benchmark models on the device).
void fill_normal(void* out, int64_t n, DType dtype, uint64_t seed, float mean, float std,
                 cudaStream_t stream);
// spin: release_dependents lets a PDL-launched successor start at once (its prologue then runs
// while this kernel occupies the stream: the tests of what a prologue may read).
void spin(double microseconds, cudaStream_t stream, bool release_dependents = false);
// out[b] = the SM that block b of a `blocks`-block grid ran on (each block stays ~20 us): the
// SMs a stream's work may use (tests of cuda::SmPartition).
void sm_ids(int32_t* out, int blocks, cudaStream_t stream);

// Multiprocessor count of the current device (cached per device).
int sm_count();
// How many thread-block clusters of `size` CTAs (1-16; above 8 the kernel is allowed a
// non-portable size) of `kernel` at `threads` threads and `smem_bytes` of dynamic shared memory
// the current device holds at once (GPC boundaries: fewer than SMs / size); 0 when it refuses.
// The kernel's dynamic shared memory limit must already allow smem_bytes.
int max_active_clusters(const void* kernel, int threads, size_t smem_bytes, int size);

}  // namespace opd::cuda
