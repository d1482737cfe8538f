// Rotary position embedding frequencies as Hugging Face computes them:
// inv_freq[i] = 1 / theta^(2i / head_dim), i < head_dim/2, optionally rescaled:
//  - "linear": inv_freq / factor (position interpolation);
//  - "llama3" (Llama 3.1+): wavelengths longer than original_max / low_freq_factor are
//    divided by `factor`, shorter than original_max / high_freq_factor kept, and the band in
//    between interpolated smoothly;
//  - "yarn" (Peng et al. 2023): with r_i = clamp((i - low) / (high - low), 0, 1), where low/high
//    are the dimensions at which beta_fast/beta_slow rotations fit into original_max (floored /
//    ceiled when truncate), inv_freq * (1 - r_i) + inv_freq / factor * r_i. YaRN's
//    attention_factor is not a frequency: ModelConfig::attention_scale() applies it.
#pragma once

#include "core/tensor.h"
#include "model/config.h"

namespace opd {

// f32 [head_dim / 2], computed in double and rounded once.
Tensor rope_inv_freq(const ModelConfig& config);

}  // namespace opd
