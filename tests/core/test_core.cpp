// core/: Tensor views and copies, dtype conversions (bit-exact against IEEE rules and
// PyTorch's rounding), SHA-256 test vectors, the thread pool, and error messages.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/test_util.h"
#include "core/dtype.h"
#include "core/env_choice.h"
#include "core/error.h"
#include "core/sha256.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace opd {
namespace {

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::F16), 2u);
  EXPECT_EQ(dtype_size(DType::I32), 4u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  EXPECT_EQ(dtype_name(DType::BF16), "bf16");
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(float_to_bf16(bits_to_float(0x3f808000u)), 0x3f80);
  // 1.0078125 + half ulp ties to even upward (0x3f82).
  EXPECT_EQ(float_to_bf16(bits_to_float(0x3f818000u)), 0x3f82);
  EXPECT_EQ(float_to_bf16(bits_to_float(0x3f808001u)), 0x3f81);  // above halfway
  EXPECT_EQ(float_to_bf16(-2.5f), 0xc020);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(bf16_to_float(0x4049), 3.140625f);
}

TEST(DType, F16RoundTripsEveryValue) {
  // Every finite f16 converts to float and back to the same bits.
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu)) continue;  // NaN payloads
    float f = f16_to_float(static_cast<uint16_t>(h));
    ASSERT_EQ(float_to_f16(f), h) << std::hex << h;
  }
  EXPECT_EQ(f16_to_float(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_float(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);  // rounds to inf
  EXPECT_EQ(float_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_EQ(float_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie to even, up
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // half the smallest subnormal: even
  EXPECT_EQ(float_to_f16(std::ldexp(3.0f, -26)), 0x0001);
}

TEST(Tensor, EmptyZerosShapesAndViews) {
  Tensor t = Tensor::zeros({2, 3, 4}, DType::F32);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 96u);
  EXPECT_EQ(t.dim(-1), 4);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(i);
  Tensor r = t.reshape({6, -1});
  EXPECT_EQ(r.shape(), (Shape{6, 4}));
  Tensor s = t.slice_rows(1, 2);
  EXPECT_EQ(s.shape(), (Shape{1, 3, 4}));
  EXPECT_EQ(s.data<float>()[0], 12.0f);
  s.data<float>()[0] = -1;  // a view shares storage
  EXPECT_EQ(t.data<float>()[12], -1.0f);
  Tensor c = t.clone();
  c.data<float>()[0] = 42;
  EXPECT_EQ(t.data<float>()[0], 0.0f);
  EXPECT_EQ(t.describe(), "f32[2, 3, 4] cpu");
}

TEST(Tensor, MisuseIsAnErrorNotACrash) {
  Tensor t = Tensor::zeros({2, 3}, DType::F32);
  EXPECT_THROW(t.reshape({4, 2}), Error);
  EXPECT_THROW(t.reshape({-1, -1}), Error);
  EXPECT_THROW(t.slice_rows(1, 3), Error);
  EXPECT_THROW(t.dim(2), Error);
  EXPECT_THROW(t.data<int32_t>(), Error);
  EXPECT_THROW(Tensor().raw(), Error);
  EXPECT_THROW(Tensor::empty({-1}, DType::F32), Error);
  Tensor u = Tensor::zeros({3, 2}, DType::F32);
  EXPECT_THROW(t.copy_from(u), Error);
  try {
    t.reshape({5});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("[2, 3]"), std::string::npos) << e.what();
  }
}

TEST(Tensor, DtypeConversionMatchesScalarConversions) {
  Tensor t = test::random_uniform({257}, DType::F32, 3, -100, 100);
  Tensor b = t.to_dtype(DType::BF16);
  Tensor h = t.to_dtype(DType::F16);
  for (int64_t i = 0; i < t.numel(); ++i) {
    float v = t.data<float>()[i];
    EXPECT_EQ(static_cast<const uint16_t*>(b.raw())[i], float_to_bf16(v));
    EXPECT_EQ(static_cast<const uint16_t*>(h.raw())[i], float_to_f16(v));
  }
  Tensor back = b.to_dtype(DType::F32);
  EXPECT_TRUE(test::close(back, t, 8e-3, 0));
}

TEST(Tensor, PoisonIsNaN) {
  Tensor p = Tensor::poisoned({5}, DType::F32);
  for (int64_t i = 0; i < 5; ++i) EXPECT_TRUE(std::isnan(p.data<float>()[i]));
  EXPECT_FALSE(test::close(p, Tensor::zeros({5}, DType::F32), 1, 1));  // NaN never passes
}

TEST(Tensor, CudaWithoutDeviceIsAClearError) {
  if (device_hooks::cuda_compiled()) GTEST_SKIP() << "CUDA build: covered by the cuda suite";
  try {
    Tensor::empty({4}, DType::F32, Device::CUDA);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Unsupported);
  }
}

