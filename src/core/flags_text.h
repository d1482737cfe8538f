// Flags files as text (the parsing half of cli/flags_file.h, here so that tests can fuzz it):
// a TOML subset -- `key = value` lines, `#` comments, blank lines, `[name]` section headers
// (accepted only when name == `section`), values: "..." strings (escapes \" \\ \n \t), '...'
// literal strings, numbers (TOML `_` separators dropped; anything strtod reads whole, inf, nan),
// true / false, one-line [v, v, ...] arrays of those -- or, with `json`, one JSON object whose
// members are strings, numbers, booleans or arrays of them. Keys are returned as written; which
// keys exist is the caller's business. Every error is an opd::Error (InvalidData) naming
// FILE:LINE (TOML) or FILE (JSON) and what is wrong; no input makes it crash, loop or allocate
// more than a small multiple of its size (tests/core/test_flags_text.cpp fuzzes it).
#pragma once

#include <string>
#include <vector>

namespace opd {

struct FlagsScalar {
  std::string text;      // the value as a flag argument would spell it
  bool is_bool = false;  // true / false (JSON booleans too)
};
struct FlagsEntry {
  std::string key;
  std::string where;  // "FILE:LINE" (TOML) or "FILE" (JSON), for messages
  std::vector<FlagsScalar> values;
  bool is_array = false;
};

std::vector<FlagsEntry> parse_flags_text(const std::string& text, const std::string& file,
                                         bool json, const std::string& section);

}  // namespace opd
