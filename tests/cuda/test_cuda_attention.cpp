// CUDA causal GQA attention (FlashAttention-2 kernels, kernels/cuda/attention_*.cu) against the
// CPU reference in f64 on the same (bf16-representable) inputs: forward out and lse, backward
// dq, dk, dv; packed batches with unequal lengths (1, 7, 63, 64, 65, 129, 768, 1000), empty
// sequences, GQA ratios 1/2/4/8, head_dim 64/128 (tensor cores) and 32/96 (simple path), f32 and
// bf16; poisoned outputs, bit-exact determinism, every backward tile variant, input errors.
// The Hopper wgmma forward (attention_fwd_wgmma.cu): every variant (key tile 64/128, overlap
// on/off, producer warp with and without ping-pong), causal against the CPU op and the mma.sync kernel, non-causal against an
// f64 reference here; lengths 1, 17, 63, 65, 127, 129, 768, 1500 and varlen batches with empty
// sequences, GQA 16/8, 16/16, 32/8; the OPD_ATTENTION_FWD selection.
// The Hopper wgmma backward (attention_bwd_wgmma.cu): dk, dv (and with wgmma-all dq) against the
// f64 reference and the mma.sync kernels (dq of `wgmma`, from the same mma.sync dQ kernel,
// bit-identical), lengths 1, 17,
// 63, 65, 127, 129, 300, 768, 1500 and varlen batches with empty sequences, GQA 16/8, 16/16,
// 32/8, 2/1; poisoned outputs; bit-identical reruns; the OPD_ATTENTION_BWD selection.
// GPU only: every test skips cleanly without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "common/test_util.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/stream.h"
#include "kernels/cuda/attention_wgmma.h"  // the Hopper kernels and the kernel selections
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"

namespace opd {
namespace {

#define REQUIRE_GPU()                                                \
  do {                                                               \
    if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

struct AttnCase {
  const char* name;
  std::vector<int32_t> lengths;
  int64_t hq, hkv, d;
  double range = 2;  // q, k uniform in [-range, range): larger = peakier softmax
};

Tensor round_to(const Tensor& t, DType dt) {  // host f32/f64 -> values representable in dt, f64
  return t.to_dtype(dt).to_dtype(DType::F64);
}
Tensor to_device(const Tensor& host, DType dt) { return host.to_dtype(dt).to(Device::CUDA); }
Tensor poisoned_device(const Shape& s, DType dt) { return Tensor::poisoned(s, dt).to(Device::CUDA); }
Tensor from_device(const Tensor& d) { return d.to(Device::CPU).to_dtype(DType::F64); }

// Inputs, the f64 reference and the tensors the GPU backward is fed (the reference out rounded
// to the storage dtype and lse rounded to f32, so the backward is checked on its own).
struct Problem {
  int64_t n = 0;
  Tensor cu, q, k, v, dout;        // host: i32, f64 (values exact in the storage dtype)
  Tensor out_ref, lse_ref;         // f64
  Tensor out_in, lse_in;           // f64, rounded to the storage dtype / f32
  Tensor dq_ref, dk_ref, dv_ref;   // f64
  double scale = 0;
};

Problem make_problem(const AttnCase& c, DType dt, uint64_t seed) {
  Problem p;
  std::vector<int32_t> cu{0};
  for (int32_t len : c.lengths) cu.push_back(cu.back() + len);
  p.n = cu.back();
  p.cu = Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())});
  p.scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  p.q = round_to(test::random_uniform({p.n, c.hq, c.d}, DType::F32, seed, -c.range, c.range), dt);
  p.k = round_to(test::random_uniform({p.n, c.hkv, c.d}, DType::F32, seed + 1, -c.range, c.range), dt);
  p.v = round_to(test::random_uniform({p.n, c.hkv, c.d}, DType::F32, seed + 2), dt);
  p.dout = round_to(test::random_uniform({p.n, c.hq, c.d}, DType::F32, seed + 3), dt);
  p.out_ref = Tensor::poisoned({p.n, c.hq, c.d}, DType::F64);
  p.lse_ref = Tensor::poisoned({p.n, c.hq}, DType::F64);
  ops::attention_forward(p.q, p.k, p.v, p.cu, p.scale, p.out_ref, p.lse_ref);
  p.out_in = round_to(p.out_ref, dt);
  p.lse_in = round_to(p.lse_ref, DType::F32);
  p.dq_ref = Tensor::poisoned({p.n, c.hq, c.d}, DType::F64);
  p.dk_ref = Tensor::poisoned({p.n, c.hkv, c.d}, DType::F64);
  p.dv_ref = Tensor::poisoned({p.n, c.hkv, c.d}, DType::F64);
  ops::attention_backward(p.dout, p.q, p.k, p.v, p.out_in, p.lse_in, p.cu, p.scale, p.dq_ref,
                          p.dk_ref, p.dv_ref);
  return p;
}

double rms(const Tensor& t) {
  double s = 0;
  for (int64_t i = 0; i < t.numel(); ++i) s += test::element(t, i) * test::element(t, i);
  return t.numel() ? std::sqrt(s / static_cast<double>(t.numel())) : 0.0;
}

// Compares a GPU result [n, heads, d] (or [n, heads]) with its reference; on failure prints
// where it is wrong: the worst element as (row, head, column) with its sequence and position,
// the count of bad elements, and the relative error of each sequence, so one GPU run is
// enough to tell a masking bug (one position band), a tail bug (last rows of sequences) or a
// GQA bug (some heads) apart.
::testing::AssertionResult matches(const char* what, const Tensor& got, const Tensor& ref,
                                   const std::vector<int32_t>& lengths, double rtol,
                                   double atol_rel_rms, double rel_l2_max) {
  if (got.shape() != ref.shape()) {
    return ::testing::AssertionFailure() << what << ": shape " << shape_str(got.shape())
                                         << " vs " << shape_str(ref.shape());
  }
  // The floor covers references that are exactly 0 (a single-token sequence has dq = dk = 0:
  // the GPU returns rounding noise of ~1e-7 there).
  const double atol = std::max(atol_rel_rms * rms(ref), 1e-6);
  const int64_t n = got.dim(0), heads = got.dim(1), d = got.ndim() == 3 ? got.dim(2) : 1;
  test::Diff diff = test::compare(got, ref);
  int64_t bad = 0, first_bad = -1;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double x = test::element(got, i), y = test::element(ref, i);
    if (!(std::fabs(x - y) <= atol + rtol * std::fabs(y))) {
      if (first_bad < 0) first_bad = i;
      ++bad;
    }
  }
  if (!diff.has_nan && bad == 0 && diff.rel_l2 <= rel_l2_max) return ::testing::AssertionSuccess();
  auto where = [&](int64_t i) {
    const int64_t row = i / (heads * d), head = (i / d) % heads, col = i % d;
    int64_t seq = 0, start = 0;
    while (seq < static_cast<int64_t>(lengths.size()) && start + lengths[seq] <= row) start += lengths[seq++];
    return cat("row ", row, " (sequence ", seq, " position ", row - start, "), head ", head,
               ", column ", col, ": got ", test::element(got, i), " want ", test::element(ref, i));
  };
  auto fail = ::testing::AssertionFailure();
  fail << what << ": rel_l2 " << diff.rel_l2 << " (max " << rel_l2_max << "), max_abs "
       << diff.max_abs << ", nan/inf " << (diff.has_nan ? "YES" : "no") << ", " << bad << " of "
       << got.numel() << " elements outside " << atol << " + " << rtol << "*|ref|";
  if (diff.worst >= 0) fail << "\n  worst: " << where(diff.worst);
  if (first_bad >= 0) fail << "\n  first bad: " << where(first_bad);
  fail << "\n  per sequence rel_l2:";
  int64_t start = 0;
  for (size_t s = 0; s < lengths.size(); ++s) {
    double num = 0, den = 0;
    for (int64_t i = start * heads * d; i < (start + lengths[s]) * heads * d; ++i) {
      const double x = test::element(got, i), y = test::element(ref, i);
      num += (x - y) * (x - y);
      den += y * y;
    }
    fail << " [" << s << " len " << lengths[s] << ": " << (den > 0 ? std::sqrt(num / den) : std::sqrt(num)) << "]";
    start += lengths[s];
  }
  (void)n;
  return fail;
}

