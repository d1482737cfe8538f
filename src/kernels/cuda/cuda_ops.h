// Declarations of the CUDA kernels behind kernels/ops.h (only in builds with OPD_WITH_CUDA).
// Raw device pointers + a stream; shapes were validated by the Tensor-level dispatcher.
#pragma once

#include <cstdint>

#include "core/dtype.h"

typedef struct CUstream_st* cudaStream_t;

namespace opd {
class Tensor;  // core/tensor.h (C++20) stays out of the C++17 .cu files that include this
}

namespace opd::cuda {

// RMSNorm forward over rows of H: y = x * rstd * w. x/y/w share `dtype` (f32 or bf16),
// rstd is f32 [N]; accumulation in f32.
void rmsnorm_forward(const void* x, const void* w, double eps, int64_t n, int64_t h, DType dtype,
                     void* y, float* rstd, cudaStream_t stream);
// dx written, dw accumulated (f32 for f32 inputs; for bf16 inputs dw is f32 too: master grads).
void rmsnorm_backward(const void* dy, const void* x, const void* w, const float* rstd, int64_t n,
                      int64_t h, DType dtype, void* dx, float* dw, cudaStream_t stream);

// Fill out[i] = philox_uniform(seed, stream_id, i) for i < n (same values as the CPU).
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

 private:
  int64_t batch_ = 0, total_rows_ = 0, num_tiles_ = 0, max_seqlen_ = 0;
  void* buffer_ = nullptr;
  const int32_t* q_tiles_ = nullptr;
  const int32_t* k_tiles_ = nullptr;
  const int32_t* cu_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// True when (dtype, head_dim) runs the tensor-core kernels (bf16, head_dim 64 or 128); other
// head_dim <= 256 and f32 run a simple f32-arithmetic kernel (correct, slow: for testing).
bool attention_has_fast_path(DType dtype, int64_t head_dim);

// q/out [T, hq, d], k/v [T, hkv, d] in `dtype` (bf16 or f32); lse f32 [T, hq].
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

}  // namespace opd::cuda
