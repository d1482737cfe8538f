// AdamW + global grad-norm clipping (formulas in optimizer.h): the CPU reference loop, the
// validation of parameters and hyper-parameters, and the hand-off to the CUDA multi-tensor
// kernels (kernels/cuda/adamw.h) for device parameters.
#include "train/optimizer.h"

#include <cmath>
#include <string>

#include "core/thread_pool.h"
#ifdef OPD_WITH_CUDA
#include "core/cuda/allocator.h"  // cuda::current_stream
#include "kernels/cuda/adamw.h"
#endif

namespace opd {

namespace {

// The f32 scalars of one step, formed in double as torch does in Python, then rounded to f32
// where PyTorch's kernels round a Python scalar for an f32 tensor.
struct Scalars {
  float coef = 1.0f;  // clipping factor
  float decay, lerp_weight, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
};

Scalars step_scalars(const AdamWConfig& c, double lr, int64_t step) {
  const double t = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(c.beta1, t);
  const double bc2 = 1.0 - std::pow(c.beta2, t);
  Scalars s;
  s.decay = static_cast<float>(1.0 - lr * c.weight_decay);
  s.lerp_weight = static_cast<float>(1.0 - c.beta1);
  s.beta2 = static_cast<float>(c.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.eps = static_cast<float>(c.eps);
  s.neg_step_size = static_cast<float>(-(lr / bc1));
  return s;
}

// torch.nn.utils.clip_grad_norm_: clip_coef = max_norm / (total_norm + 1e-6) in f32, at most 1.
float clip_coefficient(double norm, double max_norm) {
  const float c = static_cast<float>(max_norm) / (static_cast<float>(norm) + 1e-6f);
  return std::fmin(c, 1.0f);
}

// One element in the order of torch's CPU kernels (mul_, lerp_, mul_, addcmul_, sqrt, div,
// add_, addcdiv_); volatile-free plain f32 arithmetic.
inline void adamw_element(float& p, float g, float& m, float& v, const Scalars& s) {
  p = p * s.decay;
  const float w = s.lerp_weight;
  m = std::fabs(w) < 0.5f ? m + w * (g - m) : g - (g - m) * (1.0f - w);
  v = v * s.beta2;
  v = v + s.one_minus_beta2 * g * g;
  const float denom = std::sqrt(v) / s.bc2_sqrt + s.eps;
  p = p + s.neg_step_size * m / denom;
}

double cpu_sum_squares(const std::vector<OptimParam>& params) {
  double total = 0;  // f64 and in order: deterministic and far below f32 rounding
  for (const OptimParam& p : params) {
    const float* g = p.grad.data<float>();
    for (int64_t i = 0; i < p.grad.numel(); ++i) total += static_cast<double>(g[i]) * g[i];
  }
  return total;
}

// The update of every parameter on the host; grads scaled by s.coef when clipping.
void cpu_update(const std::vector<OptimParam>& params, std::vector<Tensor>& m_all,
                std::vector<Tensor>& v_all, const Scalars& s, bool clip) {
  for (size_t i = 0; i < params.size(); ++i) {
    const OptimParam& prm = params[i];
    float* p = prm.master.data<float>();
    const float* g = prm.grad.data<float>();
    float* m = m_all[i].data<float>();
    float* v = v_all[i].data<float>();
    const bool has_model = prm.model.defined();
    const bool bf16 = has_model && prm.model.dtype() == DType::BF16;
    uint16_t* model_bf16 = bf16 ? static_cast<uint16_t*>(prm.model.raw()) : nullptr;
    float* model_f32 = has_model && !bf16 ? prm.model.data<float>() : nullptr;
    parallel_for(
        prm.master.numel(),
        [&](int64_t begin, int64_t end) {
          for (int64_t j = begin; j < end; ++j) {
            // torch scales the stored gradient by the (clamped) coefficient only when clipping.
            const float gj = clip ? g[j] * s.coef : g[j];
            adamw_element(p[j], gj, m[j], v[j], s);
            if (model_bf16) model_bf16[j] = float_to_bf16(p[j]);
            else if (model_f32) model_f32[j] = p[j];
          }
        },
        1 << 14);
  }
}

}  // namespace

#ifdef OPD_WITH_CUDA
struct AdamW::CudaState {
  std::unique_ptr<cuda::MultiTensorAdamW> kernels;
};
#else
struct AdamW::CudaState {};
#endif

AdamW::AdamW(std::vector<OptimParam> params, AdamWConfig config)
    : params_(std::move(params)), config_(config) {
  const AdamWConfig& c = config_;
  OPD_CHECK(c.beta1 >= 0 && c.beta1 < 1 && c.beta2 >= 0 && c.beta2 < 1, InvalidArgument,
            "AdamW: betas must be in [0, 1), got (", c.beta1, ", ", c.beta2, ")");
  OPD_CHECK(c.eps > 0 && std::isfinite(c.eps), InvalidArgument, "AdamW: eps must be > 0, got ",
            c.eps);
  OPD_CHECK(c.weight_decay >= 0 && std::isfinite(c.weight_decay), InvalidArgument,
            "AdamW: weight_decay must be >= 0, got ", c.weight_decay);
  if (!params_.empty()) device_ = params_.front().master.device();
  for (size_t i = 0; i < params_.size(); ++i) {
    check_param(i);
    m_.push_back(Tensor::zeros(params_[i].master.shape(), DType::F32, device_));
    v_.push_back(Tensor::zeros(params_[i].master.shape(), DType::F32, device_));
  }
  build_device_state();
}

void AdamW::check_param(size_t i) const {
  const OptimParam& p = params_[i];
  OPD_CHECK(p.master.defined() && p.grad.defined(), InvalidArgument, "AdamW: parameter ", i,
            " has an undefined master or grad tensor");
  OPD_CHECK(p.master.dtype() == DType::F32 && p.grad.dtype() == DType::F32, InvalidArgument,
            "AdamW: parameter ", i, " master and grad must be f32, got ", p.master.describe(),
            " and ", p.grad.describe());
  OPD_CHECK(p.grad.shape() == p.master.shape(), InvalidArgument, "AdamW: parameter ", i,
            " grad ", p.grad.describe(), " does not match master ", p.master.describe());
  OPD_CHECK(p.master.device() == device_ && p.grad.device() == device_, InvalidArgument,
            "AdamW: parameter ", i, " is not on the device of parameter 0");
  OPD_CHECK(p.master.writable(), InvalidArgument, "AdamW: parameter ", i, " is read-only");
  if (p.model.defined()) {
    OPD_CHECK(p.model.shape() == p.master.shape() && p.model.device() == device_ &&
                  (p.model.dtype() == DType::BF16 || p.model.dtype() == DType::F32) &&
                  p.model.writable(),
              InvalidArgument, "AdamW: parameter ", i, " model copy ", p.model.describe(),
              " must be a writable bf16 or f32 tensor shaped like ", p.master.describe());
    OPD_CHECK(p.model.dtype() == params_.front().model.dtype() || !params_.front().model.defined(),
              InvalidArgument, "AdamW: model copies must share one dtype");
  }
}

// The CUDA multi-tensor kernels hold the parameters' device pointers: built at construction and
// again whenever the gradient buffers are re-bound.
void AdamW::build_device_state() {
  if (device_ != Device::CUDA) return;
#ifdef OPD_WITH_CUDA
  std::vector<cuda::AdamWTensor> tensors;
  DType model_dtype = DType::BF16;
  for (size_t i = 0; i < params_.size(); ++i) {
    const OptimParam& p = params_[i];
    if (p.model.defined()) model_dtype = p.model.dtype();
    tensors.push_back({p.master.data<float>(), p.grad.data<float>(), m_[i].data<float>(),
                       v_[i].data<float>(), p.model.defined() ? p.model.raw() : nullptr,
                       p.master.numel()});
  }
  cuda_ = std::make_unique<CudaState>();
  cuda_->kernels =
      std::make_unique<cuda::MultiTensorAdamW>(tensors, model_dtype, cuda::current_stream());
  table_grads_.clear();
  for (const OptimParam& p : params_) table_grads_.push_back(p.grad.raw());
#else
  OPD_FAIL(Unsupported, "AdamW on CUDA: this build has no CUDA backend");
#endif
}

AdamW::~AdamW() = default;
AdamW::AdamW(AdamW&&) noexcept = default;
AdamW& AdamW::operator=(AdamW&&) noexcept = default;

void AdamW::set_steps(int64_t steps) {
  OPD_CHECK(steps >= 0, InvalidArgument, "AdamW: step count must be >= 0, got ", steps);
  step_ = steps;
}

double AdamW::grad_norm() {
  check_bound("grad_norm");
  if (device_ == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    cudaStream_t stream = cuda::current_stream();
    cuda_->kernels->grad_norm(0.0, stream);
    double norm = 0;
    float coef = 1;
    cuda_->kernels->read_norm(&norm, &coef, stream);
    return norm;
#endif
  }
  return std::sqrt(cpu_sum_squares(params_));
}

StepReport AdamW::step(double lr, double max_norm) {
  check_bound("step");
  OPD_CHECK(std::isfinite(lr) && lr >= 0, InvalidArgument, "AdamW: lr must be finite and >= 0, got ",
            lr);
  OPD_CHECK(!std::isnan(max_norm), InvalidArgument, "AdamW: max_norm is NaN");
  const bool clip = max_norm > 0 && std::isfinite(max_norm);
  ++step_;
  Scalars s = step_scalars(config_, lr, step_);
  StepReport report;
  if (device_ == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    cudaStream_t stream = cuda::current_stream();
    cuda::AdamWScalars ks{s.decay, s.lerp_weight, s.beta2, s.one_minus_beta2,
                          s.bc2_sqrt, s.eps, s.neg_step_size};
    if (clip) cuda_->kernels->grad_norm(max_norm, stream);
    cuda_->kernels->step(ks, clip, stream);
    if (clip) {
      float coef = 1;
      cuda_->kernels->read_norm(&report.grad_norm, &coef, stream);
      report.clip_coef = coef;
      report.norm_computed = true;
    }
    return report;
#endif
  }
  if (clip) {
    report.grad_norm = std::sqrt(cpu_sum_squares(params_));
    report.norm_computed = true;
    s.coef = clip_coefficient(report.grad_norm, max_norm);
    report.clip_coef = s.coef;
  }
  cpu_update(params_, m_, v_, s, clip);
  return report;
}

bool AdamW::step_if_finite(double lr, double max_norm, StepReport* report) {
  check_bound("step");
  OPD_CHECK(std::isfinite(lr) && lr >= 0, InvalidArgument, "AdamW: lr must be finite and >= 0, got ",
            lr);
  OPD_CHECK(!std::isnan(max_norm), InvalidArgument, "AdamW: max_norm is NaN");
  const bool clip = max_norm > 0 && std::isfinite(max_norm);
  StepReport rep;
  rep.norm_computed = true;
#ifdef OPD_WITH_CUDA
  cudaStream_t stream = device_ == Device::CUDA ? cuda::current_stream() : nullptr;
#endif
  if (device_ == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    // The norm kernel also leaves the clip coefficient on the device for the update kernel.
    cuda_->kernels->grad_norm(clip ? max_norm : 0.0, stream);
    float coef = 1;
    cuda_->kernels->read_norm(&rep.grad_norm, &coef, stream);
    rep.clip_coef = clip ? coef : 1.0f;
#endif
  } else {
    rep.grad_norm = std::sqrt(cpu_sum_squares(params_));
    rep.clip_coef = clip ? clip_coefficient(rep.grad_norm, max_norm) : 1.0f;
  }
  if (report) *report = rep;
  if (!std::isfinite(rep.grad_norm)) return false;
  ++step_;
  Scalars s = step_scalars(config_, lr, step_);
  if (device_ == Device::CUDA) {
#ifdef OPD_WITH_CUDA
    cuda::AdamWScalars ks{s.decay, s.lerp_weight, s.beta2, s.one_minus_beta2,
                          s.bc2_sqrt, s.eps, s.neg_step_size};
    cuda_->kernels->step(ks, clip, stream);
#endif
    return true;
  }
  s.coef = static_cast<float>(rep.clip_coef);
  cpu_update(params_, m_, v_, s, clip);
  return true;
}

void AdamW::release_grads() {
  // The CUDA kernels' pointer table stays (never launched while released): when the next
  // gradients land at the same addresses, as the caching allocator usually places them, binding
  // them needs no rebuild (which uploads the table and synchronizes the stream).
  for (OptimParam& p : params_) p.grad = Tensor();
  grads_bound_ = false;
}

void AdamW::bind_grads(const std::vector<Tensor>& grads) {
  OPD_CHECK(grads.size() == params_.size(), InvalidArgument, "AdamW::bind_grads: ", grads.size(),
            " gradients for ", params_.size(), " parameters");
  std::vector<Tensor> previous;
  for (size_t i = 0; i < params_.size(); ++i) {
    previous.push_back(params_[i].grad);
    params_[i].grad = grads[i];
  }
  try {
    for (size_t i = 0; i < params_.size(); ++i) check_param(i);
  } catch (...) {  // a refused set leaves the optimizer as it was
    for (size_t i = 0; i < params_.size(); ++i) params_[i].grad = previous[i];
    throw;
  }
  grads_bound_ = true;
  if (device_state_matches_grads()) return;
  build_device_state();
}

bool AdamW::device_state_matches_grads() const {
  if (device_ != Device::CUDA || !cuda_ || table_grads_.size() != params_.size()) return false;
  for (size_t i = 0; i < params_.size(); ++i)
    if (table_grads_[i] != params_[i].grad.raw()) return false;
  return true;
}

void AdamW::check_bound(const char* what) const {
  OPD_CHECK(grads_bound_, InvalidArgument, "AdamW::", what,
            ": the gradients were released (bind_grads first)");
}

}  // namespace opd
