// ZeRO-2 overlap (dist/bucket_ready.h, dist/zero.h): buckets become complete exactly when their
// last parameter group finishes, order_for() replays the same order, misuse is refused; and
// reducing buckets one by one in that (backward) order gives bitwise the same sharded step as
// reduce_all() after each micro-batch, over 1..3 processes (CPU communicator).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "common/test_util.h"
#include "dist/bucket_ready.h"
#include "dist_test_util.h"

namespace opd::dist {
namespace {

// Like a model: embedding, 3 "layers" of 3 parameters, final norm (groups: 0 lm_head (none here),
// 1 final norm, 2 + i layer i, 5 embedding).
const std::vector<Shape> kShapes = {{40, 3}, {3}, {6, 3}, {3, 6}, {3}, {6, 3}, {3, 6}, {3}, {6, 3}, {3, 6}, {3}};
const std::vector<int> kGroups = {5, 2, 2, 2, 3, 3, 3, 4, 4, 4, 1};
const std::vector<int> kBackward = {0, 1, 4, 3, 2, 5};  // the order a backward reports groups

TEST(BucketReadiness, BucketsCompleteWithTheirLastParameter) {
  for (int64_t bucket : {int64_t{1}, int64_t{30}, int64_t{64}, int64_t{1} << 20}) {
    const ShardLayout L = make_shard_layout(kShapes, 2, bucket, 4);
    BucketReadiness r(L, kGroups, 6);
    std::vector<int> order;
    std::vector<bool> done_group(6, false);
    for (int g : kBackward) {
      done_group[g] = true;
      for (int b : r.finish(g)) {
        order.push_back(b);
        // Every parameter of a completed bucket belongs to a finished group...
        for (size_t i = L.buckets[b].first_param; i < L.buckets[b].end_param; ++i)
          EXPECT_TRUE(done_group[kGroups[i]]) << "bucket " << b << " completed early";
      }
      // ...and every bucket whose parameters all finished is complete.
      for (int b : r.remaining()) {
        bool all = true;
        for (size_t i = L.buckets[b].first_param; i < L.buckets[b].end_param; ++i) all = all && done_group[kGroups[i]];
        EXPECT_FALSE(all) << "bucket " << b << " should be complete";
      }
    }
    EXPECT_TRUE(r.remaining().empty());
    auto sorted = order;
    std::sort(sorted.begin(), sorted.end());
    ASSERT_EQ(sorted.size(), L.buckets.size());
    for (size_t b = 0; b < sorted.size(); ++b) EXPECT_EQ(sorted[b], static_cast<int>(b));
    EXPECT_EQ(r.order_for(kBackward), order);
    // The embedding (bucket 0 holds it) is always last: the backward finishes it last.
    EXPECT_EQ(order.back(), 0);
    EXPECT_THROW(r.finish(2), Error);  // twice in a micro-batch
    r.reset();
    EXPECT_EQ(r.remaining().size(), L.buckets.size());
    EXPECT_NO_THROW(r.finish(2));
    // Groups never reported: order_for ends with the remaining buckets, ascending.
    const auto partial = r.order_for({1});
    EXPECT_EQ(partial.size(), L.buckets.size());
  }
  const ShardLayout L = make_shard_layout(kShapes, 2, 30, 4);
  EXPECT_THROW(BucketReadiness(L, {1, 2}, 6), Error);
  auto bad = kGroups;
  bad[3] = 6;
  EXPECT_THROW(BucketReadiness(L, bad, 6), Error);
  BucketReadiness r(L, kGroups, 6);
  EXPECT_THROW(r.finish(-1), Error);
  EXPECT_THROW(r.finish(6), Error);
}

Tensor weight(size_t i) { return test::random_uniform(kShapes[i], DType::F32, 80 + i, -1, 1); }
Tensor grad_of(int rank, size_t i, int step, int micro) {
  return test::random_uniform(kShapes[i], DType::F32, 5000 + 1000 * step + 100 * micro + 10 * rank + i,
                              -0.5, 0.5);
}

// The same ZeRO-2 training twice in one process (two stores): reduce_all() after each
// micro-batch vs. buckets in backward order as groups finish; every rank's state must be equal
// bit for bit. Rank 1 (when present) has one micro-batch fewer and replays order_for().
std::string overlap_equals_reduce_all(int rank, int world, int port_a, int port_b) {
  std::string err;
  std::vector<ZeroOptimizer::FullState> states;
  std::vector<std::vector<Tensor>> models;
  for (int variant = 0; variant < 2; ++variant) {
    auto comm = make_cpu_communicator(
        Store::connect(test::local_env(rank, world, variant == 0 ? port_a : port_b), 60));
    ZeroConfig zc;
    zc.stage = ZeroStage::Two;
    zc.bucket_numel = 30;
    zc.align = 4;
    zc.model_dtype = DType::F32;
    ZeroOptimizer zo(*comm, kShapes, zc);
    std::vector<Tensor> w;
    for (size_t i = 0; i < kShapes.size(); ++i) w.push_back(weight(i));
    zo.load_weights(w);
    BucketReadiness ready(zo.layout(), kGroups, 6);
    for (int step = 1; step <= 3; ++step) {
      const int micro = rank == 1 ? 2 : 3;
      for (int m = 0; m < micro; ++m) {
        zo.wait_reductions();
        if (variant == 0) {
          for (size_t i = 0; i < kShapes.size(); ++i) zo.grad(i).copy_from(grad_of(rank, i, step, m));
          zo.reduce_all();
          continue;
        }
        ready.reset();
        for (int g : kBackward) {
          // The "backward" writes group g's gradients, then reports it.
          for (size_t i = 0; i < kShapes.size(); ++i)
            if (kGroups[i] == g) zo.grad(i).copy_from(grad_of(rank, i, step, m));
          for (int b : ready.finish(g)) zo.reduce_bucket(b);
        }
        for (int b : ready.remaining()) zo.reduce_bucket(b);
      }
      for (int m = micro; m < 3; ++m) {  // the replayed micro-batch, zero gradients
        if (variant == 0) zo.reduce_all();
        else
          for (int b : ready.order_for(kBackward)) zo.reduce_bucket(b);
      }
      zo.step(1e-2, step == 2 ? 0.05 : 0);
    }
    states.push_back(zo.gather_state());
    std::vector<Tensor> model;
    for (size_t i = 0; i < kShapes.size(); ++i) model.push_back(zo.param(i).clone());
    models.push_back(model);
  }
  auto same = [](const Tensor& a, const Tensor& b) {
    return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
  };
  for (size_t i = 0; i < kShapes.size(); ++i) {
    err += test::expect(same(states[0].master[i], states[1].master[i]), cat("master ", i));
    err += test::expect(same(states[0].exp_avg[i], states[1].exp_avg[i]), cat("exp_avg ", i));
    err += test::expect(same(states[0].exp_avg_sq[i], states[1].exp_avg_sq[i]), cat("exp_avg_sq ", i));
    err += test::expect(same(models[0][i], models[1][i]), cat("model ", i));
  }
  return err;
}

TEST(ZeroOverlap, BucketsInBackwardOrderEqualReduceAllBitwise) {
  for (int world = 1; world <= 3; ++world) {
    const int a = pick_free_port(), b = pick_free_port();
    auto out = test::run_ranks(world, [&](int rank) { return overlap_equals_reduce_all(rank, world, a, b); });
    EXPECT_TRUE(test::all_ok(out)) << "world " << world;
  }
}

}  // namespace
}  // namespace opd::dist
