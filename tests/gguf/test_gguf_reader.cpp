// GGUF reader and dequantization: the committed fixture (every metadata value type, alignment 64,
// one tensor of random blocks per supported type) against the float32 reference of
// tools/make_dequant_fixtures.py (itself checked against gguf.quants); then a mutation test on a
// synthetic file: every truncation, targeted corruptions (bad magic, versions, counts, lengths,
// types, dims, offsets) with the error text they must give, and seeded random byte flips, which
// must each parse or throw opd::Error, never crash (the _asan build runs the same).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/test_util.h"
#include "core/error.h"
#include "gguf/gguf_test_util.h"
#include "model/dequant.h"
#include "model/gguf.h"
#include "model/safetensors.h"

namespace opd {
namespace {

using test::GgufBuilder;

std::string error_of(const std::string& bytes) {
  try {
    GgufFile::from_bytes(std::make_shared<const std::string>(bytes), "mutant.gguf");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(GgufReader, FixtureHeaderAndEveryValueType) {
  const GgufFile f = GgufFile::open(test::fixture_path("gguf/dequant.gguf"));
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.data_offset() % 64, 0u);
  EXPECT_EQ(f.get_string("general.architecture"), "test");
  EXPECT_EQ(f.find("test.u8")->u, 200u);
  EXPECT_EQ(f.find("test.i8")->i, -100);
  EXPECT_EQ(f.find("test.u16")->u, 60000u);
  EXPECT_EQ(f.find("test.i16")->i, -30000);
  EXPECT_EQ(f.get_uint("test.u32"), 4000000000u);
  EXPECT_EQ(f.find("test.i32")->i, -2000000000);
  EXPECT_EQ(f.get_float("test.f32"), 0.25);
  EXPECT_TRUE(f.get_bool("test.bool", false));
  EXPECT_EQ(f.get_string("test.string"), "h\xc3\xa9llo");
  EXPECT_EQ(f.get_uint("test.u64"), (uint64_t{1} << 63) + 5);
  EXPECT_EQ(f.find("test.i64")->i, -(int64_t{1} << 62));
  EXPECT_EQ(f.get_float("test.f64"), -1.5e300);
  EXPECT_EQ(f.get_int_array("test.array_i32"), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(f.get_string_array("test.array_str"), (std::vector<std::string>{"a", "", "\xc3\xbc"}));
  const GgufValue* nested = f.find("test.array_nested");
  ASSERT_NE(nested, nullptr);
  ASSERT_EQ(nested->array.size(), 2u);
  EXPECT_EQ(nested->array[0].array.size(), 2u);
  EXPECT_EQ(nested->array[0].array[1].u, 8u);
  EXPECT_TRUE(nested->array[1].array.empty());
  EXPECT_EQ(f.metadata().size(), 17u);
  EXPECT_EQ(f.metadata()[0].first, "general.architecture");  // file order kept
  // Typed accessors name the key and both types on a mismatch.
  try {
    f.get_string("test.u32");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'test.u32' is uint32 4000000000, expected a string"),
              std::string::npos) << e.what();
  }
  EXPECT_THROW(f.get_uint("test.i8"), Error);  // negative
  EXPECT_THROW(f.get_uint("absent.key"), Error);
  EXPECT_EQ(f.get_uint("absent.key", 7), 7u);

  ASSERT_EQ(f.tensors().size(), 9u);
  const GgufTensorInfo& q4k = f.tensor("t_q4_k");
  EXPECT_EQ(q4k.type, GgmlType::Q4_K);
  EXPECT_EQ(q4k.ne, (std::vector<int64_t>{512, 3}));
  EXPECT_EQ(q4k.shape(), (Shape{3, 512}));
  EXPECT_EQ(q4k.nbytes, 6u * 144u);
  for (const GgufTensorInfo& t : f.tensors()) EXPECT_EQ(t.offset % 64, 0u) << t.name;
}

// Every supported type against the reference, as f32 and as bf16 output.
TEST(GgufReader, DequantizeEveryTypeMatchesReference) {
  const GgufFile f = GgufFile::open(test::fixture_path("gguf/dequant.gguf"));
  const SafetensorsFile ref = SafetensorsFile::open(test::fixture_path("gguf/dequant_expected.safetensors"));
  int checked = 0;
  for (const GgufTensorInfo& info : f.tensors()) {
    SCOPED_TRACE(info.name);
    ASSERT_TRUE(dequant_supported(info.type));
    const Tensor want = ref.get(info.name);
    // Same float32 operations in the same order as the reference: equal up to rounding noise.
    const Tensor got = f.dequantize(info, DType::F32);
    EXPECT_TRUE(test::close(got, want, 1e-6, 1e-9, 1e-6));
    double sq = 0;
    for (int64_t i = 0; i < want.numel(); ++i) sq += test::element(want, i) * test::element(want, i);
    EXPECT_GT(sq, 0.0);  // not a trivially zero block
    const Tensor got_bf16 = f.dequantize(info, DType::BF16);
    EXPECT_EQ(got_bf16.dtype(), DType::BF16);
    EXPECT_TRUE(test::close(got_bf16.to_dtype(DType::F32), want, 8e-3, 1e-6, 8e-3));
    ++checked;
  }
  EXPECT_EQ(checked, 9);
}

TEST(GgufReader, DequantizeRejectsWrongSizesAndUnsupportedTypes) {
  std::vector<uint8_t> src(34, 0);
  std::vector<float> out(33);
  EXPECT_THROW(dequantize_blocks(GgmlType::Q8_0, src, out), Error);  // not whole blocks
  out.resize(64);
  EXPECT_THROW(dequantize_blocks(GgmlType::Q8_0, src, out), Error);  // too few bytes
  std::vector<uint8_t> q5(22, 0);
  std::vector<float> o5(32);
  try {
    dequantize_blocks(GgmlType::Q5_0, q5, o5);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Unsupported);
    EXPECT_NE(std::string(e.what()).find("Q5_0"), std::string::npos);
  }
}

// A small valid file: metadata of several types (nested array included), a Q8_0 and an F32
// tensor, alignment 32.
std::string valid_file() {
  std::vector<float> w(2 * 8);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.25f * static_cast<float>(i) - 1.0f;
  std::string q8;
  GgufBuilder::put<uint16_t>(q8, 0x2c00);  // d = 0.0625 (f16)
  for (int i = 0; i < 32; ++i) q8 += static_cast<char>(i * 7 - 100);
  GgufBuilder b;
  b.kv_str("general.architecture", "llama")
      .kv_u32("general.alignment", 32)
      .kv_f32("x.f", 1.5f)
      .kv_bool("x.b", true)
      .kv_str_array("x.tokens", {"a", "bc", ""})
      .kv_i32_array("x.types", {1, 3, -4});
  std::string nested;
  GgufBuilder::put<uint32_t>(nested, 9);  // array of arrays
  GgufBuilder::put<uint64_t>(nested, 1);
  GgufBuilder::put<uint32_t>(nested, 0);  // of u8
  GgufBuilder::put<uint64_t>(nested, 2);
  nested += "\x05\x06";
  b.kv_raw("x.nested", 9, nested);
  b.tensor("q", {32, 1}, 8, q8).tensor_f32("w", {8, 2}, w.data());
  return b.build();
}

TEST(GgufMutation, ValidFileParsesAndEveryTruncationFails) {
  const std::string good = valid_file();
  const GgufFile f = GgufFile::from_bytes(std::make_shared<const std::string>(good), "good.gguf");
  ASSERT_EQ(f.tensors().size(), 2u);
  const Tensor q = f.dequantize(f.tensor("q"));
  EXPECT_FLOAT_EQ(q.data<float>()[0], -100 * 0.0625f);
  EXPECT_FLOAT_EQ(q.data<float>()[31], (31 * 7 - 100) * 0.0625f);
  const Tensor w = f.dequantize(f.tensor("w"));
  EXPECT_EQ(w.shape(), (Shape{2, 8}));
  EXPECT_FLOAT_EQ(w.data<float>()[15], 0.25f * 15 - 1.0f);
  // The last tensor ends at the end of the file, so every strict prefix is invalid.
  for (size_t n = 0; n < good.size(); ++n) {
    const std::string err = error_of(good.substr(0, n));
    ASSERT_FALSE(err.empty()) << "prefix of " << n << " bytes parsed";
  }
  // Truncation inside the header names the field, the value and the bytes left.
  const std::string err = error_of(good.substr(0, 30));
  EXPECT_NE(err.find("header.metadata_kv_count = 7 cannot fit"), std::string::npos) << err;
  EXPECT_NE(err.find("file size 30"), std::string::npos) << err;
  const std::string err2 = error_of(good.substr(0, good.size() - 150));
  EXPECT_NE(err2.find("file size " + std::to_string(good.size() - 150)), std::string::npos) << err2;
}

struct Corruption {
  const char* what;
  std::string bytes;
  const char* expect;  // substring of the error
};

std::string patch(std::string s, size_t at, const std::string& bytes) {
  s.replace(at, bytes.size(), bytes);
  return s;
}
template <typename T>
std::string le(T v) {
  std::string s;
  GgufBuilder::put(s, v);
  return s;
}

TEST(GgufMutation, TargetedCorruptionsGiveNamedErrors) {
  const std::string good = valid_file();
  std::vector<float> one(32, 1.0f);
  std::vector<Corruption> cases = {
      {"bad magic", patch(good, 0, "GGUG"), "bad magic 47 47 55 47"},
      {"version 1", patch(good, 4, le<uint32_t>(1)), "version 1"},
      {"version 4", patch(good, 4, le<uint32_t>(4)), "header.version = 4"},
      {"big endian", patch(good, 4, le<uint32_t>(0x03000000)), "big-endian"},
      {"tensor count", patch(good, 8, le<uint64_t>(uint64_t{1} << 60)), "header.tensor_count = 1152921504606846976 cannot fit"},
      {"kv count", patch(good, 16, le<uint64_t>(1000000)), "header.metadata_kv_count = 1000000 cannot fit"},
      {"key length", patch(good, 24, le<uint64_t>(uint64_t{1} << 40)), "metadata[0].key length 1099511627776"},
      {"value type", patch(good, 32 + 20, le<uint32_t>(13)), "value type 13"},
      {"empty", std::string(), "too short"},
  };
  // Corruptions of fields after the metadata are built with the builder.
  cases.push_back({"unknown ggml type", GgufBuilder().tensor_f32("w", {32}, one.data()).build(), ""});
  {
    std::string s = GgufBuilder().tensor("w", {32}, 77, std::string(128, '\0')).build();
    cases.push_back({"unknown ggml type 77", s, "ggml type 77, which is unknown"});
    cases.push_back({"row not whole blocks", GgufBuilder().tensor("q", {31}, 8, std::string(34, '\0')).build(),
                     "ne[0] = 31 is not a multiple of the Q8_0 block size 32"});
    cases.push_back({"five dims", GgufBuilder().tensor("w", {1, 1, 1, 1, 1}, 0, std::string(4, '\0')).build(),
                     "n_dims = 5"});
    cases.push_back({"zero dim", GgufBuilder().tensor("w", {0}, 0, "").build(), "ne[0] = 0"});
    cases.push_back({"numel overflow",
                     GgufBuilder().tensor("w", {uint64_t{1} << 40, uint64_t{1} << 40}, 0, "").build(),
                     "element count overflows"});
    cases.push_back({"duplicate tensor",
                     GgufBuilder().tensor_f32("w", {32}, one.data()).tensor_f32("w", {32}, one.data()).build(),
                     "appears twice"});
    cases.push_back({"duplicate key", GgufBuilder().kv_u32("a", 1).kv_u32("a", 2).build(), "appears twice"});
    cases.push_back({"alignment not power of two", GgufBuilder().kv_u32("general.alignment", 24).build(),
                     "general.alignment = 24 is not a power of two"});
    cases.push_back({"alignment wrong type", GgufBuilder().kv_i32("general.alignment", 32).build(),
                     "the spec says uint32"});
    cases.push_back({"bool value 2", GgufBuilder().kv_raw("b", 7, "\x02").build(), "byte value 2"});
    // Data shorter than the tensor: drop the last 4 bytes of an F32 tensor.
    std::string full = GgufBuilder().tensor_f32("w", {32}, one.data()).build();
    cases.push_back({"tensor past end", full.substr(0, full.size() - 4), "ends past the data section"});
    // Offset patched to a misaligned / far value.
    // magic, version, counts, then name length, "w", n_dims, ne[0], type: the offset follows.
    const size_t off_at = 4 + 4 + 8 + 8 + 8 + 1 + 4 + 8 + 4;
    ASSERT_EQ(full.size(), 64u + 128u) << "layout assumption of this test";
    cases.push_back({"misaligned offset", patch(full, off_at, le<uint64_t>(4)), "not a multiple of the alignment 32"});
    cases.push_back({"offset past end", patch(full, off_at, le<uint64_t>(uint64_t{1} << 50)), "ends past the data section"});
    std::string two = GgufBuilder().tensor_f32("a", {32}, one.data()).tensor_f32("b", {32}, one.data()).build();
    // Second tensor's offset (128) -> 96: overlaps the first.
    const size_t second_off = 4 + 4 + 8 + 8 + (8 + 1 + 4 + 8 + 4 + 8) + (8 + 1 + 4 + 8 + 4);
    cases.push_back({"overlap", patch(two, second_off, le<uint64_t>(96)), "overlap"});
    std::string arr;
    GgufBuilder::put<uint32_t>(arr, 8);
    GgufBuilder::put<uint64_t>(arr, uint64_t{1} << 61);
    cases.push_back({"array length", GgufBuilder().kv_raw("x", 9, arr).build(), "array length = 2305843009213693952 cannot fit"});
    std::string deep;
    for (int i = 0; i < 10; ++i) {
      GgufBuilder::put<uint32_t>(deep, 9);
      GgufBuilder::put<uint64_t>(deep, 1);
    }
    cases.push_back({"deep nesting", GgufBuilder().kv_raw("x", 9, deep).build(), "deeper than 8"});
  }
  for (const Corruption& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string err = error_of(c.bytes);
    if (std::string(c.what) == "unknown ggml type") {
      EXPECT_TRUE(err.empty()) << "control case must parse: " << err;
      continue;
    }
    ASSERT_FALSE(err.empty()) << "parsed without error";
    EXPECT_NE(err.find(c.expect), std::string::npos) << err;
    EXPECT_NE(err.find("mutant.gguf"), std::string::npos) << "error must name the file: " << err;
  }
}

TEST(GgufMutation, RandomByteFlipsNeverCrash) {
  const std::string good = valid_file();
  std::mt19937_64 rng(1234);
  int parsed = 0, rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string m = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) m[rng() % m.size()] = static_cast<char>(rng() & 0xff);
    if (trial % 5 == 0) m.resize(rng() % (m.size() + 1));
    try {
      GgufFile f = GgufFile::from_bytes(std::make_shared<const std::string>(m), "mutant.gguf");
      for (const GgufTensorInfo& t : f.tensors())
        if (dequant_supported(t.type)) (void)f.dequantize(t);
      ++parsed;
    } catch (const Error&) {
      ++rejected;
    }
  }
  std::printf("[ mutation ] 3000 mutants: %d parsed, %d rejected with opd::Error\n", parsed, rejected);
  EXPECT_GT(rejected, 0);
  EXPECT_GT(parsed, 0);  // flips in tensor data or string bytes are still valid files
}

}  // namespace
}  // namespace opd
