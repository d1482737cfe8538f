// The weight-streaming decode GEMM, both kernels (v2: kernels/cuda/decode_gemm.cu, v3:
// decode_gemm_v3.cu, declared in gemm.h; every GPU test runs for each as V/CudaDecodeGemm.*/v2|v3)
// against the CPU linear (kernels/ops.h linear_forward, OpenBLAS f32 on the same
// bf16-representable inputs): a sweep of m x n x k (odd sizes, k % 32 != 0, n below one CTA
// tile), odd m (1, 3, 17, 64) x odd n (1, 7, 65, 130) x small and half-granule k (8, 24, 264,
// 1032: k % 16 == 8, stages of unequal length), bf16 and f32 outputs, bias, a padded x row
// stride, forced split counts (cluster sizes 1-8) and v3's 64/128-row CTAs, NaN-poisoned outputs
// and NaN beyond the shape (rows >= m, the row-stride pad), bit-identical reruns and batch
// sizes (a row's bits do not depend on m), the arguments it must refuse, and a
// programmatic-dependent launch right behind a kernel that writes x (and a second GEMM behind
// the first). Then the model: one decode step of PagedForward with the
// decode GEMM against cuBLASLt (fixture models, bf16, with and without q/k/v biases), and greedy
// rollouts through the engine (CUDA graphs) with and without it. v3's plan for the W1 shapes is
// checked on the host (no GPU needed).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "core/cuda/allocator.h"  // current_stream
#include "kernels/cuda/cuda_ops.h"   // gather_rows (the PDL test's producer)
#include "cuda/cuda_test_util.h"
#include "kernels/cuda/gemm.h"
#include "kernels/ops.h"
#include "model/kv_cache.h"
#include "model/paged_forward.h"
#include "rollout/engine.h"
#include "rollout/rollout_test_util.h"  // model_dir, seeded_prompt, request

namespace opd::test {
namespace {

// f32 accumulation over k terms of magnitude <= 4 (inputs in [-2, 2)), as test_cuda_gemm.cpp:
// bf16 outputs at one bf16 rounding plus slack, f32 outputs at summation-order differences.
Tol decode_tol(DType out_dt, int64_t k) {
  const double scale = 4.0 * std::sqrt(static_cast<double>(k));
  if (out_dt == DType::F32) return {1e-5, 6e-6 * scale, 1e-5};
  return {8e-3, 2e-3 * scale, 6e-3};
}

bool any_nan(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (std::isnan(element(t, i))) return true;
  return false;
}

// x [m, ldx] on the device as bf16 from host f32 x [rows >= m, k]: rows [0, m) copied, the
// row-stride pad (columns >= k) NaN.
Tensor device_x(const Tensor& x_host, int64_t m, int64_t k, int64_t ldx) {
  Tensor p = Tensor::poisoned({m, ldx}, DType::F32);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; ++c) p.data<float>()[r * ldx + c] = x_host.data<float>()[r * k + c];
  return dev(p, DType::BF16);
}

// The kernel version under test (the suite's parameter), also the process default while a test
// runs (PagedForward and the engine pass version 0).
class CudaDecodeGemm : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { cuda::decode_gemm_set_default_version(GetParam()); }
  void TearDown() override { cuda::decode_gemm_set_default_version(0); }
  int version() const { return GetParam(); }
};

void run(int version, const Tensor& xd, int64_t ldx, const Tensor& wd, const Tensor* bias,
         Tensor& yd, int64_t m, int64_t n, int64_t k, int force_splits = 0, int force_rows = 0) {
  cuda::DecodeGemmArgs a;
  a.version = version;
  a.force_rows = force_rows;
  a.x = xd.raw();
  a.ldx = ldx;
  a.w = wd.raw();
  a.bias = bias ? bias->raw() : nullptr;
  a.y = yd.raw();
  a.ldy = n;
  a.m = m;
  a.n = n;
  a.k = k;
  a.y_dtype = yd.dtype();
  a.force_splits = force_splits;
  cuda::decode_gemm(a, cuda::current_stream());
  OPD_CUDA_CHECK(cudaStreamSynchronize(cuda::current_stream()));
}

