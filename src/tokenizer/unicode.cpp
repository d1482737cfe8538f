// NFC normalization (UAX #15) and regex class data, matching Hugging Face tokenizers.
#include "tokenizer/unicode.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "tokenizer/utf8.h"

namespace opd::unicode {
namespace {

#include "tokenizer/unicode_tables.inc"

constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr int kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
              kSCount = kLCount * kNCount;

// Quick-check value: 0 Yes, 1 Maybe, 2 No.
int quick_check(char32_t c) {
  const auto* it = std::upper_bound(std::begin(kQc), std::end(kQc), c,
                                    [](char32_t v, const QcRange& r) { return v < r.first; });
  if (it == std::begin(kQc)) return 0;
  --it;
  return c <= it->last ? it->value : 0;
}

const DecompEntry* find_decomposition(char32_t c) {
  const auto* it = std::lower_bound(std::begin(kDecomp), std::end(kDecomp), c,
                                    [](const DecompEntry& e, char32_t v) { return e.cp < v; });
  return (it != std::end(kDecomp) && it->cp == c) ? it : nullptr;
}

void decompose(char32_t c, std::vector<char32_t>& out) {
  if (c >= kSBase && c < kSBase + kSCount) {  // Hangul syllable
    const int s = static_cast<int>(c - kSBase);
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  if (const DecompEntry* d = find_decomposition(c)) {
    out.insert(out.end(), kDecompData + d->offset, kDecompData + d->offset + d->length);
  } else {
    out.push_back(c);
  }
}

// Primary composite of (a, b), or 0.
char32_t compose(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount)
    return a + (b - kTBase);
  const CompEntry key{a, b, 0};
  const auto* it = std::lower_bound(std::begin(kComp), std::end(kComp), key,
                                    [](const CompEntry& x, const CompEntry& y) {
                                      return x.first != y.first ? x.first < y.first
                                                                : x.second < y.second;
                                    });
  return (it != std::end(kComp) && it->first == a && it->second == b) ? it->composite : 0;
}

// NFC quick check over the whole string: true means "certainly already NFC".
bool quick_yes(std::string_view s) {
  // Code points below U+0300 are all NFC_QC=Yes with combining class 0: their UTF-8 lead bytes
  // are below 0xCC, so ASCII, Latin-1 and most European text is decided by one byte scan.
  size_t i = 0;
  while (i < s.size() && static_cast<unsigned char>(s[i]) < 0xCC) ++i;
  if (i == s.size()) return true;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;  // back to a lead
  int last_ccc = 0;
  while (i < s.size()) {
    const char32_t c = utf8::decode_at(s, i);
    if (c < 0x300) {
      last_ccc = 0;
      continue;
    }
    const int ccc = combining_class(c);
    if (ccc != 0 && last_ccc > ccc) return false;
    if (quick_check(c) != 0) return false;
    last_ccc = ccc;
  }
  return true;
}

std::string class_body(const char32_t (*ranges)[2], int count) {
  std::string out;
  char buf[40];
  for (int i = 0; i < count; ++i) {
    if (ranges[i][0] == ranges[i][1])
      std::snprintf(buf, sizeof buf, "\\x{%X}", static_cast<unsigned>(ranges[i][0]));
    else
      std::snprintf(buf, sizeof buf, "\\x{%X}-\\x{%X}", static_cast<unsigned>(ranges[i][0]),
                    static_cast<unsigned>(ranges[i][1]));
    out += buf;
  }
  return out;
}

}  // namespace

int combining_class(char32_t c) {
  if (c < 0x300) return 0;
  const auto* it = std::lower_bound(std::begin(kCcc), std::end(kCcc), c,
                                    [](const CccEntry& e, char32_t v) { return e.cp < v; });
  return (it != std::end(kCcc) && it->cp == c) ? it->ccc : 0;
}

bool nfc(std::string_view s, std::string& out) {
  if (quick_yes(s)) return false;
  // 1. Full canonical decomposition.
  std::vector<char32_t> cps;
  cps.reserve(s.size());
  for (size_t i = 0; i < s.size();) decompose(utf8::decode_at(s, i), cps);
  // 2. Canonical ordering: stable sort of each run of non-starters by combining class.
  for (size_t i = 0; i < cps.size();) {
    if (combining_class(cps[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && combining_class(cps[j]) != 0) ++j;
    std::stable_sort(cps.begin() + static_cast<std::ptrdiff_t>(i),
                     cps.begin() + static_cast<std::ptrdiff_t>(j),
                     [](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }
  // 3. Canonical composition: a character combines with the last starter unless blocked by
  // an intervening character of the same or higher class (or any starter).
  std::vector<char32_t> res;
  res.reserve(cps.size());
  ptrdiff_t starter = -1;
  int last_ccc = -1;
  for (char32_t c : cps) {
    const int ccc = combining_class(c);
    if (starter >= 0) {
      const bool blocked = last_ccc != -1 && (last_ccc == 0 || last_ccc >= ccc);
      if (!blocked) {
        if (char32_t comp = compose(res[static_cast<size_t>(starter)], c)) {
          res[static_cast<size_t>(starter)] = comp;
          continue;
        }
      }
    }
    if (ccc == 0) {
      starter = static_cast<ptrdiff_t>(res.size());
      last_ccc = -1;
    } else {
      last_ccc = ccc;
    }
    res.push_back(c);
  }
  out.clear();
  out.reserve(s.size() + 8);
  for (char32_t c : res) utf8::append(out, c);
  return true;
}

std::string regex_space_class() { return class_body(kOnigSpace, kOnigSpaceCount); }
std::string regex_letter_delta() { return class_body(kLetterDelta, kLetterDeltaCount); }
std::string regex_number_delta() { return class_body(kNumberDelta, kNumberDeltaCount); }

}  // namespace opd::unicode
