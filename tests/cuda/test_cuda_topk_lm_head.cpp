// CUDA tiled lm_head top-K (teacher/topk_lm_head_cuda.cu) against the CPU reference
// (teacher/topk_lm_head.cpp) on the same bf16/f32-representable hidden rows and lm_head:
// K in {0, 1, 5, 64, 300, 1000, 4096, V}, vocabularies not a multiple of the tile, tiles of 7 ..
// 20000 ids, row chunks of 1 .. 512, temperatures 0.7 .. 2, actual ids with -1 (none), ranks on
// and off, f32 and bf16; the device memory bound (never [N x V]); determinism; bad actual ids and
// non-finite logits rejected with the CPU's messages; and the row kernels alone on given logits
// (no GEMM) against an exact dense reference, on both merge paths (the racecheck target); a
// graph-captured call replays bit-identical to the eager one.
// GPU only: skips cleanly without a device.
//
// Ids: both sides compute the same f32 logits up to the GEMM's summation order (OpenBLAS vs
// cuBLASLt, both f32 accumulation of exact bf16/f32 products): |dz| ~ 1e-6 here. Two ids whose
// exact logits (f64 in the test) differ by less than that can come out in either order, so an
// id mismatch at a position is accepted only when the exact logits of the two ids are within
// kNearTie, and such swaps are counted and must stay rare. Logprobs are compared position by
// position (sorted values do not depend on which of two near-tied ids is listed first).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "core/cuda/allocator.h"  // DeviceBuffer, current_stream
#include "core/cuda/stream.h"     // Stream
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

// The host inputs of a case: logits with a spread like a real lm_head, |z| up to ~10 (rows in
// [-1, 1), weights scaled), and actual ids (every 5th row -1).
struct TopKInputs {
  Tensor hid, w;
  std::vector<int32_t> actual;
};
TopKInputs make_inputs(const TopKCase& c, DType dt, uint64_t seed) {
  const double wscale = 3.0 / std::sqrt(static_cast<double>(c.h));
  return {rand_in({c.n, c.h}, dt, seed, -1, 1), rand_in({c.v, c.h}, dt, seed + 1, -wscale, wscale),
          make_actual(c.n, c.v, seed + 2)};
}

// The shapes of the CPU comparison: one tile, vocabularies not a multiple of the tile, row
// counts not a multiple of the chunk, K from 0 to 4096.
std::vector<TopKCase> common_cases() {
  return {
      {"one_row", 1, 64, 1000, 5, 4096, 512, 1.0, true},
      {"odd_tiles", 7, 100, 5003, 64, 1000, 3, 0.7, true},
      {"many_rows", 300, 256, 32785, 64, 4096, 128, 1.0, false},
      {"k300_merges", 33, 128, 5003, 300, 512, 16, 2.0, true},
      {"k0", 20, 64, 3000, 0, 700, 8, 1.3, true},
      {"k_equals_v_tiny_tiles", 5, 64, 96, 96, 7, 2, 1.0, true},
      {"k1", 9, 32, 2000, 1, 333, 4, 1.0, true},
      {"k1000_one_tile", 64, 64, 20000, 1000, 20000, 64, 1.0, false},
      {"k4096", 4, 64, 9000, 4096, 4096, 4, 1.0, false},
  };
}

