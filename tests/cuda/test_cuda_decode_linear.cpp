// opd's decode linear (kernels/cuda/decode_linear.h, y = x W^T + bias for <= 64 bf16 rows)
// against a CPU reference we did not write the kernel's way (f64 dot products of the same bf16
// values, rounded once to bf16): the W1 shapes, odd shapes (m 1-64, n not a multiple of 16, k
// not a multiple of 32, clusters of 1-8 splits), with bias; bits run to run and per row at every
// m (batch independence); launched with programmatic dependent launch behind a kernel that
// writes x, the plain launch's bits; the refusals. (Greedy rollouts with it on:
// test_cuda_rollout.cpp, CudaRollout.DecodeLinearGreedyIsTheFullForwardArgmax.) The plan test
// runs without a GPU; the rest skip.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/decode_linear.h"

namespace opd::test {
namespace {

// The reference: y[i, j] = sum_k x[i, k] w[j, k] (+ b[j]) in f64 over host f32 tensors holding
// bf16 values.
Tensor cpu_linear(const Tensor& x, const Tensor& w, const Tensor* b) {
  const int64_t m = x.shape()[0], k = x.shape()[1], n = w.shape()[0];
  Tensor y = Tensor::empty({m, n}, DType::F32);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = b ? b->data<float>()[j] : 0.0;
      for (int64_t q = 0; q < k; ++q)
        s += static_cast<double>(x.data<float>()[i * k + q]) * w.data<float>()[j * k + q];
      y.data<float>()[i * n + j] = static_cast<float>(s);
    }
  }
  return y;
}

struct Shape3 {
  int64_t m, n, k;
};

TEST(CudaDecodeLinearPlan, W1ShapesFillOneWaveWithinTheClustersTheDeviceHolds) {
  // Runs without a GPU: the plan depends on (n, k), the SMs and the cluster capacity only.
  const int sms = 132;
  const int caps[4] = {132, 66, 30, 15};  // clusters of 1, 2, 4, 8 resident at once (H200-like)
  struct Want {
    int64_t n, k;
    int rows16, splits;
  };
  for (const Want& w : {Want{4096, 1024, 2, 1}, Want{1024, 2048, 1, 2}, Want{6144, 1024, 3, 1},
                        Want{1024, 3072, 1, 2}}) {
    SCOPED_TRACE(cat("n ", w.n, " k ", w.k));
    const cuda::DecodeLinearPlan p = cuda::decode_linear_plan(w.n, w.k, sms, caps);
    ASSERT_TRUE(p.ok);
    EXPECT_EQ(p.rows16, w.rows16);
    EXPECT_EQ(p.splits, w.splits);
    EXPECT_EQ(p.row_blocks * p.splits, 128);  // one wave on 132 SMs
    EXPECT_LE(p.warp_steps, 6);
    EXPECT_LE(p.smem_bytes, size_t{227} * 1024);
    EXPECT_EQ(p.row_blocks, (w.n + 16 * p.rows16 - 1) / (16 * p.rows16));
  }
  // Fewer resident clusters of 2 than the o projection's 64 row blocks: the plan takes the best
  // that fits (clusters of 4 over 48-row blocks: 22 clusters, 88 CTAs), never a second wave.
  const int tight[4] = {132, 60, 30, 15};
  const cuda::DecodeLinearPlan o = cuda::decode_linear_plan(1024, 2048, sms, tight);
  ASSERT_TRUE(o.ok);
  EXPECT_LE(o.row_blocks, o.splits == 2 ? 60 : o.splits == 4 ? 30 : o.splits == 8 ? 15 : sms);
  EXPECT_EQ(o.row_blocks * o.splits, 88);
  EXPECT_FALSE(cuda::decode_linear_plan(151936, 1024, sms, caps).ok);  // more row blocks than SMs
  EXPECT_FALSE(cuda::decode_linear_plan(4096, 1020, sms, caps).ok);    // k % 8 != 0
  EXPECT_FALSE(cuda::decode_linear_plan(64, 0, sms, caps).ok);
  EXPECT_FALSE(cuda::decode_linear_plan(4096, 1 << 20, sms, caps).ok);  // a warp's k range too long
  // A narrow, long shape splits k over a cluster of 8.
  const cuda::DecodeLinearPlan narrow = cuda::decode_linear_plan(32, 4096, sms, caps);
  ASSERT_TRUE(narrow.ok);
  EXPECT_EQ(narrow.splits, 8);
}

