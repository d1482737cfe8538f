// Fused lm_head + distillation loss (loss/fused_loss.h) against: the float64 PyTorch reference
// fixtures of tools/loss_reference.py (every support mode, beta in {0, 0.1, 0.5, 0.9, 1},
// T in {0.7, 1, 1.3}, with and without sft_alpha; loss, d hidden, d lm_head), central finite
// differences, a dense (non-fused) CPU computation, and identities of the definitions
// (topk / topk+tail with K = V equal full; topk+tail is a lower bound of full; an empty slot is
// the same as no slot). Plus the memory bound O(N x K + N x tile) measured with memory_stats,
// the kernel's guard against ids that skipped validation, and argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "core/philox.h"
#include "core/thread_pool.h"
#include "loss/divergence.h"
#include "loss/fused_loss.h"
#include "loss/loss_test_util.h"
#include "model/safetensors.h"

namespace opd {
namespace {

const std::vector<double> kBetas{0.0, 0.1, 0.5, 0.9, 1.0};
const std::vector<double> kTemps{0.7, 1.0, 1.3};
const std::vector<SupportMode> kModes{SupportMode::Full, SupportMode::TopK, SupportMode::TopKTail,
                                      SupportMode::Sampled};

struct Case {
  std::string name;
  SupportMode mode;
  double beta, temperature, sft_alpha;
};

// Mirrors case_list() of tools/loss_reference.py.
std::vector<Case> case_list() {
  std::vector<Case> cases;
  auto add = [&](SupportMode m, double b, double t, double s) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "%s/b%g/T%g/sft%g", std::string(support_mode_name(m)).c_str(), b,
                  t, s);
    cases.push_back({buf, m, b, t, s});
  };
  for (SupportMode m : kModes) {
    for (double b : (m == SupportMode::Sampled ? std::vector<double>{0.5} : kBetas))
      for (double t : kTemps) add(m, b, t, 0.0);
    add(m, 0.5, 0.7, 0.3);
    add(m, 0.0, 1.0, 0.3);
  }
  return cases;
}

int temp_index(double t) {
  for (size_t i = 0; i < kTemps.size(); ++i)
    if (kTemps[i] == t) return static_cast<int>(i);
  return -1;
}

// The fixture inputs, converted to `dtype` (f32 or f64), and the teacher payload of each
// temperature run through validation like production code (two sequences, row 7 padding).
struct Problem {
  DType dtype;
  int64_t n, h, v, k;
  Tensor hidden, lm_head, teacher_hidden, teacher_lm_head, targets, weights, weights_full, sft_rows;
  double n_total;
  std::vector<TeacherTopK> teacher;  // per temperature index
};

Problem load_problem(DType dtype) {
  SafetensorsFile in = SafetensorsFile::open(test::fixture_path("loss/inputs.safetensors"));
  Problem p;
  p.dtype = dtype;
  p.hidden = in.get("hidden").to_dtype(dtype);
  p.lm_head = in.get("lm_head").to_dtype(dtype);
  p.teacher_hidden = in.get("teacher_hidden").to_dtype(dtype);
  p.teacher_lm_head = in.get("teacher_lm_head").to_dtype(dtype);
  p.targets = in.get("targets").clone();
  p.sft_rows = in.get("sft_rows").clone();
  p.weights = in.get("weights").to_dtype(dtype);
  p.n = p.hidden.dim(0);
  p.h = p.hidden.dim(1);
  p.v = p.lm_head.dim(0);
  Tensor ids = in.get("teacher_ids");
  p.k = ids.dim(1);
  p.n_total = in.get("n_total").data<double>()[0];
  Tensor valid = in.get("valid");
  // Full mode has no payload: padding is expressed by weight 0 there.
  p.weights_full = p.weights.clone();
  for (int64_t r = 0; r < p.n; ++r) {
    if (valid.data<int32_t>()[r] == 0) {
      if (dtype == DType::F32) p.weights_full.data<float>()[r] = 0;
      else p.weights_full.data<double>()[r] = 0;
    }
  }
  for (size_t t = 0; t < kTemps.size(); ++t) {
    TeacherPayload pl = test::payload_from_dense(
        {3, 11}, {6, 4}, ids, in.get("teacher_logprobs_T" + std::to_string(t)),
        in.get("actual_logprobs_T" + std::to_string(t)), p.v);
    pl.temperature = kTemps[t];  // the fixture's teacher applied T (like opd's own teacher)
    LossConfig cfg;
    cfg.temperature = kTemps[t];
    CompletionLayout layout = test::layout_of(pl);
    layout.padding.assign(p.n, 0);
    for (int64_t r = 0; r < p.n; ++r) layout.padding[r] = valid.data<int32_t>()[r] == 0;
    p.teacher.push_back(validate_teacher_payload(pl, layout, p.v, cfg, dtype));
  }
  return p;
}

FusedLossArgs args_for(const Problem& p, const LossConfig& cfg) {
  FusedLossArgs a;
  a.hidden = p.hidden;
  a.lm_head = p.lm_head;
  a.targets = p.targets;
  a.sft_rows = p.sft_rows;
  a.n_total = p.n_total;
  if (cfg.mode == SupportMode::Full) {
    a.weights = p.weights_full;
    a.teacher_hidden = p.teacher_hidden;
    a.teacher_lm_head = p.teacher_lm_head;
  } else {
    a.weights = p.weights;
    a.teacher = &p.teacher[temp_index(cfg.temperature)];
  }
  return a;
}

struct Grads {
  LossResult res;
  Tensor dh, dw;
};

// Runs the fused loss with d_hidden poisoned (NaN: every element must be written) and d_lm_head
// starting from small random values (it is accumulated); returns the increment of d_lm_head.
Grads run_fused(const LossConfig& cfg, const FusedLossArgs& a) {
  const int64_t n = a.hidden.dim(0), h = a.hidden.dim(1), v = a.lm_head.dim(0);
  const DType dt = a.hidden.dtype();
  Grads g;
  g.dh = Tensor::poisoned({n, h}, dt);
  Tensor start = test::random_uniform({v, h}, dt, 99, -1e-3, 1e-3);
  g.dw = start.clone();
  g.res = fused_lm_head_loss(cfg, a, &g.dh, &g.dw);
  for (int64_t i = 0; i < g.dw.numel(); ++i) {
    if (dt == DType::F32) g.dw.data<float>()[i] -= start.data<float>()[i];
    else g.dw.data<double>()[i] -= start.data<double>()[i];
  }
  return g;
}