void run_case(const TopKCase& c, DType dt, uint64_t seed, int64_t* swaps, int64_t* entries) {
  const TopKInputs in = make_inputs(c, dt, seed);
  const Tensor &hid = in.hid, &w = in.w;
  const std::vector<int32_t>& actual = in.actual;
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
  std::vector<TopKCase> cases = common_cases();
  cases.push_back({"qwen_vocab", 64, 2048, 151936, 64, 16384, 2048, 1.0, true});
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

// ---- The row kernels alone, on given logits (TopKLmHeadCudaArgs::logits: no GEMM).
// The reference is dense and exact on the same f32 logits: ids in (z desc, id asc) order must be
// identical (no GEMM summation order in between, so no near-tie allowance), logprobs within the
// f32 LSE error, ranks exact. Even rows hold logits on a 1/8 grid (hundreds of exact ties, so
// the id tie-break decides), odd rows continuous values. Small candidate capacities push small
// tiles through the global-memory merge path (C > capacity) as well as the shared-memory one.
// This is the variant gpu_check.sh runs under compute-sanitizer racecheck: cuBLASLt's Hopper
// GEMM kernels fault under racecheck by themselves (seen with PyTorch's F.linear alone), so the
// GEMM path cannot be raced; these tests race every row kernel on every merge path.
struct LogitCase {
  const char* name;
  int64_t n, v, k, tile, chunk;
  double t;
  int cand_cap;
  bool ranks;
  bool constant_rows = false;  // every logit of a row equal (row r: r / 4 - 1): ties only
};

struct DenseRef {
  std::vector<int32_t> ids;
  std::vector<double> logprobs, actual_logprobs;
  std::vector<int32_t> ranks;
};

DenseRef dense_reference(const std::vector<float>& z, int64_t n, int64_t v, int64_t k, double t,
                         const std::vector<int32_t>& actual) {
  DenseRef ref;
  std::vector<int32_t> order(static_cast<size_t>(v));
  for (int64_t r = 0; r < n; ++r) {
    const float* zr = z.data() + r * v;
    double m = -INFINITY;
    for (int64_t j = 0; j < v; ++j) m = std::max(m, zr[j] / t);
    double s = 0;
    for (int64_t j = 0; j < v; ++j) s += std::exp(zr[j] / t - m);
    const double lse = m + std::log(s);
    for (int64_t j = 0; j < v; ++j) order[static_cast<size_t>(j)] = static_cast<int32_t>(j);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
      return zr[a] > zr[b] || (zr[a] == zr[b] && a < b);
    });
    for (int64_t i = 0; i < k; ++i) {
      ref.ids.push_back(order[static_cast<size_t>(i)]);
      ref.logprobs.push_back(zr[order[static_cast<size_t>(i)]] / t - lse);
    }
    const int32_t y = actual[static_cast<size_t>(r)];
    ref.actual_logprobs.push_back(y >= 0 ? zr[y] / t - lse : NAN);
    int32_t above = 0;
    if (y >= 0)
      for (int64_t j = 0; j < v; ++j) above += zr[j] > zr[y];
    ref.ranks.push_back(y >= 0 ? above + 1 : 0);
  }
  return ref;
}

// Device outputs of one low-level call (host copies), for bit comparisons.
struct RawOutputs {
  Tensor ids, logprobs, actual_logprobs, ranks, flags;
};

void expect_same_outputs(const RawOutputs& want, const RawOutputs& got) {
  EXPECT_TRUE(same_bits(want.ids, got.ids)) << "ids differ";
  EXPECT_TRUE(same_bits(want.logprobs, got.logprobs)) << "logprobs differ";
  EXPECT_TRUE(same_bits(want.actual_logprobs, got.actual_logprobs)) << "actual logprobs differ";
  EXPECT_TRUE(same_bits(want.ranks, got.ranks)) << "ranks differ";
  EXPECT_TRUE(same_bits(want.flags, got.flags)) << "error flags differ";
}

// One low-level call on the inputs set in `a` (logits, or hidden + lm_head; sizes, K, T, tiles):
// poisoned outputs (ids -7, logprobs NaN) bound into it, its workspace, host copies back; every
// error flag must stay -1.
RawOutputs run_raw(cuda::TopKLmHeadCudaArgs a) {
  const int64_t n = a.rows, k = a.k;
  const int64_t entries = std::max<int64_t>(1, n * k);  // no zero-byte device tensors
  Tensor ids = Tensor::from_vector(std::vector<int32_t>(static_cast<size_t>(entries), -7),
                                   {entries}).to(Device::CUDA);
  Tensor lps = dev_poison({entries}, DType::F32);
  Tensor act = dev_poison({n}, DType::F32);
  Tensor ranks = Tensor::from_vector(std::vector<int32_t>(static_cast<size_t>(n), -7), {n})
                     .to(Device::CUDA);
  Tensor flags = Tensor::from_vector(std::vector<int32_t>(3, -1), {3}).to(Device::CUDA);
  a.ids = k > 0 ? ids.data<int32_t>() : nullptr;
  a.logprobs = k > 0 ? lps.data<float>() : nullptr;
  a.actual_logprobs = act.data<float>();
  a.actual_ranks = a.want_ranks ? ranks.data<int32_t>() : nullptr;
  a.error_flag = reinterpret_cast<unsigned*>(flags.data<int32_t>());
  cuda::DeviceBuffer ws(
      cuda::topk_lm_head_cuda_workspace_bytes(n, a.vocab, k, a.vocab_tile, a.row_chunk),
      cuda::current_stream());
  cuda::topk_lm_head_cuda(a, ws.get(), cuda::current_stream());
  RawOutputs o{ids.to(Device::CPU), lps.to(Device::CPU), act.to(Device::CPU),
               ranks.to(Device::CPU), flags.to(Device::CPU)};
  for (int f = 0; f < 3; ++f) EXPECT_EQ(o.flags.data<int32_t>()[f], -1) << "error flag " << f;
  return o;
}

