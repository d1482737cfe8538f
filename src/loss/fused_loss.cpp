// CPU fused lm_head + distillation loss in vocabulary tiles (fused_loss.h): online LSE over
// tiles of z = H W^T, direct dot products at the teacher's K ids and the target, per-row
// coefficients from loss/divergence.h, and a backward that recomputes each tile and
// accumulates dH += dZ W_tile, dW_tile += dZ^T H with OpenBLAS GEMMs.
#include "loss/fused_loss.h"

#include <cblas.h>  // cblas_sgemm / cblas_dgemm for the tile GEMMs

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "loss/divergence.h"
#if defined(OPD_WITH_CUDA)
#include "loss/fused_loss_cuda.h"  // the CUDA implementation, for device tensors
#endif

namespace opd {

namespace {

// Per-row statistics columns of the [N, kRowStatCols] f64 scratch.
enum RowCol : int64_t {
  kLseT = 0,     // online max of z/T, then LSE(z/T)
  kSumT = 1,     // online sum, then the dense coefficient A_r on softmax(z/T)
  kLse1 = 2,     // online max of z, then LSE(z)            (SFT rows, T != 1)
  kSum1 = 3,     // online sum, then the dense coefficient B_r on softmax(z)
  kLseTeach = 4, // full: online max of t/T, then LSE(t/T)
  kSumTeach = 5, // full: online sum
  kDiv = 6,      // D_r (full: accumulated in pass B)
  kAux = 7,      // full: G_r = sum_v g_v (pass B); then CE_r
};
static_assert(kRowStatCols == 8, "row stat columns");

blasint blas_int(int64_t v) {
  OPD_CHECK(v <= INT_MAX, Unsupported, "fused loss: dimension ", v,
            " exceeds the 32-bit range of the CBLAS interface");
  return static_cast<blasint>(v);
}

// C[m, n] = A[m, k] op B + beta C, row-major; trans_a/trans_b as CBLAS.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              blas_int(m), blas_int(n), blas_int(k), 1.0f, a, blas_int(lda), b, blas_int(ldb), beta,
              c, blas_int(ldc));
}
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              blas_int(m), blas_int(n), blas_int(k), 1.0, a, blas_int(lda), b, blas_int(ldb), beta,
              c, blas_int(ldc));
}

double read_float(const Tensor& t, int64_t i) {
  return t.dtype() == DType::F32 ? static_cast<double>(t.data<float>()[i]) : t.data<double>()[i];
}

void check_shape(const Tensor& t, const Shape& shape, const char* name) {
  OPD_CHECK(t.defined(), InvalidArgument, "fused loss: ", name, " is missing");
  OPD_CHECK(t.shape() == shape, InvalidArgument, "fused loss: ", name, " has shape ",
            shape_str(t.shape()), ", expected ", shape_str(shape));
  OPD_CHECK(t.device() == Device::CPU, InvalidArgument, "fused loss: ", name,
            " must be a host tensor for the CPU implementation");
}

void check_float(const Tensor& t, const char* name) {
  OPD_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F64, InvalidArgument, "fused loss: ",
            name, " must be f32 or f64, got ", dtype_name(t.dtype()));
}

template <typename T>
class FusedLoss {
 public:
  FusedLoss(const LossConfig& config, const FusedLossArgs& args, Tensor* d_hidden,
            Tensor* d_lm_head)
      : c_(config), a_(args), dh_(d_hidden), dw_(d_lm_head) {}

  LossResult run();

 private:
  void check_args();
  void gather();
  void compute_tile(int64_t v0, int64_t tw, T* z) const;          // z = H W[v0:v0+tw]^T
  void compute_teacher_tile(int64_t v0, int64_t tw, T* t) const;  // t = Ht Wt[v0:v0+tw]^T
  void pass_lse();
  void pass_full_divergence();
  LossResult row_coefficients();
  void pass_backward();
  void sparse_backward();

  bool row_used(int64_t r) const { return used_[r] != 0; }