TEST_P(CudaDecodeGemm, MatchesCpuLinearAcrossShapes) {
  REQUIRE_GPU();
  const int64_t ms[] = {1, 2, 7, 16, 33, 64};
  const int64_t ns[] = {8, 24, 1000, 1024, 4096, 6144};
  const int64_t ks[] = {64, 1024, 2048, 3072, 1032};
  uint64_t seed = 1;
  for (int64_t n : ns) {
    for (int64_t k : ks) {
      Tensor x = rand_in({64, k}, DType::BF16, seed++), w = rand_in({n, k}, DType::BF16, seed++);
      Tensor y_ref = Tensor::poisoned({64, n}, DType::F32);
      ops::linear_forward(x, w, Tensor(), y_ref);
      Tensor wd = dev(w, DType::BF16);
      const cuda::DecodeGemmPlan plan = cuda::decode_gemm_plan(n, k, 0, 0, version());
      for (int64_t m : ms) {
        // Rows >= m of x are NaN on the device: a read of them would poison the sums.
        Tensor xp = Tensor::poisoned({64, k}, DType::F32);
        std::copy(x.data<float>(), x.data<float>() + m * k, xp.data<float>());
        Tensor xd = dev(xp, DType::BF16);
        for (DType out : {DType::BF16, DType::F32}) {
          SCOPED_TRACE(cat("m ", m, " n ", n, " k ", k, " out ", dtype_name(out), " v",
                           plan.version, " rows ", plan.rows, " splits ", plan.splits,
                           " chunks per warp ", plan.chunks_per_warp));
          EXPECT_EQ(plan.version, version());
          Tensor yd = dev_poison({m, n}, out);
          run(version(), xd, k, wd, nullptr, yd, m, n, k);
          const Tol t = decode_tol(out, k);
          EXPECT_TRUE(close(host(yd), y_ref.slice_rows(0, m).clone(), t.rtol, t.atol, t.rel_l2));
        }
      }
    }
  }
}

// Bias in the epilogue, a padded x row stride (the pad is NaN), split counts 1-8 (and asks
// for more, clamped to 8) with one or several k tiles per CTA (v2) or 64- and 128-row CTAs with
// 1-3 stages (v3; k = 520 = 32.5 granules, so that one split's whole slice fits in shared
// memory), each against the CPU.
TEST_P(CudaDecodeGemm, BiasStridesAndSplits) {
  REQUIRE_GPU();
  const int64_t n = 1000, k = version() == 2 ? 2056 : 520, ldx = k + 24;
  const std::vector<int> rows_list = version() == 2 ? std::vector<int>{0} : std::vector<int>{0, 64, 128};
  Tensor x = rand_in({64, k}, DType::BF16, 40), w = rand_in({n, k}, DType::BF16, 41);
  Tensor b = rand_in({n}, DType::BF16, 42);
  Tensor y_ref = Tensor::poisoned({64, n}, DType::F32);
  ops::linear_forward(x, w, b, y_ref);
  Tensor wd = dev(w, DType::BF16);
  for (int64_t m : {3, 64}) {
    Tensor xd = device_x(x, m, k, ldx);
    for (DType out : {DType::BF16, DType::F32}) {
      Tensor bd = dev(b, out);
      for (int rows : rows_list) {
        for (int splits : {1, 2, 3, 5, 7, 8, 9, 100}) {
          const cuda::DecodeGemmPlan plan = cuda::decode_gemm_plan(n, k, splits, 0, version(), rows);
          EXPECT_EQ(plan.splits, std::min(splits, 8));
          EXPECT_EQ(plan.version, version());
          if (rows > 0) EXPECT_EQ(plan.rows, rows);
          SCOPED_TRACE(cat("m ", m, " out ", dtype_name(out), " rows ", plan.rows, " splits ",
                           plan.splits, " stages ", plan.stages, " chunks per warp ",
                           plan.chunks_per_warp));
          Tensor yd = dev_poison({m, n}, out);
          run(version(), xd, ldx, wd, &bd, yd, m, n, k, splits, rows);
          const Tol t = decode_tol(out, k);
          EXPECT_TRUE(close(host(yd), y_ref.slice_rows(0, m).clone(), t.rtol, t.atol, t.rel_l2));
        }
      }
    }
  }
}

// Same inputs, same bits, also when the split CTAs finish in another order.
TEST_P(CudaDecodeGemm, DeterministicBitIdentical) {
  REQUIRE_GPU();
  const int64_t m = 64, n = 1024, k = 3072;
  Tensor x = rand_in({m, k}, DType::BF16, 50), w = rand_in({n, k}, DType::BF16, 51);
  Tensor xd = dev(x, DType::BF16), wd = dev(w, DType::BF16);
  for (int splits : {0, 5, 8}) {
    const cuda::DecodeGemmPlan plan = cuda::decode_gemm_plan(n, k, splits, 0, version());
    EXPECT_GT(plan.splits, 1);
    EXPECT_EQ(plan.version, version());
    Tensor first;
    for (int rep = 0; rep < 4; ++rep) {
      Tensor yd = dev_poison({m, n}, DType::BF16);
      run(version(), xd, k, wd, nullptr, yd, m, n, k, splits);
      Tensor got = yd.to(Device::CPU);
      if (rep == 0) {
        first = got;
      } else {
        EXPECT_TRUE(same_bits(got, first)) << "splits " << plan.splits << " rerun " << rep;
      }
    }
  }
}