RawOutputs run_logit_case(const LogitCase& c, uint64_t seed) {
  SCOPED_TRACE(c.name);
  std::vector<float> z(static_cast<size_t>(c.n * c.v));
  for (int64_t r = 0; r < c.n; ++r)
    for (int64_t j = 0; j < c.v; ++j) {
      const double u = philox_uniform(seed, static_cast<uint64_t>(r), static_cast<uint64_t>(j));
      const double x = 16 * u - 8;
      z[static_cast<size_t>(r * c.v + j)] =
          c.constant_rows ? static_cast<float>(r) / 4 - 1
                          : static_cast<float>(r % 2 == 0 ? std::round(x * 8) / 8 : x);
    }
  const std::vector<int32_t> actual = make_actual(c.n, c.v, seed + 1);
  const DenseRef ref = dense_reference(z, c.n, c.v, c.k, c.t, actual);

  Tensor logits = Tensor::from_vector(z, {c.n, c.v}).to(Device::CUDA);
  Tensor actual_dev = Tensor::from_vector(actual, {c.n}).to(Device::CUDA);
  cuda::TopKLmHeadCudaArgs a;
  a.logits = logits.data<float>();
  a.rows = c.n;
  a.vocab = c.v;
  a.actual = actual_dev.data<int32_t>();
  a.k = c.k;
  a.temperature = c.t;
  a.want_ranks = c.ranks;
  a.vocab_tile = c.tile;
  a.row_chunk = c.chunk;
  a.candidate_capacity = c.cand_cap;
  const RawOutputs o = run_raw(a);
  const Tensor &hi = o.ids, &hl = o.logprobs, &ha = o.actual_logprobs, &hr = o.ranks;
  int64_t bad_ids = 0;
  for (int64_t i = 0; i < c.n * c.k; ++i) {
    bad_ids += hi.data<int32_t>()[i] != ref.ids[static_cast<size_t>(i)];
    const double want = ref.logprobs[static_cast<size_t>(i)], got = hl.data<float>()[i];
    EXPECT_TRUE(std::fabs(got - want) <= 1e-4 + 1e-5 * std::fabs(want))
        << "entry " << i << ": logprob " << got << " vs " << want;
    if (bad_ids == 1 && hi.data<int32_t>()[i] != ref.ids[static_cast<size_t>(i)])
      ADD_FAILURE() << "first id mismatch at entry " << i << " (row " << i / c.k << "): "
                    << hi.data<int32_t>()[i] << " vs " << ref.ids[static_cast<size_t>(i)];
  }
  EXPECT_EQ(bad_ids, 0);
  for (int64_t r = 0; r < c.n; ++r) {
    const double want = ref.actual_logprobs[static_cast<size_t>(r)], got = ha.data<float>()[r];
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "row " << r;
    } else {
      EXPECT_TRUE(std::fabs(got - want) <= 1e-4 + 1e-5 * std::fabs(want))
          << "row " << r << ": actual logprob " << got << " vs " << want;
    }
    if (c.ranks) EXPECT_EQ(hr.data<int32_t>()[r], ref.ranks[static_cast<size_t>(r)]) << "row " << r;
  }
  return o;
}

TEST(CudaTopKLmHead, RowKernelsOnGivenLogitsMatchDenseReference) {
  REQUIRE_GPU();
  const std::vector<LogitCase> cases = {
      {"smem_merge", 3, 1000, 5, 4096, 8, 1.0, cuda::kTopKLmHeadCandCap, true},
      {"global_merge_cap1", 5, 3001, 64, 700, 2, 0.7, 1, true},
      {"global_merge_cap7", 9, 5003, 100, 512, 4, 1.3, 7, true},
      // Vocabulary and tiles multiples of 4: the 16-byte row loads, also in the global merge.
      {"global_merge_cap7_vec", 9, 5004, 100, 512, 4, 1.3, 7, true},
      {"smem_merge_vec_short_tail", 5, 4100, 64, 1024, 3, 0.9, cuda::kTopKLmHeadCandCap, true},
      {"k_equals_v_tiny_tiles", 4, 96, 96, 7, 3, 1.0, 5, true},
      {"k0", 6, 777, 0, 100, 6, 1.0, 16, true},
      {"k1", 7, 2000, 1, 333, 7, 2.0, 3, false},
      {"k4096_opt_in_smem", 2, 9000, 4096, 4096, 2, 1.0, cuda::kTopKLmHeadCandCap, false},
      {"many_rows", 300, 4000, 64, 1024, 128, 1.0, cuda::kTopKLmHeadCandCap, true},
      // A first tile with more candidates than the capacity and k <= 256: the floor from the
      // threads' maxima (continuous rows: ~100 keys above it, ranked; 1/8-grid rows: a few
      // hundred tied keys, the radix select in shared memory), then later tiles collected in
      // pass 1.
      {"first_tile_floor", 6, 20000, 64, 8192, 3, 1.0, cuda::kTopKLmHeadCandCap, true},
      // The same with a capacity the tied rows' keys above the floor overflow: those rows fall
      // back to the radix select over the row.
      {"first_tile_floor_overflow", 5, 9001, 64, 4096, 2, 0.8, 300, true},
      // Every logit of a row tied: the first tile's floor equals them all, so its 4,096 keys
      // overflow the capacity and the lowest ids win through the radix select over the row;
      // later tiles' equal logits lose to the kept keys by id (no candidate).
      {"constant_rows", 3, 9000, 64, 4096, 2, 1.0, cuda::kTopKLmHeadCandCap, true, true},
  };
  uint64_t seed = 100;
  for (const LogitCase& c : cases) run_logit_case(c, seed += 3);
}