struct Tol {
  double rtol, atol_rel_rms, rel_l2;
};
// bf16: operands exact, products accumulated in f32, but P and dS are rounded to bf16 before
// their matrix products and outputs are stored in bf16 (2^-9 relative): ~1e-3 .. 5e-3 rel_l2.
// bf16: P and dS are rounded to bf16 before the tensor-core products (as in FlashAttention), so
// single elements of dq/dk carry errors up to ~6% of the tensor's RMS (seen on the H200: 3 to 56
// of ~10^6 elements beyond 2%) while the relative L2 error stays at ~2.4e-3 in every sequence.
Tol tol_for(DType dt) { return dt == DType::F32 ? Tol{1e-3, 1e-4, 5e-5} : Tol{3e-2, 1e-1, 1e-2}; }

void check_forward_and_backward(const AttnCase& c, DType dt, uint64_t seed) {
  SCOPED_TRACE(cat(c.name, " ", dtype_name(dt), " hq ", c.hq, " hkv ", c.hkv, " d ", c.d));
  Problem p = make_problem(c, dt, seed);
  const Tol tol = tol_for(dt);
  Tensor cu_d = p.cu.to(Device::CUDA);
  Tensor qd = to_device(p.q, dt), kd = to_device(p.k, dt), vd = to_device(p.v, dt);

  Tensor out_d = poisoned_device({p.n, c.hq, c.d}, dt);
  Tensor lse_d = poisoned_device({p.n, c.hq}, DType::F32);
  ops::attention_forward(qd, kd, vd, cu_d, p.scale, out_d, lse_d);
  EXPECT_TRUE(matches("out", from_device(out_d), p.out_ref, c.lengths, tol.rtol, tol.atol_rel_rms,
                      tol.rel_l2));
  // lse comes from f32 sums of exact products in both dtypes: tight.
  EXPECT_TRUE(matches("lse", from_device(lse_d), p.lse_ref, c.lengths, 1e-5, 1e-5, 1e-5));

  Tensor dout_d = to_device(p.dout, dt), out_in_d = to_device(p.out_in, dt);
  Tensor lse_in_d = to_device(p.lse_in, DType::F32);
  Tensor dq_d = poisoned_device({p.n, c.hq, c.d}, dt);
  Tensor dk_d = poisoned_device({p.n, c.hkv, c.d}, dt);
  Tensor dv_d = poisoned_device({p.n, c.hkv, c.d}, dt);
  ops::attention_backward(dout_d, qd, kd, vd, out_in_d, lse_in_d, cu_d, p.scale, dq_d, dk_d, dv_d);
  EXPECT_TRUE(matches("dq", from_device(dq_d), p.dq_ref, c.lengths, tol.rtol, tol.atol_rel_rms,
                      tol.rel_l2));
  EXPECT_TRUE(matches("dk", from_device(dk_d), p.dk_ref, c.lengths, tol.rtol, tol.atol_rel_rms,
                      tol.rel_l2));
  EXPECT_TRUE(matches("dv", from_device(dv_d), p.dv_ref, c.lengths, tol.rtol, tol.atol_rel_rms,
                      tol.rel_l2));
}

const std::vector<int32_t> kMixed = {0, 1, 7, 0, 63, 64, 65, 129, 0, 768, 1000, 0};

class CudaAttention : public ::testing::TestWithParam<AttnCase> {};

TEST_P(CudaAttention, Bf16MatchesCpu) {
  REQUIRE_GPU();
  check_forward_and_backward(GetParam(), DType::BF16, 100);
}

TEST_P(CudaAttention, F32MatchesCpu) {
  REQUIRE_GPU();
  check_forward_and_backward(GetParam(), DType::F32, 200);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttention,
    ::testing::Values(
        AttnCase{"len1_d128_g1", {1}, 2, 2, 128},
        AttnCase{"len7_d64_g2", {7}, 4, 2, 64},
        AttnCase{"len64_d128_g1", {64}, 1, 1, 128},
        AttnCase{"len129_d64_g8", {129}, 8, 1, 64},
        AttnCase{"len1000_d128_g2", {1000}, 4, 2, 128},
        AttnCase{"len768_d64_g4", {768}, 8, 2, 64},
        AttnCase{"exact_tiles_d128_g2", {128, 256, 384}, 4, 2, 128},
        AttnCase{"mixed_d128_g8", kMixed, 8, 1, 128},
        AttnCase{"mixed_d128_g4", kMixed, 8, 2, 128},
        AttnCase{"mixed_d64_g1", kMixed, 2, 2, 64},
        AttnCase{"mixed_d64_g2", kMixed, 4, 2, 64},
        AttnCase{"short_many_d128_g2", {1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144}, 4, 2, 128},
        AttnCase{"peaky_d128_g2", {65, 300, 129}, 4, 2, 128, 8.0},
        AttnCase{"peaky_d64_g1", {200, 1}, 2, 2, 64, 8.0},
        AttnCase{"simple_path_d96_g2", {1, 65, 200}, 4, 2, 96},
        AttnCase{"simple_path_d32_g4", {0, 33, 7}, 4, 1, 32},
        AttnCase{"empty_batch", {}, 4, 2, 128},
        AttnCase{"only_empty_sequences", {0, 0, 0}, 2, 1, 64}),
    [](const auto& info) { return std::string(info.param.name); });

// Every backward tile variant (the benchmark times all of them) computes the same gradients.
TEST(CudaAttentionBackward, EveryTileVariantMatchesCpu) {
  REQUIRE_GPU();
  for (int64_t d : {64, 128}) {
    AttnCase c{"variants", {1, 63, 65, 129, 500}, 8, 2, d};
    Problem p = make_problem(c, DType::BF16, 300 + d);
    const Tol tol = tol_for(DType::BF16);
    cuda::AttentionPlan plan(p.cu.data<int32_t>(), static_cast<int64_t>(c.lengths.size()), p.n,
                             nullptr);
    Tensor qd = to_device(p.q, DType::BF16), kd = to_device(p.k, DType::BF16);
    Tensor vd = to_device(p.v, DType::BF16), dout_d = to_device(p.dout, DType::BF16);
    Tensor out_d = to_device(p.out_in, DType::BF16), lse_d = to_device(p.lse_in, DType::F32);
    for (int dkdv_queries : {32, 64}) {
      for (int dq_keys : {32, 64}) {
        SCOPED_TRACE(cat("d ", d, " dkdv_queries ", dkdv_queries, " dq_keys ", dq_keys));
        Tensor dq = poisoned_device({p.n, c.hq, d}, DType::BF16);
        Tensor dk = poisoned_device({p.n, c.hkv, d}, DType::BF16);
        Tensor dv = poisoned_device({p.n, c.hkv, d}, DType::BF16);
        cuda::attention_backward(plan, dout_d.raw(), qd.raw(), kd.raw(), vd.raw(), out_d.raw(),
                                 lse_d.data<float>(), c.hq, c.hkv, d, p.scale, DType::BF16,
                                 dq.raw(), dk.raw(), dv.raw(), nullptr,
                                 cuda::AttentionBwdTiles{dkdv_queries, dq_keys});
        EXPECT_TRUE(matches("dq", from_device(dq), p.dq_ref, c.lengths, tol.rtol,
                            tol.atol_rel_rms, tol.rel_l2));
        EXPECT_TRUE(matches("dk", from_device(dk), p.dk_ref, c.lengths, tol.rtol,
                            tol.atol_rel_rms, tol.rel_l2));
        EXPECT_TRUE(matches("dv", from_device(dv), p.dv_ref, c.lengths, tol.rtol,
                            tol.atol_rel_rms, tol.rel_l2));
      }
    }
  }
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  Tensor ha = a.to(Device::CPU), hb = b.to(Device::CPU);
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0;
}