// Batch independence (gemm.h: the plan depends on (n, k) only): the first m rows of y at m = 1,
// 3, 17, 33 are the bits of the same rows at m = 64 (each output is one dot product in a fixed k
// order, whatever the other rows of x are).
TEST_P(CudaDecodeGemm, RowBitsDoNotDependOnTheBatchSize) {
  REQUIRE_GPU();
  const int64_t n = 1000, k = 1032;
  Tensor xd = dev(rand_in({64, k}, DType::BF16, 55), DType::BF16);
  Tensor wd = dev(rand_in({n, k}, DType::BF16, 56), DType::BF16);
  for (DType out : {DType::BF16, DType::F32}) {
    Tensor full = dev_poison({64, n}, out);
    run(version(), xd, k, wd, nullptr, full, 64, n, k);
    const Tensor want = host(full);
    for (int64_t m : {1, 3, 17, 33}) {
      Tensor yd = dev_poison({m, n}, out);
      run(version(), xd, k, wd, nullptr, yd, m, n, k);
      EXPECT_TRUE(same_bits(host(yd), want.slice_rows(0, m).clone()))
          << "m " << m << " out " << dtype_name(out);
    }
  }
}

// Refused with InvalidArgument naming the shape; nothing written.
TEST_P(CudaDecodeGemm, RefusesBadArguments) {
  REQUIRE_GPU();
  const int64_t m = 4, n = 64, k = 128;
  Tensor xd = dev(rand_in({m, k + 8}, DType::BF16, 60), DType::BF16);
  Tensor wd = dev(rand_in({n, k}, DType::BF16, 61), DType::BF16);
  Tensor xf = dev(rand_in({m, k}, DType::BF16, 62), DType::F32);
  Tensor yd = dev_poison({m, n}, DType::BF16);
  auto good = [&] {
    cuda::DecodeGemmArgs a;
    a.x = xd.raw(), a.ldx = k, a.w = wd.raw(), a.y = yd.raw(), a.ldy = n;
    a.m = m, a.n = n, a.k = k;
    a.version = version();
    return a;
  };
  struct Bad {
    const char* what;
    std::function<void(cuda::DecodeGemmArgs&)> edit;
  };
  const std::vector<Bad> bad = {
      {"m 0", [](cuda::DecodeGemmArgs& a) { a.m = 0; }},
      {"m 65", [](cuda::DecodeGemmArgs& a) { a.m = 65; }},
      {"n 0", [](cuda::DecodeGemmArgs& a) { a.n = 0; }},
      {"k 12", [](cuda::DecodeGemmArgs& a) { a.k = 12, a.ldx = 16; }},
      {"k 0", [](cuda::DecodeGemmArgs& a) { a.k = 0; }},
      {"ldx < k", [](cuda::DecodeGemmArgs& a) { a.ldx = k - 8; }},
      {"ldx % 8", [](cuda::DecodeGemmArgs& a) { a.ldx = k + 4; }},
      {"ldy < n", [](cuda::DecodeGemmArgs& a) { a.ldy = n - 1; }},
      {"x misaligned", [&](cuda::DecodeGemmArgs& a) { a.x = static_cast<const char*>(xd.raw()) + 2; }},
      {"W misaligned", [&](cuda::DecodeGemmArgs& a) { a.w = static_cast<const char*>(wd.raw()) + 8; }},
      {"x f32", [&](cuda::DecodeGemmArgs& a) { a.x = xf.raw(), a.x_dtype = DType::F32; }},
      {"y i32", [](cuda::DecodeGemmArgs& a) { a.y_dtype = DType::I32; }},
      {"no y", [](cuda::DecodeGemmArgs& a) { a.y = nullptr; }},
      {"splits -1", [](cuda::DecodeGemmArgs& a) { a.force_splits = -1; }},
      {"rows 32", [](cuda::DecodeGemmArgs& a) { a.force_rows = 32; }},
      {"version 1", [](cuda::DecodeGemmArgs& a) { a.version = 1; }},
  };
  for (const Bad& c : bad) {
    cuda::DecodeGemmArgs a = good();
    c.edit(a);
    EXPECT_NE(cuda::decode_gemm_unsupported(a), nullptr) << c.what;
    const std::string msg = error_message(
        [&] { cuda::decode_gemm(a, cuda::current_stream()); },
        ErrorKind::InvalidArgument);
    EXPECT_NE(msg.find("decode_gemm"), std::string::npos) << c.what << ": " << msg;
  }
  OPD_CUDA_CHECK(cudaStreamSynchronize(cuda::current_stream()));
  EXPECT_TRUE(all_nan(host(yd)));
  // The good arguments run (the refusals above were about the edits).
  EXPECT_EQ(cuda::decode_gemm_unsupported(good()), nullptr);
  cuda::decode_gemm(good(), cuda::current_stream());
  OPD_CUDA_CHECK(cudaStreamSynchronize(cuda::current_stream()));
  EXPECT_FALSE(all_nan(host(yd)));
}

