// Per-position generalized JSD of DESIGN.md "Loss", as plain inline functions shared by the CPU
// fused loss and (mirrored, same code) the CUDA kernel: nothing here allocates or indexes with
// data, so every function is __host__ __device__ under nvcc.
//
// P = teacher, Q = student, both at temperature T (logits / T). Per completion token:
// - beta=0: forward KL(P||Q); beta=1: reverse KL(Q||P) (TRL / ms-swift convention);
// - 0<beta<1: JSD(beta) = beta*KL(P||M) + (1-beta)*KL(Q||M), M = beta*P + (1-beta)*Q.
// For one position with student logits z (full vocabulary V) and teacher top-K ids
// S = {i_1..i_K} with teacher log-probabilities a_k = log p(i_k) (normalized over the full
// vocabulary, at temperature T):
// - full: p and q over all of V (teacher logits tiled like the student's: LSEs first,
//   divergence second).
// - topk: p~_k = softmax(a)_k, q~_k = softmax(z_S / T)_k; divergence over K atoms.
// - topk+tail: K+1 atoms. Teacher: p_k = exp(a_k), tail p_R = 1 - sum_k p_k. Student:
//   q_k = exp(z_{i_k}/T - LSE(z/T)) with the exact log-sum-exp over V, tail q_R = 1 - sum_k q_k.
//   Log-tails are log1p(-sum) clamped at a tiny floor (log(tail_floor), no gradient there);
//   a coarsening of the full distributions, so a lower bound of the full divergence that
//   equals it when the tails vanish.
// - sampled: r_t = log p(y_t) - log q(y_t); loss = -sum_t sg(r_t) * log q(y_t) / N
//   (REINFORCE with a per-token reward, no discount; sg = stop-gradient).
// - cross-entropy (sft_alpha, dataset rows): ce = LSE(z) - z_y at temperature 1 (plain SFT).
// Gradients flow only into the student; teacher values are constants.
//
// Gradients. With g_j = dD/d(log q_j) per atom (log q_j treated as free variables):
//   beta=0: g = -p;  beta=1: g = q (log q - log p + 1);  else g = (1-beta) q (log q - log m).
// Chaining through log q = s - LSE(s), s = z / T, gives dD/ds_v = g_v - q_v * sum_j g_j (full,
// topk over the K atoms), and for topk+tail (tail derivative d log q_R / d log q_k = -q_k/q_R):
//   h_k = g_k - (g_R / q_R) q_k,  dD/ds_v = sum_k h_k [v = i_k] - q_v sum_k h_k.
// So every mode's d z is (dense coefficient per row) * softmax(z/T)_v + sparse terms at the K
// ids and the target, which is what lets the fused kernel recompute logits tile by tile.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define OPD_LOSS_HD __host__ __device__ inline
#else
#define OPD_LOSS_HD inline
#endif