// No atomics anywhere: the same inputs give bit-identical outputs (also under a different
// poison of the outputs, which must all be overwritten).
TEST(CudaAttention, DeterministicBitIdentical) {
  REQUIRE_GPU();
  AttnCase c{"determinism", kMixed, 8, 2, 128};
  std::vector<int32_t> cu{0};
  for (int32_t len : c.lengths) cu.push_back(cu.back() + len);
  const int64_t n = cu.back();
  Tensor cu_d = Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())}).to(Device::CUDA);
  const DType dt = DType::BF16;
  Tensor q = to_device(test::random_uniform({n, c.hq, c.d}, DType::F32, 11, -2, 2), dt);
  Tensor k = to_device(test::random_uniform({n, c.hkv, c.d}, DType::F32, 12, -2, 2), dt);
  Tensor v = to_device(test::random_uniform({n, c.hkv, c.d}, DType::F32, 13), dt);
  Tensor dout = to_device(test::random_uniform({n, c.hq, c.d}, DType::F32, 14), dt);
  const double scale = 1.0 / std::sqrt(128.0);
  Tensor out[2], lse[2], dq[2], dk[2], dv[2];
  for (int r = 0; r < 2; ++r) {
    out[r] = r ? poisoned_device({n, c.hq, c.d}, dt) : Tensor::zeros({n, c.hq, c.d}, dt, Device::CUDA);
    lse[r] = r ? poisoned_device({n, c.hq}, DType::F32) : Tensor::zeros({n, c.hq}, DType::F32, Device::CUDA);
    ops::attention_forward(q, k, v, cu_d, scale, out[r], lse[r]);
    dq[r] = poisoned_device({n, c.hq, c.d}, dt);
    dk[r] = r ? poisoned_device({n, c.hkv, c.d}, dt) : Tensor::zeros({n, c.hkv, c.d}, dt, Device::CUDA);
    dv[r] = poisoned_device({n, c.hkv, c.d}, dt);
    ops::attention_backward(dout, q, k, v, out[0], lse[0], cu_d, scale, dq[r], dk[r], dv[r]);
  }
  EXPECT_TRUE(same_bytes(out[0], out[1]));
  EXPECT_TRUE(same_bytes(lse[0], lse[1]));
  EXPECT_TRUE(same_bytes(dq[0], dq[1]));
  EXPECT_TRUE(same_bytes(dk[0], dk[1]));
  EXPECT_TRUE(same_bytes(dv[0], dv[1]));
}

// The GPU forward's own out/lse fed to its backward (the training path) stays within bf16
// tolerance of the f64 gradients.
TEST(CudaAttention, ForwardThenBackwardEndToEnd) {
  REQUIRE_GPU();
  AttnCase c{"end_to_end", {5, 130, 700}, 16, 8, 128};
  Problem p = make_problem(c, DType::BF16, 400);
  const DType dt = DType::BF16;
  Tensor cu_d = p.cu.to(Device::CUDA);
  Tensor qd = to_device(p.q, dt), kd = to_device(p.k, dt), vd = to_device(p.v, dt);
  Tensor out_d = poisoned_device({p.n, c.hq, c.d}, dt), lse_d = poisoned_device({p.n, c.hq}, DType::F32);
  ops::attention_forward(qd, kd, vd, cu_d, p.scale, out_d, lse_d);
  Tensor dq = poisoned_device({p.n, c.hq, c.d}, dt), dk = poisoned_device({p.n, c.hkv, c.d}, dt);
  Tensor dv = poisoned_device({p.n, c.hkv, c.d}, dt);
  ops::attention_backward(to_device(p.dout, dt), qd, kd, vd, out_d, lse_d, cu_d, p.scale, dq, dk, dv);
  EXPECT_TRUE(matches("dq", from_device(dq), p.dq_ref, c.lengths, 3e-2, 1e-1, 1.5e-2));
  EXPECT_TRUE(matches("dk", from_device(dk), p.dk_ref, c.lengths, 3e-2, 1e-1, 1.5e-2));
  EXPECT_TRUE(matches("dv", from_device(dv), p.dv_ref, c.lengths, 3e-2, 1e-1, 1.5e-2));
}

// ---- the wgmma forward -------------------------------------------------------------------

// f64 attention forward over a packed batch, causal or not: out [n, hq, d], lse [n, hq]
// (natural log). The non-causal reference; checked against the CPU op on causal inputs.
void reference_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                       const std::vector<int32_t>& lengths, double scale, bool causal,
                       Tensor& out, Tensor& lse) {
  const int64_t hq = q.dim(1), hkv = k.dim(1), d = q.dim(2), n = q.dim(0);
  out = Tensor::poisoned({n, hq, d}, DType::F64);
  lse = Tensor::poisoned({n, hq}, DType::F64);
  const double* Q = q.data<double>();
  const double* K = k.data<double>();
  const double* V = v.data<double>();
  double* O = out.data<double>();
  double* L = lse.data<double>();
  int64_t start = 0;
  std::vector<double> sc;
  for (int32_t len : lengths) {
    for (int64_t i = 0; i < len; ++i) {
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t g = h / (hq / hkv);
        const int64_t last = causal ? i : len - 1;
        sc.assign(static_cast<size_t>(last + 1), 0.0);
        double mx = -INFINITY;
        for (int64_t j = 0; j <= last; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) {
            dot += Q[((start + i) * hq + h) * d + c] * K[((start + j) * hkv + g) * d + c];
          }
          sc[j] = dot * scale;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= last; ++j) sum += std::exp(sc[j] - mx);
        for (int64_t c = 0; c < d; ++c) {
          double acc = 0;
          for (int64_t j = 0; j <= last; ++j) {
            acc += std::exp(sc[j] - mx) * V[((start + j) * hkv + g) * d + c];
          }
          O[((start + i) * hq + h) * d + c] = acc / sum;
        }
        L[(start + i) * hq + h] = mx + std::log(sum);
      }
    }
    start += len;
  }
}

struct FwdProblem {
  int64_t n = 0;
  Tensor cu, q, k, v;  // host i32 / f64 (bf16-exact)
  Tensor out_ref, lse_ref;
  double scale = 0;
};