// Odd batch sizes (1, 3, 17, 64: one, a part of one, several 8-row groups of x), odd n (1, 7,
// 65, 130: a row block with 1-2 valid W rows, blocks past one CTA tile), k = 8 (half a 16-wide
// mma step), 24 and 264 (k % 16 == 8: the zero-filled half granule; slices and stages of unequal
// length), 1032; every plan the default picks, and for v3 also 8 forced splits (granule slices
// of 1 or 0.5 granule at small k are clamped), each against the CPU.
TEST_P(CudaDecodeGemm, OddShapesAgainstCpu) {
  REQUIRE_GPU();
  uint64_t seed = 70;
  for (int64_t n : {1, 7, 65, 130}) {
    for (int64_t k : {8, 24, 264, 1032}) {
      Tensor x = rand_in({64, k}, DType::BF16, seed++), w = rand_in({n, k}, DType::BF16, seed++);
      Tensor b = rand_in({n}, DType::BF16, seed++);
      Tensor y_ref = Tensor::poisoned({64, n}, DType::F32);
      ops::linear_forward(x, w, b, y_ref);
      Tensor wd = dev(w, DType::BF16);
      for (int64_t m : {1, 3, 17, 64}) {
        Tensor xp = Tensor::poisoned({64, k}, DType::F32);  // rows >= m NaN on the device
        std::copy(x.data<float>(), x.data<float>() + m * k, xp.data<float>());
        Tensor xd = dev(xp, DType::BF16);
        for (DType out : {DType::BF16, DType::F32}) {
          Tensor bd = dev(b, out);
          for (int splits : {0, 8}) {
            const cuda::DecodeGemmPlan plan = cuda::decode_gemm_plan(n, k, splits, 0, version());
            SCOPED_TRACE(cat("m ", m, " n ", n, " k ", k, " out ", dtype_name(out), " v",
                             plan.version, " rows ", plan.rows, " splits ", plan.splits,
                             " stages ", plan.stages));
            EXPECT_EQ(plan.version, version());
            Tensor yd = dev_poison({m, n}, out);
            run(version(), xd, k, wd, &bd, yd, m, n, k, splits);
            const Tol t = decode_tol(out, k);
            EXPECT_TRUE(close(host(yd), y_ref.slice_rows(0, m).clone(), t.rtol, t.atol, t.rel_l2));
          }
        }
      }
    }
  }
}