TEST(CudaDecodeLinear, MatchesTheCpuLinear) {
  REQUIRE_GPU();
  uint64_t seed = 1200;
  const std::vector<Shape3> shapes = {
      {64, 4096, 1024}, {64, 1024, 2048}, {64, 6144, 1024}, {64, 1024, 3072},  // W1
      {1, 7, 8},        {3, 65, 24},      {17, 130, 264},   {33, 1, 1032},
      {64, 97, 40},     {48, 200, 72},    {5, 32, 4096},    {64, 50, 2056},  // clusters of 8 / 4
      {9, 300, 512},    {16, 6144, 1024}, {2, 1024, 3072}};
  for (const Shape3& s : shapes) {
    for (bool with_bias : {false, true}) {
      const cuda::DecodeLinearPlan plan = cuda::decode_linear_device_plan(s.n, s.k);
      SCOPED_TRACE(cat("m ", s.m, " n ", s.n, " k ", s.k, with_bias ? " bias" : "", " (rows16 ",
                       plan.rows16, ", splits ", plan.splits, ", ", plan.row_blocks * plan.splits,
                       " CTAs)"));
      ASSERT_TRUE(plan.ok);
      if (!with_bias && s.m == 64)
        std::printf("decode_linear plan n %lld k %lld: rows16 %d, splits %d, %lld CTAs\n",
                    (long long)s.n, (long long)s.k, plan.rows16, plan.splits,
                    (long long)(plan.row_blocks * plan.splits));
      const Tensor x = rand_in({s.m, s.k}, DType::BF16, seed++, -1, 1);
      const Tensor w = rand_in({s.n, s.k}, DType::BF16, seed++, -0.1, 0.1);
      const Tensor b = rand_in({s.n}, DType::BF16, seed++, -1, 1);
      Tensor xd = dev(x, DType::BF16), wd = dev(w, DType::BF16), bd = dev(b, DType::BF16);
      Tensor yd = dev_poison({s.m, s.n}, DType::BF16);
      ASSERT_TRUE(cuda::decode_linear_supports(xd.raw(), wd.raw(), yd.raw(), s.m, s.k, s.n,
                                               DType::BF16));
      cuda::decode_linear(xd.raw(), wd.raw(), with_bias ? bd.raw() : nullptr, s.m, s.k, s.n,
                          DType::BF16, yd.raw(), nullptr, false);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const Tensor want = round_through(cpu_linear(x, w, with_bias ? &b : nullptr), DType::BF16);
      EXPECT_TRUE(close_as(host(yd), want, DType::BF16)) << diff_summary(host(yd), want);
    }
  }
}

// A row's bits do not depend on how many rows the call has (the plan depends on (n, k) only)
// and a rerun gives the same bits (fixed summation orders, no atomics).
TEST(CudaDecodeLinear, RowBitsDoNotDependOnTheBatchAndRerunsAreIdentical) {
  REQUIRE_GPU();
  for (const Shape3& s : {Shape3{64, 1024, 2048}, Shape3{64, 6144, 1024}, Shape3{64, 200, 72}}) {
    SCOPED_TRACE(cat("n ", s.n, " k ", s.k));
    const Tensor x = rand_in({s.m, s.k}, DType::BF16, 1300 + s.n, -1, 1);
    Tensor xd = dev(x, DType::BF16);
    Tensor wd = dev(rand_in({s.n, s.k}, DType::BF16, 1400 + s.n, -0.1, 0.1), DType::BF16);
    auto run = [&](int64_t m) {
      Tensor y = dev_poison({m, s.n}, DType::BF16);
      cuda::decode_linear(xd.raw(), wd.raw(), nullptr, m, s.k, s.n, DType::BF16, y.raw(),
                          nullptr, false);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      return host(y);
    };
    const Tensor full = run(64);
    EXPECT_TRUE(same_bits(run(64), full)) << "rerun";
    for (int64_t m : {1, 3, 8, 17, 33, 63}) {
      const Tensor part = run(m);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < s.n; ++j)
          ASSERT_EQ(part.data<float>()[i * s.n + j], full.data<float>()[i * s.n + j])
              << "m " << m << " row " << i << " col " << j;
    }
  }
}

