// AdamW with decoupled weight decay (Loshchilov & Hutter 2019) and global gradient-norm
// clipping, computed exactly as torch.optim.AdamW (single-tensor path) and
// torch.nn.utils.clip_grad_norm_ do it, on f32 master weights with f32 moments:
//   coef = min(1, max_norm / (||g||_2 + 1e-6)), g <- g * coef     (only when max_norm > 0)
//   p <- p * (1 - lr * wd)
//   m <- lerp(m, g, 1 - beta1);  v <- v * beta2 + (1 - beta2) * g * g
//   p <- p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// t counts steps from 1. After the update an optional model copy (bf16 for training) is
// refreshed from the master weights. The CPU path is the reference (f32, same operation
// order as PyTorch's CPU kernels); the CUDA path updates every tensor in one multi-tensor
// launch and keeps the clipping coefficient on the device (kernels/cuda/adamw.h). The norm
// is deterministic on both: f64 accumulation on the CPU, a fixed-order two-stage sum on CUDA.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace opd {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

// One parameter tensor as the optimizer sees it; all on one device.
struct OptimParam {
  Tensor master;  // f32, updated in place
  Tensor grad;    // f32, same shape; read, never modified (clipping scales it on the fly)
  Tensor model;   // optional (undefined: none): bf16 or f32 copy refreshed from master
};

struct StepReport {
  double grad_norm = 0;  // global L2 norm of the gradients before clipping (0 if not computed)
  double clip_coef = 1;  // the factor the gradients were scaled by
  bool norm_computed = false;
};

class AdamW {
 public:
  // Moments start at zero, on the parameters' device. Throws InvalidArgument on mismatched
  // shapes, dtypes or devices, or hyper-parameters outside their ranges.
  AdamW(std::vector<OptimParam> params, AdamWConfig config);
  ~AdamW();
  AdamW(AdamW&&) noexcept;
  AdamW& operator=(AdamW&&) noexcept;

  // One step at learning rate lr; with max_norm > 0 the gradients are clipped to that global
  // norm first (and the norm is reported). On CUDA this reads back the norm (one sync) only
  // when it was computed.
  StepReport step(double lr, double max_norm = 0);
  // The global L2 norm of the current gradients (no update).
  double grad_norm();
  // The norm first (one computation, read back once); when it is finite, the step of
  // step(lr, max_norm) with that norm's clip coefficient, and true; otherwise nothing changes
  // (not even the step count) and false. *report gets the norm either way. Bit-identical to
  // grad_norm() followed by step(), with one norm pass instead of two.
  bool step_if_finite(double lr, double max_norm, StepReport* report);

  // Gradient buffers can leave between steps (the trainer frees them during the rollout):
  // release_grads() drops this optimizer's references (step/grad_norm then throw until
  // bind_grads), bind_grads() takes new f32 tensors shaped like the parameters, same device.
  void release_grads();
  void bind_grads(const std::vector<Tensor>& grads);
  bool grads_bound() const { return grads_bound_; }

  int64_t steps() const { return step_; }
  void set_steps(int64_t steps);  // checkpoint restore, with exp_avg()/exp_avg_sq() contents
  const std::vector<OptimParam>& params() const { return params_; }
  std::vector<Tensor>& exp_avg() { return m_; }
  std::vector<Tensor>& exp_avg_sq() { return v_; }
  const AdamWConfig& config() const { return config_; }

 private:
  std::vector<OptimParam> params_;
  AdamWConfig config_;
  std::vector<Tensor> m_, v_;
  int64_t step_ = 0;
  Device device_ = Device::CPU;
  bool grads_bound_ = true;
  void check_param(size_t i) const;
  void build_device_state();
  bool device_state_matches_grads() const;
  std::vector<const void*> table_grads_;  // the gradient pointers the CUDA kernels were built on
  void check_bound(const char* what) const;
  struct CudaState;
  std::unique_ptr<CudaState> cuda_;
};

}  // namespace opd