FwdProblem make_fwd_problem(const AttnCase& c, bool causal, uint64_t seed) {
  FwdProblem p;
  std::vector<int32_t> cu{0};
  for (int32_t len : c.lengths) cu.push_back(cu.back() + len);
  p.n = cu.back();
  p.cu = Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())});
  p.scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const DType dt = DType::BF16;
  p.q = round_to(test::random_uniform({p.n, c.hq, c.d}, DType::F32, seed, -c.range, c.range), dt);
  p.k = round_to(test::random_uniform({p.n, c.hkv, c.d}, DType::F32, seed + 1, -c.range, c.range), dt);
  p.v = round_to(test::random_uniform({p.n, c.hkv, c.d}, DType::F32, seed + 2), dt);
  if (causal) {
    p.out_ref = Tensor::poisoned({p.n, c.hq, c.d}, DType::F64);
    p.lse_ref = Tensor::poisoned({p.n, c.hq}, DType::F64);
    ops::attention_forward(p.q, p.k, p.v, p.cu, p.scale, p.out_ref, p.lse_ref);
  } else {
    reference_forward(p.q, p.k, p.v, c.lengths, p.scale, false, p.out_ref, p.lse_ref);
  }
  return p;
}

// Skips unless the device runs the sm_90a build (any Hopper GPU does: see WgmmaAvailable).
#define REQUIRE_WGMMA()                                                                     \
  do {                                                                                      \
    REQUIRE_GPU();                                                                          \
    if (!cuda::attention_wgmma_available()) GTEST_SKIP() << "device runs no sm_90a code";   \
  } while (0)

// Restores the process-wide forward kernel selection when a test ends.
struct FwdKernelGuard {
  cuda::AttentionFwdKernel saved = cuda::attention_fwd_kernel_setting();
  ~FwdKernelGuard() { cuda::set_attention_fwd_kernel(saved); }
};

using Sched = cuda::AttentionWgmmaSchedule;
const std::vector<cuda::AttentionWgmmaConfig> kWgmmaVariants = {
    {128, true},  {128, false}, {64, true, Sched::Producer}, {128, true, Sched::Producer},
    {64, true},   {64, false},  {64, true, Sched::PingPong}, {128, true, Sched::PingPong}};

std::string variant_name(const cuda::AttentionWgmmaConfig& v) {
  const char* sched = v.schedule == Sched::PingPong   ? " ping-pong"
                      : v.schedule == Sched::Producer ? " producer"
                                                      : "";
  return cat("block_n ", v.block_n, v.overlap ? " overlap" : " serial", sched);
}

// The reference f64 forward agrees with the CPU op on causal inputs (so the non-causal
// comparisons below rest on a checked reference). CPU only; runs without a GPU too.
TEST(CudaAttentionWgmma, ReferenceMatchesCpuOpCausal) {
  AttnCase c{"ref", {0, 5, 33, 0, 70}, 4, 2, 16};
  FwdProblem p = make_fwd_problem(c, /*causal=*/true, 900);
  Tensor out, lse;
  reference_forward(p.q, p.k, p.v, c.lengths, p.scale, true, out, lse);
  EXPECT_TRUE(matches("out", out, p.out_ref, c.lengths, 1e-12, 1e-12, 1e-12));
  EXPECT_TRUE(matches("lse", lse, p.lse_ref, c.lengths, 1e-12, 1e-12, 1e-12));
}

// On a Hopper GPU the library's sm_90a code must be the one loaded (else auto never picks the
// wgmma kernel and every test below would skip silently).
TEST(CudaAttentionWgmma, WgmmaAvailableOnHopper) {
  REQUIRE_GPU();
  int dev = 0, major = 0, minor = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), cudaSuccess);
  if (major != 9 || minor != 0) GTEST_SKIP() << "not compute capability 9.0";
  EXPECT_TRUE(cuda::attention_wgmma_available());
}

class CudaAttentionWgmma : public ::testing::TestWithParam<AttnCase> {};

// Every variant, causal and not, against the f64 reference; causal also against the mma.sync
// kernel (same bf16 rounding points, so it is closer than the f64 reference).
TEST_P(CudaAttentionWgmma, MatchesReferenceAndMmaKernel) {
  REQUIRE_WGMMA();
  const AttnCase& c = GetParam();
  const Tol tol = tol_for(DType::BF16);
  const DType dt = DType::BF16;
  for (bool causal : {true, false}) {
    FwdProblem p = make_fwd_problem(c, causal, causal ? 500 : 600);
    cuda::AttentionPlan plan(p.cu.data<int32_t>(), static_cast<int64_t>(c.lengths.size()), p.n,
                             nullptr);
    Tensor qd = to_device(p.q, dt), kd = to_device(p.k, dt), vd = to_device(p.v, dt);
    Tensor mma_out, mma_lse;
    if (causal) {
      Tensor o = poisoned_device({p.n, c.hq, c.d}, dt), l = poisoned_device({p.n, c.hq}, DType::F32);
      FwdKernelGuard guard;
      cuda::set_attention_fwd_kernel(cuda::AttentionFwdKernel::Mma);
      cuda::attention_forward(plan, qd.raw(), kd.raw(), vd.raw(), c.hq, c.hkv, c.d, p.scale, dt,
                              o.raw(), l.data<float>(), nullptr);
      mma_out = from_device(o);
      mma_lse = from_device(l);
    }
    for (const auto& variant : kWgmmaVariants) {
      SCOPED_TRACE(cat(c.name, causal ? " causal " : " non-causal ", variant_name(variant)));
      Tensor o = poisoned_device({p.n, c.hq, c.d}, dt), l = poisoned_device({p.n, c.hq}, DType::F32);
      cuda::attention_forward_wgmma(plan, qd.raw(), kd.raw(), vd.raw(), c.hq, c.hkv, p.scale,
                                    causal, o.raw(), l.data<float>(), nullptr, variant);
      OPD_CUDA_CHECK(cudaDeviceSynchronize());
      Tensor out = from_device(o), lse = from_device(l);
      EXPECT_TRUE(matches("out", out, p.out_ref, c.lengths, tol.rtol, tol.atol_rel_rms, tol.rel_l2));
      EXPECT_TRUE(matches("lse", lse, p.lse_ref, c.lengths, 1e-5, 1e-5, 1e-5));
      if (causal) {
        EXPECT_TRUE(matches("out vs mma", out, mma_out, c.lengths, tol.rtol, tol.atol_rel_rms,
                            tol.rel_l2));
        EXPECT_TRUE(matches("lse vs mma", lse, mma_lse, c.lengths, 1e-5, 1e-5, 1e-5));
      }
    }
  }
}

const std::vector<int32_t> kWgmmaMixed = {0, 1, 17, 0, 63, 65, 127, 129, 0, 768, 0};

// The wgmma kernels' shape sweep (forward and backward): odd lengths around the 64/128 tiles,
// GQA 16/8, 16/16, 32/8, 4/2, 2/1, varlen batches with empty sequences.
const std::vector<AttnCase> kWgmmaShapes = {
    AttnCase{"len1_g16_8", {1}, 16, 8, 128},
    AttnCase{"len17_g16_16", {17}, 16, 16, 128},
    AttnCase{"len63_g32_8", {63}, 32, 8, 128},
    AttnCase{"len65_g16_8", {65}, 16, 8, 128},
    AttnCase{"len127_g16_16", {127}, 16, 16, 128},
    AttnCase{"len129_g32_8", {129}, 32, 8, 128},
    AttnCase{"len768_g16_8", {768}, 16, 8, 128},
    // 24 key tiles of 64: the forward's ping-pong ring (4 slots) wraps six times.
    AttnCase{"len1500_g4_2", {1500}, 4, 2, 128},
    AttnCase{"len300_g2_1", {300}, 2, 1, 128},
    AttnCase{"mixed_g16_8", kWgmmaMixed, 16, 8, 128},
    AttnCase{"mixed_g16_16", kWgmmaMixed, 16, 16, 128},
    AttnCase{"mixed_g32_8", kWgmmaMixed, 32, 8, 128},
    AttnCase{"mixed_g2_1", kWgmmaMixed, 2, 1, 128},
    AttnCase{"exact_tiles_g4_2", {128, 256, 64, 192}, 4, 2, 128},
    AttnCase{"peaky_g4_2", {65, 300, 129}, 4, 2, 128, 8.0},
    AttnCase{"only_empty", {0, 0}, 4, 2, 128}};