  const LossConfig& c_;
  const FusedLossArgs& a_;
  Tensor* dh_;
  Tensor* dw_;
  int64_t n_ = 0, h_ = 0, v_ = 0, k_ = 0, ht_ = 0, tile_ = 0;
  double inv_t_ = 1;
  bool full_ = false, need_lse_t_ = false, need_lse_1_ = false, same_lse_ = false;
  std::vector<uint8_t> used_;  // O(N): row in the loss (valid and weight != 0)
  std::vector<uint8_t> sft_;   // O(N): row gets the CE term
  Tensor zk_;                  // f64 [N, K+1]: z at the K ids and the target, then coefficients
  Tensor stats_;               // f64 [N, kRowStatCols]
  Tensor tile_buf_;            // T [N, tile]
  Tensor teacher_tile_buf_;    // T [N, tile] (full)
  std::atomic<int64_t> bad_ids_{0};
};

template <typename T>
void FusedLoss<T>::check_args() {
  check_loss_config(c_);
  check_float(a_.hidden, "hidden");
  OPD_CHECK(a_.hidden.dtype() == dtype_of<T>(), Internal, "fused loss: dtype dispatch");
  OPD_CHECK(a_.hidden.ndim() == 2 && a_.lm_head.defined() && a_.lm_head.ndim() == 2,
            InvalidArgument, "fused loss: hidden [N, H] and lm_head [V, H] must be 2-d, got ",
            a_.hidden.describe(), " and ", a_.lm_head.describe());
  n_ = a_.hidden.dim(0);
  h_ = a_.hidden.dim(1);
  v_ = a_.lm_head.dim(0);
  check_shape(a_.hidden, {n_, h_}, "hidden");
  check_shape(a_.lm_head, {v_, h_}, "lm_head");
  OPD_CHECK(a_.lm_head.dtype() == a_.hidden.dtype(), InvalidArgument,
            "fused loss: lm_head dtype ", dtype_name(a_.lm_head.dtype()), " != hidden dtype ",
            dtype_name(a_.hidden.dtype()));
  OPD_CHECK(v_ >= 1 && v_ <= INT32_MAX, InvalidArgument, "fused loss: vocabulary ", v_,
            " must be in [1, 2^31)");
  check_shape(a_.targets, {n_}, "targets");
  OPD_CHECK(a_.targets.dtype() == DType::I32, InvalidArgument, "fused loss: targets must be i32");
  check_shape(a_.weights, {n_}, "weights");
  check_float(a_.weights, "weights");
  OPD_CHECK(std::isfinite(a_.n_total) && a_.n_total > 0, InvalidArgument,
            "fused loss: n_total ", a_.n_total, " must be finite and > 0");
  if (c_.sft_alpha > 0) {
    check_shape(a_.sft_rows, {n_}, "sft_rows");
    OPD_CHECK(a_.sft_rows.dtype() == DType::I32, InvalidArgument,
              "fused loss: sft_rows must be i32");
  }
  full_ = c_.mode == SupportMode::Full;
  if (full_) {
    OPD_CHECK(a_.teacher_hidden.defined() && a_.teacher_hidden.ndim() == 2 &&
                  a_.teacher_lm_head.defined() && a_.teacher_lm_head.ndim() == 2,
              InvalidArgument, "fused loss: full mode needs teacher_hidden [N, Ht] and "
              "teacher_lm_head [Vt, Ht]");
    ht_ = a_.teacher_hidden.dim(1);
    const int64_t vt = a_.teacher_lm_head.dim(0);
    check_shape(a_.teacher_hidden, {n_, ht_}, "teacher_hidden");
    check_shape(a_.teacher_lm_head, {vt, ht_}, "teacher_lm_head");
    OPD_CHECK(a_.teacher_hidden.dtype() == a_.hidden.dtype() &&
                  a_.teacher_lm_head.dtype() == a_.hidden.dtype(),
              InvalidArgument, "fused loss: teacher tensors must have the student's dtype ",
              dtype_name(a_.hidden.dtype()));
    OPD_CHECK(vt >= v_, InvalidArgument, "fused loss: full mode: teacher vocabulary ", vt,
              " is smaller than the student's ", v_,
              " (student ids the teacher cannot score would get p = 0)");
    OPD_CHECK(vt == v_ || c_.vocab_policy == VocabPolicy::ClipToStudent, InvalidData,
              "fused loss: full mode: teacher vocabulary ", vt, " is larger than the student's ",
              v_, " (vocab policy 'error'; 'clip-to-student' renormalizes over the student's ids)");
  } else {
    OPD_CHECK(a_.teacher != nullptr, InvalidArgument, "fused loss: mode ",
              support_mode_name(c_.mode), " needs a validated teacher payload");
    const TeacherTopK& t = *a_.teacher;
    k_ = t.k;
    OPD_CHECK(t.rows == n_, InvalidArgument, "fused loss: teacher payload has ", t.rows,
              " rows, hidden has ", n_);
    OPD_CHECK(k_ >= 1 || c_.mode == SupportMode::Sampled, InvalidArgument, "fused loss: mode ",
              support_mode_name(c_.mode), " needs K >= 1 teacher entries per row, got ", k_);
    check_shape(t.ids, {n_, k_}, "teacher ids");
    OPD_CHECK(t.ids.dtype() == DType::I32, InvalidArgument, "fused loss: teacher ids must be i32");
    check_shape(t.logprobs, {n_, k_}, "teacher logprobs");
    check_float(t.logprobs, "teacher logprobs");
    check_shape(t.actual_logprobs, {n_}, "teacher actual_logprobs");
    check_float(t.actual_logprobs, "teacher actual_logprobs");
    check_shape(t.valid, {n_}, "teacher valid");
    OPD_CHECK(t.valid.dtype() == DType::I32, InvalidArgument, "fused loss: teacher valid must be i32");
  }
  if (dh_ || dw_) {
    OPD_CHECK(dh_ && dw_, InvalidArgument,
              "fused loss: give both d_hidden and d_lm_head (or neither for forward only)");
    check_shape(*dh_, {n_, h_}, "d_hidden");
    check_shape(*dw_, {v_, h_}, "d_lm_head");
    OPD_CHECK(dh_->dtype() == a_.hidden.dtype() && dw_->dtype() == a_.hidden.dtype(),
              InvalidArgument, "fused loss: gradients must have dtype ", dtype_name(a_.hidden.dtype()));
    OPD_CHECK(dh_->writable() && dw_->writable(), InvalidArgument,
              "fused loss: gradient tensors must be writable");
  }

  // Rows in the loss; targets of those rows are checked here (invariant 1).
  used_.assign(n_, 0);
  sft_.assign(n_, 0);
  const int32_t* y = a_.targets.data<int32_t>();
  const int32_t* valid = full_ ? nullptr : a_.teacher->valid.data<int32_t>();
  for (int64_t r = 0; r < n_; ++r) {
    const double w = read_float(a_.weights, r);
    OPD_CHECK(std::isfinite(w), InvalidData, "fused loss: weight of row ", r, " is ", w);
    used_[r] = w != 0.0 && (valid == nullptr || valid[r] != 0);
    if (!used_[r]) continue;
    OPD_CHECK(y[r] >= 0 && y[r] < v_, InvalidData, "fused loss: target id ", y[r], " of row ", r,
              " is outside the student vocabulary [0, ", v_, ")");
    if (c_.sft_alpha > 0) {
      const int32_t f = a_.sft_rows.data<int32_t>()[r];
      OPD_CHECK(f == 0 || f == 1, InvalidArgument, "fused loss: sft_rows[", r, "] = ", f,
                " must be 0 or 1");
      sft_[r] = static_cast<uint8_t>(f);
    }
  }
}

