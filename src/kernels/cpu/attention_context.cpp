// Causal grouped-query attention of query rows over cached context, the naive reference (f64
// accumulation): sequence b has len_q = cu_q[b+1] - cu_q[b] query rows that are the LAST len_q
// of its len_k = cu_k[b+1] - cu_k[b] keys (bottom-right aligned causal mask, FlashAttention-2's
// convention for len_q != len_k): query i sees keys 0 .. len_k - len_q + i. S = scale q k^T,
// lse = logsumexp(S), out = exp(S - lse) v. With cu_q == cu_k it is attention_forward.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/cpu/cpu_ops.h"

namespace opd::cpu {

void check_cu_seqlens_context(const char* op, const int32_t* cu_q, const int32_t* cu_k,
                              int64_t batch, int64_t n_q, int64_t n_k) {
  check_cu_seqlens(op, cu_q, batch, n_q);
  check_cu_seqlens(op, cu_k, batch, n_k);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len_q = cu_q[b + 1] - cu_q[b], len_k = cu_k[b + 1] - cu_k[b];
    OPD_CHECK(len_k >= len_q, InvalidData, op, ": sequence ", b, " has ", len_q,
              " query rows but only ", len_k, " keys (queries are the last rows of the keys)");
  }
}

template <typename T>
void attention_forward_context(const T* q, const T* k, const T* v, const int32_t* cu_q,
                               const int32_t* cu_k, int64_t batch, int64_t n_q, int64_t n_k,
                               int64_t hq, int64_t hkv, int64_t d, double scale, T* out, T* lse) {
  check_cu_seqlens_context("attention_forward_context", cu_q, cu_k, batch, n_q, n_k);
  OPD_CHECK(hkv >= 1 && hq % hkv == 0, InvalidArgument, "attention_forward_context: query heads ",
            hq, " must be a multiple of kv heads ", hkv);
  const int64_t group = hq / hkv;
  // One task per (sequence, query head): they write disjoint rows of out and lse.
  parallel_for(batch * hq, [&](int64_t begin, int64_t end) {
    std::vector<double> scores, acc(static_cast<size_t>(d));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / hq, h = task % hq, g = h / group;
      const int64_t q0 = cu_q[b], len_q = cu_q[b + 1] - q0, k0 = cu_k[b];
      const int64_t offset = (cu_k[b + 1] - k0) - len_q;  // keys before the first query row
      scores.resize(static_cast<size_t>(cu_k[b + 1] - k0));
      for (int64_t i = 0; i < len_q; ++i) {
        const T* qi = q + ((q0 + i) * hq + h) * d;
        const int64_t n_keys = offset + i + 1;  // causal, bottom-right aligned
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < n_keys; ++j) {
          const T* kj = k + ((k0 + j) * hkv + g) * d;
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += static_cast<double>(qi[c]) * kj[c];
          scores[static_cast<size_t>(j)] = scale * dot;
          m = std::max(m, scores[static_cast<size_t>(j)]);
        }
        double sum = 0;  // stable log-sum-exp: shifted by the row max
        for (int64_t j = 0; j < n_keys; ++j) sum += std::exp(scores[static_cast<size_t>(j)] - m);
        const double row_lse = m + std::log(sum);
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < n_keys; ++j) {
          const double p = std::exp(scores[static_cast<size_t>(j)] - row_lse);
          const T* vj = v + ((k0 + j) * hkv + g) * d;
          for (int64_t c = 0; c < d; ++c) acc[static_cast<size_t>(c)] += p * vj[c];
        }
        T* oi = out + ((q0 + i) * hq + h) * d;
        for (int64_t c = 0; c < d; ++c) oi[c] = static_cast<T>(acc[static_cast<size_t>(c)]);
        lse[(q0 + i) * hq + h] = static_cast<T>(row_lse);
      }
    }
  });
}

template void attention_forward_context<float>(const float*, const float*, const float*,
                                               const int32_t*, const int32_t*, int64_t, int64_t,
                                               int64_t, int64_t, int64_t, int64_t, double, float*,
                                               float*);
template void attention_forward_context<double>(const double*, const double*, const double*,
                                                const int32_t*, const int32_t*, int64_t, int64_t,
                                                int64_t, int64_t, int64_t, int64_t, double,
                                                double*, double*);

}  // namespace opd::cpu