// Launched with PDL right behind a kernel that writes x into a NaN-poisoned buffer: the W loads
// run before the wait, x only after it, so the bits equal the plain launch's (and no NaN).
TEST(CudaDecodeLinear, PdlLaunchBehindAProducerGivesThePlainLaunchBits) {
  REQUIRE_GPU();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (const Shape3& s : {Shape3{64, 4096, 1024}, Shape3{64, 1024, 3072}, Shape3{17, 130, 264}}) {
    SCOPED_TRACE(cat("m ", s.m, " n ", s.n, " k ", s.k));
    Tensor src = dev(rand_in({s.m, s.k}, DType::BF16, 1500 + s.n, -1, 1), DType::BF16);
    Tensor wd = dev(rand_in({s.n, s.k}, DType::BF16, 1600 + s.n, -0.1, 0.1), DType::BF16);
    Tensor bd = dev(rand_in({s.n}, DType::BF16, 1700 + s.n), DType::BF16);
    std::vector<int32_t> identity(static_cast<size_t>(s.m));
    for (int64_t i = 0; i < s.m; ++i) identity[static_cast<size_t>(i)] = static_cast<int32_t>(i);
    Tensor rows = Tensor::from_vector(identity, {s.m}).to(Device::CUDA);
    std::vector<Tensor> outs;
    for (bool pdl : {false, true}) {
      Tensor x = dev_poison({s.m, s.k}, DType::BF16), y = dev_poison({s.m, s.n}, DType::BF16);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      cuda::gather_rows(src.raw(), DType::BF16, s.m, rows.data<int32_t>(), s.m, s.k, x.raw(),
                        DType::BF16, stream);
      cuda::decode_linear(x.raw(), wd.raw(), bd.raw(), s.m, s.k, s.n, DType::BF16, y.raw(),
                          stream, pdl);
      // A second one behind the first (its x is the first's y when shapes allow; else again x).
      Tensor y2 = dev_poison({s.m, s.n}, DType::BF16);
      cuda::decode_linear(x.raw(), wd.raw(), nullptr, s.m, s.k, s.n, DType::BF16, y2.raw(),
                          stream, pdl);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      outs.push_back(host(y));
      outs.push_back(host(y2));
    }
    for (const Tensor& t : outs)
      for (int64_t i = 0; i < t.numel(); ++i) ASSERT_FALSE(std::isnan(t.data<float>()[i]));
    EXPECT_TRUE(same_bits(outs[2], outs[0])) << diff_summary(outs[2], outs[0]);
    EXPECT_TRUE(same_bits(outs[3], outs[1])) << diff_summary(outs[3], outs[1]);
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST(CudaDecodeLinear, RefusesWhatItCannotTake) {
  REQUIRE_GPU();
  Tensor x = dev(rand_in({65, 64}, DType::BF16, 1), DType::BF16);
  Tensor w = dev(rand_in({32, 64}, DType::BF16, 2), DType::BF16);
  Tensor y = dev_poison({65, 32}, DType::BF16);
  Tensor xf = dev(rand_in({8, 64}, DType::F32, 3), DType::F32);
  Tensor wf = dev(rand_in({32, 64}, DType::F32, 4), DType::F32);
  EXPECT_TRUE(cuda::decode_linear_supports(x.raw(), w.raw(), y.raw(), 64, 64, 32, DType::BF16));
  EXPECT_FALSE(cuda::decode_linear_supports(x.raw(), w.raw(), y.raw(), 65, 64, 32, DType::BF16));
  EXPECT_FALSE(cuda::decode_linear_supports(x.raw(), w.raw(), y.raw(), 0, 64, 32, DType::BF16));
  EXPECT_FALSE(cuda::decode_linear_supports(xf.raw(), wf.raw(), y.raw(), 8, 64, 32, DType::F32));
  EXPECT_FALSE(cuda::decode_linear_supports(x.raw(), w.raw(), y.raw(), 8, 60, 32, DType::BF16));
  const void* x_odd = static_cast<const char*>(x.raw()) + 2;  // 2-byte aligned
  EXPECT_FALSE(cuda::decode_linear_supports(x_odd, w.raw(), y.raw(), 8, 56, 32, DType::BF16));
  const std::string msg = error_message(
      [&] {
        cuda::decode_linear(x.raw(), w.raw(), nullptr, 65, 64, 32, DType::BF16, y.raw(), nullptr,
                            false);
      },
      ErrorKind::Unsupported);
  EXPECT_NE(msg.find("65 x 64 x 32"), std::string::npos) << msg;
}

}  // namespace
}  // namespace opd::test