template <typename T>
void FusedLoss<T>::compute_tile(int64_t v0, int64_t tw, T* z) const {
  const T* hp = a_.hidden.data<T>();
  const T* wp = a_.lm_head.data<T>() + v0 * h_;
  gemm(false, true, n_, tw, h_, hp, h_, wp, h_, T(0), z, tw);
}

template <typename T>
void FusedLoss<T>::compute_teacher_tile(int64_t v0, int64_t tw, T* t) const {
  const T* hp = a_.teacher_hidden.data<T>();
  const T* wp = a_.teacher_lm_head.data<T>() + v0 * ht_;
  gemm(false, true, n_, tw, ht_, hp, ht_, wp, ht_, T(0), t, tw);
}

// z at the K teacher ids and at the target as direct dot products (double accumulation).
// Ids are guarded: an id outside [0, V) that is not kEmptySlot is counted, never read.
template <typename T>
void FusedLoss<T>::gather() {
  double* zk = zk_.data<double>();
  const T* hp = a_.hidden.data<T>();
  const T* wp = a_.lm_head.data<T>();
  const int32_t* ids = k_ > 0 ? a_.teacher->ids.data<int32_t>() : nullptr;
  const int32_t* y = a_.targets.data<int32_t>();
  parallel_for(n_, [&](int64_t begin, int64_t end) {
    int64_t bad = 0;
    for (int64_t r = begin; r < end; ++r) {
      double* row = zk + r * (k_ + 1);
      for (int64_t j = 0; j <= k_; ++j) row[j] = 0;
      if (!row_used(r)) continue;
      const T* h = hp + r * h_;
      for (int64_t j = 0; j <= k_; ++j) {
        const int64_t id = j < k_ ? ids[r * k_ + j] : y[r];
        if (j < k_ && id == kEmptySlot) continue;
        if (id < 0 || id >= v_) {
          ++bad;
          continue;
        }
        const T* w = wp + id * h_;
        double acc = 0;
        for (int64_t i = 0; i < h_; ++i) acc += static_cast<double>(h[i]) * static_cast<double>(w[i]);
        row[j] = acc;
      }
    }
    bad_ids_ += bad;
  });
  OPD_CHECK(bad_ids_.load() == 0, InvalidData, "fused loss: ", bad_ids_.load(),
            " teacher ids outside [0, ", v_, ") reached the gather (payload not validated?); "
            "they were skipped and nothing was computed");
}

