// Helpers shared by the kernel tests: f64 random tensors, the random-projection loss
// L = sum(out * R), central-difference gradients, error-message assertions.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>

#include "common/test_util.h"
#include "core/error.h"
#include "core/tensor.h"

namespace opd::test {

inline Tensor rand64(const Shape& shape, uint64_t seed, double lo = -1, double hi = 1) {
  return random_uniform(shape, DType::F64, seed, lo, hi);
}

// sum(a * b) over all elements, in double (a and b of any float dtype).
inline double dot(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += element(a, i) * element(b, i);
  return s;
}

// a - b for f64 tensors (the part of an accumulated gradient added by one backward call).
inline Tensor minus(const Tensor& a, const Tensor& b) {
  Tensor d = Tensor::empty(a.shape(), DType::F64);
  for (int64_t i = 0; i < a.numel(); ++i) d.data<double>()[i] = a.data<double>()[i] - b.data<double>()[i];
  return d;
}

// Central differences of loss() with respect to every element of x (f64; perturbed in place
// and restored). Truncation error ~eps^2, rounding ~1e-16 |L| / eps: ~1e-10 for eps = 1e-6.
inline Tensor numeric_grad(Tensor& x, const std::function<double()>& loss, double eps = 1e-6) {
  Tensor g = Tensor::empty(x.shape(), DType::F64);
  double* p = x.data<double>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    double saved = p[i];
    p[i] = saved + eps;
    double up = loss();
    p[i] = saved - eps;
    double down = loss();
    p[i] = saved;
    g.data<double>()[i] = (up - down) / (2 * eps);
  }
  return g;
}

// Analytic vs numeric gradient: relative L2 error <= 1e-7 and elementwise 1e-6 relative.
inline ::testing::AssertionResult grad_close(const Tensor& analytic, const Tensor& numeric) {
  return close(analytic, numeric, 1e-6, 1e-8, 1e-7);
}

// f32 result vs f64 result of the same inputs (f32 rounding, fp32 GEMM accumulation).
inline ::testing::AssertionResult f32_close(const Tensor& f32, const Tensor& f64,
                                            double rtol = 1e-5, double atol = 1e-6) {
  return close(f32, f64, rtol, atol, rtol);
}

// fn() throws opd::Error of `kind` whose message contains every one of `parts`.
inline ::testing::AssertionResult throws(const std::function<void()>& fn, ErrorKind kind,
                                         std::initializer_list<std::string> parts) {
  try {
    fn();
  } catch (const Error& e) {
    std::string msg = e.what();
    if (e.kind() != kind)
      return ::testing::AssertionFailure()
             << "error kind " << error_kind_name(e.kind()) << ", expected "
             << error_kind_name(kind) << ": " << msg;
    for (const std::string& p : parts)
      if (msg.find(p) == std::string::npos)
        return ::testing::AssertionFailure() << "message lacks \"" << p << "\": " << msg;
    return ::testing::AssertionSuccess() << msg;
  }
  return ::testing::AssertionFailure() << "no opd::Error thrown";
}

// Every element of t is NaN (an output that must not have been touched).
inline bool all_nan(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!std::isnan(element(t, i))) return false;
  return true;
}

inline bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

}  // namespace opd::test