double rel(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-300); }

struct Worst {
  double loss = 0, dh = 0, dw = 0;
  void update(double l, const test::Diff& h, const test::Diff& w) {
    loss = std::max(loss, l);
    dh = std::max(dh, h.max_rel);
    dw = std::max(dw, w.max_rel);
  }
};

void check_against_fixtures(DType dtype, double tol, int64_t tile) {
  Problem p = load_problem(dtype);
  SafetensorsFile ref = SafetensorsFile::open(test::fixture_path("loss/cases.safetensors"));
  int checked = 0;
  Worst worst;
  for (const Case& c : case_list()) {
    SCOPED_TRACE(c.name);
    LossConfig cfg;
    cfg.mode = c.mode;
    cfg.beta = c.beta;
    cfg.temperature = c.temperature;
    cfg.sft_alpha = c.sft_alpha;
    cfg.vocab_tile = tile;
    ASSERT_TRUE(ref.contains(c.name + "/loss")) << c.name;
    Grads g = run_fused(cfg, args_for(p, cfg));
    const double ref_loss = ref.get(c.name + "/loss").data<double>()[0];
    test::Diff dh = test::compare(g.dh, ref.get(c.name + "/grad_hidden"));
    test::Diff dw = test::compare(g.dw, ref.get(c.name + "/grad_lm_head"));
    EXPECT_TRUE(std::isfinite(g.res.loss));
    EXPECT_LE(rel(g.res.loss, ref_loss), tol) << g.res.loss << " vs " << ref_loss;
    EXPECT_FALSE(dh.has_nan);
    EXPECT_FALSE(dw.has_nan);
    EXPECT_LE(dh.max_rel, tol) << "rel_l2 " << dh.rel_l2;
    EXPECT_LE(dw.max_rel, tol) << "rel_l2 " << dw.rel_l2;
    EXPECT_NE(ref_loss, 0.0) << "a zero reference loss would make the check weak";
    worst.update(rel(g.res.loss, ref_loss), dh, dw);
    ++checked;
  }
  // Every case of the fixture was compared (none silently skipped).
  EXPECT_EQ(std::to_string(checked), ref.metadata().at("cases"));
  EXPECT_EQ(static_cast<int>(ref.names().size()), 3 * checked);
  std::printf("%s tile %lld: %d cases, worst rel err: loss %.3g, d hidden %.3g, d lm_head %.3g\n",
              std::string(dtype_name(dtype)).c_str(), static_cast<long long>(tile), checked,
              worst.loss, worst.dh, worst.dw);
}

TEST(FusedLoss, MatchesFloat64PyTorchReferenceF64) { check_against_fixtures(DType::F64, 1e-6, 37); }
TEST(FusedLoss, MatchesFloat64PyTorchReferenceF64OneTile) {
  check_against_fixtures(DType::F64, 1e-6, 4096);
}
TEST(FusedLoss, MatchesFloat64PyTorchReferenceF32) { check_against_fixtures(DType::F32, 1e-5, 37); }

// Tile width must not matter beyond rounding: 1 column, odd, exactly V, larger than V.
TEST(FusedLoss, TileWidthDoesNotChangeTheResult) {
  Problem p = load_problem(DType::F64);
  for (SupportMode m : kModes) {
    LossConfig cfg;
    cfg.mode = m;
    cfg.beta = 0.5;
    cfg.temperature = 1.3;
    cfg.sft_alpha = 0.3;
    cfg.vocab_tile = p.v;
    Grads base = run_fused(cfg, args_for(p, cfg));
    for (int64_t tile : {int64_t{1}, int64_t{2}, int64_t{37}, int64_t{156}, int64_t{100000}}) {
      cfg.vocab_tile = tile;
      Grads g = run_fused(cfg, args_for(p, cfg));
      EXPECT_LE(rel(g.res.loss, base.res.loss), 1e-13) << support_mode_name(m) << " tile " << tile;
      EXPECT_TRUE(test::close(g.dh, base.dh, 1e-12, 1e-15)) << support_mode_name(m) << " tile " << tile;
      EXPECT_TRUE(test::close(g.dw, base.dw, 1e-12, 1e-15)) << support_mode_name(m) << " tile " << tile;
    }
  }
}