INSTANTIATE_TEST_SUITE_P(Shapes, CudaAttentionWgmma, ::testing::ValuesIn(kWgmmaShapes),
                         [](const auto& info) { return std::string(info.param.name); });

// No atomics: two runs of every variant give bit-identical out and lse (different poisons).
TEST(CudaAttentionWgmma, DeterministicBitIdentical) {
  REQUIRE_WGMMA();
  AttnCase c{"determinism", kWgmmaMixed, 16, 8, 128};
  FwdProblem p = make_fwd_problem(c, true, 700);
  cuda::AttentionPlan plan(p.cu.data<int32_t>(), static_cast<int64_t>(c.lengths.size()), p.n,
                           nullptr);
  const DType dt = DType::BF16;
  Tensor qd = to_device(p.q, dt), kd = to_device(p.k, dt), vd = to_device(p.v, dt);
  for (bool causal : {true, false}) {
    for (const auto& variant : kWgmmaVariants) {
      SCOPED_TRACE(cat(causal ? "causal " : "non-causal ", variant_name(variant)));
      Tensor out[2], lse[2];
      for (int r = 0; r < 2; ++r) {
        out[r] = r ? poisoned_device({p.n, c.hq, c.d}, dt) : Tensor::zeros({p.n, c.hq, c.d}, dt, Device::CUDA);
        lse[r] = r ? poisoned_device({p.n, c.hq}, DType::F32) : Tensor::zeros({p.n, c.hq}, DType::F32, Device::CUDA);
        cuda::attention_forward_wgmma(plan, qd.raw(), kd.raw(), vd.raw(), c.hq, c.hkv, p.scale,
                                      causal, out[r].raw(), lse[r].data<float>(), nullptr, variant);
      }
      EXPECT_TRUE(same_bytes(out[0], out[1]));
      EXPECT_TRUE(same_bytes(lse[0], lse[1]));
    }
  }
}

// The selection: forcing wgmma routes the Tensor op (and so the model) through the wgmma
// kernel (bf16, head_dim 128 only), forcing mma through the mma.sync kernel; both match the
// CPU; f32 and head_dim 64 always take the other kernels.
TEST(CudaAttentionWgmma, SelectionRoutesTheTensorOp) {
  REQUIRE_WGMMA();
  FwdKernelGuard guard;
  using K = cuda::AttentionFwdKernel;
  for (K wg : {K::Wgmma, K::WgmmaPingPong}) {
    cuda::set_attention_fwd_kernel(wg);
    EXPECT_EQ(cuda::resolve_attention_fwd_kernel(DType::BF16, 128), wg);
    EXPECT_EQ(cuda::resolve_attention_fwd_kernel(DType::BF16, 64), K::Mma);
    EXPECT_EQ(cuda::resolve_attention_fwd_kernel(DType::F32, 128), K::Mma);
  }
  EXPECT_EQ(cuda::attention_wgmma_config(K::Wgmma).schedule, Sched::Synced);
  EXPECT_EQ(cuda::attention_wgmma_config(K::WgmmaPingPong).schedule, Sched::PingPong);
  EXPECT_THROW(cuda::attention_wgmma_config(K::Mma), Error);
  cuda::set_attention_fwd_kernel(K::Mma);
  EXPECT_EQ(cuda::resolve_attention_fwd_kernel(DType::BF16, 128), K::Mma);
  cuda::set_attention_fwd_kernel(K::Auto);  // the measured default on a device with sm_90a
  EXPECT_EQ(cuda::resolve_attention_fwd_kernel(DType::BF16, 128), K::WgmmaPingPong);
  EXPECT_EQ(cuda::resolve_attention_fwd_kernel(DType::BF16, 64), K::Mma);
  AttnCase c{"selection", {5, 130, 700}, 16, 8, 128};
  FwdProblem p = make_fwd_problem(c, true, 800);
  const Tol tol = tol_for(DType::BF16);
  const DType dt = DType::BF16;
  Tensor cu_d = p.cu.to(Device::CUDA);
  Tensor qd = to_device(p.q, dt), kd = to_device(p.k, dt), vd = to_device(p.v, dt);
  Tensor outs[3];
  for (K kernel : {K::Mma, K::Wgmma, K::WgmmaPingPong}) {
    SCOPED_TRACE(cuda::attention_fwd_kernel_name(kernel));
    cuda::set_attention_fwd_kernel(kernel);
    Tensor o = poisoned_device({p.n, c.hq, c.d}, dt), l = poisoned_device({p.n, c.hq}, DType::F32);
    ops::attention_forward(qd, kd, vd, cu_d, p.scale, o, l);
    EXPECT_TRUE(matches("out", from_device(o), p.out_ref, c.lengths, tol.rtol, tol.atol_rel_rms, tol.rel_l2));
    EXPECT_TRUE(matches("lse", from_device(l), p.lse_ref, c.lengths, 1e-5, 1e-5, 1e-5));
    outs[static_cast<int>(kernel) - static_cast<int>(K::Mma)] = o;
  }
  // The kernels round P differently only through summation order: close, not identical.
  EXPECT_TRUE(matches("wgmma vs mma", from_device(outs[1]), from_device(outs[0]), c.lengths,
                      tol.rtol, tol.atol_rel_rms, tol.rel_l2));
  EXPECT_TRUE(matches("wgmma-pingpong vs mma", from_device(outs[2]), from_device(outs[0]),
                      c.lengths, tol.rtol, tol.atol_rel_rms, tol.rel_l2));
}

TEST(CudaAttentionWgmma, RejectsBadConfig) {
  REQUIRE_WGMMA();
  std::vector<int32_t> cu{0, 8};
  cuda::AttentionPlan plan(cu.data(), 1, 8, nullptr);
  Tensor q = poisoned_device({8, 4, 128}, DType::BF16), k = poisoned_device({8, 3, 128}, DType::BF16);
  Tensor lse = poisoned_device({8, 4}, DType::F32);
  // hq not a multiple of hkv; block_n not 64/128; producer / ping-pong without overlap.
  EXPECT_THROW(cuda::attention_forward_wgmma(plan, q.raw(), k.raw(), k.raw(), 4, 3, 0.1, true,
                                             q.raw(), lse.data<float>(), nullptr),
               Error);
  EXPECT_THROW(cuda::attention_forward_wgmma(plan, q.raw(), k.raw(), k.raw(), 4, 2, 0.1, true,
                                             q.raw(), lse.data<float>(), nullptr, {96, true}),
               Error);
  EXPECT_THROW(cuda::attention_forward_wgmma(plan, q.raw(), k.raw(), k.raw(), 4, 2, 0.1, true,
                                             q.raw(), lse.data<float>(), nullptr,
                                             {64, false, Sched::PingPong}),
               Error);
  EXPECT_THROW(cuda::attention_forward_wgmma(plan, q.raw(), k.raw(), k.raw(), 4, 2, 0.1, true,
                                             q.raw(), lse.data<float>(), nullptr,
                                             {64, false, Sched::Producer}),
               Error);
}

