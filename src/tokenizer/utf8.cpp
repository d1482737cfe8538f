// UTF-8 validation and maximal-subpart replacement (see utf8.h for the rule and why).
#include "tokenizer/utf8.h"

namespace opd::utf8 {
namespace {

// Allowed range of the second byte for a lead byte (Unicode Table 3-7); later bytes are 80..BF.
struct Lead {
  uint8_t length;  // 0: not a lead byte
  uint8_t lo, hi;  // second byte range
};

Lead lead_of(unsigned char b) {
  if (b < 0x80) return {1, 0, 0};
  if (b < 0xC2) return {0, 0, 0};
  if (b < 0xE0) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};  // no surrogates
  if (b < 0xF0) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b < 0xF4) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};  // nothing above U+10FFFF
  return {0, 0, 0};
}

// Number of bytes at s[i] that are a valid beginning of a sequence (stops at the first
// byte that breaks it or at the end of s); `complete` says whether the whole sequence is there.
size_t valid_prefix(std::string_view s, size_t i, bool& complete) {
  const Lead lead = lead_of(static_cast<unsigned char>(s[i]));
  complete = false;
  if (lead.length == 0) return 0;
  if (lead.length == 1) {
    complete = true;
    return 1;
  }
  size_t n = 1;
  for (; n < lead.length; ++n) {
    if (i + n >= s.size()) return n;
    const auto b = static_cast<unsigned char>(s[i + n]);
    const unsigned char lo = n == 1 ? lead.lo : 0x80, hi = n == 1 ? lead.hi : 0xBF;
    if (b < lo || b > hi) return n;
  }
  complete = true;
  return n;
}

}  // namespace

size_t sequence_length(std::string_view s, size_t i) {
  bool complete = false;
  const size_t n = valid_prefix(s, i, complete);
  return complete ? n : 0;
}

size_t maximal_subpart(std::string_view s, size_t i) {
  bool complete = false;
  const size_t n = valid_prefix(s, i, complete);
  return n == 0 ? 1 : n;
}

bool is_valid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = sequence_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

void append_valid(std::string& out, std::string_view s) {
  size_t i = 0, run = 0;  // [run, i) is valid and not yet copied
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = sequence_length(s, i);
    if (n != 0) {
      i += n;
      continue;
    }
    out.append(s.substr(run, i - run));
    out.append("\xEF\xBF\xBD");
    i += maximal_subpart(s, i);
    run = i;
  }
  out.append(s.substr(run));
}

std::string to_valid(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  append_valid(out, s);
  return out;
}

size_t incomplete_tail(std::string_view s) {
  // A lead byte at most 3 bytes from the end whose sequence is valid but cut off.
  for (size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    const size_t i = s.size() - back;
    const auto b = static_cast<unsigned char>(s[i]);
    if (b >= 0x80 && b < 0xC0) continue;  // continuation byte: look further back
    bool complete = false;
    const size_t n = valid_prefix(s, i, complete);
    return (!complete && n == back && lead_of(b).length > back) ? back : 0;
  }
  return 0;
}

void append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

}  // namespace opd::utf8
