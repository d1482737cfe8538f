// Dense layer through OpenBLAS GEMM: y = x @ w^T (+ bias), and its backward dx = dy @ w,
// dw += dy^T @ x, dbias += sum_rows dy (row-major x [n, in], w [out, in], y [n, out]).
#include <cblas.h>  // cblas_sgemm / cblas_dgemm

#include <algorithm>
#include <climits>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/cpu_ops.h"

namespace opd::cpu {

namespace {

// CBLAS takes 32-bit dimensions; a larger one would wrap silently, so refuse it.
blasint blas_int(int64_t v) {
  OPD_CHECK(v <= INT_MAX, Unsupported, "linear: dimension ", v,
            " exceeds the 32-bit range of the CBLAS interface");
  return static_cast<blasint>(v);
}

void gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta, tb, blas_int(m), blas_int(n), blas_int(k), 1.0f, a,
              blas_int(lda), b, blas_int(ldb), beta, c, blas_int(ldc));
}

void gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta, tb, blas_int(m), blas_int(n), blas_int(k), 1.0, a,
              blas_int(lda), b, blas_int(ldb), beta, c, blas_int(ldc));
}

}  // namespace

template <typename T>
void linear_forward(const T* x, const T* w, const T* bias, int64_t n, int64_t in, int64_t out,
                    T* y) {
  if (n == 0 || out == 0) return;
  // Start y from the bias (beta = 1 adds the product to it) or let beta = 0 overwrite it.
  if (bias) {
    for (int64_t r = 0; r < n; ++r) std::copy(bias, bias + out, y + r * out);
  } else if (in == 0) {
    std::fill(y, y + n * out, T(0));
  }
  // An empty reduction (in == 0) leaves y = bias; BLAS would reject lda = 0.
  if (in == 0) return;
  gemm(CblasNoTrans, CblasTrans, n, out, in, x, in, w, in, bias ? T(1) : T(0), y, out);
}

template <typename T>
void linear_backward(const T* dy, const T* x, const T* w, int64_t n, int64_t in, int64_t out,
                     T* dx, T* dw, T* dbias) {
  if (dx && n > 0 && in > 0) {
    if (out == 0) {
      std::fill(dx, dx + n * in, T(0));
    } else {
      gemm(CblasNoTrans, CblasNoTrans, n, in, out, dy, out, w, in, T(0), dx, in);  // dx = dy @ w
    }
  }
  if (n > 0 && in > 0 && out > 0) {
    gemm(CblasTrans, CblasNoTrans, out, in, n, dy, out, x, in, T(1), dw, in);  // dw += dy^T @ x
  }
  if (dbias && out > 0) {
    // Column sums in double and in row order: deterministic, no float cancellation drift.
    std::vector<double> acc(static_cast<size_t>(out), 0.0);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < out; ++c) acc[c] += dy[r * out + c];
    for (int64_t c = 0; c < out; ++c) dbias[c] = static_cast<T>(dbias[c] + acc[c]);
  }
}

template void linear_forward<float>(const float*, const float*, const float*, int64_t, int64_t,
                                    int64_t, float*);
template void linear_forward<double>(const double*, const double*, const double*, int64_t,
                                     int64_t, int64_t, double*);
template void linear_backward<float>(const float*, const float*, const float*, int64_t, int64_t,
                                     int64_t, float*, float*, float*);
template void linear_backward<double>(const double*, const double*, const double*, int64_t,
                                      int64_t, int64_t, double*, double*, double*);

}  // namespace opd::cpu
