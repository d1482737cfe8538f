// CUDA tiled lm_head top-K (teacher/topk_lm_head_cuda.cu) against the CPU reference
// (teacher/topk_lm_head.cpp) on the same bf16/f32-representable hidden rows and lm_head:
// K in {0, 1, 5, 64, 300, 1000, 4096, V}, vocabularies not a multiple of the tile, tiles of 7 ..
// 20000 ids, row chunks of 1 .. 512, temperatures 0.7 .. 2, actual ids with -1 (none), ranks on
// and off, f32 and bf16; the device memory bound (never [N x V]); determinism; bad actual ids and
// non-finite logits rejected with the CPU's messages. GPU only: skips cleanly without a device.
//
// Ids: both sides compute the same f32 logits up to the GEMM's summation order (OpenBLAS vs
// cuBLASLt, both f32 accumulation of exact bf16/f32 products): |dz| ~ 1e-6 here. Two ids whose
// exact logits (f64 in the test) differ by less than that can come out in either order, so an
// id mismatch at a position is accepted only when the exact logits of the two ids are within
// kNearTie, and such swaps are counted and must stay rare. Logprobs are compared position by
// position (sorted values do not depend on which of two near-tied ids is listed first).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "core/cuda/allocator.h"
#include "core/philox.h"
#include "cuda/cuda_test_util.h"
#include "teacher/topk_lm_head.h"
#include "teacher/topk_lm_head_cuda.h"

