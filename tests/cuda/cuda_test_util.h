// Helpers shared by the GPU tests (tests/cuda/test_cuda_<op>.cpp): a skip without a device,
// inputs exactly representable in the storage dtype (so CPU and GPU see identical values),
// device copies, poisoned device outputs, and tolerances per storage dtype.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "common/test_util.h"
#include "core/cuda/stream.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/kernel_test_util.h"  // throws, same_bits, all_nan

namespace opd::test {

#define REQUIRE_GPU()                                                           \
  do {                                                                          \
    if (::opd::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";     \
  } while (0)

inline Tensor round_through(const Tensor& host_f32, DType dt) {
  return dt == DType::BF16 ? host_f32.to_dtype(DType::BF16).to_dtype(DType::F32) : host_f32;
}
// Host f32 tensor uniform in [lo, hi) whose values are representable in `dt`.
inline Tensor rand_in(const Shape& s, DType dt, uint64_t seed, double lo = -2, double hi = 2) {
  return round_through(random_uniform(s, DType::F32, seed, lo, hi), dt);
}
// Host f32 -> device tensor of dtype dt (and back to host f32).
inline Tensor dev(const Tensor& host_f32, DType dt) {
  return host_f32.to_dtype(dt).to(Device::CUDA);
}
inline Tensor dev_i32(const Tensor& host_i32) { return host_i32.to(Device::CUDA); }
inline Tensor host(const Tensor& d) {
  Tensor h = d.to(Device::CPU);
  return h.dtype() == DType::F32 ? h : h.to_dtype(DType::F32);
}
inline Tensor dev_poison(const Shape& s, DType dt) {
  return Tensor::poisoned(s, dt).to(Device::CUDA);
}

// Tolerances for outputs stored in dt and computed in f32: tight for f32 (reordered sums),
// one bf16 rounding (2^-8 relative) plus slack for bf16.
struct Tol {
  double rtol, atol, rel_l2;
};
inline Tol tol_for(DType dt) { return dt == DType::F32 ? Tol{2e-5, 1e-6, 1e-5} : Tol{8e-3, 1e-2, 6e-3}; }
inline ::testing::AssertionResult close_as(const Tensor& gpu_host, const Tensor& ref, DType dt) {
  Tol t = tol_for(dt);
  return close(gpu_host, ref, t.rtol, t.atol, t.rel_l2);
}

// For failure messages: how far two host f32 tensors are apart (differing elements, max |a-b|,
// relative L2, NaNs), so a bit mismatch says whether it is rounding or a wrong value.
inline std::string diff_summary(const Tensor& a_in, const Tensor& b_in) {
  const Tensor a = host(a_in), b = host(b_in);
  if (a.shape() != b.shape()) return "shapes differ";
  const float* x = a.data<float>();
  const float* y = b.data<float>();
  int64_t differ = 0, nans = 0;
  double max_abs = 0, num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (std::isnan(x[i]) || std::isnan(y[i])) ++nans;
    if (x[i] != y[i]) ++differ;
    const double d = static_cast<double>(x[i]) - y[i];
    max_abs = std::max(max_abs, std::fabs(d));
    num += d * d;
    den += static_cast<double>(x[i]) * x[i];
  }
  return cat(differ, " of ", a.numel(), " elements differ, max |diff| ", max_abs, ", rel L2 ",
             den > 0 ? std::sqrt(num / den) : 0.0, ", NaNs ", nans);
}

inline std::string dtype_label(DType dt) { return std::string(dtype_name(dt)); }

// The message of the opd::Error fn throws ("" and a test failure when none / another kind).
template <typename Fn>
std::string error_message(Fn&& fn, ErrorKind kind) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no opd::Error thrown";
  return "";
}

// The part of an error message before the "[check ..." suffix the CPU checks append.
inline std::string message_head(const std::string& m) {
  auto p = m.find(" [check");
  return p == std::string::npos ? m : m.substr(0, p);
}

}  // namespace opd::test
