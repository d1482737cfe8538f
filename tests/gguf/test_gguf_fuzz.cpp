// Deterministic mutation fuzzing of the GGUF path (gguf.cpp reader, gguf_convert.cpp config and
// tensor mapping, gguf_vocab.cpp tokenizer rebuild): a valid tiny Llama GGUF (metadata, a byte-level
// vocabulary, f32/f16/Q8_0 tensors) mutated by byte edits and by overwriting counts, lengths, dims,
// types and offsets with edge values; every case must end in success (after which every tensor is
// dequantized and every metadata value read) or an opd::Error. Regressions hold minimized inputs.
#include <gtest/gtest.h>

#include <iostream>

#include "common/fuzz_util.h"
#include "gguf/gguf_test_util.h"
#include "model/dequant.h"
#include "model/gguf.h"
#include "model/gguf_convert.h"
#include "tokenizer/gguf_vocab.h"

namespace opd {
namespace {

using test::GgufBuilder;

constexpr int64_t kH = 32, kHeads = 2, kKv = 1, kD = 16, kI = 32;

std::string tiny_gguf() {
  GgufBuilder b;
  b.kv_str("general.architecture", "llama")
      .kv_u32("llama.block_count", 1)
      .kv_u32("llama.context_length", 64)
      .kv_u32("llama.embedding_length", kH)
      .kv_u32("llama.feed_forward_length", kI)
      .kv_u32("llama.attention.head_count", kHeads)
      .kv_u32("llama.attention.head_count_kv", kKv)
      .kv_f32("llama.rope.freq_base", 10000.0f)
      .kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  const int64_t V = static_cast<int64_t>(test::add_byte_level_vocab(b));
  b.kv_bool("tokenizer.ggml.add_bos_token", true)
      .kv_str("tokenizer.chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}");
  uint32_t seed = 1;
  auto f32 = [&](const std::string& name, std::vector<uint64_t> ne) {
    uint64_t n = 1;
    for (uint64_t d : ne) n *= d;
    std::vector<float> v(n);
    for (float& x : v) x = static_cast<float>(static_cast<int>(philox_u32(seed, 1, seed * 7919 + (&x - v.data())) % 200) - 100) / 256.0f;
    ++seed;
    b.tensor_f32(name, std::move(ne), v.data());
  };
  {  // embedding as Q8_0: [kH, V] in 32-element blocks of f16 scale + 32 int8
    std::string raw;
    for (int64_t blk = 0; blk < kH * V / 32; ++blk) {
      GgufBuilder::put<uint16_t>(raw, 0x2000);  // f16 2^-7
      for (int j = 0; j < 32; ++j) raw += static_cast<char>((blk * 31 + j * 7) % 255 - 127);
    }
    b.tensor("token_embd.weight", {uint64_t(kH), uint64_t(V)}, 8, raw);
  }
  f32("blk.0.attn_norm.weight", {kH});
  f32("blk.0.attn_q.weight", {kH, kHeads * kD});
  f32("blk.0.attn_k.weight", {kH, kKv * kD});
  f32("blk.0.attn_v.weight", {kH, kKv * kD});
  f32("blk.0.attn_output.weight", {kHeads * kD, kH});
  f32("blk.0.ffn_norm.weight", {kH});
  f32("blk.0.ffn_gate.weight", {kH, kI});
  f32("blk.0.ffn_up.weight", {kH, kI});
  f32("blk.0.ffn_down.weight", {kI, kH});
  {  // output_norm as F16 ones
    std::string raw;
    for (int64_t i = 0; i < kH; ++i) GgufBuilder::put<uint16_t>(raw, 0x3C00);
    b.tensor("output_norm.weight", {uint64_t(kH)}, 1, raw);
  }
  return b.build();
}

// Everything a consumer of the file does: read each metadata value, dequantize each tensor,
// build the config, the tokenizer files and the HF tensors.
void consume(const std::string& img, const std::string& what) {
  GgufFile g = GgufFile::from_bytes(std::make_shared<const std::string>(img), what);
  for (const auto& [k, v] : g.metadata()) {
    volatile size_t sink = k.size() + v.describe().size();
    (void)sink;
  }
  for (const GgufTensorInfo& t : g.tensors()) {
    if (t.numel() > (int64_t{1} << 22) || !dequant_supported(t.type)) continue;
    Tensor d = g.dequantize(t, DType::F32);
    double sum = 0;
    for (int64_t i = 0; i < d.numel(); ++i) sum += d.data<float>()[i];
    volatile double sink = sum;
    (void)sink;
  }
  const ModelConfig c = gguf_model_config(g);
  (void)gguf_tokenizer_files(g, c);
  (void)gguf_model_tensors(g, c, DType::F32);
}

void put_at(std::string& img, size_t pos, uint64_t v, size_t bytes) {
  if (pos + bytes <= img.size()) std::memcpy(img.data() + pos, &v, bytes);
}

TEST(GgufFuzz, RandomMutations) {
  const std::string base = tiny_gguf();
  ASSERT_NO_THROW(consume(base, "base"));
  // Header length: the tensor infos end before the first alignment padding of the data section.
  GgufFile parsed = GgufFile::from_bytes(std::make_shared<const std::string>(base), "base");
  const size_t header = static_cast<size_t>(parsed.data_offset());
  std::vector<std::string> dict;
  for (uint64_t v : {uint64_t{0}, uint64_t{1}, uint64_t{0xFFFFFFFF}, ~uint64_t{0}, uint64_t{1} << 63, uint64_t{1} << 32}) {
    dict.emplace_back(reinterpret_cast<const char*>(&v), 8);
  }
  dict.push_back("GGUF");
  const int iters = test::fuzz_iters(2500);
  int ok = 0;
  for (int c = 0; c < iters; ++c) {
    test::FuzzRng rng(0x99af0000u + static_cast<uint64_t>(c));
    std::string img = base;
    std::string log = "case " + std::to_string(c) + ": ";
    for (size_t k = 0, n = 1 + rng.below(3); k < n; ++k) {
      if (rng.chance(60)) {
        // A field-sized edge value at a random header position (hits counts, lengths, dims,
        // types, offsets; aligned positions more often since fields often are).
        const size_t pos = rng.chance(50) ? rng.below(header) / 4 * 4 : rng.below(header);
        const size_t bytes = rng.chance(50) ? 8 : 4;
        const uint64_t v = test::interesting_u64(rng, 0);
        put_at(img, pos, v, bytes);
        log += "put" + std::to_string(bytes) + "@" + std::to_string(pos) + "=" + std::to_string(v) + " ";
      } else {
        test::mutate_bytes(img, rng, dict, &log);
      }
    }
    if (test::accepts(log, [&] { consume(img, log); })) ++ok;
  }
  std::cout << "[ fuzz     ] " << iters << " GGUF images: " << ok << " converted\n";
  EXPECT_GT(ok, iters / 50);
}

// gguf_model_config's error on a one-layer tiny Llama header with `block_count` layers and the
// extra key-value pair of `extra` (key, GGUF type, raw value bytes; none when the key is empty).
std::string tiny_llama_config_error(uint32_t block_count, const std::string& key = "",
                                    uint32_t type = 0, const std::string& value = "") {
  GgufBuilder b;
  b.kv_str("general.architecture", "llama")
      .kv_u32("llama.block_count", block_count)
      .kv_u32("llama.embedding_length", 32)
      .kv_u32("llama.feed_forward_length", 32)
      .kv_u32("llama.attention.head_count", 2)
      .kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  if (!key.empty()) b.kv_raw(key, type, value);
  const std::string img = b.tensor("token_embd.weight", {32, 4}, 0, std::string(32 * 4 * 4, '\0')).build();
  GgufFile g = GgufFile::from_bytes(std::make_shared<const std::string>(img), "regression.gguf");
  return test::error_of([&] { gguf_model_config(g); });
}

TEST(GgufFuzz, Regressions) {
  // A uint64 token id past INT64_MAX was cast to a negative id that passed `id >= vocab`.
  {
    const std::string err = tiny_llama_config_error(
        1, "tokenizer.ggml.eos_token_id", 10, std::string("\xff\xff\xff\xff\xff\xff\xff\xff", 8));
    EXPECT_NE(err.find("eos_token_id = 18446744073709551615 is outside the vocabulary"), std::string::npos) << err;
  }
  // context_length as a uint64 past INT64_MAX became a negative max_position_embeddings.
  {
    const std::string err = tiny_llama_config_error(
        1, "llama.context_length", 10, std::string("\x00\x00\x00\x00\x00\x00\x00\x80", 8));
    EXPECT_NE(err.find("context_length' = 9223372036854775808 is outside [1, 2^31]"), std::string::npos) << err;
  }
  // block_count = 2^31: parameter_shapes() would list ~2*10^10 tensors before reading any.
  {
    const std::string err = tiny_llama_config_error(2147483648u);
    EXPECT_NE(err.find("block_count = 2147483648 is over opd's limit of 4096 layers"), std::string::npos) << err;
  }
  // Arrays of one-byte elements: ~100 bytes of parsed value per file byte. The header-wide
  // element limit stops a small file from allocating gigabytes.
  {
    std::string arr;
    GgufBuilder::put<uint32_t>(arr, 0);  // uint8 elements
    const uint64_t n = (uint64_t{1} << 23) + 1;
    GgufBuilder::put<uint64_t>(arr, n);
    arr.append(n, '\1');
    std::string img = GgufBuilder().kv_raw("big", 9, arr).build();
    const std::string err =
        test::error_of([&] { GgufFile::from_bytes(std::make_shared<const std::string>(img), "big.gguf"); });
    EXPECT_NE(err.find("array elements past 8388608"), std::string::npos) << err;
  }
}

}  // namespace
}  // namespace opd
