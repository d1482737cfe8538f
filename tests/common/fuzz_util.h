// Shared pieces of the deterministic mutation fuzzers (tests/*/test_*_fuzz.cpp, in the style of
// tests/model/test_safetensors_fuzz.cpp): a Philox-seeded random source, byte- and text-level
// mutators, and fuzz_iters(), which reads OPD_FUZZ_ITERS so a deeper campaign can run the same
// tests longer (e.g. OPD_FUZZ_ITERS=200000 build/tests/test_tokenizer_asan --gtest_filter='*Fuzz*').
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <functional>
#include <iterator>
#include <string>
#include <typeinfo>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/philox.h"

namespace opd::test {

class FuzzRng {
 public:
  explicit FuzzRng(uint64_t seed, uint32_t stream = 0xf022) : seed_(seed), stream_(stream) {}
  uint32_t next() { return philox_u32(seed_, stream_, i_++); }
  uint64_t next64() { return (uint64_t{next()} << 32) | next(); }
  size_t below(size_t n) { return n ? static_cast<size_t>(next64() % n) : 0; }
  bool chance(unsigned percent) { return next() % 100 < percent; }
  template <typename T, size_t N>
  const T& pick(const T (&a)[N]) { return a[below(N)]; }

 private:
  uint64_t seed_;
  uint32_t stream_;
  uint64_t i_ = 0;
};

// Iterations of a fuzz loop: `dflt` (kept small so the _asan suites stay fast) unless
// OPD_FUZZ_ITERS is set to a positive number.
inline int fuzz_iters(int dflt) {
  if (const char* v = std::getenv("OPD_FUZZ_ITERS")) {
    const long n = std::strtol(v, nullptr, 10);
    if (n > 0) return static_cast<int>(n);
  }
  return dflt;
}

// Numbers that break size arithmetic: 0, off-by-one around `near`, powers of two, the top of
// the 32- and 64-bit ranges.
inline uint64_t interesting_u64(FuzzRng& rng, uint64_t near) {
  switch (rng.below(9)) {
    case 0: return 0;
    case 1: return near + rng.below(3) - 1;
    case 2: return near * 2;
    case 3: return uint64_t{1} << rng.below(64);
    case 4: return ~uint64_t{0} - rng.below(16);
    case 5: return (uint64_t{1} << 63) + rng.below(4);
    case 6: return 0xFFFFFFFFu - rng.below(4);
    case 7: return rng.below(64);
    default: return rng.next64();
  }
}

// One random byte-level edit of `s`: flip a bit, set a byte, insert or delete a run, duplicate
// or truncate, splice in one of `dict` (the format's own tokens). Appends what it did to *log.
inline void mutate_bytes(std::string& s, FuzzRng& rng, const std::vector<std::string>& dict,
                         std::string* log) {
  const size_t n = s.size();
  switch (rng.below(8)) {
    case 0:
      if (n) {
        const size_t p = rng.below(n);
        s[p] = static_cast<char>(s[p] ^ (1u << rng.below(8)));
        *log += "flip@" + std::to_string(p) + " ";
      }
      break;
    case 1:
      if (n) {
        const size_t p = rng.below(n);
        static const unsigned char kBytes[] = {0, 0x7f, 0x80, 0xbf, 0xc0, 0xff, '"', '\\', '{', '[', '%', '-', '9'};
        s[p] = static_cast<char>(kBytes[rng.below(std::size(kBytes))]);
        *log += "set@" + std::to_string(p) + " ";
      }
      break;
    case 2: {
      const size_t p = rng.below(n + 1), len = 1 + rng.below(std::min<size_t>(n + 1, 64));
      if (p < n) s.erase(p, len);
      *log += "del@" + std::to_string(p) + " ";
      break;
    }
    case 3: {
      const size_t p = rng.below(n + 1);
      s.resize(p);
      *log += "trunc@" + std::to_string(p) + " ";
      break;
    }
    case 4: {
      if (n) {
        const size_t a = rng.below(n), len = 1 + rng.below(std::min<size_t>(n - a, 256));
        const std::string piece = s.substr(a, len);
        s.insert(rng.below(n + 1), piece);
        *log += "dup@" + std::to_string(a) + " ";
      }
      break;
    }
    default:
      if (!dict.empty()) {
        const std::string& w = dict[rng.below(dict.size())];
        s.insert(rng.below(n + 1), w);
        *log += "ins'" + w.substr(0, 20) + "' ";
      }
      break;
  }
}

// Runs `body`; an opd::Error is an accepted rejection (returns false), success returns true,
// and any other exception is a test failure naming `what`.
inline bool accepts(const std::string& what, const std::function<void()>& body) {
  try {
    body();
    return true;
  } catch (const Error&) {
    return false;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "non-opd exception (" << typeid(e).name() << "): " << e.what() << " in " << what;
  } catch (...) {
    ADD_FAILURE() << "unknown exception in " << what;
  }
  return false;
}

// The opd::Error message of `body`, or "" when it succeeds (a non-opd exception fails the test).
inline std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "non-opd exception (" << typeid(e).name() << "): " << e.what();
    return e.what();
  }
  return "";
}

