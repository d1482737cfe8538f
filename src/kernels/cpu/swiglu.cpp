// SwiGLU gating (Shazeer 2020): out = silu(gate) * up with silu(g) = g * sigmoid(g); backward
// dgate = dout * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))), dup = dout * silu(g).
#include <cmath>

#include "core/thread_pool.h"
#include "kernels/cpu/cpu_ops.h"

namespace opd::cpu {

namespace {

// Evaluated from the side where exp cannot overflow.
double sigmoid(double g) {
  if (g >= 0) return 1.0 / (1.0 + std::exp(-g));
  double e = std::exp(g);
  return e / (1.0 + e);
}

}  // namespace

template <typename T>
void swiglu_forward(const T* gate, const T* up, int64_t n, T* out) {
  parallel_for(
      n,
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          double g = gate[i];
          out[i] = static_cast<T>(g * sigmoid(g) * up[i]);
        }
      },
      4096);
}

template <typename T>
void swiglu_backward(const T* dout, const T* gate, const T* up, int64_t n, T* dgate, T* dup) {
  parallel_for(
      n,
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          double g = gate[i], s = sigmoid(g), dy = dout[i];
          dgate[i] = static_cast<T>(dy * up[i] * s * (1.0 + g * (1.0 - s)));
          dup[i] = static_cast<T>(dy * g * s);
        }
      },
      4096);
}

template void swiglu_forward<float>(const float*, const float*, int64_t, float*);
template void swiglu_forward<double>(const double*, const double*, int64_t, double*);
template void swiglu_backward<float>(const float*, const float*, const float*, int64_t, float*,
                                     float*);
template void swiglu_backward<double>(const double*, const double*, const double*, int64_t,
                                      double*, double*);

}  // namespace opd::cpu
