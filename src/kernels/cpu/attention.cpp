// Causal grouped-query attention over packed variable-length sequences, the naive O(L^2)
// reference: S = scale * q k^T over rows cu_seqlens[b] .. t, lse = logsumexp(S),
// out = exp(S - lse) v; backward with P = exp(S - lse), dP = dout v^T,
// dS = P * (dP - rowsum(dout * out)), dq = scale dS k, dk = scale dS^T q, dv = P^T dout.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/cpu/cpu_ops.h"

namespace opd::cpu {

void check_cu_seqlens(const char* op, const int32_t* cu_seqlens, int64_t batch, int64_t n) {
  OPD_CHECK(cu_seqlens[0] == 0, InvalidData, op, ": cu_seqlens[0] = ", cu_seqlens[0],
            " but must be 0");
  for (int64_t b = 1; b <= batch; ++b) {
    OPD_CHECK(cu_seqlens[b] >= cu_seqlens[b - 1], InvalidData, op, ": cu_seqlens[", b, "] = ",
              cu_seqlens[b], " is less than cu_seqlens[", b - 1, "] = ", cu_seqlens[b - 1],
              " (must be non-decreasing)");
    OPD_CHECK(cu_seqlens[b] <= n, InvalidData, op, ": cu_seqlens[", b, "] = ", cu_seqlens[b],
              " exceeds the number of rows T = ", n);
  }
  OPD_CHECK(cu_seqlens[batch] == n, InvalidData, op, ": cu_seqlens[", batch, "] = ",
            cu_seqlens[batch], " but must equal the number of rows T = ", n);
}

template <typename T>
void attention_forward(const T* q, const T* k, const T* v, const int32_t* cu_seqlens,
                       int64_t batch, int64_t n, int64_t hq, int64_t hkv, int64_t d, double scale,
                       T* out, T* lse) {
  check_cu_seqlens("attention_forward", cu_seqlens, batch, n);
  int64_t group = hq / hkv;
  // One task per (sequence, query head): they write disjoint rows of out and lse.
  parallel_for(batch * hq, [&](int64_t begin, int64_t end) {
    std::vector<double> scores, acc(static_cast<size_t>(d));
    for (int64_t task = begin; task < end; ++task) {
      int64_t b = task / hq, h = task % hq, g = h / group;
      int64_t s0 = cu_seqlens[b], s1 = cu_seqlens[b + 1];
      scores.resize(static_cast<size_t>(s1 - s0));
      for (int64_t i = s0; i < s1; ++i) {
        const T* qi = q + (i * hq + h) * d;
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = s0; j <= i; ++j) {  // causal: keys up to and including row i
          const T* kj = k + (j * hkv + g) * d;
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += static_cast<double>(qi[c]) * kj[c];
          scores[j - s0] = scale * dot;
          m = std::max(m, scores[j - s0]);
        }
        // Stable log-sum-exp: shift by the row max so exp never overflows.
        double sum = 0;
        for (int64_t j = s0; j <= i; ++j) sum += std::exp(scores[j - s0] - m);
        double row_lse = m + std::log(sum);
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = s0; j <= i; ++j) {
          double p = std::exp(scores[j - s0] - row_lse);
          const T* vj = v + (j * hkv + g) * d;
          for (int64_t c = 0; c < d; ++c) acc[c] += p * vj[c];
        }
        T* oi = out + (i * hq + h) * d;
        for (int64_t c = 0; c < d; ++c) oi[c] = static_cast<T>(acc[c]);
        lse[i * hq + h] = static_cast<T>(row_lse);
      }
    }
  });
}

