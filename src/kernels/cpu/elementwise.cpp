// Elementwise sums: out = a + b, and acc += x (residual adds and gradient accumulation).
#include "core/thread_pool.h"
#include "kernels/cpu/cpu_ops.h"

namespace opd::cpu {

template <typename T>
void add(const T* a, const T* b, int64_t n, T* out) {
  parallel_for(
      n,
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) out[i] = a[i] + b[i];
      },
      1 << 14);
}

template <typename T>
void add_inplace(T* acc, const T* x, int64_t n) {
  parallel_for(
      n,
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) acc[i] += x[i];
      },
      1 << 14);
}

template void add<float>(const float*, const float*, int64_t, float*);
template void add<double>(const double*, const double*, int64_t, double*);
template void add_inplace<float>(float*, const float*, int64_t);
template void add_inplace<double>(double*, const double*, int64_t);

}  // namespace opd::cpu