// ---- dense (non-fused) CPU computation: [N, V] logits materialized, no tiles ------------------
Grads dense_reference(const LossConfig& cfg, const FusedLossArgs& a) {
  const int64_t n = a.hidden.dim(0), h = a.hidden.dim(1), v = a.lm_head.dim(0);
  const double* H = a.hidden.data<double>();
  const double* W = a.lm_head.data<double>();
  const double inv_t = 1.0 / cfg.temperature;
  std::vector<double> z(n * v), dz(n * v, 0.0), tz;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < v; ++c) {
      double acc = 0;
      for (int64_t i = 0; i < h; ++i) acc += H[r * h + i] * W[c * h + i];
      z[r * v + c] = acc;
    }
  if (cfg.mode == SupportMode::Full) {
    const int64_t ht = a.teacher_hidden.dim(1);
    tz.resize(n * v);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < v; ++c) {
        double acc = 0;
        for (int64_t i = 0; i < ht; ++i)
          acc += a.teacher_hidden.data<double>()[r * ht + i] * a.teacher_lm_head.data<double>()[c * ht + i];
        tz[r * v + c] = acc;
      }
  }
  auto lse = [&](const double* x, double scale) {
    double m = -INFINITY;
    for (int64_t c = 0; c < v; ++c) m = std::max(m, scale * x[c]);
    double s = 0;
    for (int64_t c = 0; c < v; ++c) s += std::exp(scale * x[c] - m);
    return m + std::log(s);
  };
  Grads g;
  const int32_t* y = a.targets.data<int32_t>();
  for (int64_t r = 0; r < n; ++r) {
    const double w = a.weights.data<double>()[r];
    const bool valid = a.teacher == nullptr || a.teacher->valid.data<int32_t>()[r] != 0;
    if (w == 0 || !valid) continue;
    const double scale = w / a.n_total;
    const double* zr = &z[r * v];
    double* dzr = &dz[r * v];
    const double lt = lse(zr, inv_t);
    double div = 0;
    if (cfg.mode == SupportMode::Full) {
      const double ltt = lse(&tz[r * v], inv_t);
      double gsum = 0;
      std::vector<double> gv(v);
      for (int64_t c = 0; c < v; ++c) {
        loss::AtomTerm t = loss::atom_term(inv_t * tz[r * v + c] - ltt, inv_t * zr[c] - lt, cfg.beta);
        div += t.d;
        gv[c] = t.g;
        gsum += t.g;
      }
      for (int64_t c = 0; c < v; ++c) dzr[c] += scale * inv_t * (gv[c] - std::exp(inv_t * zr[c] - lt) * gsum);
    } else if (cfg.mode == SupportMode::Sampled) {
      double dsy = 0;
      loss::RowResult res = loss::sampled_row(a.teacher->actual_logprobs.data<double>()[r],
                                              inv_t * zr[y[r]], lt, &dsy);
      div = res.value;
      for (int64_t c = 0; c < v; ++c) dzr[c] += scale * inv_t * res.dense * std::exp(inv_t * zr[c] - lt);
      dzr[y[r]] += scale * inv_t * dsy;
    } else {
      const int64_t k = a.teacher->k;
      const int32_t* ids = a.teacher->ids.data<int32_t>() + r * k;
      std::vector<double> av(k), s(k), ds(k);
      for (int64_t j = 0; j < k; ++j) {
        av[j] = a.teacher->logprobs.data<double>()[r * k + j];
        s[j] = ids[j] >= 0 ? inv_t * zr[ids[j]] : 0;
      }
      loss::RowResult res = cfg.mode == SupportMode::TopK
                                ? loss::topk_row(k, ids, av.data(), s.data(), cfg.beta, ds.data())
                                : loss::topk_tail_row(k, ids, av.data(), s.data(), lt, cfg.beta,
                                                      cfg.tail_floor, ds.data());
      div = res.value;
      for (int64_t c = 0; c < v; ++c) dzr[c] += scale * inv_t * res.dense * std::exp(inv_t * zr[c] - lt);
      for (int64_t j = 0; j < k; ++j)
        if (ids[j] >= 0) dzr[ids[j]] += scale * inv_t * ds[j];
    }
    double ce = 0;
    if (cfg.sft_alpha > 0 && a.sft_rows.data<int32_t>()[r]) {
      const double l1 = lse(zr, 1.0);
      ce = l1 - zr[y[r]];
      for (int64_t c = 0; c < v; ++c) dzr[c] += scale * cfg.sft_alpha * std::exp(zr[c] - l1);
      dzr[y[r]] -= scale * cfg.sft_alpha;
    }
    g.res.loss += scale * (div + cfg.sft_alpha * ce);
  }
  g.dh = Tensor::zeros({n, h}, DType::F64);
  g.dw = Tensor::zeros({v, h}, DType::F64);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < v; ++c)
      for (int64_t i = 0; i < h; ++i) {
        g.dh.data<double>()[r * h + i] += dz[r * v + c] * W[c * h + i];
        g.dw.data<double>()[c * h + i] += dz[r * v + c] * H[r * h + i];
      }
  return g;
}

TEST(FusedLoss, EqualsDenseNonFusedComputation) {
  Problem p = load_problem(DType::F64);
  double worst = 0;
  for (SupportMode m : kModes)
    for (double b : {0.0, 0.5, 1.0})
      for (double t : {0.7, 1.0})
        for (double sft : {0.0, 0.3}) {
          LossConfig cfg;
          cfg.mode = m;
          cfg.beta = b;
          cfg.temperature = t;
          cfg.sft_alpha = sft;
          cfg.vocab_tile = 37;
          FusedLossArgs a = args_for(p, cfg);
          Grads f = run_fused(cfg, a);
          Grads d = dense_reference(cfg, a);
          SCOPED_TRACE(describe(cfg));
          EXPECT_LE(rel(f.res.loss, d.res.loss), 1e-12);
          EXPECT_TRUE(test::close(f.dh, d.dh, 1e-10, 1e-14));
          EXPECT_TRUE(test::close(f.dw, d.dw, 1e-10, 1e-14));
          worst = std::max({worst, test::compare(f.dh, d.dh).max_rel, test::compare(f.dw, d.dw).max_rel});
        }
  std::printf("fused vs dense: worst gradient max rel err %.3g\n", worst);
}

// ---- central finite differences of the fused loss in f64 ------------------------------------
// (sampled mode is excluded: its surrogate carries a stop-gradient, so its gradient is not the
// derivative of its value; the PyTorch fixtures check it.)
TEST(FusedLoss, GradientsMatchFiniteDifferences) {
  Problem p = load_problem(DType::F64);
  double worst = 0;
  int probes = 0;
  for (SupportMode m : {SupportMode::Full, SupportMode::TopK, SupportMode::TopKTail})
    for (double b : {0.0, 0.5, 1.0})
      for (double t : {0.7, 1.3}) {
        LossConfig cfg;
        cfg.mode = m;
        cfg.beta = b;
        cfg.temperature = t;
        cfg.sft_alpha = 0.3;
        cfg.vocab_tile = 37;
        SCOPED_TRACE(describe(cfg));
        Tensor hidden = p.hidden.clone(), lm_head = p.lm_head.clone();
        FusedLossArgs a = args_for(p, cfg);
        a.hidden = hidden;
        a.lm_head = lm_head;
        Grads g = run_fused(cfg, a);
        auto probe = [&](Tensor& x, const Tensor& grad, int64_t i) {
          const double eps = 1e-5, x0 = x.data<double>()[i];
          x.data<double>()[i] = x0 + eps;
          const double lp = fused_lm_head_loss(cfg, a, nullptr, nullptr).loss;
          x.data<double>()[i] = x0 - eps;
          const double lm = fused_lm_head_loss(cfg, a, nullptr, nullptr).loss;
          x.data<double>()[i] = x0;
          const double fd = (lp - lm) / (2 * eps), an = grad.data<double>()[i];
          EXPECT_NEAR(an, fd, 1e-9 + 1e-6 * std::fabs(fd)) << "element " << i;
          worst = std::max(worst, std::fabs(an - fd) / (1e-6 + std::fabs(fd)));
          ++probes;
        };
        for (int64_t i = 0; i < hidden.numel(); ++i) probe(hidden, g.dh, i);
        // lm_head rows of row 0's teacher ids and target, plus a spread of other entries.
        const int64_t k = p.k;
        for (int64_t j = 0; j < k; ++j)
          for (int64_t i = 0; i < p.h; i += 3)
            probe(lm_head, g.dw, p.teacher[0].ids.data<int32_t>()[j] * p.h + i);
        for (int64_t i = 0; i < lm_head.numel(); i += 29) probe(lm_head, g.dw, i);
      }
  std::printf("finite differences: %d probes, worst |an - fd| / (1e-6 + |fd|) = %.3g\n", probes, worst);
}

