// Deterministic mutation fuzzing of the safetensors reader: valid images (the reference
// writer's file, a transformers shard, our writer's file) mutated at random (byte flips and
// digit edits in the header, structured edits of shapes/offsets/dtypes, junk JSON, random or
// huge header lengths, truncation). Every case must end in a valid load, after which every
// tensor's bytes are read in full through its dtype (so ASan/UBSan see any out-of-bounds or
// misaligned view), or in an opd::Error; never a crash and never another exception type.
#include <gtest/gtest.h>

#include <cctype>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>

#include "common/fuzz_util.h"
#include "common/test_util.h"
#include "core/philox.h"
#include "common/python_oracle.h"
#include "model/safetensors.h"

namespace opd {
namespace {

using nlohmann::json;

// Cheap enough to run in full under ASan+UBSan too (about 3 s there, 1 s without).
constexpr int kRandomCases = 6000;

// The shared fuzz source on this test's own Philox stream.
struct Rng : test::FuzzRng {
  explicit Rng(uint64_t seed) : FuzzRng(seed, 0x5afe) {}
};

uint64_t header_len(const std::string& img) {
  uint64_t n = 0;
  if (img.size() >= 8) std::memcpy(&n, img.data(), 8);
  return n;
}
void set_header_len(std::string& img, uint64_t n) {
  if (img.size() >= 8) std::memcpy(img.data(), &n, 8);
}
// Header bytes actually present (the length field may lie).
size_t header_span(const std::string& img) {
  if (img.size() < 8) return 0;
  return static_cast<size_t>(std::min<uint64_t>(header_len(img), img.size() - 8));
}

// Inserts `text` into the header at `pos` (relative to the header) and, usually, fixes the
// length field so the JSON stays framed and the mutation reaches the validator.
void insert_in_header(std::string& img, size_t pos, const std::string& text, bool fix_length) {
  if (img.size() < 8) return;
  img.insert(8 + pos, text);
  if (fix_length) set_header_len(img, header_len(img) + text.size());
}

const char* kJunk[] = {
    ",", "{", "}", "[", "]", ":", "\"", "null", "-1", "0", "1e400", "-0", "2.5",
    "18446744073709551616", "18446744073709551615", "9223372036854775808", "\"\\ud800\"",
    "\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},",
    "\"y\":{\"dtype\":\"I64\",\"shape\":[0],\"data_offsets\":[0,0]},",
    "\"__metadata__\":{\"a\":1},", "\"__metadata__\":null,", "\"__metadata__\":{\"k\":\"v\"},",
    "\"z\":[],", "\"z\":{},", "\"z\":{\"dtype\":\"BOOL\",\"shape\":[1],\"data_offsets\":[0,1]},",
    "[[[[[[[[[[[[[[[[", "\xff\xfe", "\t\n ", "true", "\"data_offsets\":[0,0]"};

const char* kDtypes[] = {"F32", "F64", "BF16", "F16", "I32", "I64", "U8", "BOOL", "F8_E4M3", "f32", ""};

// Edits the parsed header of a valid image: a tensor's shape, offsets or dtype, or metadata;
// the result is re-serialized and framed correctly, so only the validator can catch it.
bool structured_mutation(std::string& img, Rng& rng, std::string* what) {
  if (img.size() < 8) return false;
  json h;
  try {
    h = json::parse(img.substr(8, header_span(img)));
  } catch (const json::exception&) {
    return false;
  }
  if (!h.is_object() || h.empty()) return false;
  auto it = h.begin();
  std::advance(it, static_cast<long>(rng.below(h.size())));
  json& e = it.value();
  if (it.key() == "__metadata__" || !e.is_object()) {
    e = rng.chance(50) ? json(42) : json::object({{"k", json::array()}});
    *what = "metadata";
  } else {
    switch (rng.below(12)) {
      case 0:
        if (e["shape"].is_array() && !e["shape"].empty()) {
          e["shape"][rng.below(e["shape"].size())] = test::interesting_u64(rng, 2);
        } else {
          e["shape"] = json::array({test::interesting_u64(rng, 1)});
        }
        *what = "shape dim";
        break;
      case 1:
        if (!e["shape"].is_array()) e["shape"] = json::array();
        e["shape"].push_back(test::interesting_u64(rng, 1));
        *what = "shape rank";
        break;
      case 2: {
        int k = static_cast<int>(rng.below(2));
        if (!e["data_offsets"].is_array() || e["data_offsets"].size() != 2) {
          e["data_offsets"] = json::array({0, 0});
        }
        uint64_t v = e["data_offsets"][k].is_number_unsigned() ? e["data_offsets"][k].get<uint64_t>() : 0;
        e["data_offsets"][k] = test::interesting_u64(rng, v);
        *what = "offset";
        break;
      }
      case 3:
        e["dtype"] = rng.chance(90) ? json(kDtypes[rng.below(std::size(kDtypes))]) : json(7);
        *what = "dtype";
        break;
      case 4: e.erase(rng.chance(50) ? "shape" : "data_offsets"); *what = "erase field"; break;
      case 5: e["shape"] = json::array(); *what = "scalar shape"; break;
      case 6: e["data_offsets"] = json::array({-1, 3.5}); *what = "bad offsets"; break;
      // Consistent edits: the file stays valid but is read with another dtype or shape.
      case 7: {
        static const std::map<std::string, std::string> same_size = {
            {"F32", "I32"}, {"I32", "F32"}, {"BF16", "F16"}, {"F16", "BF16"}, {"F64", "I64"}, {"I64", "F64"}};
        if (e["dtype"].is_string() && same_size.count(e["dtype"].get<std::string>())) {
          e["dtype"] = same_size.at(e["dtype"].get<std::string>());
        }
        *what = "same-size dtype";
        break;
      }
      case 8: {
        uint64_t numel = 1;
        if (e["shape"].is_array()) {
          for (const auto& d : e["shape"]) numel *= d.is_number_unsigned() ? d.get<uint64_t>() : 1;
        }
        e["shape"] = rng.chance(50) ? json::array({numel}) : json::array({uint64_t{1}, numel, uint64_t{1}});
        *what = "reshape";
        break;
      }
      case 9: {  // move the tensor: same span, different place
        if (!e["data_offsets"].is_array() || e["data_offsets"].size() != 2) break;
        for (int k = 0; k < 2; ++k) {
          if (!e["data_offsets"][k].is_number_unsigned()) return false;
        }
        const uint64_t shift = rng.chance(70) ? 1 + rng.below(16) : test::interesting_u64(rng, 8);
        const bool up = rng.chance(50);
        for (int k = 0; k < 2; ++k) {
          uint64_t v = e["data_offsets"][k].get<uint64_t>();
          e["data_offsets"][k] = up ? v + shift : v - shift;
        }
        *what = "shift";
        break;
      }
      case 10:
        e = rng.chance(50) ? json("F32") : json::array({1, 2});
        *what = "entry not object";
        break;
      default: {
        json moved = e;
        std::string name = it.key() + (rng.chance(50) ? "_renamed" : "");
        h.erase(it);
        h[name + "\u00e9"] = std::move(moved);
        *what = "rename";
        break;
      }
    }
  }
  std::string text = h.dump();
  text.append(rng.below(9), ' ');
  img = img.substr(0, 8) + text + img.substr(8 + header_span(img));
  set_header_len(img, text.size());
  return true;
}

std::string mutate(const std::string& base, Rng& rng, std::string* log) {
  std::string img = base;
  const int rounds = rng.chance(60) ? 1 : 2 + static_cast<int>(rng.below(2));
  for (int r = 0; r < rounds; ++r) {
    const size_t span = header_span(img);
    std::string what;
    switch (rng.below(9)) {
      case 0:  // random header byte
        if (span) img[8 + rng.below(span)] = static_cast<char>(rng.next());
        what = "byte";
        break;
      case 1: {  // change or add a digit in a number
        std::vector<size_t> digits;
        for (size_t i = 0; i < span; ++i) {
          if (std::isdigit(static_cast<unsigned char>(img[8 + i]))) digits.push_back(i);
        }
        if (digits.empty()) break;
        size_t pos = digits[rng.below(digits.size())];
        if (rng.chance(60)) {
          img[8 + pos] = static_cast<char>('0' + rng.below(10));
        } else {
          insert_in_header(img, pos, std::string(1 + rng.below(20), static_cast<char>('0' + rng.below(10))),
                           rng.chance(85));
        }
        what = "digit";
        break;
      }
      case 2:  // truncate the image anywhere
        img.resize(rng.below(img.size() + 1));
        what = "truncate";
        break;
      case 3: {  // lie in the length field
        uint64_t n = header_len(img);
        set_header_len(img, rng.chance(50) ? test::interesting_u64(rng, n) : n + rng.below(17) - 8);
        what = "length";
        break;
      }
      case 4:  // junk JSON
        insert_in_header(img, rng.below(span + 1), kJunk[rng.below(std::size(kJunk))], rng.chance(85));
        what = "junk";
        break;
      case 5:
      case 6:
        if (!structured_mutation(img, rng, &what)) what = "structured (skipped)";
        break;
      case 7:  // grow or shrink the data section, or replace the header by a non-object
        if (rng.chance(10) && img.size() >= 8) {
          static const char* not_objects[] = {"[]", "\"s\"", "1", "null", "[{}]"};
          std::string text = not_objects[rng.below(std::size(not_objects))];
          img = img.substr(0, 8) + text + img.substr(8 + span);
          set_header_len(img, text.size());
          what = "not an object";
          break;
        }
        if (rng.chance(50)) img.append(1 + rng.below(16), '\x5a');
        else if (img.size() > 8 + span) img.resize(img.size() - 1 - rng.below(std::min<size_t>(16, img.size() - 8 - span)));
        what = "data size";
        break;
      default:  // delete a header byte run
        if (span) {
          size_t pos = rng.below(span);
          size_t len = 1 + rng.below(std::min<size_t>(8, span - pos));
          img.erase(8 + pos, len);
          if (rng.chance(85)) set_header_len(img, header_len(img) - len);
        }
        what = "delete";
        break;
    }
    *log += what + " ";
  }
  return img;
}

enum class Outcome { Loaded, Rejected };

// Loads the image; on success reads every element of every tensor through its dtype and
// checks that each view lies inside the image (or is an aligned private copy).
// Key phrases of the reader's error messages, to see which validators the fuzzer reaches.
const char* kValidators[] = {"shorter than the 8-byte", "header length", "not valid JSON",
                             "must be a JSON object", "names tensor", "entry must be an object",
                             "entry has no", "dtype must be a string", "unknown dtype",
                             "is not supported", "shape must be", "overflows",
                             "data_offsets must be", "has begin > end", "span", "end past the data",
                             "overlap", "leave a gap", "tensors cover", "__metadata__"};

Outcome load_and_touch(const std::string& img, const std::string& log, bool via_file,
                       const test::ScratchDir& dir, std::map<std::string, int>* hits = nullptr) {
  auto bytes = std::make_shared<const std::string>(img);
  try {
    SafetensorsFile f = via_file ? [&] {
      const std::string path = dir.file("case.safetensors");
      test::write_file_bytes(path, img);
      return SafetensorsFile::open(path);
    }()
                                 : SafetensorsFile::from_bytes(bytes, "fuzz");
    for (const auto& name : f.names()) {
      Tensor t = f.get(name);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % dtype_size(t.dtype()), 0u) << log;
      if (!via_file && !t.writable()) {
        const char* lo = bytes->data();
        const char* p = static_cast<const char*>(t.raw());
        EXPECT_TRUE(p >= lo && p + t.nbytes() <= lo + bytes->size())
            << "view outside the image: " << name << " after " << log;
      }
      double sum = 0;
      for (int64_t i = 0; i < t.numel(); ++i) sum += test::element(t, i);
      volatile double sink = sum;
      (void)sink;
    }
    for (const auto& [k, v] : f.metadata()) {
      volatile size_t sink = k.size() + v.size();
      (void)sink;
    }
    return Outcome::Loaded;
  } catch (const Error& e) {
    if (hits) {
      std::string what = e.what();
      std::string key = "(other)";
      for (const char* v : kValidators) {
        if (what.find(v) != std::string::npos) {
          key = v;
          break;
        }
      }
      ++(*hits)[key];
    }
    return Outcome::Rejected;
  }
}

std::vector<std::string> base_images(const test::ScratchDir& dir) {
  std::vector<std::string> images;
  images.push_back(test::read_file_bytes(test::fixture_path("safetensors/basic.safetensors")));
  images.push_back(test::read_file_bytes(
      test::fixture_path("safetensors/sharded/model-00002-of-00003.safetensors")));
  // Our writer: mixed dtypes, odd byte counts, an empty and a scalar tensor, metadata.
  const std::string ours = dir.file("ours.safetensors");
  save_safetensors(ours,
                   {{"a", test::random_uniform({3, 3}, DType::F32, 1)},
                    {"b", test::random_uniform({3}, DType::F32, 2).to_dtype(DType::BF16)},
                    {"c", Tensor::from_vector<int64_t>({1, -2}, {2})},
                    {"d", Tensor::empty({0}, DType::F16)},
                    {"e", Tensor::from_vector<double>({0.5}, {})}},
                   {{"format", "pt"}});
  images.push_back(test::read_file_bytes(ours));
  return images;
}

TEST(SafetensorsFuzz, RandomMutations) {
  test::ScratchDir dir;
  const auto images = base_images(dir);
  for (const auto& img : images) {
    ASSERT_EQ(load_and_touch(img, "base", false, dir), Outcome::Loaded);
  }
  int loaded = 0, rejected = 0;
  std::map<std::string, int> hits;
  for (int c = 0; c < kRandomCases; ++c) {
    Rng rng(0x5eed0000u + static_cast<uint64_t>(c));
    const std::string& base = images[rng.below(images.size())];
    std::string log = "case " + std::to_string(c) + ": ";
    std::string img = mutate(base, rng, &log);
    Outcome o = Outcome::Rejected;
    try {
      o = load_and_touch(img, log, c % 40 == 0, dir, &hits);  // some through open()/mmap
    } catch (const std::exception& e) {
      ADD_FAILURE() << "non-opd exception " << e.what() << " in " << log;
    } catch (...) {
      ADD_FAILURE() << "unknown exception in " << log;
    }
    (o == Outcome::Loaded ? loaded : rejected)++;
  }
  // Both outcomes must be common, or the mutations are not reaching the validator.
  std::cout << "[ fuzz     ] " << kRandomCases << " cases: " << loaded << " loaded, " << rejected
            << " rejected\n";
  EXPECT_GT(loaded, kRandomCases / 20);
  for (const auto& [k, n] : hits) std::cout << "[ fuzz     ]   " << n << " x " << k << "\n";
  EXPECT_EQ(hits.count("(other)"), 0u) << "an error message outside the known validators";
  EXPECT_GE(hits.size(), std::size(kValidators) - 1) << "validators the mutations never reach";
  EXPECT_GT(rejected, kRandomCases / 2);
}

// Exhaustive single-byte edits of the reference file's header: each position set to each of
// a few structural characters.
TEST(SafetensorsFuzz, EveryHeaderByte) {
  test::ScratchDir dir;
  const std::string base = test::read_file_bytes(test::fixture_path("safetensors/basic.safetensors"));
  const size_t n = header_span(base);
  const std::string values = std::string("0 9\"{}[],:-x.\xff") + '\0';
  int loaded = 0, cases = 0;
  for (size_t pos = 0; pos < n; ++pos) {
    for (char v : values) {
      if (base[8 + pos] == v) continue;
      std::string img = base;
      img[8 + pos] = v;
      ++cases;
      try {
        loaded += load_and_touch(img, cat("byte ", pos, " = ", int(v)), false, dir) == Outcome::Loaded;
      } catch (const std::exception& e) {
        ADD_FAILURE() << "non-opd exception " << e.what() << " at byte " << pos;
      }
    }
  }
  std::cout << "[ fuzz     ] " << cases << " single-byte edits, " << loaded << " still valid\n";
  EXPECT_GT(loaded, 0);  // e.g. a digit of a value inside metadata
}

// The format requires the tensors to cover the data section exactly, so every strict prefix
// of a valid file must be rejected, and every length field but the true one too.
TEST(SafetensorsFuzz, EveryTruncationAndLength) {
  test::ScratchDir dir;
  const std::string base = test::read_file_bytes(test::fixture_path("safetensors/basic.safetensors"));
  for (size_t cut = 0; cut < base.size(); ++cut) {
    EXPECT_EQ(load_and_touch(base.substr(0, cut), "cut", false, dir), Outcome::Rejected) << cut;
  }
  const uint64_t n = header_len(base);
  for (uint64_t len = 0; len <= base.size() + 8; ++len) {
    std::string img = base;
    set_header_len(img, len);
    EXPECT_EQ(load_and_touch(img, "len", false, dir), len == n ? Outcome::Loaded : Outcome::Rejected)
        << len;
  }
}

}  // namespace
}  // namespace opd