// The pass is stream-ordered without host synchronization, so it can be captured: the replayed
// graph gives the eager run's outputs bit for bit.
TEST(CudaTopKLmHead, GraphCaptureReplaysTheEagerRunBitForBit) {
  REQUIRE_GPU();
  const LogitCase c{"capture", 5, 3001, 64, 700, 2, 0.7, 16, true};
  const RawOutputs eager = run_logit_case(c, 900);
  std::vector<float> z(static_cast<size_t>(c.n * c.v));
  for (int64_t r = 0; r < c.n; ++r)
    for (int64_t j = 0; j < c.v; ++j) {  // run_logit_case's logits for seed 900
      const double x = 16 * philox_uniform(900, static_cast<uint64_t>(r), static_cast<uint64_t>(j)) - 8;
      z[static_cast<size_t>(r * c.v + j)] = static_cast<float>(r % 2 == 0 ? std::round(x * 8) / 8 : x);
    }
  const std::vector<int32_t> actual = make_actual(c.n, c.v, 901);
  // Everything allocated and initialized before the capture (no allocation inside it).
  Tensor logits = Tensor::from_vector(z, {c.n, c.v}).to(Device::CUDA);
  Tensor actual_dev = Tensor::from_vector(actual, {c.n}).to(Device::CUDA);
  Tensor ids = Tensor::from_vector(std::vector<int32_t>(static_cast<size_t>(c.n * c.k), -7),
                                   {c.n * c.k}).to(Device::CUDA);
  Tensor lps = dev_poison({c.n * c.k}, DType::F32);
  Tensor act = dev_poison({c.n}, DType::F32);
  Tensor ranks = Tensor::from_vector(std::vector<int32_t>(static_cast<size_t>(c.n), -7), {c.n})
                     .to(Device::CUDA);
  Tensor flags = Tensor::from_vector(std::vector<int32_t>(3, -1), {3}).to(Device::CUDA);
  cuda::TopKLmHeadCudaArgs a;
  a.logits = logits.data<float>();
  a.rows = c.n;
  a.vocab = c.v;
  a.actual = actual_dev.data<int32_t>();
  a.k = c.k;
  a.temperature = c.t;
  a.want_ranks = c.ranks;
  a.vocab_tile = c.tile;
  a.row_chunk = c.chunk;
  a.candidate_capacity = c.cand_cap;
  a.ids = ids.data<int32_t>();
  a.logprobs = lps.data<float>();
  a.actual_logprobs = act.data<float>();
  a.actual_ranks = ranks.data<int32_t>();
  a.error_flag = reinterpret_cast<unsigned*>(flags.data<int32_t>());
  cuda::Stream stream;
  cuda::DeviceBuffer ws(cuda::topk_lm_head_cuda_workspace_bytes(c.n, c.v, c.k, c.tile, c.chunk),
                        stream.get());
  OPD_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  OPD_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  cuda::topk_lm_head_cuda(a, ws.get(), stream.get());
  cudaGraph_t graph = nullptr;
  OPD_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  cudaGraphExec_t exec = nullptr;
  OPD_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  OPD_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
  OPD_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  OPD_CUDA_CHECK(cudaGraphExecDestroy(exec));
  OPD_CUDA_CHECK(cudaGraphDestroy(graph));
  const RawOutputs captured{ids.to(Device::CPU), lps.to(Device::CPU), act.to(Device::CPU),
                            ranks.to(Device::CPU), flags.to(Device::CPU)};
  expect_same_outputs(eager, captured);
}

TEST(CudaTopKLmHead, CandidateCapacityOutsideItsRangeIsRefused) {
  REQUIRE_GPU();
  cuda::TopKLmHeadCudaArgs a;
  a.rows = 1;
  a.vocab = 10;
  a.k = 1;
  Tensor logits = Tensor::from_vector(std::vector<float>(10, 0.5f), {1, 10}).to(Device::CUDA);
  a.logits = logits.data<float>();
  for (int cap : {0, -1, cuda::kTopKLmHeadCandCap + 1}) {
    a.candidate_capacity = cap;
    EXPECT_NE(error_message([&] { cuda::topk_lm_head_cuda(a, nullptr, cuda::current_stream()); },
                            ErrorKind::InvalidArgument)
                  .find("candidate_capacity"),
              std::string::npos);
  }
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