TEST(Sha256, Fips180Vectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  Sha256 h;  // one million 'a', fed in uneven pieces
  std::string chunk(997, 'a');
  size_t left = 1000000;
  while (left) {
    size_t n = std::min(left, chunk.size());
    h.update(chunk.data(), n);
    left -= n;
  }
  EXPECT_EQ(h.hex_digest(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(ThreadPool, EveryIndexOnceAndExceptionsPropagate) {
  const int64_t n = 10007;
  std::vector<std::atomic<int>> hits(n);
  parallel_for(n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) hits[i]++;
  });
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << i;
  EXPECT_THROW(parallel_for(100, [](int64_t b, int64_t) {
                 if (b == 0) OPD_FAIL(Internal, "boom");
               }),
               Error);
  // Nested use runs inline rather than deadlocking.
  std::atomic<int64_t> total{0};
  parallel_for(8, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      parallel_for(10, [&](int64_t b2, int64_t e2) { total += e2 - b2; });
  });
  EXPECT_EQ(total.load(), 80);
}

TEST(Error, CheckMacroNamesTheCondition) {
  try {
    int limit = 3, value = 7;
    OPD_CHECK(value < limit, InvalidData, "value ", value, " over limit ", limit);
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("value 7 over limit 3"), std::string::npos) << m;
    EXPECT_NE(m.find("value < limit"), std::string::npos) << m;
    EXPECT_EQ(e.kind(), ErrorKind::InvalidData);
  }
}

// A NUL quoted from input (a tensor or field name) no longer cuts what() short.
TEST(Error, NulBytesInAMessageAreWrittenOut) {
  try {
    OPD_FAIL(InvalidData, "field 'hidden_act' is '", std::string("si\0lu", 5), "', not supported");
    FAIL();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("field 'hidden_act' is 'si\\0lu', not supported"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace opd

namespace opd {
namespace {

TEST(MemoryStats, TracksLiveAndPeakHostBytes) {
  reset_peak_memory(Device::CPU);
  const int64_t base = memory_stats(Device::CPU).in_use;
  {
    Tensor a = Tensor::empty({1000}, DType::F32);
    Tensor b = Tensor::empty({500}, DType::F64);
    EXPECT_EQ(memory_stats(Device::CPU).in_use - base, 8000);
  }
  EXPECT_EQ(memory_stats(Device::CPU).in_use, base);
  EXPECT_EQ(memory_stats(Device::CPU).peak - base, 8000);
  reset_peak_memory(Device::CPU);
  EXPECT_EQ(memory_stats(Device::CPU).peak, base);
}

}  // namespace
// EnvChoice: the environment's value read on first use, the fallback when unset or empty, a
// setter that wins, and an unknown value refused with the variable, the value and the names.
TEST(EnvChoice, ReadsOnceFallsBackAndNamesBadValues) {
  const char* var = "OPD_TEST_ENV_CHOICE";
  ::unsetenv(var);
  EnvChoice c(var, {{"a", 0}, {"b", 1}, {"c", 2}}, 1);
  EXPECT_EQ(c.get(), 1);
  ::setenv(var, "c", 1);
  EXPECT_EQ(c.get(), 1) << "read once";
  c.reset();
  EXPECT_EQ(c.get(), 2);
  c.set(0);
  EXPECT_EQ(c.get(), 0);
  ::setenv(var, "", 1);
  c.reset();
  EXPECT_EQ(c.get(), 1) << "empty = unset";
  ::setenv(var, "d", 1);
  c.reset();
  try {
    c.get();
    ADD_FAILURE() << "no error for an unknown value";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("OPD_TEST_ENV_CHOICE=d is not one of a, b, c"), std::string::npos)
        << e.what();
  }
  c.set(2);  // a setter recovers from a bad environment value
  EXPECT_EQ(c.get(), 2);
  ::unsetenv(var);
}

}  // namespace opd
