// model/weights_fingerprint.h: the same weights give the same fingerprint under any path;
// rewritten weights, a changed config.json, a changed header or a changed byte inside a sample
// change it; only config.json, the headers and the samples are read (the cost bound that keeps a
// 64 GB teacher cheap); a byte between the samples is, as documented, not seen.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/test_util.h"
#include "core/error.h"
#include "model/init.h"
#include "model/weights_fingerprint.h"

namespace opd {
namespace {

namespace fs = std::filesystem;

class WeightsFingerprintTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("opd_weights_fp_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
    save(dir("a"), 2);
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string dir(const std::string& rel) const { return (root_ / rel).string(); }
  // The tiny teacher of the training tests (hidden 48, 2 layers: ~150 KB of weights, more than
  // the 16 x 4 KiB samples) with weights drawn from `seed`.
  static void save(const std::string& d, uint64_t seed) {
    const ModelConfig c = test::tiny_demo_config(48, 2);
    save_model_dir(d, c, init_weights(c, seed, 0.1), test::source_dir() + "/demo/tokenizer");
  }
  static void flip_byte(const std::string& file, int64_t at) {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(at);
    char b = 0;
    f.read(&b, 1);
    b = static_cast<char>(b ^ 0x01);
    f.seekp(at);
    f.write(&b, 1);
  }
  static int64_t data_start(const std::string& file) {
    std::ifstream f(file, std::ios::binary);
    unsigned char len[8];
    f.read(reinterpret_cast<char*>(len), 8);
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len[i]) << (8 * i);
    return 8 + static_cast<int64_t>(n);
  }
  fs::path root_;
};

TEST_F(WeightsFingerprintTest, SameWeightsGiveTheSameFingerprintUnderAnyPath) {
  const WeightsFingerprint a = weights_fingerprint(dir("a"));
  EXPECT_EQ(a.sha256.size(), 64u);
  EXPECT_EQ(a.files, 1);
  EXPECT_EQ(a.total_bytes, static_cast<int64_t>(fs::file_size(dir("a") + "/model.safetensors")));
  EXPECT_EQ(weights_fingerprint(dir("a")).sha256, a.sha256);
  fs::copy(dir("a"), dir("copy"), fs::copy_options::recursive);
  EXPECT_EQ(weights_fingerprint(dir("copy")).sha256, a.sha256);
}

TEST_F(WeightsFingerprintTest, RewrittenWeightsConfigOrSampledBytesChangeIt) {
  const std::string before = weights_fingerprint(dir("a")).sha256;
  fs::copy(dir("a"), dir("b"), fs::copy_options::recursive);
  save(dir("b"), 7);  // retrained: same names, shapes and sizes, other values
  EXPECT_NE(weights_fingerprint(dir("b")).sha256, before);

  fs::copy(dir("a"), dir("c"), fs::copy_options::recursive);
  std::ofstream(dir("c") + "/config.json", std::ios::app) << " ";
  EXPECT_NE(weights_fingerprint(dir("c")).sha256, before);

  fs::copy(dir("a"), dir("d"), fs::copy_options::recursive);
  const std::string st = dir("d") + "/model.safetensors";
  flip_byte(st, data_start(st) + 100);  // inside the first sample
  EXPECT_NE(weights_fingerprint(dir("d")).sha256, before);

  fs::copy(dir("a"), dir("e"), fs::copy_options::recursive);
  const std::string se = dir("e") + "/model.safetensors";
  const int64_t size = static_cast<int64_t>(fs::file_size(se));
  flip_byte(se, size - 1);  // inside the last sample
  EXPECT_NE(weights_fingerprint(dir("e")).sha256, before);

  fs::copy(dir("a"), dir("f"), fs::copy_options::recursive);
  fs::copy_file(dir("a") + "/model.safetensors", dir("f") + "/extra.safetensors");
  EXPECT_NE(weights_fingerprint(dir("f")).sha256, before);  // another file
}

// The cost bound: config.json, each header and 16 x 4 KiB, never the whole file; so a byte
// between two samples is not seen (the documented limit: a hand edit of one weight).
TEST_F(WeightsFingerprintTest, ReadsOnlyConfigHeadersAndSamples) {
  const std::string st = dir("a") + "/model.safetensors";
  const int64_t size = static_cast<int64_t>(fs::file_size(st));
  const int64_t data0 = data_start(st), data_len = size - data0;
  ASSERT_GT(data_len, 2 * WeightsFingerprint::kSamples * WeightsFingerprint::kSampleBytes)
      << "the test model must be larger than the samples";
  const WeightsFingerprint a = weights_fingerprint(dir("a"));
  EXPECT_EQ(a.bytes_read, static_cast<int64_t>(fs::file_size(dir("a") + "/config.json")) + data0 +
                              WeightsFingerprint::kSamples * WeightsFingerprint::kSampleBytes);
  // The middle of the gap between the first two samples.
  const int64_t gap = (data_len - WeightsFingerprint::kSampleBytes) / (WeightsFingerprint::kSamples - 1);
  flip_byte(st, data0 + WeightsFingerprint::kSampleBytes + (gap - WeightsFingerprint::kSampleBytes) / 2);
  EXPECT_EQ(weights_fingerprint(dir("a")).sha256, a.sha256);
}

TEST_F(WeightsFingerprintTest, UnreadableDirectoriesAndBrokenFilesAreNamedErrors) {
  EXPECT_THROW(weights_fingerprint(dir("missing")), Error);
  std::ofstream(dir("a") + "/broken.safetensors") << "\xff\xff\xff\xff\xff\xff\xff\x7f{}";
  try {
    weights_fingerprint(dir("a"));
    ADD_FAILURE() << "a header length past the file was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("broken.safetensors: header length"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace opd
