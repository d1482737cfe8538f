// Rotary position embedding frequencies as Hugging Face computes them:
// inv_freq[i] = 1 / theta^(2i / head_dim), i < head_dim/2, optionally rescaled with the
// "llama3" rule (Llama 3.1+): wavelengths longer than original_max / low_freq_factor are
// divided by `factor`, shorter than original_max / high_freq_factor kept, and the band in
// between interpolated smoothly.
#pragma once

#include "core/tensor.h"
#include "model/config.h"

namespace opd {

// f32 [head_dim / 2], computed in double and rounded once.
Tensor rope_inv_freq(const ModelConfig& config);

}  // namespace opd