// ---- identities of the definitions --------------------------------------------------------
// A payload holding all V ids: topk renormalizes over the whole vocabulary and topk+tail has
// empty tails (clamped at the floor, no gradient), so both equal full.
TEST(FusedLoss, TopKAndTailWithAllIdsEqualFull) {
  Problem p = load_problem(DType::F64);
  const int64_t n = p.n, v = p.v;
  for (double t : kTemps) {
    // Teacher log-probabilities over all V ids at temperature t, in a scrambled order.
    Tensor ids = Tensor::empty({n, v}, DType::I32);
    Tensor lp = Tensor::empty({n, v}, DType::F64);
    Tensor actual = Tensor::empty({n}, DType::F64);
    for (int64_t r = 0; r < n; ++r) {
      std::vector<double> tl(v);
      double m = -INFINITY;
      for (int64_t c = 0; c < v; ++c) {
        double acc = 0;
        for (int64_t i = 0; i < p.teacher_hidden.dim(1); ++i)
          acc += p.teacher_hidden.data<double>()[r * p.teacher_hidden.dim(1) + i] *
                 p.teacher_lm_head.data<double>()[c * p.teacher_hidden.dim(1) + i];
        tl[c] = acc / t;
        m = std::max(m, tl[c]);
      }
      double s = 0;
      for (double x : tl) s += std::exp(x - m);
      for (int64_t j = 0; j < v; ++j) {
        const int64_t c = (j * 37 + r) % v;  // 37 is coprime with 157: a permutation
        ids.data<int32_t>()[r * v + j] = static_cast<int32_t>(c);
        lp.data<double>()[r * v + j] = tl[c] - m - std::log(s);
      }
      actual.data<double>()[r] = tl[p.targets.data<int32_t>()[r]] - m - std::log(s);
    }
    TeacherPayload pl = test::payload_from_dense({0}, {n}, ids, lp, actual, v);
    pl.temperature = t;
    LossConfig vcfg;
    vcfg.temperature = t;
    TeacherTopK all = validate_teacher_payload(pl, test::layout_of(pl), v, vcfg, DType::F64);
    for (double b : kBetas) {
      LossConfig cfg;
      cfg.beta = b;
      cfg.temperature = t;
      cfg.vocab_tile = 40;
      cfg.mode = SupportMode::Full;
      FusedLossArgs a = args_for(p, cfg);
      a.weights = p.weights;  // no padding rows here
      Grads full = run_fused(cfg, a);
      a.teacher = &all;
      for (SupportMode m : {SupportMode::TopK, SupportMode::TopKTail}) {
        cfg.mode = m;
        Grads g = run_fused(cfg, a);
        SCOPED_TRACE(describe(cfg));
        EXPECT_LE(rel(g.res.loss, full.res.loss), 1e-9) << g.res.loss << " vs " << full.res.loss;
        EXPECT_TRUE(test::close(g.dh, full.dh, 1e-8, 1e-13));
        EXPECT_TRUE(test::close(g.dw, full.dw, 1e-8, 1e-13));
        if (m == SupportMode::TopKTail) EXPECT_EQ(g.res.tail_clamped, g.res.rows_used);
      }
    }
  }
}

// topk+tail is a coarsening of the full distributions, so by the data-processing inequality of
// f-divergences its divergence is <= the full one, row by row, for every beta and K.
TEST(FusedLoss, TopKTailIsALowerBoundOfFull) {
  Problem p = load_problem(DType::F64);
  int rows_checked = 0;
  for (double t : kTemps)
    for (double b : kBetas)
      for (int64_t r = 0; r < p.n; ++r) {
        if (p.teacher[temp_index(t)].valid.data<int32_t>()[r] == 0) continue;
        Tensor w = Tensor::zeros({p.n}, DType::F64);
        w.data<double>()[r] = 1.0;
        LossConfig cfg;
        cfg.beta = b;
        cfg.temperature = t;
        cfg.mode = SupportMode::Full;
        FusedLossArgs a = args_for(p, cfg);
        a.weights = w;
        const double full = fused_lm_head_loss(cfg, a, nullptr, nullptr).loss;
        cfg.mode = SupportMode::TopKTail;
        a = args_for(p, cfg);
        a.weights = w;
        const double tail = fused_lm_head_loss(cfg, a, nullptr, nullptr).loss;
        EXPECT_GT(tail, 0.0);
        EXPECT_LE(tail, full * (1 + 1e-12)) << "row " << r << " beta " << b << " T " << t;
        ++rows_checked;
      }
  EXPECT_GT(rows_checked, 100);
}