// ---- the wgmma backward (dK/dV) ----------------------------------------------------------

// Restores the process-wide backward kernel selection when a test ends.
struct BwdKernelGuard {
  cuda::AttentionBwdKernel saved = cuda::attention_bwd_kernel_setting();
  ~BwdKernelGuard() { cuda::set_attention_bwd_kernel(saved); }
};

struct BwdOut {
  Tensor dq, dk, dv;  // device, bf16
};

// The plan-level backward with `kernel` selected, on the problem's rounded out / lse; outputs
// start NaN-poisoned (zeros with zero_init, so two runs differ in what must be overwritten).
BwdOut run_backward(const Problem& p, const AttnCase& c, cuda::AttentionBwdKernel kernel,
                    bool zero_init = false) {
  const DType dt = DType::BF16;
  cuda::AttentionPlan plan(p.cu.data<int32_t>(), static_cast<int64_t>(c.lengths.size()), p.n,
                           nullptr);
  Tensor qd = to_device(p.q, dt), kd = to_device(p.k, dt), vd = to_device(p.v, dt);
  Tensor dout_d = to_device(p.dout, dt), out_d = to_device(p.out_in, dt);
  Tensor lse_d = to_device(p.lse_in, DType::F32);
  auto init = [&](const opd::Shape& s) {
    return zero_init ? Tensor::zeros(s, dt, Device::CUDA) : poisoned_device(s, dt);
  };
  BwdOut r{init({p.n, c.hq, c.d}), init({p.n, c.hkv, c.d}), init({p.n, c.hkv, c.d})};
  BwdKernelGuard guard;
  cuda::set_attention_bwd_kernel(kernel);
  cuda::attention_backward(plan, dout_d.raw(), qd.raw(), kd.raw(), vd.raw(), out_d.raw(),
                           lse_d.data<float>(), c.hq, c.hkv, c.d, p.scale, dt, r.dq.raw(),
                           r.dk.raw(), r.dv.raw(), nullptr);
  OPD_CUDA_CHECK(cudaDeviceSynchronize());
  return r;
}

class CudaAttentionWgmmaBwd : public ::testing::TestWithParam<AttnCase> {};

// dk, dv of the wgmma kernel against the f64 reference and against the mma.sync kernel (the
// same bf16 rounding points: P and dS rounded before their products); with `wgmma`, dq comes
// from the same mma.sync dQ kernel as with `mma`, so it is bit-identical; with `wgmma-all` it
// comes from the wgmma dQ kernel (checked like dk, dv) and dk, dv are `wgmma`'s bit for bit.
TEST_P(CudaAttentionWgmmaBwd, MatchesReferenceAndMmaKernel) {
  REQUIRE_WGMMA();
  const AttnCase& c = GetParam();
  SCOPED_TRACE(cat(c.name, " hq ", c.hq, " hkv ", c.hkv));
  const Tol tol = tol_for(DType::BF16);
  Problem p = make_problem(c, DType::BF16, 1000);
  using K = cuda::AttentionBwdKernel;
  const BwdOut mma = run_backward(p, c, K::Mma), wg = run_backward(p, c, K::Wgmma);
  const BwdOut all = run_backward(p, c, K::WgmmaAll);
  {
    SCOPED_TRACE("wgmma-all");
    const Tensor dq = from_device(all.dq);
    EXPECT_TRUE(matches("dq", dq, p.dq_ref, c.lengths, tol.rtol, tol.atol_rel_rms, tol.rel_l2));
    EXPECT_TRUE(matches("dq vs mma", dq, from_device(mma.dq), c.lengths, tol.rtol,
                        tol.atol_rel_rms, tol.rel_l2));
    EXPECT_TRUE(same_bytes(all.dk, wg.dk));
    EXPECT_TRUE(same_bytes(all.dv, wg.dv));
  }
  const Tensor dk = from_device(wg.dk), dv = from_device(wg.dv);
  EXPECT_TRUE(matches("dk", dk, p.dk_ref, c.lengths, tol.rtol, tol.atol_rel_rms, tol.rel_l2));
  EXPECT_TRUE(matches("dv", dv, p.dv_ref, c.lengths, tol.rtol, tol.atol_rel_rms, tol.rel_l2));
  EXPECT_TRUE(matches("dk vs mma", dk, from_device(mma.dk), c.lengths, tol.rtol,
                      tol.atol_rel_rms, tol.rel_l2));
  EXPECT_TRUE(matches("dv vs mma", dv, from_device(mma.dv), c.lengths, tol.rtol,
                      tol.atol_rel_rms, tol.rel_l2));
  EXPECT_TRUE(matches("dq", from_device(wg.dq), p.dq_ref, c.lengths, tol.rtol, tol.atol_rel_rms,
                      tol.rel_l2));
  EXPECT_TRUE(same_bytes(wg.dq, mma.dq));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaAttentionWgmmaBwd, ::testing::ValuesIn(kWgmmaShapes),
                         [](const auto& info) { return std::string(info.param.name); });

// No atomics: two runs (one into zeros, one into NaN poison) are bit-identical.
TEST(CudaAttentionWgmmaBwd, DeterministicBitIdentical) {
  REQUIRE_WGMMA();
  AttnCase c{"determinism", kWgmmaMixed, 16, 8, 128};
  Problem p = make_problem(c, DType::BF16, 1100);
  for (auto kernel : {cuda::AttentionBwdKernel::Wgmma, cuda::AttentionBwdKernel::WgmmaAll}) {
    SCOPED_TRACE(cuda::attention_bwd_kernel_name(kernel));
    const BwdOut a = run_backward(p, c, kernel, /*zero_init=*/true);
    const BwdOut b = run_backward(p, c, kernel);
    EXPECT_TRUE(same_bytes(a.dk, b.dk));
    EXPECT_TRUE(same_bytes(a.dv, b.dv));
    EXPECT_TRUE(same_bytes(a.dq, b.dq));
  }
}

// The setting itself needs no device: names, the setter, and auto staying a setting of its own.
TEST(CudaAttentionWgmmaBwd, SettingRoundTrip) {
  BwdKernelGuard guard;
  using K = cuda::AttentionBwdKernel;
  for (K kernel : {K::Mma, K::Wgmma, K::WgmmaAll, K::Auto}) {
    cuda::set_attention_bwd_kernel(kernel);
    EXPECT_EQ(cuda::attention_bwd_kernel_setting(), kernel);
  }
  EXPECT_STREQ(cuda::attention_bwd_kernel_name(K::Mma), "mma");
  EXPECT_STREQ(cuda::attention_bwd_kernel_name(K::Wgmma), "wgmma");
  EXPECT_STREQ(cuda::attention_bwd_kernel_name(K::WgmmaAll), "wgmma-all");
  EXPECT_STREQ(cuda::attention_bwd_kernel_name(K::Auto), "auto");
}

