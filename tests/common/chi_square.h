// Pearson's chi-square goodness-of-fit test for sampler tests (the CPU sampler against
// transformers, the CUDA sampler against the CPU's): the upper-tail p-value of the chi-square
// distribution (Numerical Recipes 6.2) and the test statistic with small bins pooled.
// Checked against the standard tables in tests/rollout/test_sampler.cpp (ChiSquare.*).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace opd::test {

// Upper tail of the chi-square distribution with df degrees of freedom: Q(df/2, x/2), the
// regularized upper incomplete gamma function (series below a + 1, Lentz continued fraction
// above; Numerical Recipes 6.2).
inline double chi2_pvalue(double x, int df) {
  const double a = df / 2.0, z = x / 2.0;
  if (z <= 0) return 1.0;
  const double log_front = -z + a * std::log(z) - std::lgamma(a);
  if (z < a + 1) {
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 10000; ++n) {
      term *= z / (a + n);
      sum += term;
      if (term < sum * 1e-16) break;
    }
    return 1.0 - sum * std::exp(log_front);
  }
  const double tiny = 1e-300;
  double b = z + 1 - a, c = 1 / tiny, d = 1 / b, h = d;
  for (int i = 1; i < 10000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (std::fabs(d) < tiny) d = tiny;
    c = b + an / c;
    if (std::fabs(c) < tiny) c = tiny;
    d = 1 / d;
    const double del = d * c;
    h *= del;
    if (std::fabs(del - 1) < 1e-16) break;
  }
  return std::exp(log_front) * h;
}

// Pearson's chi-square of counts against probabilities; bins with expected count < 5 are
// pooled into one (the usual validity rule). A count in a zero-probability bin is p = 0.
inline double chi2_test(const std::vector<int64_t>& counts, const std::vector<double>& probs) {
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  double stat = 0, pooled_e = 0;
  int64_t pooled_c = 0;
  int bins = 0;
  for (size_t v = 0; v < counts.size(); ++v) {
    const double e = probs[v] * static_cast<double>(total);
    if (probs[v] == 0) {
      if (counts[v] > 0) return 0.0;
      continue;
    }
    if (e < 5) {
      pooled_e += e;
      pooled_c += counts[v];
      continue;
    }
    stat += (counts[v] - e) * (counts[v] - e) / e;
    ++bins;
  }
  if (pooled_e > 0) {
    stat += (pooled_c - pooled_e) * (pooled_c - pooled_e) / pooled_e;
    ++bins;
  }
  return bins <= 1 ? 1.0 : chi2_pvalue(stat, bins - 1);
}

}  // namespace opd::test
