// RMSNorm over the last dimension (Zhang & Sennrich 2019): y = x * rstd * w with
// rstd = 1/sqrt(mean(x^2) + eps), and its backward
// dx = rstd * (w*dy - x * rstd^2 * mean(x*w*dy)), dw += sum_rows dy * x * rstd.
#include <cmath>
#include <vector>

#include "core/thread_pool.h"
#include "kernels/cpu/cpu_ops.h"

namespace opd::cpu {

template <typename T>
void rmsnorm_forward(const T* x, const T* w, double eps, int64_t n, int64_t h, T* y, T* rstd) {
  parallel_for(n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * h;
      double sum_sq = 0;  // double: a mean of h squares loses digits in float for large h
      for (int64_t c = 0; c < h; ++c) sum_sq += static_cast<double>(xr[c]) * xr[c];
      double rs = 1.0 / std::sqrt(sum_sq / static_cast<double>(h) + eps);
      rstd[r] = static_cast<T>(rs);
      for (int64_t c = 0; c < h; ++c) y[r * h + c] = static_cast<T>(xr[c] * rs * w[c]);
    }
  });
}

template <typename T>
void rmsnorm_backward(const T* dy, const T* x, const T* w, const T* rstd, int64_t n, int64_t h,
                      T* dx, T* dw) {
  parallel_for(n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * h;
      const T* dyr = dy + r * h;
      double rs = rstd[r];
      double dot = 0;  // sum(x * w * dy)
      for (int64_t c = 0; c < h; ++c) dot += static_cast<double>(xr[c]) * w[c] * dyr[c];
      double mean = dot / static_cast<double>(h);
      for (int64_t c = 0; c < h; ++c) {
        dx[r * h + c] = static_cast<T>(rs * (static_cast<double>(w[c]) * dyr[c] -
                                             xr[c] * rs * rs * mean));
      }
    }
  });
  // dw sums over rows: split the columns among threads so each sum runs in row order.
  parallel_for(
      h,
      [&](int64_t c0, int64_t c1) {
        std::vector<double> acc(static_cast<size_t>(c1 - c0), 0.0);
        for (int64_t r = 0; r < n; ++r) {
          double rs = rstd[r];
          for (int64_t c = c0; c < c1; ++c)
            acc[c - c0] += static_cast<double>(dy[r * h + c]) * x[r * h + c] * rs;
        }
        for (int64_t c = c0; c < c1; ++c) dw[c] = static_cast<T>(dw[c] + acc[c - c0]);
      },
      64);
}

template void rmsnorm_forward<float>(const float*, const float*, double, int64_t, int64_t, float*,
                                     float*);
template void rmsnorm_forward<double>(const double*, const double*, double, int64_t, int64_t,
                                      double*, double*);
template void rmsnorm_backward<float>(const float*, const float*, const float*, const float*,
                                      int64_t, int64_t, float*, float*);
template void rmsnorm_backward<double>(const double*, const double*, const double*, const double*,
                                       int64_t, int64_t, double*, double*);

}  // namespace opd::cpu