namespace opd::loss {

// log(exp(a) + exp(b)) without overflow; -inf if both are -inf.
OPD_LOSS_HD double log_add_exp(double a, double b) {
  double m = a > b ? a : b;
  if (m == -INFINITY) return -INFINITY;
  return m + ::log(::exp(a - m) + ::exp(b - m));
}

// One atom j of the divergence: its contribution d to D and g = dD/d(log q_j).
struct AtomTerm {
  double d;
  double g;
};

OPD_LOSS_HD AtomTerm atom_term(double logp, double logq, double beta) {
  double p = ::exp(logp), q = ::exp(logq);
  if (beta == 0.0) {  // KL(P||Q) = sum p (log p - log q)
    return {p == 0.0 ? 0.0 : p * (logp - logq), -p};
  }
  if (beta == 1.0) {  // KL(Q||P) = sum q (log q - log p)
    if (q == 0.0) return {0.0, 0.0};
    return {q * (logq - logp), q * (logq - logp + 1.0)};
  }
  // log m = log(beta p + (1-beta) q), as TRL computes the mixture (logsumexp of the two).
  double logm = log_add_exp(logp + ::log(beta), logq + ::log1p(-beta));
  double d = (p == 0.0 ? 0.0 : beta * p * (logp - logm)) +
             (q == 0.0 ? 0.0 : (1.0 - beta) * q * (logq - logm));
  return {d, q == 0.0 ? 0.0 : (1.0 - beta) * q * (logq - logm)};
}

// g / q for an atom with q > 0 (the tail atom): finite even where q is at the floor.
OPD_LOSS_HD double atom_g_over_q(double logp, double logq, double beta) {
  if (beta == 0.0) return -::exp(logp - logq);
  if (beta == 1.0) return logq - logp + 1.0;
  double logm = log_add_exp(logp + ::log(beta), logq + ::log1p(-beta));
  return (1.0 - beta) * (logq - logm);
}

// log(1 - sum) clamped at log_floor: the tail atom. Returns true in *clamped when the floor
// applied (then the tail carries no gradient).
OPD_LOSS_HD double log_tail(double sum, double tail_floor, bool* clamped) {
  if (sum < 1.0 - tail_floor) {
    *clamped = false;
    return ::log1p(-sum);
  }
  *clamped = true;
  return ::log(tail_floor);
}

// Result of one row: the divergence (or surrogate loss) and the dense coefficient `dense` such
// that dD/ds_v = dense * q_v + sparse_v, q = softmax(s), s = z / T.
struct RowResult {
  double value = 0;
  double dense = 0;
  bool tail_clamped = false;  // topk+tail: the student tail hit the floor
};

// topk: slots with ids[k] < 0 are empty (dropped by ClipToStudent) and are not atoms.
// s[k] = z_{i_k} / T, a[k] = teacher log-probability. Writes ds[k] = dD/ds_{i_k}.
OPD_LOSS_HD RowResult topk_row(int64_t k_slots, const int32_t* ids, const double* a,
                               const double* s, double beta, double* ds) {
  double ma = -INFINITY, ms = -INFINITY;
  for (int64_t k = 0; k < k_slots; ++k) {
    if (ids[k] < 0) continue;
    ma = a[k] > ma ? a[k] : ma;
    ms = s[k] > ms ? s[k] : ms;
  }
  RowResult res;
  if (ms == -INFINITY) {  // no atoms: nothing to match
    for (int64_t k = 0; k < k_slots; ++k) ds[k] = 0;
    return res;
  }
  double sa = 0, ss = 0;
  for (int64_t k = 0; k < k_slots; ++k) {
    if (ids[k] < 0) continue;
    sa += ::exp(a[k] - ma);
    ss += ::exp(s[k] - ms);
  }
  double lse_a = ma + ::log(sa), lse_s = ms + ::log(ss);
  double g_sum = 0;
  for (int64_t k = 0; k < k_slots; ++k) {
    if (ids[k] < 0) {
      ds[k] = 0;
      continue;
    }
    AtomTerm t = atom_term(a[k] - lse_a, s[k] - lse_s, beta);
    res.value += t.d;
    ds[k] = t.g;
    g_sum += t.g;
  }
  for (int64_t k = 0; k < k_slots; ++k) {
    if (ids[k] >= 0) ds[k] -= ::exp(s[k] - lse_s) * g_sum;
  }
  return res;
}

// topk+tail: lse = LSE(z/T) over the whole vocabulary. Writes ds[k] (sparse part at i_k) and
// returns the dense coefficient on q_v = exp(s_v - lse).
OPD_LOSS_HD RowResult topk_tail_row(int64_t k_slots, const int32_t* ids, const double* a,
                                    const double* s, double lse, double beta, double tail_floor,
                                    double* ds) {
  double sum_p = 0, sum_q = 0;
  for (int64_t k = 0; k < k_slots; ++k) {
    if (ids[k] < 0) continue;
    sum_p += ::exp(a[k]);
    sum_q += ::exp(s[k] - lse);
  }
  bool p_clamped = false, q_clamped = false;
  double logp_tail = log_tail(sum_p, tail_floor, &p_clamped);
  double logq_tail = log_tail(sum_q, tail_floor, &q_clamped);
  RowResult res;
  res.tail_clamped = q_clamped;
  for (int64_t k = 0; k < k_slots; ++k) {
    if (ids[k] < 0) {
      ds[k] = 0;
      continue;
    }
    AtomTerm t = atom_term(a[k], s[k] - lse, beta);
    res.value += t.d;
    ds[k] = t.g;
  }
  res.value += atom_term(logp_tail, logq_tail, beta).d;
  double rho = q_clamped ? 0.0 : atom_g_over_q(logp_tail, logq_tail, beta);  // g_R / q_R
  double h_sum = 0;
  for (int64_t k = 0; k < k_slots; ++k) {
    if (ids[k] < 0) continue;
    ds[k] -= rho * ::exp(s[k] - lse);
    h_sum += ds[k];
  }
  res.dense = -h_sum;
  return res;
}

// sampled: s_y = z_y / T, a_y = teacher log p(y). value = -sg(r) log q(y), r = a_y - log q(y).
// Writes *ds_y (sparse part at y); dense coefficient r on q.
OPD_LOSS_HD RowResult sampled_row(double a_y, double s_y, double lse, double* ds_y) {
  double logq_y = s_y - lse;
  double r = a_y - logq_y;
  RowResult res;
  res.value = -r * logq_y;
  res.dense = r;
  *ds_y = -r;
  return res;
}

// Cross-entropy at temperature 1: value = lse1 - z_y; dCE/dz_v = softmax(z)_v - [v = y].
OPD_LOSS_HD double cross_entropy_row(double z_y, double lse1) { return lse1 - z_y; }

// Online log-sum-exp state (running max m, sum of exp(x - m)), merged tile by tile.
struct OnlineLse {
  double m = -INFINITY;
  double s = 0;
  OPD_LOSS_HD void add_max_sum(double tile_max, double tile_sum) {  // tile_sum = sum exp(x - tile_max)
    if (tile_max == -INFINITY) return;
    if (tile_max > m) {
      s = s * ::exp(m - tile_max) + tile_sum;
      m = tile_max;
    } else {
      s += tile_sum * ::exp(tile_max - m);
    }
  }
  OPD_LOSS_HD double value() const { return m + ::log(s); }
};

}  // namespace opd::loss
