// Token embedding lookup and its scatter-add backward: out[t, :] = table[ids[t], :] and
// dtable[ids[t], :] += dout[t, :], with every id checked against [0, V) before anything is written.
#include <algorithm>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/cpu/cpu_ops.h"

namespace opd::cpu {

void check_token_ids(const char* op, const int32_t* ids, int64_t n, int64_t vocab) {
  for (int64_t t = 0; t < n; ++t) {
    OPD_CHECK(ids[t] >= 0 && ids[t] < vocab, InvalidData, op, ": token id ", ids[t], " at row ",
              t, " is outside the vocabulary [0, ", vocab, ")");
  }
}

template <typename T>
void embedding_forward(const int32_t* ids, const T* table, int64_t n, int64_t vocab,
                       int64_t hidden, T* out) {
  check_token_ids("embedding_forward", ids, n, vocab);
  parallel_for(n, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* src = table + static_cast<int64_t>(ids[t]) * hidden;
      std::copy(src, src + hidden, out + t * hidden);
    }
  });
}

template <typename T>
void embedding_backward(const int32_t* ids, const T* dout, int64_t n, int64_t vocab,
                        int64_t hidden, T* dtable) {
  check_token_ids("embedding_backward", ids, n, vocab);
  // Repeated ids make rows collide, so threads split the hidden columns instead of the rows:
  // every element of dtable then receives its contributions in row order, deterministically.
  parallel_for(
      hidden,
      [&](int64_t c0, int64_t c1) {
        for (int64_t t = 0; t < n; ++t) {
          T* dst = dtable + static_cast<int64_t>(ids[t]) * hidden;
          const T* src = dout + t * hidden;
          for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
        }
      },
      64);
}

template void embedding_forward<float>(const int32_t*, const float*, int64_t, int64_t, int64_t,
                                       float*);
template void embedding_forward<double>(const int32_t*, const double*, int64_t, int64_t, int64_t,
                                        double*);
template void embedding_backward<float>(const int32_t*, const float*, int64_t, int64_t, int64_t,
                                        float*);
template void embedding_backward<double>(const int32_t*, const double*, int64_t, int64_t,
                                         int64_t, double*);

}  // namespace opd::cpu