// Programmatic dependent launch (kernels/cuda/pdl.cuh): the GEMM PDL-launched right behind a
// kernel that writes its x (gather_rows copying x from a source into a NaN-poisoned buffer), and
// a second GEMM PDL-launched behind the first (it reads the first's y: the first's early
// launch_dependents must not let it read y before the first completed). The outputs equal the
// plain launches' bit for bit and hold no NaN, so nothing read x or h before its producer was
// done. v2 ignores the request (no wait in it: launched plainly), so it must pass as well.
TEST_P(CudaDecodeGemm, PdlLaunchBehindAProducerGivesThePlainLaunchesBits) {
  REQUIRE_GPU();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const int64_t k = 1032, n1 = 4096, n2 = 1000;
  for (int64_t m : {3, 64}) {
    SCOPED_TRACE(cat("m ", m));
    std::vector<int32_t> identity(m);
    for (int64_t t = 0; t < m; ++t) identity[t] = static_cast<int32_t>(t);
    Tensor rows_d = Tensor::from_vector(identity, {m}).to(Device::CUDA);
    Tensor src = dev(rand_in({m, k}, DType::BF16, 80), DType::BF16);
    Tensor w1 = dev(rand_in({n1, k}, DType::BF16, 81, -0.1, 0.1), DType::BF16);
    Tensor w2 = dev(rand_in({n2, n1}, DType::BF16, 82, -0.1, 0.1), DType::BF16);
    std::vector<Tensor> hs, ys;
    for (bool pdl : {false, true}) {
      Tensor xd = dev_poison({m, k}, DType::BF16), h = dev_poison({m, n1}, DType::BF16);
      Tensor y = dev_poison({m, n2}, DType::F32);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      cuda::gather_rows(src.raw(), DType::BF16, m, rows_d.data<int32_t>(), m, k, xd.raw(),
                        DType::BF16, stream);
      cuda::DecodeGemmArgs a;
      a.x = xd.raw(), a.ldx = k, a.w = w1.raw(), a.y = h.raw(), a.ldy = n1;
      a.m = m, a.n = n1, a.k = k, a.version = version(), a.pdl = pdl;
      cuda::decode_gemm(a, stream);
      cuda::DecodeGemmArgs b;
      b.x = h.raw(), b.ldx = n1, b.w = w2.raw(), b.y = y.raw(), b.ldy = n2;
      b.m = m, b.n = n2, b.k = n1, b.y_dtype = DType::F32, b.version = version(), b.pdl = pdl;
      cuda::decode_gemm(b, stream);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      hs.push_back(host(h));
      ys.push_back(host(y));
    }
    EXPECT_FALSE(any_nan(hs[1]));
    EXPECT_FALSE(any_nan(ys[1]));
    EXPECT_TRUE(same_bits(hs[1], hs[0]));
    EXPECT_TRUE(same_bits(ys[1], ys[0]));
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// One decode step (12 sequences) of bf16 fixture models through PagedForward's fused path with
// the decode GEMM against the same step on cuBLASLt: f32 logits within bf16 rounding (the two
// sum in different orders and round the same activations); the decode GEMM's step twice gives
// the same bits. qwen2 and llama_bias carry q/k/v biases (the epilogue's bias).
TEST_P(CudaDecodeGemm, PagedForwardDecodeStepMatchesCublasLt) {
  REQUIRE_GPU();
  for (const char* family : {"qwen3", "qwen2", "llama_bias"}) {
    SCOPED_TRACE(family);
    Transformer gpu = Transformer::load(model_dir(family)).to(Device::CUDA, DType::BF16);
    const int64_t V = gpu.config().vocab_size, bs = 4;
    PagedForward ours(gpu, true), lt(gpu, true);
    ours.set_decode_gemm(true);
    lt.set_decode_gemm(false);
    std::vector<Tensor> logits;
    for (PagedForward* f : {&lt, &ours, &ours}) {
      KvCache cache(gpu.config(), bs, 64, DType::BF16, Device::CUDA);
      std::vector<std::vector<int32_t>> tables(12);
      PagedStep prefill, decode;
      for (int b = 0; b < 12; ++b)
        for (int i = 0; i < 3; ++i) tables[b].push_back(cache.allocate());
      for (int b = 0; b < 12; ++b) prefill.add(seeded_prompt(300 + b, 9, V), 0, tables[b]);
      (void)f->step(prefill, cache);  // 108 tokens: cuBLASLt in both
      for (int b = 0; b < 12; ++b) {
        const std::vector<int32_t> next = {static_cast<int32_t>((7 * b + 3) % V)};
        decode.add(next, 9, tables[b]);
      }
      logits.push_back(host(f->step(decode, cache)));
    }
    EXPECT_TRUE(close(logits[1], logits[0], 2e-2, 2e-2, 2e-2));
    EXPECT_TRUE(same_bits(logits[1], logits[2]));
  }
}

// Greedy rollouts (CUDA graphs: the decode GEMM's cluster launches are captured and replayed)
// with and without the decode GEMM: the same tokens, except
// where two logits tie within bf16 rounding. At a divergence the prefixes are equal, so the
// chosen tokens' log-probabilities (both the top one) must agree to rounding; before it, every
// log-probability agrees to rounding.
TEST_P(CudaDecodeGemm, GreedyRolloutTokensEqualCublasLtUpToTies) {
  REQUIRE_GPU();
  Transformer gpu = Transformer::load(model_dir("qwen3")).to(Device::CUDA, DType::BF16);
  const int64_t V = gpu.config().vocab_size;
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 20; ++i) {
    GenerationRequest r = request(seeded_prompt(500 + i, 4 + i % 7, V), 24, 0.0);
    r.ignore_eos = true;
    reqs.push_back(r);
  }
  EngineOptions on, off;
  on.block_size = off.block_size = 8;
  on.cuda_decode_gemm = true;
  off.cuda_decode_gemm = false;
  RolloutEngine e_on(gpu, on, {}), e_off(gpu, off, {});
  const auto got = e_on.generate(reqs), want = e_off.generate(reqs);
  EXPECT_GT(e_on.stats().graph_steps, 10);
  int identical = 0;
  for (size_t r = 0; r < reqs.size(); ++r) {
    const SampleOutput &a = got[r].samples[0], &b = want[r].samples[0];
    ASSERT_EQ(a.ids.size(), b.ids.size());
    size_t k = 0;
    while (k < a.ids.size() && a.ids[k] == b.ids[k]) {
      EXPECT_NEAR(a.model_logprobs[k], b.model_logprobs[k], 2e-2) << "request " << r << " step " << k;
      ++k;
    }
    if (k == a.ids.size()) {
      ++identical;
    } else {
      EXPECT_NEAR(a.model_logprobs[k], b.model_logprobs[k], 2e-2)
          << "request " << r << " diverges at step " << k << " without a near-tie";
    }
  }
  EXPECT_GE(identical, 16) << "of " << reqs.size();
}

INSTANTIATE_TEST_SUITE_P(V, CudaDecodeGemm, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& i) { return cat("v", i.param); });