// Pass A: online LSE of z/T (all used rows), of z (SFT rows, T != 1), of t/T (full).
template <typename T>
void FusedLoss<T>::pass_lse() {
  double* st = stats_.data<double>();
  for (int64_t r = 0; r < n_; ++r) {
    st[r * kRowStatCols + kLseT] = -INFINITY;
    st[r * kRowStatCols + kSumT] = 0;
    st[r * kRowStatCols + kLse1] = -INFINITY;
    st[r * kRowStatCols + kSum1] = 0;
    st[r * kRowStatCols + kLseTeach] = -INFINITY;
    st[r * kRowStatCols + kSumTeach] = 0;
  }
  if (!need_lse_t_ && !need_lse_1_ && !full_) return;
  T* z = tile_buf_.data<T>();
  T* t = full_ ? teacher_tile_buf_.data<T>() : nullptr;
  auto reduce = [](const T* x, int64_t n, double scale, double* m_io, double* s_io) {
    double m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, scale * static_cast<double>(x[i]));
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += std::exp(scale * static_cast<double>(x[i]) - m);
    loss::OnlineLse lse{*m_io, *s_io};
    lse.add_max_sum(m, s);
    *m_io = lse.m;
    *s_io = lse.s;
  };
  for (int64_t v0 = 0; v0 < v_; v0 += tile_) {
    const int64_t tw = std::min(tile_, v_ - v0);
    compute_tile(v0, tw, z);
    if (full_) compute_teacher_tile(v0, tw, t);
    parallel_for(n_, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        if (!row_used(r)) continue;
        double* s = st + r * kRowStatCols;
        if (need_lse_t_) reduce(z + r * tw, tw, inv_t_, s + kLseT, s + kSumT);
        if (need_lse_1_ && sft_[r] && !same_lse_) reduce(z + r * tw, tw, 1.0, s + kLse1, s + kSum1);
        if (full_) reduce(t + r * tw, tw, inv_t_, s + kLseTeach, s + kSumTeach);
      }
    });
  }
  for (int64_t r = 0; r < n_; ++r) {
    double* s = st + r * kRowStatCols;
    if (!row_used(r)) continue;
    if (need_lse_t_) s[kLseT] = s[kLseT] + std::log(s[kSumT]);
    if (need_lse_1_ && sft_[r]) s[kLse1] = same_lse_ ? s[kLseT] : s[kLse1] + std::log(s[kSum1]);
    if (full_) s[kLseTeach] = s[kLseTeach] + std::log(s[kSumTeach]);
  }
}

