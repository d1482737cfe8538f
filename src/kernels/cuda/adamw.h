// Multi-tensor AdamW and global gradient norm on CUDA (the math of train/optimizer.h, same
// f32 operation order as torch.optim.AdamW's single-tensor path): one launch updates every
// parameter tensor, walking a device table of (tensor, chunk) entries built once, and the
// gradient norm is a two-stage deterministic reduction (f32 sums per 64K-element chunk, then
// one block adds the chunk sums in f64 in a fixed order). The clipping coefficient stays on
// the device, so clipping costs no extra pass over the gradients. C++17-clean.
#pragma once

#include <cstdint>
#include <vector>

#include "core/cuda/allocator.h"
#include "core/dtype.h"

namespace opd::cuda {

struct AdamWTensor {
  float* param = nullptr;      // f32 master weights, updated in place
  const float* grad = nullptr; // f32, read only
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* model = nullptr;       // optional copy refreshed from param (dtype: model_dtype)
  int64_t n = 0;
};

// f32 scalars of one step, formed on the host in double exactly as torch does, then rounded.
struct AdamWScalars {
  float decay;          // 1 - lr * weight_decay
  float lerp_weight;    // 1 - beta1
  float beta2;          // beta2
  float one_minus_beta2;
  float bc2_sqrt;       // sqrt(1 - beta2^t)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^t)
};

class MultiTensorAdamW {
 public:
  // model_dtype: BF16 or F32 for the model copies (ignored where model == nullptr).
  MultiTensorAdamW(const std::vector<AdamWTensor>& tensors, DType model_dtype,
                   cudaStream_t stream);
  // Sum of squares of all gradients -> norm (f64, device) and, when max_norm > 0, the clip
  // coefficient min(1, max_norm / (norm + 1e-6)) (f32, device; 1 when max_norm <= 0).
  void grad_norm(double max_norm, cudaStream_t stream);
  // The update; grads are scaled by the device clip coefficient when use_clip is set.
  void step(const AdamWScalars& s, bool use_clip, cudaStream_t stream);
  // Reads the norm and coefficient of the last grad_norm() (synchronizes the stream).
  void read_norm(double* norm, float* coef, cudaStream_t stream) const;
  int64_t chunks() const { return chunks_; }

 private:
  DeviceBuffer tensors_;  // device AdamWTensor-like table
  DeviceBuffer chunk_table_;
  DeviceBuffer partials_;  // f32 [chunks]
  DeviceBuffer result_;    // f64 norm, f32 coef
  int64_t chunks_ = 0;
  DType model_dtype_;
};

}  // namespace opd::cuda
