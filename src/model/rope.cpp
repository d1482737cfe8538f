// RoPE inverse frequencies with optional llama3 scaling (formula in rope.h; mirrors
// transformers' _compute_default_rope_parameters and _compute_llama3_parameters).
#include "model/rope.h"

#include <cmath>
#include <numbers>

namespace opd {

Tensor rope_inv_freq(const ModelConfig& config) {
  const int64_t half = config.head_dim / 2;
  Tensor out = Tensor::empty({half}, DType::F32);
  float* f = out.data<float>();
  const RopeScaling& rs = config.rope_scaling;
  for (int64_t i = 0; i < half; ++i) {
    // transformers computes arange(0, d, 2).float() / d and the power in float32.
    float exponent = static_cast<float>(2 * i) / static_cast<float>(config.head_dim);
    double inv = 1.0 / std::pow(static_cast<double>(static_cast<float>(config.rope_theta)),
                                static_cast<double>(exponent));
    if (rs.llama3) {
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
    }
    f[i] = static_cast<float>(inv);
  }
  return out;
}

}  // namespace opd