// Pass B (full): D_r = sum_v d_v and G_r = sum_v g_v with p, q from the pass-A LSEs.
template <typename T>
void FusedLoss<T>::pass_full_divergence() {
  double* st = stats_.data<double>();
  T* z = tile_buf_.data<T>();
  T* t = teacher_tile_buf_.data<T>();
  for (int64_t r = 0; r < n_; ++r) st[r * kRowStatCols + kDiv] = st[r * kRowStatCols + kAux] = 0;
  for (int64_t v0 = 0; v0 < v_; v0 += tile_) {
    const int64_t tw = std::min(tile_, v_ - v0);
    compute_tile(v0, tw, z);
    compute_teacher_tile(v0, tw, t);
    parallel_for(n_, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        if (!row_used(r)) continue;
        double* s = st + r * kRowStatCols;
        double d = 0, g = 0;
        for (int64_t i = 0; i < tw; ++i) {
          loss::AtomTerm term =
              loss::atom_term(inv_t_ * static_cast<double>(t[r * tw + i]) - s[kLseTeach],
                              inv_t_ * static_cast<double>(z[r * tw + i]) - s[kLseT], c_.beta);
          d += term.d;
          g += term.g;
        }
        s[kDiv] += d;
        s[kAux] += g;
      }
    });
  }
}

// Per-row divergence values and gradient coefficients (scaled by weight_r / n_total):
// zk_ row becomes the sparse coefficients d z at the K ids and the target; kSumT the dense
// coefficient on softmax(z/T), kSum1 the one on softmax(z).
template <typename T>
LossResult FusedLoss<T>::row_coefficients() {
  double* st = stats_.data<double>();
  double* zk = zk_.data<double>();
  const int32_t* ids = k_ > 0 ? a_.teacher->ids.data<int32_t>() : nullptr;
  std::vector<uint8_t> clamped(n_, 0);
  std::vector<double> kl(n_, 0.0);
  parallel_for(n_, [&](int64_t begin, int64_t end) {
    std::vector<double> a(k_), s(k_), ds(k_);  // O(K) per thread
    for (int64_t r = begin; r < end; ++r) {
      double* row_st = st + r * kRowStatCols;
      double* coef = zk + r * (k_ + 1);
      const double z_y = coef[k_];
      double dense_t = 0, dense_1 = 0, div = 0, ce = 0;
      if (!row_used(r)) {
        for (int64_t j = 0; j <= k_; ++j) coef[j] = 0;
        row_st[kSumT] = row_st[kSum1] = row_st[kDiv] = row_st[kAux] = 0;
        continue;
      }
      const double scale = read_float(a_.weights, r) / a_.n_total;
      const double scale_t = scale * inv_t_;  // d/dz = (1/T) d/ds
      double sparse_y = 0;
      switch (c_.mode) {
        case SupportMode::Full: {
          div = row_st[kDiv];
          dense_t = -scale_t * row_st[kAux];  // -q_v G_r; the g_v part is added per element
          break;
        }
        case SupportMode::TopK:
        case SupportMode::TopKTail: {
          for (int64_t j = 0; j < k_; ++j) {
            a[j] = read_float(a_.teacher->logprobs, r * k_ + j);
            s[j] = inv_t_ * coef[j];
          }
          loss::RowResult res =
              c_.mode == SupportMode::TopK
                  ? loss::topk_row(k_, ids + r * k_, a.data(), s.data(), c_.beta, ds.data())
                  : loss::topk_tail_row(k_, ids + r * k_, a.data(), s.data(), row_st[kLseT],
                                        c_.beta, c_.tail_floor, ds.data());
          div = res.value;
          dense_t = scale_t * res.dense;
          clamped[r] = res.tail_clamped;
          for (int64_t j = 0; j < k_; ++j) coef[j] = scale_t * ds[j];
          break;
        }
        case SupportMode::Sampled: {
          for (int64_t j = 0; j < k_; ++j) coef[j] = 0;
          const double a_y = read_float(a_.teacher->actual_logprobs, r);
          double ds_y = 0;
          loss::RowResult res = loss::sampled_row(a_y, inv_t_ * z_y, row_st[kLseT], &ds_y);
          div = res.value;
          dense_t = scale_t * res.dense;
          sparse_y = scale_t * ds_y;
          kl[r] = (inv_t_ * z_y - row_st[kLseT]) - a_y;
          break;
        }
      }
      if (sft_[r]) {
        ce = loss::cross_entropy_row(z_y, row_st[kLse1]);
        dense_1 = scale * c_.sft_alpha;
        sparse_y -= scale * c_.sft_alpha;
      }
      coef[k_] = sparse_y;
      row_st[kSumT] = dense_t;
      row_st[kSum1] = dense_1;
      row_st[kDiv] = div;
      row_st[kAux] = ce;
    }
  });
  // Serial sums in row order: the result does not depend on the thread count.
  LossResult res;
  for (int64_t r = 0; r < n_; ++r) {
    if (!row_used(r)) continue;
    const double w = read_float(a_.weights, r);
    const double* row_st = st + r * kRowStatCols;
    res.divergence_sum += w * row_st[kDiv];
    res.ce_sum += w * row_st[kAux];
    res.sampled_kl_sum += w * kl[r];
    res.rows_used += 1;
    res.tail_clamped += clamped[r];
  }
  res.loss = (res.divergence_sum + c_.sft_alpha * res.ce_sum) / a_.n_total;
  return res;
}