// A slot emptied by ClipToStudent (kEmptySlot, -inf) is the same as a payload without it.
TEST(FusedLoss, EmptySlotEqualsPayloadWithoutIt) {
  Problem p = load_problem(DType::F64);
  const TeacherTopK& full_k = p.teacher[1];
  const int64_t k = p.k;
  TeacherTopK holed = full_k, fewer = full_k;
  holed.ids = full_k.ids.clone();
  holed.logprobs = full_k.logprobs.clone();
  fewer.k = k - 1;
  fewer.ids = Tensor::empty({p.n, k - 1}, DType::I32);
  fewer.logprobs = Tensor::empty({p.n, k - 1}, DType::F64);
  for (int64_t r = 0; r < p.n; ++r) {
    const int64_t hole = r % k;
    holed.ids.data<int32_t>()[r * k + hole] = kEmptySlot;
    holed.logprobs.data<double>()[r * k + hole] = -INFINITY;
    for (int64_t j = 0, o = 0; j < k; ++j) {
      if (j == hole) continue;
      fewer.ids.data<int32_t>()[r * (k - 1) + o] = full_k.ids.data<int32_t>()[r * k + j];
      fewer.logprobs.data<double>()[r * (k - 1) + o] = full_k.logprobs.data<double>()[r * k + j];
      ++o;
    }
  }
  for (SupportMode m : {SupportMode::TopK, SupportMode::TopKTail})
    for (double b : {0.0, 0.5, 1.0}) {
      LossConfig cfg;
      cfg.mode = m;
      cfg.beta = b;
      cfg.vocab_tile = 50;
      FusedLossArgs a = args_for(p, cfg);
      a.teacher = &holed;
      Grads g1 = run_fused(cfg, a);
      a.teacher = &fewer;
      Grads g2 = run_fused(cfg, a);
      a.teacher = &full_k;
      Grads g0 = run_fused(cfg, a);
      SCOPED_TRACE(describe(cfg));
      EXPECT_LE(rel(g1.res.loss, g2.res.loss), 1e-13);
      EXPECT_TRUE(test::close(g1.dh, g2.dh, 1e-12, 1e-15));
      EXPECT_TRUE(test::close(g1.dw, g2.dw, 1e-12, 1e-15));
      EXPECT_GT(rel(g0.res.loss, g1.res.loss), 1e-6) << "the hole must change the loss";
    }
}

// Full mode with a larger teacher vocabulary: ClipToStudent equals a teacher restricted to the
// student's ids (renormalized over them); the 'error' policy refuses it.
TEST(FusedLoss, FullModeClipToStudentEqualsRestrictedTeacher) {
  Problem p = load_problem(DType::F64);
  const int64_t extra = 11, ht = p.teacher_hidden.dim(1);
  Tensor big = Tensor::empty({p.v + extra, ht}, DType::F64);
  Tensor extra_rows = test::random_uniform({extra, ht}, DType::F64, 5, -3, 3);
  std::copy(p.teacher_lm_head.data<double>(), p.teacher_lm_head.data<double>() + p.v * ht,
            big.data<double>());
  std::copy(extra_rows.data<double>(), extra_rows.data<double>() + extra * ht,
            big.data<double>() + p.v * ht);
  for (double b : {0.0, 0.5, 1.0}) {
    LossConfig cfg;
    cfg.mode = SupportMode::Full;
    cfg.beta = b;
    cfg.temperature = 1.3;
    cfg.vocab_tile = 64;
    FusedLossArgs a = args_for(p, cfg);
    Grads ref = run_fused(cfg, a);
    a.teacher_lm_head = big;
    test::expect_error([&] { run_fused(cfg, a); }, ErrorKind::InvalidData,
                       {"teacher vocabulary 168", "larger than the student's 157"});
    cfg.vocab_policy = VocabPolicy::ClipToStudent;
    Grads g = run_fused(cfg, a);
    EXPECT_LE(rel(g.res.loss, ref.res.loss), 1e-13);
    EXPECT_TRUE(test::close(g.dh, ref.dh, 1e-12, 1e-15));
    EXPECT_TRUE(test::close(g.dw, ref.dw, 1e-12, 1e-15));
  }
  LossConfig cfg;
  cfg.mode = SupportMode::Full;
  FusedLossArgs a = args_for(p, cfg);
  a.teacher_lm_head = p.teacher_lm_head.slice_rows(0, p.v - 1);
  test::expect_error([&] { run_fused(cfg, a); }, ErrorKind::InvalidArgument,
                     {"teacher vocabulary 156", "smaller than the student's 157"});
}

// A teacher that returns log-probabilities at temperature 1 (a plain vLLM server): topk is exact
// after validation rescales a_k / T (the result equals the payload computed at T); topk+tail and
// sampled are refused with a message naming both temperatures.
TEST(FusedLoss, TeacherAtTemperatureOneIsExactForTopKAndRefusedOtherwise) {
  Problem p = load_problem(DType::F64);
  SafetensorsFile in = SafetensorsFile::open(test::fixture_path("loss/inputs.safetensors"));
  TeacherPayload pl = test::payload_from_dense({3, 11}, {6, 4}, in.get("teacher_ids"),
                                               in.get("teacher_logprobs_T1"),
                                               in.get("actual_logprobs_T1"), p.v);
  CompletionLayout layout = test::layout_of(pl);
  layout.padding.assign(p.n, 0);
  layout.padding[7] = 1;
  for (double t : {0.7, 1.3}) {
    LossConfig cfg;
    cfg.temperature = t;
    for (SupportMode m : {SupportMode::TopKTail, SupportMode::Sampled}) {
      cfg.mode = m;
      test::expect_error([&] { validate_teacher_payload(pl, layout, p.v, cfg, DType::F64); },
                         ErrorKind::InvalidData,
                         {"at temperature 1 cannot give exact values at the distillation "
                          "temperature " + cat(t),
                          std::string("for mode ") + std::string(support_mode_name(m)),
                          "use mode topk"});
    }
    cfg.mode = SupportMode::TopK;
    TeacherTopK rescaled = validate_teacher_payload(pl, layout, p.v, cfg, DType::F64);
    FusedLossArgs a = args_for(p, cfg);  // the payload computed at temperature t
    Grads exact = run_fused(cfg, a);
    a.teacher = &rescaled;
    Grads g = run_fused(cfg, a);
    EXPECT_LE(rel(g.res.loss, exact.res.loss), 1e-12) << t;
    EXPECT_TRUE(test::close(g.dh, exact.dh, 1e-10, 1e-15));
    EXPECT_TRUE(test::close(g.dw, exact.dw, 1e-10, 1e-15));
  }
}

