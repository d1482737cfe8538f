// cuda::SmPartition (core/cuda/sm_partition.h: the SMs split into two groups by CUDA green
// contexts) and the measurement kernels built on it or beside it: kernels issued on a group's
// stream run only on that group's SMs, the groups are disjoint and cover the device, device
// memory of the primary context works on both, a GEMM planned for a group's SM count (cuBLASLt's
// SM count target, gemm_set_stream_sm_count) matches the CPU; refusals. The persistent probe
// (kernels/cuda/persistent_probe.h) reads every weight byte exactly once in every variant
// (checksum against the host). Skipped without a device (and the partition tests without green
// contexts in the driver).
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>
#include <vector>

#include "core/cuda/sm_partition.h"
#include "cuda/cuda_test_util.h"
#include "kernels/cuda/cuda_ops.h"   // sm_ids, sm_count
#include "kernels/cuda/gemm.h"       // linear_forward, gemm_set_stream_sm_count
#include "kernels/cuda/persistent_probe.h"

namespace opd::test {
namespace {

#define REQUIRE_GREEN_CONTEXTS()                                                        \
  do {                                                                                  \
    REQUIRE_GPU();                                                                      \
    if (!::opd::cuda::SmPartition::supported()) GTEST_SKIP() << "no green contexts";    \
  } while (0)

std::set<int32_t> sms_used(cudaStream_t stream, int blocks) {
  Tensor ids = Tensor::empty({blocks}, DType::I32, Device::CUDA);
  cuda::sm_ids(ids.data<int32_t>(), blocks, stream);
  OPD_CUDA_CHECK(cudaStreamSynchronize(stream));
  const Tensor h = ids.to(Device::CPU);
  return std::set<int32_t>(h.data<int32_t>(), h.data<int32_t>() + blocks);
}

TEST(CudaSmPartition, KernelsOfAGroupRunOnlyOnItsSms) {
  REQUIRE_GREEN_CONTEXTS();
  const int total = cuda::sm_count();
  for (int ask : {8, 24, 41}) {
    if (ask >= total) continue;
    cuda::SmPartition part(0, ask);
    SCOPED_TRACE(part.describe());
    EXPECT_GE(part.sms_b(), ask);
    EXPECT_GE(part.sms_a(), 1);
    EXPECT_EQ(part.sms_a() + part.sms_b(), total);
    // Many more blocks than SMs, each resident ~20 us: every SM of the group gets some.
    const std::set<int32_t> a = sms_used(part.stream_a(), 8 * total);
    const std::set<int32_t> b = sms_used(part.stream_b(), 8 * total);
    EXPECT_LE(static_cast<int>(a.size()), part.sms_a());
    EXPECT_LE(static_cast<int>(b.size()), part.sms_b());
    EXPECT_GE(static_cast<int>(b.size()), part.sms_b() / 2) << "group B barely used";
    for (int32_t sm : b) EXPECT_EQ(a.count(sm), 0u) << "SM " << sm << " in both groups";
  }
}

TEST(CudaSmPartition, RefusesAGroupThatLeavesTheOtherEmpty) {
  REQUIRE_GREEN_CONTEXTS();
  const int total = cuda::sm_count();
  EXPECT_TRUE(throws([&] { cuda::SmPartition p(0, 0); }, ErrorKind::InvalidArgument,
                     {"group B asks for 0 SMs", "must leave group A"}));
  EXPECT_TRUE(throws([&] { cuda::SmPartition p(0, total); }, ErrorKind::InvalidArgument,
                     {cat("asks for ", total, " SMs")}));
}

TEST(CudaSmPartition, GemmPlannedForTheGroupMatchesTheCpu) {
  REQUIRE_GREEN_CONTEXTS();
  cuda::SmPartition part(0, 24);
  const int64_t m = 300, k = 256, n = 520;
  const Tensor x = rand_in({m, k}, DType::BF16, 11), w = rand_in({n, k}, DType::BF16, 12);
  // f64 reference and, per element, the f32 accumulation's error bound k u sum |x w| (u = 2^-24):
  // the products are exact in f32 (bf16 inputs), the sum of k of them is not.
  std::vector<double> ref(static_cast<size_t>(m * n)), bound(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0, mag = 0;
      for (int64_t q = 0; q < k; ++q) {
        const double p = static_cast<double>(x.data<float>()[i * k + q]) * w.data<float>()[j * k + q];
        acc += p;
        mag += std::fabs(p);
      }
      ref[static_cast<size_t>(i * n + j)] = acc;
      bound[static_cast<size_t>(i * n + j)] = static_cast<double>(k) * std::ldexp(1.0, -24) * mag + 1e-12;
    }
  const Tensor xd = dev(x, DType::BF16), wd = dev(w, DType::BF16);
  for (cudaStream_t s : {part.stream_a(), part.stream_b()}) {
    cuda::gemm_set_stream_sm_count(s, s == part.stream_a() ? part.sms_a() : part.sms_b());
    Tensor y = dev_poison({m, n}, DType::F32);
    cuda::linear_forward(xd.raw(), wd.raw(), nullptr, m, k, n, DType::BF16, DType::F32, y.raw(), s);
    OPD_CUDA_CHECK(cudaStreamSynchronize(s));
    const Tensor yh = host(y);
    int64_t bad = 0;
    for (int64_t e = 0; e < m * n; ++e)
      if (!(std::fabs(yh.data<float>()[e] - ref[static_cast<size_t>(e)]) <= bound[static_cast<size_t>(e)])) ++bad;
    EXPECT_EQ(bad, 0) << (s == part.stream_a() ? "group A" : "group B");
    cuda::gemm_set_stream_sm_count(s, 0);
  }
}

// The probe reads every weight byte once: the sum over CTAs of its checksums is the sum of
// (x ^ y ^ z ^ w) over every 16-byte word of every layer's phases, however the slices fall.
TEST(CudaPersistentProbe, ReadsEveryWeightByteExactlyOnceInEveryVariant) {
  REQUIRE_GPU();
  const int sms = cuda::sm_count();
  // Odd sizes: a phase smaller than one word per CTA, one spanning several 32 KiB pieces per CTA.
  const int64_t phase[4] = {16 * 37, 16 * 7919, 16 * int64_t{sms} * 3000, 0};
  const int layers = 3;
  const int64_t layer_bytes = phase[0] + phase[1] + phase[2] + phase[3];
  const int64_t words = layer_bytes * layers / 4;
  Tensor w = Tensor::empty({words}, DType::I32, Device::CUDA);
  cuda::fill_ints(w.data<int32_t>(), words, 77, -2000000000, 2000000000, nullptr);
  const Tensor wh = w.to(Device::CPU);
  uint32_t want = 0;
  const uint32_t* u = reinterpret_cast<const uint32_t*>(wh.data<int32_t>());
  for (int64_t i = 0; i + 3 < words; i += 4) want += u[i] ^ u[i + 1] ^ u[i + 2] ^ u[i + 3];
  Tensor sink = Tensor::empty({sms}, DType::I32, Device::CUDA);
  Tensor counter = Tensor::empty({2}, DType::I32, Device::CUDA);
  struct V {
    bool barrier, prefetch, producer;
    int every, slots;
    bool flag = false;
  };
  for (const V v : {V{false, true, false, 1, 6}, V{true, true, false, 1, 6}, V{true, false, false, 1, 6},
                    V{true, true, false, 2, 6}, V{false, true, true, 1, 6}, V{true, true, true, 1, 6},
                    V{true, true, true, 1, 1}, V{true, true, true, 4, 3},
                    V{true, true, true, 1, 6, true}, V{true, true, true, 3, 2, true}}) {
    cuda::PersistentProbeArgs a;
    a.weights = w.raw();
    std::memcpy(a.phase_bytes, phase, sizeof(phase));
    a.phases = 4;
    a.layers = layers;
    a.barrier = v.barrier;
    a.prefetch = v.prefetch;
    a.producer_warp = v.producer;
    a.barrier_every = v.every;
    a.slots = v.slots;
    a.flag_barrier = v.flag;
    a.counter = static_cast<unsigned*>(counter.raw());
    a.sink = static_cast<uint32_t*>(sink.raw());
    cuda::persistent_probe(a, nullptr);
    OPD_CUDA_CHECK(cudaDeviceSynchronize());
    const Tensor sh = sink.to(Device::CPU);
    uint32_t got = 0;
    for (int c = 0; c < sms; ++c) got += static_cast<uint32_t>(sh.data<int32_t>()[c]);
    EXPECT_EQ(got, want) << "barrier " << v.barrier << " prefetch " << v.prefetch << " producer "
                         << v.producer << " every " << v.every << " slots " << v.slots << " flag " << v.flag;
    if (v.barrier) {  // every CTA arrived at every barrier
      const int barriers = (layers * 4 + v.every - 1) / v.every;
      EXPECT_EQ(counter.to(Device::CPU).data<int32_t>()[0], barriers * sms);
    }
  }
}

}  // namespace
}  // namespace opd::test