namespace opd::test {
namespace {

constexpr double kNearTie = 1e-4;

struct TopKCase {
  const char* name;
  int64_t n, h, v, k, tile, chunk;
  double t;
  bool ranks;
};

double exact_logit(const Tensor& hid, const Tensor& w, int64_t r, int64_t id) {
  const int64_t H = hid.dim(1);
  const float* a = hid.data<float>() + r * H;
  const float* b = w.data<float>() + id * H;
  double s = 0;
  for (int64_t i = 0; i < H; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

struct Compared {
  int64_t swaps = 0, entries = 0;
};

// GPU result vs CPU result; logprob tolerance: both are z / T - LSE with z from f32 GEMMs
// (|dz| ~ 1e-6 x |z|) and LSE in f32 (GPU) vs f64 (CPU): 1e-4 absolute + 1e-5 relative.
Compared compare_results(const TopKLmHeadResult& gpu, const TopKLmHeadResult& cpu, const Tensor& hid,
                         const Tensor& w, const std::vector<int32_t>& actual, int64_t k,
                         double t, bool ranks) {
  Compared c;
  const int64_t N = hid.dim(0);
  const double atol = 1e-4, rtol = 1e-5;
  EXPECT_EQ(gpu.ids.size(), cpu.ids.size());
  EXPECT_EQ(gpu.logprobs.size(), cpu.logprobs.size());
  if (gpu.ids.size() != cpu.ids.size()) return c;
  for (int64_t r = 0; r < N; ++r) {
    std::set<int32_t> seen;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t gi = gpu.ids[r * k + j], ci = cpu.ids[r * k + j];
      const float gl = gpu.logprobs[r * k + j], cl = cpu.logprobs[r * k + j];
      ++c.entries;
      EXPECT_TRUE(gi >= 0 && gi < w.dim(0)) << "row " << r << " pos " << j << " id " << gi;
      if (!(gi >= 0 && gi < w.dim(0))) return c;
      EXPECT_TRUE(seen.insert(gi).second) << "row " << r << ": id " << gi << " twice";
      EXPECT_TRUE(std::fabs(gl - cl) <= atol + rtol * std::fabs(cl))
          << "row " << r << " pos " << j << ": logprob " << gl << " vs cpu " << cl;
      if (j > 0) EXPECT_LE(gl, gpu.logprobs[r * k + j - 1]) << "row " << r << " not sorted";
      if (gi != ci) {
        const double dz = std::fabs(exact_logit(hid, w, r, gi) - exact_logit(hid, w, r, ci));
        EXPECT_LE(dz, kNearTie) << "row " << r << " pos " << j << ": id " << gi << " vs cpu " << ci
                                << " are not a near-tie (exact logits differ by " << dz << ")";
        ++c.swaps;
      }
    }
    const float ga = gpu.actual_logprobs[r], ca = cpu.actual_logprobs[r];
    if (actual.empty() || actual[r] < 0) {
      EXPECT_TRUE(std::isnan(ga)) << "row " << r;
    } else {
      EXPECT_TRUE(std::fabs(ga - ca) <= atol + rtol * std::fabs(ca))
          << "row " << r << ": actual logprob " << ga << " vs cpu " << ca;
    }
    if (ranks && !actual.empty()) {
      const int64_t gr = gpu.actual_ranks[r], cr = cpu.actual_ranks[r];
      if (actual[r] < 0) {
        EXPECT_EQ(gr, 0);
      } else if (gr != cr) {
        // Allowed only by ids whose exact logit is within kNearTie of the actual token's.
        const double zy = exact_logit(hid, w, r, actual[r]);
        int64_t near = 0;
        for (int64_t v = 0; v < w.dim(0); ++v)
          near += std::fabs(exact_logit(hid, w, r, v) - zy) <= kNearTie && v != actual[r];
        EXPECT_LE(std::llabs(gr - cr), near) << "row " << r << ": rank " << gr << " vs cpu " << cr;
      }
    }
  }
  (void)t;
  return c;
}

std::vector<int32_t> make_actual(int64_t n, int64_t v, uint64_t seed) {
  std::vector<int32_t> a(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r)
    a[r] = (r % 5 == 3) ? -1 : static_cast<int32_t>(philox_u32(seed, 1, r) % v);
  return a;
}

void run_case(const TopKCase& c, DType dt, uint64_t seed, int64_t* swaps, int64_t* entries) {
  // Logits with a spread like a real lm_head: |z| up to ~10 (rows in [-1, 1), weights scaled).
  const double wscale = 3.0 / std::sqrt(static_cast<double>(c.h));
  Tensor hid = rand_in({c.n, c.h}, dt, seed, -1, 1);
  Tensor w = rand_in({c.v, c.h}, dt, seed + 1, -wscale, wscale);
  std::vector<int32_t> actual = make_actual(c.n, c.v, seed + 2);
  TopKLmHeadArgs args;
  args.hidden = hid;
  args.lm_head = w;
  args.actual = actual;
  args.k = c.k;
  args.temperature = c.t;
  args.vocab_tile = c.tile;
  args.row_chunk = c.chunk;
  args.want_ranks = c.ranks;
  TopKLmHeadResult cpu = topk_lm_head(args);
  args.hidden = dev(hid, dt);
  args.lm_head = dev(w, dt);
  TopKLmHeadResult gpu = topk_lm_head(args);
  Compared r = compare_results(gpu, cpu, hid, w, actual, c.k, c.t, c.ranks);
  *swaps += r.swaps;
  *entries += r.entries;
}

TEST(CudaTopKLmHead, MatchesCpuReference) {
  REQUIRE_GPU();
  const std::vector<TopKCase> cases = {
      {"one_row", 1, 64, 1000, 5, 4096, 512, 1.0, true},
      {"odd_tiles", 7, 100, 5003, 64, 1000, 3, 0.7, true},
      {"many_rows", 300, 256, 32785, 64, 4096, 128, 1.0, false},
      {"k300_merges", 33, 128, 5003, 300, 512, 16, 2.0, true},
      {"k0", 20, 64, 3000, 0, 700, 8, 1.3, true},
      {"k_equals_v_tiny_tiles", 5, 64, 96, 96, 7, 2, 1.0, true},
      {"k1", 9, 32, 2000, 1, 333, 4, 1.0, true},
      {"k1000_one_tile", 64, 64, 20000, 1000, 20000, 64, 1.0, false},
      {"k4096", 4, 64, 9000, 4096, 4096, 4, 1.0, false},
      {"qwen_vocab", 64, 2048, 151936, 64, 16384, 2048, 1.0, true},
  };
  for (DType dt : {DType::BF16, DType::F32}) {
    int64_t swaps = 0, entries = 0;
    uint64_t seed = 10;
    for (const TopKCase& c : cases) {
      SCOPED_TRACE(std::string(c.name) + " " + dtype_label(dt));
      run_case(c, dt, seed += 7, &swaps, &entries);
    }
    std::printf("[ near-tie ] %s: %lld of %lld top-K entries swapped with a near-tied id\n",
                dtype_label(dt).c_str(), static_cast<long long>(swaps),
                static_cast<long long>(entries));
    EXPECT_LE(swaps * 1000, entries) << "near-tie swaps must be rare (<= 0.1%)";
  }
}

TEST(CudaTopKLmHead, DeviceMemoryIsNeverRowsTimesVocab) {
  REQUIRE_GPU();
  const int64_t N = 512, H = 256, V = 151936, K = 64, tile = 8192, chunk = 128;
  Tensor hid = dev(rand_in({N, H}, DType::BF16, 1), DType::BF16);
  Tensor w = dev(rand_in({V, H}, DType::BF16, 2, -0.2, 0.2), DType::BF16);
  Tensor actual = dev_i32(Tensor::from_vector(make_actual(N, V, 3), {N}));
  cuda::CachingAllocator& alloc = cuda::device_allocator();
  (void)topk_lm_head_device(hid, w, actual, K, 1.0, true, tile, chunk);  // warm (GEMM workspace)
  const int64_t before = alloc.stats().in_use;
  alloc.reset_peak();
  TopKLmHeadDeviceResult r = topk_lm_head_device(hid, w, actual, K, 1.0, true, tile, chunk);
  const int64_t peak = alloc.stats().peak_in_use - before;
  const int64_t ws = static_cast<int64_t>(cuda::topk_lm_head_cuda_workspace_bytes(N, V, K, tile, chunk));
  const int64_t outputs = N * K * 8 + N * 8;
  std::printf("[ memory ] peak %lld bytes (workspace %lld = tile %lld + state/kept %lld; outputs %lld;"
              " dense [N x V] f32 would be %lld)\n",
              static_cast<long long>(peak), static_cast<long long>(ws),
              static_cast<long long>(chunk * tile * 4), static_cast<long long>(ws - chunk * tile * 4),
              static_cast<long long>(outputs), static_cast<long long>(N * V * 4));
  // Allocator classes round up by <= 12.5%; plus the index-check flags and the error flags.
  EXPECT_LE(peak, (ws + outputs) * 9 / 8 + 64 * 1024);
  EXPECT_LT(peak * 20, N * V * 4);
  EXPECT_EQ(r.ids.dim(0), N);
}

TEST(CudaTopKLmHead, DeterministicBitIdentical) {
  REQUIRE_GPU();
  const int64_t N = 100, H = 128, V = 30011, K = 64;
  Tensor hid = dev(rand_in({N, H}, DType::BF16, 5), DType::BF16);
  Tensor w = dev(rand_in({V, H}, DType::BF16, 6, -0.3, 0.3), DType::BF16);
  Tensor actual = dev_i32(Tensor::from_vector(make_actual(N, V, 7), {N}));
  TopKLmHeadDeviceResult a = topk_lm_head_device(hid, w, actual, K, 0.8, true, 4096, 32);
  TopKLmHeadDeviceResult b = topk_lm_head_device(hid, w, actual, K, 0.8, true, 4096, 32);
  EXPECT_TRUE(same_bits(a.ids.to(Device::CPU), b.ids.to(Device::CPU)));
  EXPECT_TRUE(same_bits(a.logprobs.to(Device::CPU), b.logprobs.to(Device::CPU)));
  EXPECT_TRUE(same_bits(a.actual_logprobs.to(Device::CPU), b.actual_logprobs.to(Device::CPU)));
  EXPECT_TRUE(same_bits(a.actual_ranks.to(Device::CPU), b.actual_ranks.to(Device::CPU)));
}

TEST(CudaTopKLmHead, BadActualIdsAndNonFiniteLogitsGiveTheCpuErrors) {
  REQUIRE_GPU();
  const int64_t N = 6, H = 32, V = 500;
  Tensor hid = rand_in({N, H}, DType::F32, 8);
  Tensor w = rand_in({V, H}, DType::F32, 9, -0.5, 0.5);
  for (int32_t bad : {static_cast<int32_t>(V), -2, 1 << 30}) {
    TopKLmHeadArgs args;
    args.hidden = hid;
    args.lm_head = w;
    args.actual = {1, 2, 3, bad, 4, bad};
    args.k = 4;
    const std::string want = message_head(error_message([&] { topk_lm_head(args); }, ErrorKind::InvalidData));
    args.hidden = dev(hid, DType::F32);
    args.lm_head = dev(w, DType::F32);
    const std::string got = message_head(error_message([&] { topk_lm_head(args); }, ErrorKind::InvalidData));
    EXPECT_EQ(got, want);
  }
  Tensor poisoned = hid.clone();
  poisoned.data<float>()[3 * H + 5] = std::nanf("");
  TopKLmHeadArgs args;
  args.hidden = poisoned;
  args.lm_head = w;
  args.k = 4;
  const std::string want = message_head(error_message([&] { topk_lm_head(args); }, ErrorKind::Internal));
  args.hidden = dev(poisoned, DType::F32);
  args.lm_head = dev(w, DType::F32);
  const std::string got = message_head(error_message([&] { topk_lm_head(args); }, ErrorKind::Internal));
  EXPECT_EQ(got, want);
  // The device is healthy afterwards.
  args.hidden = dev(hid, DType::F32);
  EXPECT_EQ(topk_lm_head(args).ids.size(), static_cast<size_t>(N * 4));
}

}  // namespace
}  // namespace opd::test
