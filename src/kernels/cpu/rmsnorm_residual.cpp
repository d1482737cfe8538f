// RMSNorm fused with the residual add before it (the reference for the fused CUDA kernel):
// sum = x + r, y = rmsnorm(sum) * w; backward ds = rmsnorm_dx(dy; sum) + dres, dw += as in
// rmsnorm_backward (formulas in rmsnorm.cpp). Composed from the plain references on purpose:
// the fused op must equal add followed by rmsnorm exactly.
#include <cstddef>
#include <vector>

#include "kernels/cpu/cpu_ops.h"

namespace opd::cpu {

template <typename T>
void rmsnorm_residual_forward(const T* x, const T* r, const T* w, double eps, int64_t n,
                              int64_t h, T* sum, T* y, T* rstd) {
  add(x, r, n * h, sum);
  rmsnorm_forward(sum, w, eps, n, h, y, rstd);
}

template <typename T>
void rmsnorm_residual_backward(const T* dy, const T* sum, const T* w, const T* rstd,
                               const T* dres, int64_t n, int64_t h, T* ds, T* dw) {
  // A temporary for the norm's part: ds may be the same buffer as dres.
  std::vector<T> dnorm(static_cast<size_t>(n * h));
  rmsnorm_backward(dy, sum, w, rstd, n, h, dnorm.data(), dw);
  add(dnorm.data(), dres, n * h, ds);
}

template void rmsnorm_residual_forward<float>(const float*, const float*, const float*, double,
                                              int64_t, int64_t, float*, float*, float*);
template void rmsnorm_residual_forward<double>(const double*, const double*, const double*,
                                               double, int64_t, int64_t, double*, double*,
                                               double*);
template void rmsnorm_residual_backward<float>(const float*, const float*, const float*,
                                               const float*, const float*, int64_t, int64_t,
                                               float*, float*);
template void rmsnorm_residual_backward<double>(const double*, const double*, const double*,
                                                const double*, const double*, int64_t, int64_t,
                                                double*, double*);

}  // namespace opd::cpu
