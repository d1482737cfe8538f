// RoPE inverse frequencies with optional linear / llama3 / YaRN scaling (formulas in rope.h;
// mirrors transformers' _compute_default_rope_parameters, _compute_linear_scaling_rope_parameters,
// _compute_llama3_parameters and _compute_yarn_parameters in modeling_rope_utils.py).
#include "model/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace opd {

namespace {

// YaRN's correction range: the dimension indices (of head_dim) at which beta_fast and
// beta_slow rotations fit into the original context (find_correction_range).
void yarn_correction_range(const RopeScaling& rs, double base, int64_t dim, double* low,
                           double* high) {
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(dim) *
           std::log(static_cast<double>(rs.original_max_position_embeddings) /
                    (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(base));
  };
  double lo = correction_dim(rs.beta_fast), hi = correction_dim(rs.beta_slow);
  if (rs.truncate) {
    lo = std::floor(lo);
    hi = std::ceil(hi);
  }
  *low = std::max(lo, 0.0);
  *high = std::min(hi, static_cast<double>(dim - 1));
  if (*low == *high) *high += 0.001;  // transformers: "prevent singularity"
}

}  // namespace

Tensor rope_inv_freq(const ModelConfig& config) {
  const int64_t half = config.head_dim / 2;
  Tensor out = Tensor::empty({half}, DType::F32);
  float* f = out.data<float>();
  const RopeScaling& rs = config.rope_scaling;
  double yarn_low = 0, yarn_high = 1;
  if (rs.type == RopeType::Yarn) {
    yarn_correction_range(rs, config.rope_theta, config.head_dim, &yarn_low, &yarn_high);
  }
  for (int64_t i = 0; i < half; ++i) {
    // transformers computes arange(0, d, 2).float() / d and the power in float32.
    float exponent = static_cast<float>(2 * i) / static_cast<float>(config.head_dim);
    double inv = 1.0 / std::pow(static_cast<double>(static_cast<float>(config.rope_theta)),
                                static_cast<double>(exponent));
    switch (rs.type) {
      case RopeType::Default:
        break;
      case RopeType::Linear:
        inv = inv / rs.factor;
        break;
      case RopeType::Llama3: {
        const double old_len = static_cast<double>(rs.original_max_position_embeddings);
        const double low_wavelen = old_len / rs.low_freq_factor;
        const double high_wavelen = old_len / rs.high_freq_factor;
        const double wavelen = 2.0 * std::numbers::pi / inv;
        if (wavelen > low_wavelen) {
          inv = inv / rs.factor;
        } else if (wavelen >= high_wavelen) {  // medium band: interpolate
          double smooth = (old_len / wavelen - rs.low_freq_factor) /
                          (rs.high_freq_factor - rs.low_freq_factor);
          inv = (1.0 - smooth) * inv / rs.factor + smooth * inv;
        }
        break;
      }
      case RopeType::Yarn: {
        // ramp 0 (dimension i below `low`, high frequency): extrapolate, keep inv;
        // ramp 1 (above `high`, low frequency): interpolate, inv / factor; linear between.
        const double ramp = std::clamp((static_cast<double>(i) - yarn_low) / (yarn_high - yarn_low),
                                       0.0, 1.0);
        inv = inv / rs.factor * ramp + inv * (1.0 - ramp);
        break;
      }
    }
    f[i] = static_cast<float>(inv);
  }
  return out;
}

}  // namespace opd
