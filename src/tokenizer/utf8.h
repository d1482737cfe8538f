// UTF-8 handling for the tokenizer: validation, decoding to code points, and the replacement
// rule for invalid bytes. The rule is "substitution of maximal subparts" (Unicode 15, §3.9,
// U+FFFD per maximal ill-formed subsequence), which is what Python's
// bytes.decode("utf-8", errors="replace") and Rust's String::from_utf8_lossy both do, so text
// read with either on the Hugging Face side and raw bytes given to opd give the same string.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace opd::utf8 {

inline constexpr char32_t kReplacement = 0xFFFD;

// Length of the well-formed sequence starting at s[i], or 0 if the bytes there are not the
// start of a complete well-formed sequence (ill-formed, or cut off by the end of s).
size_t sequence_length(std::string_view s, size_t i);

// Length of the longest prefix of the ill-formed or truncated bytes at s[i] that is still a
// valid *beginning* of some well-formed sequence (at least 1): one U+FFFD replaces it.
size_t maximal_subpart(std::string_view s, size_t i);

// True when every byte of s belongs to a well-formed sequence.
bool is_valid(std::string_view s);

// s with every maximal ill-formed subsequence replaced by U+FFFD (EF BF BD).
std::string to_valid(std::string_view s);
// Appends to_valid(s) to out.
void append_valid(std::string& out, std::string_view s);

// Number of bytes at the end of s that form an incomplete but so far valid sequence (0-3):
// an incremental decoder holds these back until more bytes arrive.
size_t incomplete_tail(std::string_view s);

// Decodes one well-formed sequence at s[i] (caller guarantees validity), advancing i.
inline char32_t decode_at(std::string_view s, size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  if (b0 < 0xE0) {
    char32_t c = ((b0 & 0x1Fu) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3Fu);
    i += 2;
    return c;
  }
  if (b0 < 0xF0) {
    char32_t c = ((b0 & 0x0Fu) << 12) | ((static_cast<unsigned char>(s[i + 1]) & 0x3Fu) << 6) |
                 (static_cast<unsigned char>(s[i + 2]) & 0x3Fu);
    i += 3;
    return c;
  }
  char32_t c = ((b0 & 0x07u) << 18) | ((static_cast<unsigned char>(s[i + 1]) & 0x3Fu) << 12) |
               ((static_cast<unsigned char>(s[i + 2]) & 0x3Fu) << 6) |
               (static_cast<unsigned char>(s[i + 3]) & 0x3Fu);
  i += 4;
  return c;
}

void append(std::string& out, char32_t c);

}  // namespace opd::utf8
