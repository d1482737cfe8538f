// Rotary position embedding (Su et al. 2021) in the Hugging Face "rotate_half" layout, in
// place: for i < d/2, angle = positions[t] * inv_freq[i],
// x[i]' = x[i] cos - x[i+d/2] sin, x[i+d/2]' = x[i+d/2] cos + x[i] sin; the backward applies
// the transpose, i.e. the rotation by -angle.
#include <cmath>
#include <type_traits>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/cpu/cpu_ops.h"

namespace opd::cpu {

void check_positions(const char* op, const int32_t* positions, int64_t n) {
  for (int64_t t = 0; t < n; ++t) {
    OPD_CHECK(positions[t] >= 0, InvalidData, op, ": position ", positions[t], " at row ", t,
              " is negative (positions must be >= 0)");
  }
}

namespace {

// sign = +1 rotates by +angle (forward), -1 by -angle (backward = transpose of forward).
template <typename T>
void rotate(T* x, const int32_t* positions, const double* inv_freq, int64_t n, int64_t heads,
            int64_t head_dim, double sign) {
  int64_t half = head_dim / 2;
  parallel_for(n, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        // f32 activations: the angle is the f32 product position * inv_freq, as transformers
        // (and the frameworks models are pretrained with) form it, so long positions rotate
        // exactly as the model expects (a double angle differs by ~2e-3 rad at 32k).
        // f64 (the finite-difference reference): the angle in double.
        double angle;
        if constexpr (std::is_same_v<T, float>)
          angle = static_cast<double>(static_cast<float>(positions[t]) *
                                      static_cast<float>(inv_freq[i]));
        else
          angle = static_cast<double>(positions[t]) * inv_freq[i];
        double c = std::cos(angle), s = sign * std::sin(angle);
        for (int64_t hd = 0; hd < heads; ++hd) {
          T* row = x + (t * heads + hd) * head_dim;
          double x1 = row[i], x2 = row[i + half];
          row[i] = static_cast<T>(x1 * c - x2 * s);
          row[i + half] = static_cast<T>(x2 * c + x1 * s);
        }
      }
    }
  });
}

}  // namespace

template <typename T>
void rope_forward(T* x, const int32_t* positions, const double* inv_freq, int64_t n,
                  int64_t heads, int64_t head_dim) {
  check_positions("rope_forward", positions, n);
  rotate(x, positions, inv_freq, n, heads, head_dim, 1.0);
}

template <typename T>
void rope_backward(T* dx, const int32_t* positions, const double* inv_freq, int64_t n,
                   int64_t heads, int64_t head_dim) {
  check_positions("rope_backward", positions, n);
  rotate(dx, positions, inv_freq, n, heads, head_dim, -1.0);
}

template void rope_forward<float>(float*, const int32_t*, const double*, int64_t, int64_t,
                                  int64_t);
template void rope_forward<double>(double*, const int32_t*, const double*, int64_t, int64_t,
                                   int64_t);
template void rope_backward<float>(float*, const int32_t*, const double*, int64_t, int64_t,
                                   int64_t);
template void rope_backward<double>(double*, const int32_t*, const double*, int64_t, int64_t,
                                    int64_t);

}  // namespace opd::cpu