// The fixture's payload at temperature index t (the teacher applied kTemps[t]; `payload_t` is
// the temperature the payload claims, 1 for a plain vLLM server) with each row's entries
// reordered by test::reorder_rows(seed) (seed 0: sorted), run through validation for `cfg`.
TeacherTopK fixture_teacher_reordered(const Problem& p, size_t t, double payload_t, uint64_t seed,
                                      const LossConfig& cfg, PayloadStats* stats) {
  SafetensorsFile in = SafetensorsFile::open(test::fixture_path("loss/inputs.safetensors"));
  Tensor ids = in.get("teacher_ids").clone();
  Tensor lp = in.get("teacher_logprobs_T" + std::to_string(t)).clone();
  test::reorder_rows(ids, lp, seed);
  TeacherPayload pl = test::payload_from_dense({3, 11}, {6, 4}, ids, lp,
                                               in.get("actual_logprobs_T" + std::to_string(t)), p.v);
  pl.temperature = payload_t;
  CompletionLayout layout = test::layout_of(pl);
  layout.padding.assign(p.n, 0);
  Tensor valid = in.get("valid");
  for (int64_t r = 0; r < p.n; ++r) layout.padding[r] = valid.data<int32_t>()[r] == 0;
  return validate_teacher_payload(pl, layout, p.v, cfg, p.dtype, stats);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// A teacher may send a position's K entries in any order (a vLLM server's prompt_logprobs is a
// JSON dict; robustness.md session 17). Validation puts every row in the canonical order
// (logprob descending, ties by smaller id), so the loss and both gradients of a permuted
// payload are those of the sorted one bit for bit, in every mode that reads the teacher's
// entries (topk, topk+tail, sampled; full has no payload), with and without SFT rows, f64 and
// f32, and for a temperature-1 payload rescaled for topk (a vLLM teacher at T != 1). Second,
// the loss itself assumes no order: rows permuted after validation (what the kernel would see
// without the canonical order) agree with the sorted ones to rounding (1e-12 in f64).
TEST(FusedLoss, TeacherEntriesInAnyOrderGiveTheSameLossAndGradients) {
  int compared = 0;
  for (DType dt : {DType::F64, DType::F32}) {
    Problem p = load_problem(dt);
    for (size_t ti : {size_t{0}, size_t{1}})
      for (bool vllm_like : {false, true}) {
        const double payload_t = vllm_like ? 1.0 : kTemps[ti];
        const std::vector<SupportMode> modes =
            vllm_like ? std::vector<SupportMode>{SupportMode::TopK}
                      : std::vector<SupportMode>{SupportMode::TopK, SupportMode::TopKTail,
                                                 SupportMode::Sampled};
        for (SupportMode m : modes)
          for (double beta : {0.0, 0.5, 1.0})
            for (double sft : {0.0, 0.3}) {
              if (m == SupportMode::Sampled && beta != 0.5) continue;
              LossConfig cfg;
              cfg.mode = m;
              cfg.beta = beta;
              cfg.temperature = kTemps[ti];
              cfg.sft_alpha = sft;
              cfg.vocab_tile = 37;
              SCOPED_TRACE(cat(dtype_name(dt), " ", describe(cfg), " payload T ", payload_t));
              PayloadStats st;
              const TeacherTopK sorted = fixture_teacher_reordered(p, ti, payload_t, 0, cfg, &st);
              EXPECT_EQ(st.reordered_rows, 0);
              FusedLossArgs a = args_for(p, cfg);
              a.teacher = &sorted;
              const Grads ref = run_fused(cfg, a);
              ASSERT_TRUE(std::isfinite(ref.res.loss));
              ASSERT_NE(ref.res.loss, 0.0);
              for (uint64_t seed : {1, 2}) {
                const TeacherTopK permuted =
                    fixture_teacher_reordered(p, ti, payload_t, seed, cfg, &st);
                EXPECT_EQ(st.reordered_rows, p.n - 1) << "every row but the padding one moved";
                a.teacher = &permuted;
                const Grads g = run_fused(cfg, a);
                EXPECT_EQ(g.res.loss, ref.res.loss) << "seed " << seed;
                EXPECT_EQ(g.res.divergence_sum, ref.res.divergence_sum) << "seed " << seed;
                EXPECT_TRUE(same_bits(g.dh, ref.dh)) << "d hidden, seed " << seed;
                EXPECT_TRUE(same_bits(g.dw, ref.dw)) << "d lm_head, seed " << seed;
                ++compared;
              }
              // The loss on rows permuted behind validation's back: equal up to rounding.
              TeacherTopK raw = sorted;
              raw.ids = sorted.ids.clone();
              raw.logprobs = sorted.logprobs.clone();
              test::reorder_rows(raw.ids, raw.logprobs, 3);
              a.teacher = &raw;
              const Grads g = run_fused(cfg, a);
              const double tol = dt == DType::F64 ? 1e-12 : 1e-5;
              EXPECT_LE(rel(g.res.loss, ref.res.loss), tol);
              EXPECT_TRUE(test::close(g.dh, ref.dh, tol, tol * 1e-3));
              EXPECT_TRUE(test::close(g.dw, ref.dw, tol, tol * 1e-3));
            }
      }
  }
  EXPECT_EQ(compared, 2 * 2 * (2 * 3 * 2 + 2 + 3 * 2) * 2);
}

// Gradient accumulation: two micro-batches with the step's n_total, d_lm_head accumulated in
// one buffer, equal one call over all rows.
TEST(FusedLoss, MicroBatchesShareTheStepNormalizer) {
  Problem p = load_problem(DType::F64);
  for (SupportMode m : kModes) {
    LossConfig cfg;
    cfg.mode = m;
    cfg.sft_alpha = 0.3;
    cfg.temperature = 0.7;
    cfg.vocab_tile = 37;
    FusedLossArgs a = args_for(p, cfg);
    Grads whole = run_fused(cfg, a);
    Tensor dw = Tensor::zeros({p.v, p.h}, DType::F64);
    Tensor dh = Tensor::poisoned({p.n, p.h}, DType::F64);
    double loss = 0;
    const int64_t cut = 4;
    std::vector<TeacherTopK> parts;
    for (auto [b, e] : {std::pair<int64_t, int64_t>{0, cut}, {cut, p.n}}) {
      FusedLossArgs part = a;
      part.hidden = a.hidden.slice_rows(b, e);
      part.targets = a.targets.slice_rows(b, e);
      part.weights = a.weights.slice_rows(b, e);
      part.sft_rows = a.sft_rows.slice_rows(b, e);
      TeacherTopK t;
      if (m == SupportMode::Full) {
        part.teacher_hidden = a.teacher_hidden.slice_rows(b, e);
      } else {
        t.rows = e - b;
        t.k = a.teacher->k;
        t.ids = a.teacher->ids.slice_rows(b, e);
        t.logprobs = a.teacher->logprobs.slice_rows(b, e);
        t.actual_logprobs = a.teacher->actual_logprobs.slice_rows(b, e);
        t.valid = a.teacher->valid.slice_rows(b, e);
        part.teacher = &t;
      }
      Tensor dh_part = dh.slice_rows(b, e);
      loss += fused_lm_head_loss(cfg, part, &dh_part, &dw).loss;
    }
    SCOPED_TRACE(support_mode_name(m));
    EXPECT_LE(rel(loss, whole.res.loss), 1e-13);
    EXPECT_TRUE(test::close(dh, whole.dh, 1e-12, 1e-15));
    EXPECT_TRUE(test::close(dw, whole.dw, 1e-12, 1e-15));
  }
}

// Forward only (no gradient tensors) gives the same loss as forward + backward; rows with
// weight 0 or marked padding get d hidden = 0, and the normalizer scales everything.
TEST(FusedLoss, ForwardOnlyMasksAndNormalizer) {
  Problem p = load_problem(DType::F64);
  for (SupportMode m : kModes) {
    LossConfig cfg;
    cfg.mode = m;
    cfg.sft_alpha = 0.3;
    FusedLossArgs a = args_for(p, cfg);
    Grads g = run_fused(cfg, a);
    LossResult fwd = fused_lm_head_loss(cfg, a, nullptr, nullptr);
    EXPECT_EQ(fwd.loss, g.res.loss);
    EXPECT_EQ(g.res.rows_used, 8);  // 10 rows - 1 weight 0 - 1 padding
    for (int64_t r : {3, 7})
      for (int64_t i = 0; i < p.h; ++i) EXPECT_EQ(g.dh.data<double>()[r * p.h + i], 0.0);
    FusedLossArgs a2 = a;
    a2.n_total = 2 * a.n_total;
    Grads g2 = run_fused(cfg, a2);
    EXPECT_LE(rel(2 * g2.res.loss, g.res.loss), 1e-14);
    for (int64_t i = 0; i < g.dw.numel(); ++i)
      EXPECT_NEAR(2 * test::element(g2.dw, i), test::element(g.dw, i), 1e-12 * std::fabs(test::element(g.dw, i)) + 1e-15);
    // Changing a masked row's data changes nothing.
    Tensor hidden = a.hidden.clone();
    for (int64_t i = 0; i < p.h; ++i) hidden.data<double>()[3 * p.h + i] += 0.5;
    a2 = a;
    a2.hidden = hidden;
    EXPECT_EQ(fused_lm_head_loss(cfg, a2, nullptr, nullptr).loss, g.res.loss);
  }
}

// ---- guard: ids that skipped validation never index out of range ----------------------------
TEST(FusedLoss, UnvalidatedOutOfRangeIdsAreReportedNotRead) {
  Problem p = load_problem(DType::F32);
  for (int32_t bad : {static_cast<int32_t>(p.v), static_cast<int32_t>(p.v) + 100000, -7,
                      INT32_MIN, INT32_MAX}) {
    TeacherTopK t = p.teacher[1];
    t.ids = t.ids.clone();
    t.ids.data<int32_t>()[2 * p.k + 3] = bad;  // row 2 is a used row
    for (SupportMode m : {SupportMode::TopK, SupportMode::TopKTail}) {
      LossConfig cfg;
      cfg.mode = m;
      FusedLossArgs a = args_for(p, cfg);
      a.teacher = &t;
      Tensor dh = Tensor::poisoned({p.n, p.h}, DType::F32);
      Tensor dw = Tensor::zeros({p.v, p.h}, DType::F32);
      test::expect_error([&] { fused_lm_head_loss(cfg, a, &dh, &dw); }, ErrorKind::InvalidData,
                         {"1 teacher ids outside [0, 157)", "payload not validated"});
    }
  }
}

TEST(FusedLoss, ArgumentAndConfigChecks) {
  Problem p = load_problem(DType::F64);
  LossConfig cfg;
  FusedLossArgs a = args_for(p, cfg);
  Tensor targets = p.targets.clone();
  targets.data<int32_t>()[2] = static_cast<int32_t>(p.v);
  a.targets = targets;
  test::expect_error([&] { run_fused(cfg, a); }, ErrorKind::InvalidData,
                     {"target id 157 of row 2", "[0, 157)"});
  // The same bad id in a masked row (row 3, weight 0) is never read and is accepted.
  targets.data<int32_t>()[2] = p.targets.data<int32_t>()[2];
  targets.data<int32_t>()[3] = -100;
  EXPECT_TRUE(std::isfinite(run_fused(cfg, a).res.loss));
  a = args_for(p, cfg);
  a.n_total = 0;
  test::expect_error([&] { run_fused(cfg, a); }, ErrorKind::InvalidArgument, {"n_total 0"});
  a = args_for(p, cfg);
  for (double beta : {-0.1, 1.5, double(NAN)}) {
    LossConfig c2 = cfg;
    c2.beta = beta;
    test::expect_error([&] { run_fused(c2, a); }, ErrorKind::InvalidArgument, {"beta"});
  }
  for (double t : {0.0, -1.0, double(NAN), double(INFINITY)}) {
    LossConfig c2 = cfg;
    c2.temperature = t;
    test::expect_error([&] { run_fused(c2, a); }, ErrorKind::InvalidArgument, {"temperature"});
  }
  LossConfig c2 = cfg;
  c2.sft_alpha = -1;
  test::expect_error([&] { run_fused(c2, a); }, ErrorKind::InvalidArgument, {"sft_alpha"});
  c2 = cfg;
  c2.mode = SupportMode::TopK;
  a.teacher = nullptr;
  test::expect_error([&] { run_fused(c2, a); }, ErrorKind::InvalidArgument,
                     {"needs a validated teacher payload"});
  // An empty micro-batch (a rank without completion rows) contributes nothing.
  for (SupportMode m : kModes) {
    LossConfig c3;
    c3.mode = m;
    FusedLossArgs e = args_for(p, c3);
    e.hidden = p.hidden.slice_rows(0, 0);
    e.targets = p.targets.slice_rows(0, 0);
    e.weights = e.weights.slice_rows(0, 0);
    e.sft_rows = p.sft_rows.slice_rows(0, 0);
    e.teacher_hidden = p.teacher_hidden.slice_rows(0, 0);
    TeacherTopK t0;
    if (m != SupportMode::Full) {
      t0.k = p.k;
      t0.ids = p.teacher[1].ids.slice_rows(0, 0);
      t0.logprobs = p.teacher[1].logprobs.slice_rows(0, 0);
      t0.actual_logprobs = p.teacher[1].actual_logprobs.slice_rows(0, 0);
      t0.valid = p.teacher[1].valid.slice_rows(0, 0);
      e.teacher = &t0;
    }
    Tensor dh = Tensor::empty({0, p.h}, DType::F64);
    Tensor dw = test::random_uniform({p.v, p.h}, DType::F64, 8);
    Tensor dw0 = dw.clone();
    EXPECT_EQ(fused_lm_head_loss(c3, e, &dh, &dw).loss, 0.0);
    EXPECT_TRUE(test::close(dw, dw0, 0, 0));
  }
  EXPECT_EQ(parse_support_mode("topk+tail"), SupportMode::TopKTail);
  EXPECT_EQ(parse_vocab_policy("clip-to-student"), VocabPolicy::ClipToStudent);
  test::expect_error([] { parse_support_mode("dense"); }, ErrorKind::InvalidArgument,
                     {"unknown support mode 'dense'"});
}

// ---- memory: O(N x K + N x tile), far below N x V -------------------------------------------
TEST(FusedLoss, PeakExtraMemoryStaysUnderTheFormula) {
  const int64_t n = 256, v = 50000, h = 64, k = 16, tile = 2048;
  Tensor hidden = test::random_uniform({n, h}, DType::F32, 1, -1, 1);
  Tensor lm_head = test::random_uniform({v, h}, DType::F32, 2, -0.5, 0.5);
  Tensor t_hidden = test::random_uniform({n, h}, DType::F32, 3, -1, 1);
  Tensor t_lm_head = test::random_uniform({v, h}, DType::F32, 4, -0.5, 0.5);
  Tensor targets = test::random_ints({n}, 5, 0, static_cast<int32_t>(v));
  Tensor weights = test::random_uniform({n}, DType::F32, 6, 0.5, 1.5);
  Tensor sft = test::random_ints({n}, 7, 0, 2);
  // A valid payload: K distinct ids per row with a sub-distribution of logprobs.
  Tensor ids = Tensor::empty({n, k}, DType::I32);
  Tensor lp = Tensor::empty({n, k}, DType::F64);
  Tensor actual = Tensor::empty({n}, DType::F64);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < k; ++j) {
      ids.data<int32_t>()[r * k + j] = static_cast<int32_t>((r * 7919 + j * 3001) % v);
      lp.data<double>()[r * k + j] = -2.0 - 0.25 * j - 0.001 * (r % 13);
    }
    actual.data<double>()[r] = -3.5;
  }
  TeacherPayload pl = test::payload_from_dense({0}, {n}, ids, lp, actual, v);
  TeacherTopK teacher = validate_teacher_payload(pl, test::layout_of(pl), v, LossConfig{}, DType::F32);
  Tensor dh = Tensor::poisoned({n, h}, DType::F32);
  Tensor dw = Tensor::zeros({v, h}, DType::F32);
  const int64_t dense_bytes = n * v * 4;
  for (SupportMode m : kModes) {
    LossConfig cfg;
    cfg.mode = m;
    cfg.vocab_tile = tile;
    cfg.sft_alpha = 0.1;
    FusedLossArgs a;
    a.hidden = hidden;
    a.lm_head = lm_head;
    a.targets = targets;
    a.weights = weights;
    a.sft_rows = sft;
    a.n_total = static_cast<double>(n);
    if (m == SupportMode::Full) {
      a.teacher_hidden = t_hidden;
      a.teacher_lm_head = t_lm_head;
    } else {
      a.teacher = &teacher;
    }
    reset_peak_memory(Device::CPU);
    const int64_t before = memory_stats(Device::CPU).in_use;
    LossResult res = fused_lm_head_loss(cfg, a, &dh, &dw);
    const int64_t extra = memory_stats(Device::CPU).peak - before;
    const int64_t bound = fused_loss_scratch_bytes(n, v, m == SupportMode::Full ? 0 : k, cfg, DType::F32);
    EXPECT_TRUE(std::isfinite(res.loss));
    EXPECT_GT(extra, 0);
    EXPECT_LE(extra, bound) << support_mode_name(m);
    EXPECT_LE(bound, dense_bytes / 10);
    std::printf("%-9s N=%lld V=%lld H=%lld K=%lld tile=%lld: peak extra %lld bytes, formula %lld, "
                "dense logits N*V*4 = %lld\n",
                std::string(support_mode_name(m)).c_str(), (long long)n, (long long)v, (long long)h,
                (long long)k, (long long)tile, (long long)extra, (long long)bound,
                (long long)dense_bytes);
  }
}

}  // namespace
}  // namespace opd