// Pass C: recompute each tile, dZ in place, dH += dZ W_tile, dW_tile += dZ^T H.
template <typename T>
void FusedLoss<T>::pass_backward() {
  const double* st = stats_.data<double>();
  T* z = tile_buf_.data<T>();
  T* t = full_ ? teacher_tile_buf_.data<T>() : nullptr;
  T* dh = dh_->data<T>();
  T* dw = dw_->data<T>();
  const T* hp = a_.hidden.data<T>();
  const T* wp = a_.lm_head.data<T>();
  for (int64_t v0 = 0; v0 < v_; v0 += tile_) {
    const int64_t tw = std::min(tile_, v_ - v0);
    compute_tile(v0, tw, z);
    if (full_) compute_teacher_tile(v0, tw, t);
    parallel_for(n_, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* zr = z + r * tw;
        const double* s = st + r * kRowStatCols;
        const double dense_t = s[kSumT], dense_1 = s[kSum1];
        if (!row_used(r) || (dense_t == 0 && dense_1 == 0 && !full_)) {
          std::fill(zr, zr + tw, T(0));
          continue;
        }
        const double scale_t = read_float(a_.weights, r) / a_.n_total * inv_t_;
        for (int64_t i = 0; i < tw; ++i) {
          const double x = static_cast<double>(zr[i]);
          const double logq = inv_t_ * x - s[kLseT];
          double d = 0;
          if (same_lse_) {
            d = (dense_t + dense_1) * std::exp(logq);
          } else {
            if (dense_t != 0) d += dense_t * std::exp(logq);
            if (dense_1 != 0) d += dense_1 * std::exp(x - s[kLse1]);
          }
          if (full_) {
            const double logp = inv_t_ * static_cast<double>(t[r * tw + i]) - s[kLseTeach];
            d += scale_t * loss::atom_term(logp, logq, c_.beta).g;
          }
          zr[i] = static_cast<T>(d);
        }
      }
    });
    gemm(false, false, n_, h_, tw, z, tw, wp + v0 * h_, h_, T(1), dh, h_);
    gemm(true, false, tw, h_, n_, z, tw, hp, h_, T(1), dw + v0 * h_, h_);
  }
}

// Sparse terms at the K ids and the target: dH_r += c W_id (by rows, parallel), then
// dW_id += c h_r (serial in row order: no races, deterministic).
template <typename T>
void FusedLoss<T>::sparse_backward() {
  const double* zk = zk_.data<double>();
  const int32_t* ids = k_ > 0 ? a_.teacher->ids.data<int32_t>() : nullptr;
  const int32_t* y = a_.targets.data<int32_t>();
  T* dh = dh_->data<T>();
  T* dw = dw_->data<T>();
  const T* hp = a_.hidden.data<T>();
  const T* wp = a_.lm_head.data<T>();
  auto id_of = [&](int64_t r, int64_t j) -> int64_t { return j < k_ ? ids[r * k_ + j] : y[r]; };
  parallel_for(n_, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (!row_used(r)) continue;
      for (int64_t j = 0; j <= k_; ++j) {
        const double c = zk[r * (k_ + 1) + j];
        const int64_t id = id_of(r, j);
        if (c == 0 || id < 0 || id >= v_) continue;  // empty slots have c == 0
        const T* w = wp + id * h_;
        for (int64_t i = 0; i < h_; ++i) dh[r * h_ + i] += static_cast<T>(c * static_cast<double>(w[i]));
      }
    }
  });
  for (int64_t r = 0; r < n_; ++r) {
    if (!row_used(r)) continue;
    for (int64_t j = 0; j <= k_; ++j) {
      const double c = zk[r * (k_ + 1) + j];
      const int64_t id = id_of(r, j);
      if (c == 0 || id < 0 || id >= v_) continue;
      const T* h = hp + r * h_;
      T* w = dw + id * h_;
      for (int64_t i = 0; i < h_; ++i) w[i] += static_cast<T>(c * static_cast<double>(h[i]));
    }
  }
}

