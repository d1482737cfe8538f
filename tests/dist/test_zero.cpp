// ZeRO sharding (dist/zero.h): the flat bucket layout's invariants, and the sharded AdamW step
// over 1..4 processes (CPU communicator) against the single-process AdamW of
// train/optimizer.h on the rank-ordered sum of the ranks' gradients: ZeRO-1, with and without
// clipping, f32 and bf16 model copies, avg reduction; ZeRO-2 with per-micro-batch
// reduce-scatters; and re-sharding (state gathered on 2 ranks, loaded on 3).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>

#include "common/test_util.h"
#include "dist/zero.h"
#include "dist_test_util.h"

namespace opd::dist {
namespace {

using test::expect;

const std::vector<Shape> kShapes = {{7, 5}, {13}, {3, 4, 2}, {1}, {100}, {2, 33}};

TEST(ShardLayout, Invariants) {
  for (int world : {1, 2, 3, 4, 7}) {
    for (int64_t bucket : {int64_t{1}, int64_t{40}, int64_t{1000}}) {
      for (int64_t align : {int64_t{1}, int64_t{4}, int64_t{64}}) {
        ShardLayout L = make_shard_layout(kShapes, world, bucket, align);
        SCOPED_TRACE(cat("world ", world, " bucket ", bucket, " align ", align));
        ASSERT_EQ(L.params.size(), kShapes.size());
        int64_t shard_total = 0;
        for (size_t b = 0; b < L.buckets.size(); ++b) {
          const auto& bk = L.buckets[b];
          EXPECT_EQ(bk.numel % (world * align), 0);
          EXPECT_EQ(bk.shard_numel * world, bk.numel);
          EXPECT_EQ(bk.shard_offset, shard_total);
          shard_total += bk.shard_numel;
          if (b > 0) {
            EXPECT_EQ(bk.offset, L.buckets[b - 1].offset + L.buckets[b - 1].numel);
            EXPECT_EQ(bk.first_param, L.buckets[b - 1].end_param);
          }
          EXPECT_LT(bk.first_param, bk.end_param);
          for (size_t i = bk.first_param; i < bk.end_param; ++i) {
            const auto& p = L.params[i];
            EXPECT_EQ(p.bucket, static_cast<int>(b));
            EXPECT_EQ(p.offset % align, 0);
            EXPECT_GE(p.offset, bk.offset);
            EXPECT_LE(p.offset + p.numel, bk.offset + bk.numel);
            if (i > bk.first_param) EXPECT_GE(p.offset, L.params[i - 1].offset + L.params[i - 1].numel);
            // A parameter shares a bucket with others only when the bucket fits them.
            if (bk.end_param - bk.first_param > 1) EXPECT_LE(p.offset + p.numel - bk.offset, bucket);
          }
        }
        EXPECT_EQ(L.shard_numel, shard_total);
        EXPECT_EQ(L.total_numel, L.buckets.back().offset + L.buckets.back().numel);
        if (bucket == 1) EXPECT_EQ(L.buckets.size(), kShapes.size());  // one parameter each
      }
    }
  }
  EXPECT_THROW(make_shard_layout(kShapes, 0), Error);
  EXPECT_THROW(make_shard_layout(kShapes, 2, 0), Error);
  EXPECT_THROW(make_shard_layout({{-1, 2}}, 2), Error);
}

Tensor weight(size_t i) { return test::random_uniform(kShapes[i], DType::F32, 50 + i, -1, 1); }
// Rank r's gradient of parameter i at (step, micro-batch).
Tensor grad_of(int rank, size_t i, int step, int micro) {
  return test::random_uniform(kShapes[i], DType::F32, 7000 + 1000 * step + 100 * micro + 10 * rank + i,
                              -0.5, 0.5);
}

struct Scenario {
  ZeroStage stage = ZeroStage::One;
  ReduceOp reduce = ReduceOp::Sum;
  DType model_dtype = DType::BF16;
  int micro_batches = 1;
  int steps = 3;
  double max_norm_step2 = 0.05;  // clipping on the second step (0: never)
  int64_t bucket = 40;
};

// The single-process reference: AdamW on the summed (or averaged) gradients, in rank order
// within a micro-batch and micro-batch order across them (ZeRO-2's order; ZeRO-1 sums the
// micro-batches per rank first, which the tolerance covers).
struct Reference {
  std::vector<Tensor> master, grad, model;
  std::unique_ptr<AdamW> opt;
  Reference(int world, const Scenario& s, const AdamWConfig& cfg) {
    std::vector<OptimParam> ps;
    for (size_t i = 0; i < kShapes.size(); ++i) {
      master.push_back(weight(i));
      grad.push_back(Tensor::zeros(kShapes[i], DType::F32));
      model.push_back(Tensor::zeros(kShapes[i], s.model_dtype));
      ps.push_back({master[i], grad[i], model[i]});
    }
    opt = std::make_unique<AdamW>(ps, cfg);
    (void)world;
  }
  void step(int world, const Scenario& s, int step, double lr, double max_norm) {
    for (size_t i = 0; i < kShapes.size(); ++i) {
      float* g = grad[i].data<float>();
      std::fill_n(g, grad[i].numel(), 0.0f);
      for (int m = 0; m < s.micro_batches; ++m) {
        std::vector<float> acc(grad[i].numel());
        for (int r = 0; r < world; ++r) {
          Tensor gr = grad_of(r, i, step, m);
          for (int64_t j = 0; j < gr.numel(); ++j)
            acc[j] = r == 0 ? gr.data<float>()[j] : acc[j] + gr.data<float>()[j];
        }
        for (int64_t j = 0; j < grad[i].numel(); ++j) {
          float a = s.reduce == ReduceOp::Avg ? acc[j] / static_cast<float>(world) : acc[j];
          g[j] = g[j] + a;
        }
      }
    }
    opt->step(lr, max_norm);
  }
};

// max |a-b| / (atol + rtol |b|) <= 1 elementwise, as a child-side check.
std::string close_to(const Tensor& a, const Tensor& b, double rtol, double atol, const std::string& what) {
  Tensor af = a.dtype() == DType::F32 ? a : a.to_dtype(DType::F32);
  Tensor bf = b.dtype() == DType::F32 ? b : b.to_dtype(DType::F32);
  if (af.numel() != bf.numel()) return what + ": size; ";
  for (int64_t i = 0; i < af.numel(); ++i) {
    float x = af.data<float>()[i], y = bf.data<float>()[i];
    if (!(std::fabs(x - y) <= atol + rtol * std::fabs(y)))
      return cat(what, "[", i, "] = ", x, " vs reference ", y, "; ");
  }
  return "";
}

std::string run_scenario(int rank, int world, int port, const Scenario& s) {
  auto comm = make_cpu_communicator(Store::connect(test::local_env(rank, world, port), 60));
  ZeroConfig zc;
  zc.stage = s.stage;
  zc.grad_reduce = s.reduce;
  zc.model_dtype = s.model_dtype;
  zc.bucket_numel = s.bucket;
  zc.align = 4;
  zc.adamw.weight_decay = 0.1;
  ZeroOptimizer zo(*comm, kShapes, zc);
  std::vector<Tensor> w;
  for (size_t i = 0; i < kShapes.size(); ++i) w.push_back(weight(i));
  zo.load_weights(w);
  Reference ref(world, s, zc.adamw);
  // Exact when the arithmetic order is the reference's; ZeRO-1 with several micro-batches
  // reorders the f32 sum of gradients.
  const double rtol = (s.micro_batches > 1 && s.stage == ZeroStage::One) ? 1e-4 : 1e-6;
  std::string err;
  for (int step = 1; step <= s.steps; ++step) {
    const double lr = 1e-2 * step;
    const double max_norm = step == 2 ? s.max_norm_step2 : 0;
    for (int m = 0; m < s.micro_batches; ++m) {
      for (size_t i = 0; i < kShapes.size(); ++i) {
        Tensor g = zo.grad(i);
        Tensor add = grad_of(rank, i, step, m);
        float* gp = g.data<float>();
        for (int64_t j = 0; j < g.numel(); ++j) gp[j] += add.data<float>()[j];
      }
      if (s.stage == ZeroStage::Two) zo.reduce_all();
    }
    StepReport rep = zo.step(lr, max_norm);
    ref.step(world, s, step, lr, max_norm);
    if (max_norm > 0) {
      err += expect(rep.norm_computed && rep.clip_coef < 1, cat("step ", step, ": clipping expected"));
    }
  }
  auto st = zo.gather_state();
  err += expect(st.steps == s.steps, "steps");
  for (size_t i = 0; i < kShapes.size(); ++i) {
    err += close_to(st.master[i], ref.master[i], rtol, 1e-7, cat("master ", i));
    err += close_to(st.exp_avg[i], ref.opt->exp_avg()[i], rtol, 1e-9, cat("exp_avg ", i));
    err += close_to(st.exp_avg_sq[i], ref.opt->exp_avg_sq()[i], rtol * 2, 1e-12, cat("exp_avg_sq ", i));
    // The model copy: the same rounding of (nearly) the same master; one bf16 ulp at most.
    const double mrt = s.model_dtype == DType::BF16 ? 8e-3 : rtol;
    err += close_to(zo.param(i), ref.model[i], mrt, 1e-7, cat("model ", i));
    err += expect(zo.param(i).shape() == kShapes[i], "param shape");
  }
  // Gradients are left zero for the next step.
  for (size_t i = 0; i < kShapes.size(); ++i) {
    Tensor g = zo.grad(i);
    for (int64_t j = 0; j < g.numel(); ++j)
      if (g.data<float>()[j] != 0) return err + "local gradient not cleared; ";
  }
  return err;
}

void check_scenario(const Scenario& s, const std::string& label) {
  for (int world = 1; world <= 4; ++world) {
    const int port = pick_free_port();
    auto out = test::run_ranks(world, [&](int rank) { return run_scenario(rank, world, port, s); });
    EXPECT_TRUE(test::all_ok(out)) << label << ", world " << world;
  }
}

TEST(ZeroOptimizer, Zero1MatchesSingleProcessAdamW) {
  check_scenario(Scenario{}, "zero-1 bf16 model, clipping at step 2");
}

TEST(ZeroOptimizer, Zero1F32ModelAvgNoClipOneBucket) {
  Scenario s;
  s.model_dtype = DType::F32;
  s.reduce = ReduceOp::Avg;
  s.max_norm_step2 = 0;
  s.bucket = int64_t{1} << 20;
  check_scenario(s, "zero-1 f32 model, avg, one bucket");
}

TEST(ZeroOptimizer, Zero2PerMicroBatchReduceScatter) {
  Scenario s;
  s.stage = ZeroStage::Two;
  s.micro_batches = 3;
  check_scenario(s, "zero-2, 3 micro-batches");
}

TEST(ZeroOptimizer, Zero1SeveralMicroBatchesAccumulateLocally) {
  Scenario s;
  s.micro_batches = 2;
  s.bucket = 1;  // one parameter per bucket
  check_scenario(s, "zero-1, 2 micro-batches, a bucket per parameter");
}

// State gathered on 2 ranks and loaded on 3 continues exactly like an uninterrupted run.
TEST(ZeroOptimizer, ReshardsAcrossWorldSizes) {
  const std::string path = cat(::testing::TempDir(), "/opd_zero_state_", ::getpid(), ".bin");
  auto save = [&](const ZeroOptimizer::FullState& st) {
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(&st.steps), 8);
    for (const auto* v : {&st.master, &st.exp_avg, &st.exp_avg_sq})
      for (const Tensor& t : *v) f.write(static_cast<const char*>(t.raw()), t.nbytes());
  };
  auto load = [&]() {
    ZeroOptimizer::FullState st;
    std::ifstream f(path, std::ios::binary);
    f.read(reinterpret_cast<char*>(&st.steps), 8);
    for (auto* v : {&st.master, &st.exp_avg, &st.exp_avg_sq})
      for (const Shape& sh : kShapes) {
        Tensor t = Tensor::empty(sh, DType::F32);
        f.read(static_cast<char*>(t.raw()), t.nbytes());
        v->push_back(t);
      }
    return st;
  };
  auto make = [](Communicator& comm) {
    ZeroConfig zc;
    zc.bucket_numel = 40;
    zc.align = 4;
    zc.model_dtype = DType::F32;
    return std::make_unique<ZeroOptimizer>(comm, kShapes, zc);
  };
  // Each rank contributes gradient rank 0's values only when it is rank 0 (others zero), so
  // the global gradient does not depend on the world size.
  auto feed = [](ZeroOptimizer& zo, int rank, int step) {
    if (rank != 0) return;
    for (size_t i = 0; i < kShapes.size(); ++i) zo.grad(i).copy_from(grad_of(0, i, step, 0));
  };
  int port = pick_free_port();
  auto a = test::run_ranks(2, [&](int rank) {
    auto comm = make_cpu_communicator(Store::connect(test::local_env(rank, 2, port), 60));
    auto zo = make(*comm);
    std::vector<Tensor> w;
    for (size_t i = 0; i < kShapes.size(); ++i) w.push_back(weight(i));
    zo->load_weights(w);
    for (int step = 1; step <= 2; ++step) {
      feed(*zo, rank, step);
      zo->step(1e-2, step == 2 ? 0.05 : 0);
    }
    auto st = zo->gather_state();
    if (rank == 0) save(st);
    comm->store().barrier();
    return std::string();
  });
  ASSERT_TRUE(test::all_ok(a));
  port = pick_free_port();
  auto b = test::run_ranks(3, [&](int rank) {
    auto comm = make_cpu_communicator(Store::connect(test::local_env(rank, 3, port), 60));
    auto zo = make(*comm);
    zo->load_state(load());
    feed(*zo, rank, 3);
    zo->step(1e-2, 0);
    // Reference: one process, three uninterrupted steps.
    std::vector<Tensor> master, grad;
    std::vector<OptimParam> ps;
    for (size_t i = 0; i < kShapes.size(); ++i) {
      master.push_back(weight(i));
      grad.push_back(Tensor::zeros(kShapes[i], DType::F32));
      ps.push_back({master[i], grad[i], Tensor()});
    }
    AdamW ref(ps, AdamWConfig{});
    for (int step = 1; step <= 3; ++step) {
      for (size_t i = 0; i < kShapes.size(); ++i) grad[i].copy_from(grad_of(0, i, step, 0));
      ref.step(1e-2, step == 2 ? 0.05 : 0);
    }
    auto st = zo->gather_state();
    std::string err = expect(st.steps == 3, "steps");
    for (size_t i = 0; i < kShapes.size(); ++i) {
      err += close_to(st.master[i], master[i], 1e-6, 1e-7, cat("master ", i));
      err += close_to(zo->param(i), master[i], 1e-6, 1e-7, cat("model ", i));
    }
    return err;
  });
  EXPECT_TRUE(test::all_ok(b));
  std::remove(path.c_str());
}

TEST(ZeroOptimizer, ArgumentErrors) {
  StoreServer server(0, 1);
  auto comm = make_cpu_communicator(std::make_shared<Store>("127.0.0.1", server.port(), 0, 1, 5));
  ZeroConfig zc;
  zc.model_dtype = DType::F64;
  EXPECT_THROW(ZeroOptimizer(*comm, kShapes, zc), Error);
  zc.model_dtype = DType::BF16;
  EXPECT_THROW(ZeroOptimizer(*comm, {}, zc), Error);
  ZeroOptimizer zo(*comm, kShapes, zc);
  EXPECT_THROW(zo.param(kShapes.size()), Error);
  EXPECT_THROW(zo.reduce_bucket(-1), Error);
  std::vector<Tensor> wrong = {Tensor::zeros({2}, DType::F32)};
  EXPECT_THROW(zo.load_weights(wrong), Error);
  EXPECT_THROW(zo.step(1e-3, NAN), Error);
}

}  // namespace
}  // namespace opd::dist