// The selection: wgmma only for bf16 / head_dim 128, auto = wgmma-all (the fastest), and the
// Tensor op routed through either kernel matches the f64 gradients.
TEST(CudaAttentionWgmmaBwd, SelectionRoutesTheTensorOp) {
  REQUIRE_WGMMA();
  BwdKernelGuard guard;
  using K = cuda::AttentionBwdKernel;
  for (K wg : {K::Wgmma, K::WgmmaAll}) {
    cuda::set_attention_bwd_kernel(wg);
    EXPECT_EQ(cuda::resolve_attention_bwd_kernel(DType::BF16, 128), wg);
    EXPECT_EQ(cuda::resolve_attention_bwd_kernel(DType::BF16, 64), K::Mma);
    EXPECT_EQ(cuda::resolve_attention_bwd_kernel(DType::F32, 128), K::Mma);
  }
  cuda::set_attention_bwd_kernel(K::Mma);
  EXPECT_EQ(cuda::resolve_attention_bwd_kernel(DType::BF16, 128), K::Mma);
  cuda::set_attention_bwd_kernel(K::Auto);
  EXPECT_EQ(cuda::resolve_attention_bwd_kernel(DType::BF16, 128), K::WgmmaAll);
  EXPECT_EQ(cuda::resolve_attention_bwd_kernel(DType::BF16, 64), K::Mma);
  AttnCase c{"selection", {5, 130, 700}, 16, 8, 128};
  Problem p = make_problem(c, DType::BF16, 1200);
  const Tol tol = tol_for(DType::BF16);
  const DType dt = DType::BF16;
  Tensor cu_d = p.cu.to(Device::CUDA);
  Tensor qd = to_device(p.q, dt), kd = to_device(p.k, dt), vd = to_device(p.v, dt);
  Tensor dout_d = to_device(p.dout, dt), out_d = to_device(p.out_in, dt);
  Tensor lse_d = to_device(p.lse_in, DType::F32);
  for (K kernel : {K::Mma, K::Wgmma, K::WgmmaAll}) {
    SCOPED_TRACE(cuda::attention_bwd_kernel_name(kernel));
    cuda::set_attention_bwd_kernel(kernel);
    Tensor dq = poisoned_device({p.n, c.hq, c.d}, dt), dk = poisoned_device({p.n, c.hkv, c.d}, dt);
    Tensor dv = poisoned_device({p.n, c.hkv, c.d}, dt);
    ops::attention_backward(dout_d, qd, kd, vd, out_d, lse_d, cu_d, p.scale, dq, dk, dv);
    EXPECT_TRUE(matches("dq", from_device(dq), p.dq_ref, c.lengths, tol.rtol, tol.atol_rel_rms, tol.rel_l2));
    EXPECT_TRUE(matches("dk", from_device(dk), p.dk_ref, c.lengths, tol.rtol, tol.atol_rel_rms, tol.rel_l2));
    EXPECT_TRUE(matches("dv", from_device(dv), p.dv_ref, c.lengths, tol.rtol, tol.atol_rel_rms, tol.rel_l2));
  }
}

TEST(CudaAttentionWgmmaBwd, RejectsBadHeads) {
  REQUIRE_WGMMA();
  std::vector<int32_t> cu{0, 8};
  cuda::AttentionPlan plan(cu.data(), 1, 8, nullptr);
  Tensor q = poisoned_device({8, 4, 128}, DType::BF16), k = poisoned_device({8, 3, 128}, DType::BF16);
  Tensor lse = poisoned_device({8, 4}, DType::F32);
  EXPECT_THROW(cuda::attention_backward_dkdv_wgmma(plan, q.raw(), q.raw(), k.raw(), k.raw(),
                                                   lse.data<float>(), lse.data<float>(), 4, 3,
                                                   0.1, k.raw(), k.raw(), nullptr),
               Error);
  EXPECT_THROW(cuda::attention_backward_dq_wgmma(plan, q.raw(), q.raw(), k.raw(), k.raw(),
                                                 lse.data<float>(), lse.data<float>(), 4, 3,
                                                 0.1, q.raw(), nullptr),
               Error);
}

TEST(CudaAttention, RejectsBadInputs) {
  REQUIRE_GPU();
  const DType dt = DType::BF16;
  Tensor q = poisoned_device({8, 2, 64}, dt), k = poisoned_device({8, 1, 64}, dt);
  Tensor v = poisoned_device({8, 1, 64}, dt);
  Tensor out = poisoned_device({8, 2, 64}, dt), lse = poisoned_device({8, 2}, DType::F32);
  // cu_seqlens that decreases / does not end at T: InvalidData naming the entry.
  for (std::vector<int32_t> bad : {std::vector<int32_t>{0, 5, 3, 8}, std::vector<int32_t>{0, 4, 7},
                                   std::vector<int32_t>{1, 8}}) {
    Tensor cu = Tensor::from_vector(bad, {static_cast<int64_t>(bad.size())}).to(Device::CUDA);
    try {
      ops::attention_forward(q, k, v, cu, 0.125, out, lse);
      ADD_FAILURE() << "bad cu_seqlens accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidData) << e.what();
      EXPECT_NE(std::string(e.what()).find("cu_seqlens"), std::string::npos) << e.what();
    }
  }
  Tensor cu = Tensor::from_vector(std::vector<int32_t>{0, 8}, {2}).to(Device::CUDA);
  // head_dim past the supported range: Unsupported, not a wrong answer.
  Tensor q300 = poisoned_device({8, 2, 300}, dt), k300 = poisoned_device({8, 1, 300}, dt);
  Tensor o300 = poisoned_device({8, 2, 300}, dt);
  EXPECT_THROW(ops::attention_forward(q300, k300, k300, cu, 0.1, o300, lse), Error);
  // lse must be f32.
  Tensor lse_bf16 = poisoned_device({8, 2}, dt);
  EXPECT_THROW(ops::attention_forward(q, k, v, cu, 0.125, out, lse_bf16), Error);
  // hq not a multiple of hkv.
  Tensor k3 = poisoned_device({8, 3, 64}, dt);
  EXPECT_THROW(ops::attention_forward(q, k3, k3, cu, 0.125, out, lse), Error);
}

}  // namespace
}  // namespace opd

// ---- query rows over cached context (AttentionPlan's context constructor) ----
// Each sequence's len_q query rows are the last len_q of its len_k keys (causal, bottom-right
// aligned): the mma.sync kernel (bf16 head_dim 64/128; 128 also with OPD_ATTENTION_FWD=auto,
// which must fall back from wgmma for such plans) and the f32-arithmetic kernel (f32, and bf16
// head_dim 32/96) against the CPU reference cpu::attention_forward_context in f64 on the same
// inputs. Odd lengths, len_q = 1 .. len_k, empty sequences, context longer than a key block,
// query blocks that start mid-sequence, GQA 1/2/4/8.
#include "kernels/cpu/cpu_ops.h"  // cpu::attention_forward_context, the reference