template <typename T>
void attention_backward(const T* dout, const T* q, const T* k, const T* v, const T* out,
                        const T* lse, const int32_t* cu_seqlens, int64_t batch, int64_t n,
                        int64_t hq, int64_t hkv, int64_t d, double scale, T* dq, T* dk, T* dv) {
  check_cu_seqlens("attention_backward", cu_seqlens, batch, n);
  int64_t group = hq / hkv;
  // One task per (sequence, kv head): dk/dv of a kv head gather from all query heads of its
  // group, so that task owns the whole group and every write stays disjoint (no atomics).
  parallel_for(batch * hkv, [&](int64_t begin, int64_t end) {
    std::vector<double> p, ds, dk_acc, dv_acc, dq_acc(static_cast<size_t>(d));
    for (int64_t task = begin; task < end; ++task) {
      int64_t b = task / hkv, g = task % hkv;
      int64_t s0 = cu_seqlens[b], s1 = cu_seqlens[b + 1], len = s1 - s0;
      p.resize(static_cast<size_t>(len));
      ds.resize(static_cast<size_t>(len));
      dk_acc.assign(static_cast<size_t>(len * d), 0.0);
      dv_acc.assign(static_cast<size_t>(len * d), 0.0);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t i = s0; i < s1; ++i) {
          const T* qi = q + (i * hq + h) * d;
          const T* doi = dout + (i * hq + h) * d;
          const T* oi = out + (i * hq + h) * d;
          double row_lse = lse[i * hq + h];
          double delta = 0;  // rowsum(dout * out) = sum_j P_ij dP_ij
          for (int64_t c = 0; c < d; ++c) delta += static_cast<double>(doi[c]) * oi[c];
          for (int64_t j = s0; j <= i; ++j) {
            const T* kj = k + (j * hkv + g) * d;
            const T* vj = v + (j * hkv + g) * d;
            double dot = 0, dp = 0;
            for (int64_t c = 0; c < d; ++c) {
              dot += static_cast<double>(qi[c]) * kj[c];
              dp += static_cast<double>(doi[c]) * vj[c];
            }
            p[j - s0] = std::exp(scale * dot - row_lse);
            ds[j - s0] = p[j - s0] * (dp - delta);
          }
          std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
          for (int64_t j = s0; j <= i; ++j) {
            const T* kj = k + (j * hkv + g) * d;
            double* dkj = dk_acc.data() + (j - s0) * d;
            double* dvj = dv_acc.data() + (j - s0) * d;
            for (int64_t c = 0; c < d; ++c) {
              dq_acc[c] += ds[j - s0] * kj[c];
              dkj[c] += ds[j - s0] * qi[c];
              dvj[c] += p[j - s0] * doi[c];
            }
          }
          T* dqi = dq + (i * hq + h) * d;
          for (int64_t c = 0; c < d; ++c) dqi[c] = static_cast<T>(scale * dq_acc[c]);
        }
      }
      for (int64_t j = s0; j < s1; ++j) {
        T* dkj = dk + (j * hkv + g) * d;
        T* dvj = dv + (j * hkv + g) * d;
        for (int64_t c = 0; c < d; ++c) {
          dkj[c] = static_cast<T>(scale * dk_acc[(j - s0) * d + c]);
          dvj[c] = static_cast<T>(dv_acc[(j - s0) * d + c]);
        }
      }
    }
  });
}

template void attention_forward<float>(const float*, const float*, const float*, const int32_t*,
                                       int64_t, int64_t, int64_t, int64_t, int64_t, double,
                                       float*, float*);
template void attention_forward<double>(const double*, const double*, const double*,
                                        const int32_t*, int64_t, int64_t, int64_t, int64_t,
                                        int64_t, double, double*, double*);
template void attention_backward<float>(const float*, const float*, const float*, const float*,
                                        const float*, const float*, const int32_t*, int64_t,
                                        int64_t, int64_t, int64_t, int64_t, double, float*,
                                        float*, float*);
template void attention_backward<double>(const double*, const double*, const double*,
                                         const double*, const double*, const double*,
                                         const int32_t*, int64_t, int64_t, int64_t, int64_t,
                                         int64_t, double, double*, double*, double*);

}  // namespace opd::cpu
