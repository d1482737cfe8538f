// Paged KV cache reference kernels: kv_cache_store scatters new K/V rows into cache slots, and
// paged_attention computes causal GQA attention of new query rows over keys gathered through a
// block table (formulas in kernels/ops.h). Same two-pass, double-accumulated softmax as the
// dense reference (attention.cpp), so the two agree to rounding.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/cpu/cpu_ops.h"

namespace opd::cpu {

template <typename T>
void kv_cache_store(const T* k, const T* v, const int32_t* slot_mapping, int64_t n,
                    int64_t num_blocks, int64_t block_size, int64_t hkv, int64_t d, T* k_cache,
                    T* v_cache) {
  const int64_t slots = num_blocks * block_size, row = hkv * d;
  // Validate every slot before writing any: a bad index must not leave a half-written cache.
  for (int64_t t = 0; t < n; ++t) {
    OPD_CHECK(slot_mapping[t] >= 0 && slot_mapping[t] < slots, InvalidData,
              "kv_cache_store: slot ", slot_mapping[t], " at row ", t,
              " is outside the cache [0, ", slots, ") (", num_blocks, " blocks of ", block_size,
              ")");
  }
  for (int64_t t = 0; t < n; ++t) {
    const int64_t s = slot_mapping[t];
    std::copy(k + t * row, k + (t + 1) * row, k_cache + s * row);
    std::copy(v + t * row, v + (t + 1) * row, v_cache + s * row);
  }
}

void check_paged_indices(const int32_t* cu_seqlens_q, const int32_t* seq_lens,
                         const int32_t* block_tables, int64_t batch, int64_t n,
                         int64_t num_blocks, int64_t block_size, int64_t max_blocks) {
  check_cu_seqlens("paged_attention", cu_seqlens_q, batch, n);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b], len = seq_lens[b];
    OPD_CHECK(len >= q_len, InvalidData, "paged_attention: sequence ", b, " has seq_len ", len,
              " but ", q_len, " query rows (its new tokens must be in the cache)");
    OPD_CHECK(len <= max_blocks * block_size, InvalidData, "paged_attention: sequence ", b,
              " has seq_len ", len, " but its block table holds at most ", max_blocks, " x ",
              block_size, " = ", max_blocks * block_size, " tokens");
    for (int64_t j = 0; j < (len + block_size - 1) / block_size; ++j) {
      const int32_t blk = block_tables[b * max_blocks + j];
      OPD_CHECK(blk >= 0 && blk < num_blocks, InvalidData, "paged_attention: block_tables[", b,
                ", ", j, "] = ", blk, " is outside the cache [0, ", num_blocks, ")");
    }
  }
}

template <typename T>
void paged_attention(const T* q, const T* k_cache, const T* v_cache, const int32_t* cu_seqlens_q,
                     const int32_t* seq_lens, const int32_t* block_tables, int64_t batch,
                     int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t num_blocks,
                     int64_t block_size, int64_t max_blocks, double scale, T* out) {
  check_paged_indices(cu_seqlens_q, seq_lens, block_tables, batch, n, num_blocks, block_size,
                      max_blocks);
  const int64_t group = hq / hkv;
  // One task per (sequence, query head): they write disjoint rows of out.
  parallel_for(batch * hq, [&](int64_t begin, int64_t end) {
    std::vector<double> scores, acc(static_cast<size_t>(d));
    std::vector<const T*> krow, vrow;  // per position: the cache row of kv head g
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / hq, h = task % hq, g = h / group;
      const int64_t q0 = cu_seqlens_q[b], q1 = cu_seqlens_q[b + 1], len = seq_lens[b];
      if (q0 == q1) continue;
      krow.resize(static_cast<size_t>(len));
      vrow.resize(static_cast<size_t>(len));
      for (int64_t p = 0; p < len; ++p) {
        const int64_t slot = block_tables[b * max_blocks + p / block_size] * block_size +
                             p % block_size;
        krow[p] = k_cache + (slot * hkv + g) * d;
        vrow[p] = v_cache + (slot * hkv + g) * d;
      }
      scores.resize(static_cast<size_t>(len));
      for (int64_t i = q0; i < q1; ++i) {
        const int64_t pos = len - (q1 - q0) + (i - q0);  // this query row's position
        const T* qi = q + (i * hq + h) * d;
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= pos; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += static_cast<double>(qi[c]) * krow[j][c];
          scores[j] = scale * dot;
          m = std::max(m, scores[j]);
        }
        // Stable log-sum-exp: shift by the row max so exp never overflows.
        double sum = 0;
        for (int64_t j = 0; j <= pos; ++j) sum += std::exp(scores[j] - m);
        const double lse = m + std::log(sum);
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j <= pos; ++j) {
          const double p = std::exp(scores[j] - lse);
          for (int64_t c = 0; c < d; ++c) acc[c] += p * vrow[j][c];
        }
        T* oi = out + (i * hq + h) * d;
        for (int64_t c = 0; c < d; ++c) oi[c] = static_cast<T>(acc[c]);
      }
    }
  });
}

#define OPD_INSTANTIATE(T)                                                                     \
  template void kv_cache_store<T>(const T*, const T*, const int32_t*, int64_t, int64_t,        \
                                  int64_t, int64_t, int64_t, T*, T*);                          \
  template void paged_attention<T>(const T*, const T*, const T*, const int32_t*,               \
                                   const int32_t*, const int32_t*, int64_t, int64_t, int64_t,  \
                                   int64_t, int64_t, int64_t, int64_t, int64_t, double, T*);
OPD_INSTANTIATE(float)
OPD_INSTANTIATE(double)
#undef OPD_INSTANTIATE

}  // namespace opd::cpu