namespace opd {
namespace {

struct CtxCase {
  const char* name;
  std::vector<int32_t> len_q, len_k;
  int64_t hq, hkv, d;
};

std::vector<int32_t> ctx_prefix(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu = {0};
  for (int32_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

const std::vector<CtxCase>& ctx_cases() {
  static const std::vector<CtxCase> cases = {
      {"mixed", {1, 3, 0, 33, 1, 0, 9, 64, 65, 129, 7}, {1, 7, 0, 33, 70, 5, 200, 65, 129, 1000, 500}, 8, 2, 64},
      {"decode_like", {1, 1, 1, 1, 1}, {1, 2, 63, 64, 65}, 4, 4, 64},
      {"chunked_prompt", {128, 128, 100, 300}, {256, 384, 1100, 300}, 8, 1, 128},
      {"shared_prompt", {17, 200, 1, 64, 0, 255}, {527, 710, 511, 574, 510, 765}, 16, 4, 128},
      {"gqa8_odd", {5, 31, 127}, {6, 95, 131}, 8, 1, 128},
  };
  return cases;
}

struct CtxProblem {
  std::vector<int32_t> cu_q, cu_k;
  int64_t nq = 0, nk = 0;
  double scale = 0;
  Tensor q, k, v, out_ref, lse_ref;  // host f64, values exact in the storage dtype
};

CtxProblem make_ctx_problem(const CtxCase& c, DType dt, uint64_t seed) {
  CtxProblem p;
  p.cu_q = ctx_prefix(c.len_q);
  p.cu_k = ctx_prefix(c.len_k);
  p.nq = p.cu_q.back();
  p.nk = p.cu_k.back();
  p.scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  p.q = round_to(test::random_uniform({p.nq, c.hq, c.d}, DType::F32, seed, -2, 2), dt);
  p.k = round_to(test::random_uniform({p.nk, c.hkv, c.d}, DType::F32, seed + 1, -2, 2), dt);
  p.v = round_to(test::random_uniform({p.nk, c.hkv, c.d}, DType::F32, seed + 2), dt);
  p.out_ref = Tensor::poisoned({p.nq, c.hq, c.d}, DType::F64);
  p.lse_ref = Tensor::poisoned({p.nq, c.hq}, DType::F64);
  cpu::attention_forward_context(p.q.data<double>(), p.k.data<double>(), p.v.data<double>(),
                                 p.cu_q.data(), p.cu_k.data(),
                                 static_cast<int64_t>(c.len_q.size()), p.nq, p.nk, c.hq, c.hkv,
                                 c.d, p.scale, p.out_ref.data<double>(), p.lse_ref.data<double>());
  return p;
}

struct CtxResult {
  Tensor out, lse;  // host f64
};

CtxResult run_ctx_gpu(const CtxProblem& p, const CtxCase& c, DType dt, int64_t d) {
  Tensor qd = to_device(p.q, dt), kd = to_device(p.k, dt), vd = to_device(p.v, dt);
  Tensor out_d = poisoned_device({p.nq, c.hq, d}, dt);
  Tensor lse_d = poisoned_device({p.nq, c.hq}, DType::F32);
  cuda::AttentionPlan plan(p.cu_q.data(), p.cu_k.data(), static_cast<int64_t>(c.len_q.size()),
                           p.nq, p.nk, nullptr);
  EXPECT_TRUE(plan.has_context());
  EXPECT_EQ(plan.total_k_rows(), p.nk);
  cuda::attention_forward(plan, qd.raw(), kd.raw(), vd.raw(), c.hq, c.hkv, d, p.scale, dt,
                          out_d.raw(), lse_d.data<float>(), nullptr);
  OPD_CUDA_CHECK(cudaDeviceSynchronize());
  return {from_device(out_d), from_device(lse_d)};
}

void check_ctx(const CtxCase& c, DType dt, int64_t d, uint64_t seed) {
  CtxCase cc = c;
  cc.d = d;
  SCOPED_TRACE(cat(c.name, " ", dtype_name(dt), " hq ", c.hq, " hkv ", c.hkv, " d ", d));
  CtxProblem p = make_ctx_problem(cc, dt, seed);
  CtxResult r = run_ctx_gpu(p, cc, dt, d);
  const Tol tol = tol_for(dt);
  EXPECT_TRUE(matches("out", r.out, p.out_ref, c.len_q, tol.rtol, tol.atol_rel_rms, tol.rel_l2));
  EXPECT_TRUE(matches("lse", r.lse, p.lse_ref, c.len_q, 1e-5, 1e-5, 1e-5));
}

TEST(CudaAttentionContext, Bf16TensorCoresMatchCpu) {
  REQUIRE_GPU();
  uint64_t seed = 500;
  for (const CtxCase& c : ctx_cases()) {
    for (int64_t d : {int64_t{64}, int64_t{128}}) check_ctx(c, DType::BF16, d, seed++);
  }
}

TEST(CudaAttentionContext, F32AndOtherHeadDimsMatchCpu) {
  REQUIRE_GPU();
  uint64_t seed = 600;
  for (const CtxCase& c : ctx_cases()) {
    check_ctx(c, DType::F32, 64, seed++);
    check_ctx(c, DType::F32, 128, seed++);
    check_ctx(c, DType::BF16, 32, seed++);  // the f32-arithmetic kernel with bf16 storage
    check_ctx(c, DType::BF16, 96, seed++);
  }
}

// A context plan whose keys are the query rows (cu_k == cu_q) runs the same integer arithmetic
// as the square plan: the same bits from the mma.sync kernel (head_dim 64, and 128 with the
// mma kernel forced, since square plans may take wgmma) and the f32 kernel.
TEST(CudaAttentionContext, SquareContextPlanGivesTheSquareBits) {
  REQUIRE_GPU();
  const std::vector<int32_t> lens = {0, 1, 7, 0, 63, 64, 65, 129, 300, 0};
  const cuda::AttentionFwdKernel saved = cuda::attention_fwd_kernel_setting();
  cuda::set_attention_fwd_kernel(cuda::AttentionFwdKernel::Mma);
  uint64_t seed = 700;
  for (DType dt : {DType::BF16, DType::F32}) {
    for (int64_t d : {int64_t{64}, int64_t{128}}) {
      SCOPED_TRACE(cat(dtype_name(dt), " d ", d));
      CtxCase c{"square", lens, lens, 8, 2, d};
      CtxProblem p = make_ctx_problem(c, dt, seed++);
      CtxResult ctx = run_ctx_gpu(p, c, dt, d);
      Tensor qd = to_device(p.q, dt), kd = to_device(p.k, dt), vd = to_device(p.v, dt);
      Tensor out_d = poisoned_device({p.nq, c.hq, d}, dt);
      Tensor lse_d = poisoned_device({p.nq, c.hq}, DType::F32);
      cuda::AttentionPlan plan(p.cu_q.data(), static_cast<int64_t>(lens.size()), p.nq, nullptr);
      EXPECT_FALSE(plan.has_context());
      cuda::attention_forward(plan, qd.raw(), kd.raw(), vd.raw(), c.hq, c.hkv, d, p.scale, dt,
                              out_d.raw(), lse_d.data<float>(), nullptr);
      EXPECT_TRUE(same_bytes(from_device(out_d), ctx.out));
      EXPECT_TRUE(same_bytes(from_device(lse_d), ctx.lse));
    }
  }
  cuda::set_attention_fwd_kernel(saved);
}

// The plan validates on the host before any device call, so this also runs without a GPU.
TEST(CudaAttentionContext, PlanRejectsMoreQueriesThanKeys) {
  const std::vector<int32_t> cu_q = {0, 2, 5}, cu_k = {0, 4, 6}, cu_k_bad = {0, 4, 9};
  try {
    cuda::AttentionPlan plan(cu_q.data(), cu_k.data(), 2, 5, 6, nullptr);
    ADD_FAILURE() << "no error for 3 query rows over 2 keys";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData);
    EXPECT_NE(std::string(e.what()).find("sequence 1"), std::string::npos) << e.what();
  }
  try {
    cuda::AttentionPlan plan(cu_q.data(), cu_k_bad.data(), 2, 5, 6, nullptr);
    ADD_FAILURE() << "no error for cu_seqlens_k past the key rows";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData);
  }
}

}  // namespace
}  // namespace opd
