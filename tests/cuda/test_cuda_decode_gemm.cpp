// The weight-streaming decode GEMM (kernels/cuda/decode_gemm.cu, declared in gemm.h) against
// the CPU linear (kernels/ops.h linear_forward, OpenBLAS f32 on the same bf16-representable
// inputs): a sweep of m x n x k (odd sizes, k % 32 != 0, n below one CTA tile), bf16 and f32
// outputs, bias, a padded x row stride, forced split counts (cluster sizes 1-8), NaN-poisoned
// outputs and NaN beyond the shape (rows >= m, the row-stride pad), bit-identical reruns, and
// the arguments it must refuse. Then the model: one decode step of
// PagedForward with the decode GEMM against cuBLASLt (fixture models, bf16, with and without
// q/k/v biases), and greedy rollouts through the engine (CUDA graphs) with and without it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "core/cuda/allocator.h"  // current_stream
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

// x [m, ldx] on the device as bf16 from host f32 x [rows >= m, k]: rows [0, m) copied, the
// row-stride pad (columns >= k) NaN.
Tensor device_x(const Tensor& x_host, int64_t m, int64_t k, int64_t ldx) {
  Tensor p = Tensor::poisoned({m, ldx}, DType::F32);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; ++c) p.data<float>()[r * ldx + c] = x_host.data<float>()[r * k + c];
  return dev(p, DType::BF16);
}

void run(const Tensor& xd, int64_t ldx, const Tensor& wd, const Tensor* bias, Tensor& yd,
         int64_t m, int64_t n, int64_t k, int force_splits = 0) {
  cuda::DecodeGemmArgs a;
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

TEST(CudaDecodeGemm, MatchesCpuLinearAcrossShapes) {
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
      const cuda::DecodeGemmPlan plan = cuda::decode_gemm_plan(n, k);
      for (int64_t m : ms) {
        // Rows >= m of x are NaN on the device: a read of them would poison the sums.
        Tensor xp = Tensor::poisoned({64, k}, DType::F32);
        std::copy(x.data<float>(), x.data<float>() + m * k, xp.data<float>());
        Tensor xd = dev(xp, DType::BF16);
        for (DType out : {DType::BF16, DType::F32}) {
          SCOPED_TRACE(cat("m ", m, " n ", n, " k ", k, " out ", dtype_name(out), " splits ",
                           plan.splits, " chunks per warp ", plan.chunks_per_warp));
          Tensor yd = dev_poison({m, n}, out);
          run(xd, k, wd, nullptr, yd, m, n, k);
          const Tol t = decode_tol(out, k);
          EXPECT_TRUE(close(host(yd), y_ref.slice_rows(0, m).clone(), t.rtol, t.atol, t.rel_l2));
        }
      }
    }
  }
}

// Bias in the epilogue, a padded x row stride (the pad is NaN), split counts 1-8 (and asks
// for more, clamped to 8) with one or several k tiles per CTA, each against the CPU.
TEST(CudaDecodeGemm, BiasStridesAndSplits) {
  REQUIRE_GPU();
  const int64_t n = 1000, k = 2056, ldx = k + 24;
  Tensor x = rand_in({64, k}, DType::BF16, 40), w = rand_in({n, k}, DType::BF16, 41);
  Tensor b = rand_in({n}, DType::BF16, 42);
  Tensor y_ref = Tensor::poisoned({64, n}, DType::F32);
  ops::linear_forward(x, w, b, y_ref);
  Tensor wd = dev(w, DType::BF16);
  for (int64_t m : {3, 64}) {
    Tensor xd = device_x(x, m, k, ldx);
    for (DType out : {DType::BF16, DType::F32}) {
      Tensor bd = dev(b, out);
      for (int splits : {1, 2, 3, 5, 7, 8, 9, 100}) {
        const cuda::DecodeGemmPlan plan = cuda::decode_gemm_plan(n, k, splits);
        EXPECT_EQ(plan.splits, std::min(splits, 8));
        SCOPED_TRACE(cat("m ", m, " out ", dtype_name(out), " splits ", plan.splits,
                         " chunks per warp ", plan.chunks_per_warp));
        Tensor yd = dev_poison({m, n}, out);
        run(xd, ldx, wd, &bd, yd, m, n, k, splits);
        const Tol t = decode_tol(out, k);
        EXPECT_TRUE(close(host(yd), y_ref.slice_rows(0, m).clone(), t.rtol, t.atol, t.rel_l2));
      }
    }
  }
}

// Same inputs, same bits, also when the split CTAs finish in another order.
TEST(CudaDecodeGemm, DeterministicBitIdentical) {
  REQUIRE_GPU();
  const int64_t m = 64, n = 1024, k = 3072;
  Tensor x = rand_in({m, k}, DType::BF16, 50), w = rand_in({n, k}, DType::BF16, 51);
  Tensor xd = dev(x, DType::BF16), wd = dev(w, DType::BF16);
  for (int splits : {0, 5, 8}) {
    const cuda::DecodeGemmPlan plan = cuda::decode_gemm_plan(n, k, splits);
    EXPECT_GT(plan.splits, 1);
    Tensor first;
    for (int rep = 0; rep < 4; ++rep) {
      Tensor yd = dev_poison({m, n}, DType::BF16);
      run(xd, k, wd, nullptr, yd, m, n, k, splits);
      Tensor got = yd.to(Device::CPU);
      if (rep == 0) {
        first = got;
      } else {
        EXPECT_TRUE(same_bits(got, first)) << "splits " << plan.splits << " rerun " << rep;
      }
    }
  }
}

// Refused with InvalidArgument naming the shape; nothing written.
TEST(CudaDecodeGemm, RefusesBadArguments) {
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

// One decode step (12 sequences) of bf16 fixture models through PagedForward's fused path with
// the decode GEMM against the same step on cuBLASLt: f32 logits within bf16 rounding (the two
// sum in different orders and round the same activations); the decode GEMM's step twice gives
// the same bits. qwen2 and llama_bias carry q/k/v biases (the epilogue's bias).
TEST(CudaDecodeGemm, PagedForwardDecodeStepMatchesCublasLt) {
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
TEST(CudaDecodeGemm, GreedyRolloutTokensEqualCublasLtUpToTies) {
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

}  // namespace
}  // namespace opd::test