// v3's plan on an H200 (132 SMs), host only (runs without a GPU): the W1 shapes at one wave of
// >= 0.9 x 132 CTAs with every CTA's W and x slices in shared memory (decode_gemm_v3.cu's
// table), the lm_head with 2 CTAs per SM, tiny shapes, forced values, and the fallback to v2
// when not even 64 rows x 8 splits fit (k = 16384).
TEST(CudaDecodeGemmPlan, V3PlansForTheW1ShapesAndFallsBackToV2) {
  struct Want {
    int64_t n, k;
    int rows, splits, stages;
  };
  for (const Want& w : {Want{4096, 1024, 128, 4, 2}, Want{1024, 2048, 64, 8, 2},
                        Want{6144, 1024, 128, 4, 2}, Want{1024, 3072, 64, 8, 3},
                        Want{151936, 1024, 128, 4, 2}}) {
    const cuda::DecodeGemmPlan p = cuda::decode_gemm_plan(w.n, w.k, 0, 132, 3);
    SCOPED_TRACE(cat("n ", w.n, " k ", w.k));
    EXPECT_EQ(p.version, 3);
    EXPECT_EQ(p.rows, w.rows);
    EXPECT_EQ(p.splits, w.splits);
    EXPECT_EQ(p.stages, w.stages);
    EXPECT_EQ(p.row_blocks, (w.n + w.rows - 1) / w.rows);
    EXPECT_LE(p.smem_bytes, 227 * 1024);
    if (w.n < 100000) {
      const int64_t ctas = p.row_blocks * p.splits;
      EXPECT_GE(ctas, 119);
      EXPECT_LE(ctas, (p.smem_bytes + 1024) * 2 <= 228 * 1024 ? 264 : 132);
    }
  }
  const cuda::DecodeGemmPlan tiny = cuda::decode_gemm_plan(1, 8, 0, 132, 3);
  EXPECT_EQ(tiny.version, 3);
  EXPECT_EQ(tiny.splits, 1);  // one 16-wide granule
  const cuda::DecodeGemmPlan forced = cuda::decode_gemm_plan(1000, 520, 5, 132, 3, 128);
  EXPECT_EQ(forced.version, 3);
  EXPECT_EQ(forced.rows, 128);
  EXPECT_EQ(forced.splits, 5);
  const cuda::DecodeGemmPlan big_k = cuda::decode_gemm_plan(1024, 16384, 0, 132, 3);
  EXPECT_EQ(big_k.version, 2);
  const cuda::DecodeGemmPlan v2 = cuda::decode_gemm_plan(4096, 1024, 0, 132, 2);
  EXPECT_EQ(v2.version, 2);
  EXPECT_EQ(v2.rows, 64);
  EXPECT_THROW(cuda::decode_gemm_plan(4096, 1024, 0, 132, 1), Error);
  EXPECT_THROW(cuda::decode_gemm_plan(4096, 1024, 0, 132, 3, 96), Error);
}

}  // namespace
}  // namespace opd::test