// A JSON value of the wrong shape or an edge value: wrong types, empty/huge/negative numbers,
// NaN-like floats, bad UTF-8 escapes, deep nesting.
template <typename Json>
Json junk_json(FuzzRng& rng) {
  switch (rng.below(16)) {
    case 0: return nullptr;
    case 1: return rng.chance(50);
    case 2: return -1;
    case 3: return 0;
    case 4: return static_cast<int64_t>(interesting_u64(rng, 16));
    case 5: return interesting_u64(rng, 1u << 20);
    case 6: return 1e308 * (rng.chance(50) ? 10 : -1);
    case 7: return 2.5;
    case 8: return "";
    case 9: return std::string("\xff\xfe\xc0\x80 bad utf8");
    case 10: return std::string(1 + rng.below(4096), 'a');
    case 11: return Json::array();
    case 12: return Json::object();
    case 13: {
      Json deep = 1;
      for (size_t k = 0, n = 1 + rng.below(300); k < n; ++k) deep = Json::array({std::move(deep)});
      return deep;
    }
    case 14: return Json::array({-1, "x", nullptr});
    default: return "-1";
  }
}

// Every value slot of `j` (object members and array elements, at any depth), as JSON pointers.
template <typename Json>
void json_slots(const Json& j, const typename Json::json_pointer& at, std::vector<typename Json::json_pointer>& out,
                size_t cap = 20000) {
  if (out.size() >= cap) return;
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      out.push_back(at / it.key());
      json_slots(it.value(), at / it.key(), out, cap);
    }
  } else if (j.is_array()) {
    for (size_t k = 0; k < j.size(); ++k) {
      out.push_back(at / k);
      json_slots(j[k], at / k, out, cap);
    }
  }
}

// One structural edit of a parsed JSON document: a value replaced by junk, a member removed, an
// array emptied or its element duplicated, a number nudged (0, -1, +1, x2, huge).
template <typename Json>
void mutate_json(Json& j, FuzzRng& rng, std::string* log) {
  std::vector<typename Json::json_pointer> slots;
  json_slots(j, typename Json::json_pointer(), slots);
  if (slots.empty()) {
    j = junk_json<Json>(rng);
    *log += "root=junk ";
    return;
  }
  const auto& at = slots[rng.below(slots.size())];
  Json& v = j[at];
  *log += at.to_string() + ":";
  switch (rng.below(6)) {
    case 0: case 1: v = junk_json<Json>(rng); *log += "junk "; break;
    case 2: {
      Json& parent = j[at.parent_pointer()];
      if (parent.is_object()) parent.erase(at.back());
      else if (parent.is_array() && !parent.empty()) parent.erase(parent.begin() + static_cast<long>(rng.below(parent.size())));
      *log += "erase ";
      break;
    }
    case 3:
      if (v.is_number_integer()) {
        // Wrapping neighbours (through uint64): the fuzzer itself must not overflow.
        const uint64_t x = static_cast<uint64_t>(v.template get<int64_t>());
        const int64_t opts[] = {0, -1, static_cast<int64_t>(x + 1), static_cast<int64_t>(x - 1),
                                static_cast<int64_t>(x * 2), INT64_MAX, INT64_MIN, int64_t{1} << 31, int64_t{1} << 32};
        v = opts[rng.below(std::size(opts))];
        *log += "num ";
      } else if (v.is_array() && !v.empty()) {
        v.push_back(v[rng.below(v.size())]);
        *log += "dup-elem ";
      } else if (v.is_string()) {
        std::string s = v.template get<std::string>();
        s.insert(rng.below(s.size() + 1), rng.chance(50) ? std::string("\x80") : std::string("\xf4\x90\x80\x80"));
        v = s;  // invalid UTF-8 inside a string (dumped with replace)
        *log += "bad-utf8 ";
      }
      break;
    case 4: if (v.is_array() || v.is_object()) { v.clear(); *log += "clear "; } break;
    default: v = typename Json::array_t{v}; *log += "wrap "; break;
  }
}

// dump() that never throws on invalid UTF-8 (drops the bad bytes; the byte-level mutations are
// what put invalid UTF-8 into files).
template <typename Json>
std::string dump_raw(const Json& j) {
  return j.dump(-1, ' ', false, Json::error_handler_t::ignore);
}

}  // namespace opd::test
