// Per-row cross-entropy against integer targets with a stable log-sum-exp:
// lse = m + log(sum exp(z - m)), loss = lse - z[target] (0 for target -100), and the backward
// dlogits = scale * (softmax(z) - onehot(target)), 0 for ignored rows.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/cpu/cpu_ops.h"

namespace opd::cpu {

void check_targets(const char* op, const int32_t* targets, int64_t n, int64_t vocab) {
  for (int64_t t = 0; t < n; ++t) {
    int32_t y = targets[t];
    OPD_CHECK(y == kIgnoreIndex || (y >= 0 && y < vocab), InvalidData, op, ": target ", y,
              " at row ", t, " is outside the vocabulary [0, ", vocab,
              ") and is not the ignore index ", kIgnoreIndex);
  }
}

template <typename T>
int64_t cross_entropy_forward(const T* logits, const int32_t* targets, int64_t n, int64_t vocab,
                              T* losses, T* lse) {
  check_targets("cross_entropy_forward", targets, n, vocab);
  parallel_for(n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* z = logits + r * vocab;
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t c = 0; c < vocab; ++c) m = std::max(m, static_cast<double>(z[c]));
      double sum = 0;
      for (int64_t c = 0; c < vocab; ++c) sum += std::exp(static_cast<double>(z[c]) - m);
      double row_lse = m + std::log(sum);
      lse[r] = static_cast<T>(row_lse);
      losses[r] = targets[r] == kIgnoreIndex ? T(0) : static_cast<T>(row_lse - z[targets[r]]);
    }
  });
  return std::count_if(targets, targets + n, [](int32_t y) { return y != kIgnoreIndex; });
}

template <typename T>
void cross_entropy_backward(const T* logits, const int32_t* targets, const T* lse, int64_t n,
                            int64_t vocab, double scale, T* dlogits) {
  check_targets("cross_entropy_backward", targets, n, vocab);
  parallel_for(n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* z = logits + r * vocab;
      T* dz = dlogits + r * vocab;
      if (targets[r] == kIgnoreIndex) {
        std::fill(dz, dz + vocab, T(0));
        continue;
      }
      double row_lse = lse[r];
      for (int64_t c = 0; c < vocab; ++c) {
        double p = std::exp(static_cast<double>(z[c]) - row_lse);
        dz[c] = static_cast<T>(scale * (p - (c == targets[r] ? 1.0 : 0.0)));
      }
    }
  });
}

template int64_t cross_entropy_forward<float>(const float*, const int32_t*, int64_t, int64_t,
                                              float*, float*);
template int64_t cross_entropy_forward<double>(const double*, const int32_t*, int64_t, int64_t,
                                               double*, double*);
template void cross_entropy_backward<float>(const float*, const int32_t*, const float*, int64_t,
                                            int64_t, double, float*);
template void cross_entropy_backward<double>(const double*, const int32_t*, const double*,
                                             int64_t, int64_t, double, double*);

}  // namespace opd::cpu