template <typename T>
LossResult FusedLoss<T>::run() {
  check_args();
  if (n_ == 0) {  // an empty micro-batch (e.g. a rank with no completion rows this step)
    if (dh_) dh_->fill_zero();
    return LossResult{};
  }
  tile_ = std::min(c_.vocab_tile, v_);
  inv_t_ = 1.0 / c_.temperature;
  need_lse_t_ = c_.mode != SupportMode::TopK;
  need_lse_1_ = false;
  for (int64_t r = 0; r < n_; ++r) need_lse_1_ = need_lse_1_ || (used_[r] && sft_[r]);
  // LSE(z) == LSE(z/T) at T == 1: compute it once (and one exp per logit in the backward).
  same_lse_ = need_lse_1_ && c_.temperature == 1.0 && need_lse_t_;
  const bool any_tile = need_lse_t_ || need_lse_1_;

  zk_ = Tensor::empty({n_, k_ + 1}, DType::F64);
  stats_ = Tensor::empty({n_, kRowStatCols}, DType::F64);
  if (any_tile) tile_buf_ = Tensor::empty({n_, tile_}, dtype_of<T>());
  if (full_) teacher_tile_buf_ = Tensor::empty({n_, tile_}, dtype_of<T>());

  gather();
  pass_lse();
  if (full_) pass_full_divergence();
  LossResult res = row_coefficients();
  if (dh_) {
    dh_->fill_zero();
    if (any_tile) pass_backward();
    sparse_backward();
  }
  return res;
}

}  // namespace

int64_t fused_loss_scratch_bytes(int64_t n, int64_t vocab, int64_t k, const LossConfig& config,
                                 DType dtype) {
  const int64_t tile = std::min(config.vocab_tile, vocab);
  const int64_t tiles = config.mode == SupportMode::Full ? 2 : 1;
  return n * tile * static_cast<int64_t>(dtype_size(dtype)) * tiles + n * (k + 1) * 8 +
         n * kRowStatCols * 8;
}

LossResult fused_lm_head_loss(const LossConfig& config, const FusedLossArgs& args,
                              Tensor* d_hidden, Tensor* d_lm_head) {
  return fused_lm_head_loss(config, args, d_hidden, d_lm_head, 0);
}

LossResult fused_lm_head_loss(const LossConfig& config, const FusedLossArgs& args,
                              Tensor* d_hidden, Tensor* d_lm_head, int64_t cuda_tile_budget_bytes) {
  OPD_CHECK(args.hidden.defined(), InvalidArgument, "fused loss: hidden is missing");
  if (args.hidden.device() == Device::CUDA) {
#if defined(OPD_WITH_CUDA)
    cuda::CudaLossOptions options;
    if (cuda_tile_budget_bytes > 0) options.tile_budget_bytes = cuda_tile_budget_bytes;
    return cuda::fused_lm_head_loss_cuda(config, args, d_hidden, d_lm_head, options);
#else
    (void)cuda_tile_budget_bytes;
    OPD_FAIL(Unsupported, "fused loss: hidden is a device tensor but this build has no CUDA "
             "backend");
#endif
  }
  if (args.hidden.dtype() == DType::F32) {
    return FusedLoss<float>(config, args, d_hidden, d_lm_head).run();
  }
  OPD_CHECK(args.hidden.dtype() == DType::F64, InvalidArgument,
            "fused loss: hidden must be f32 or f64, got ", dtype_name(args.hidden.dtype()));
  return FusedLoss<double>(config, args, d_hidden, d_lm_head).run();
}

}  // namespace opd
