// Flags files as text (core/flags_text.h).
#include "core/flags_text.h"
#include "core/text_io.h"

#include <nlohmann/json.hpp>

#include <cctype>
#include <sstream>

#include "core/error.h"

namespace opd {
namespace {

using Scalar = FlagsScalar;
using Entry = FlagsEntry;

std::string trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}

// ---- TOML subset --------------------------------------------------------------------------

class LineParser {
 public:
  LineParser(const std::string& line, std::string where) : s_(line), where_(std::move(where)) {}

  [[noreturn]] void fail(const std::string& what) const {
    OPD_FAIL(InvalidData, where_, ": ", what, " (flags file: `key = value` lines, TOML)");
  }
  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t')) ++i_;
  }
  bool at_end_or_comment() {
    skip_ws();
    return i_ >= s_.size() || s_[i_] == '#';
  }
  bool eat(char c) {
    skip_ws();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }

  std::string key() {
    skip_ws();
    if (i_ < s_.size() && (s_[i_] == '"' || s_[i_] == '\'')) return string_value();
    const size_t a = i_;
    while (i_ < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[i_])) || s_[i_] == '_' ||
                              s_[i_] == '-'))
      ++i_;
    if (i_ == a) fail("expected a key");
    return s_.substr(a, i_ - a);
  }

  Scalar scalar() {
    skip_ws();
    if (i_ >= s_.size()) fail("a key without a value");
    const char c = s_[i_];
    if (c == '"' || c == '\'') return Scalar{string_value(), false};
    const size_t a = i_;
    while (i_ < s_.size() && !std::isspace(static_cast<unsigned char>(s_[i_])) && s_[i_] != ',' &&
           s_[i_] != ']' && s_[i_] != '#')
      ++i_;
    const std::string word = s_.substr(a, i_ - a);
    if (word == "true" || word == "false") return Scalar{word, true};
    // A TOML number: digits, sign, '.', exponent, '_' between digits (dropped), inf / nan.
    std::string num;
    for (char ch : word)
      if (ch != '_') num += ch;
    bool ok = !num.empty();
    if (ok && num != "inf" && num != "+inf" && num != "-inf" && num != "nan") {
      size_t used = 0;
      try {
        (void)std::stod(num, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      ok = used == num.size();
    }
    if (!ok)
      fail("`" + word + "` is not a value (strings are quoted: \"...\"; numbers, true, false, "
           "[...] arrays)");
    return Scalar{num, false};
  }

  std::string string_value() {
    const char q = s_[i_++];
    std::string out;
    while (i_ < s_.size() && s_[i_] != q) {
      char c = s_[i_++];
      if (q == '"' && c == '\\') {
        if (i_ >= s_.size()) break;
        const char e = s_[i_++];
        switch (e) {
          case '"': c = '"'; break;
          case '\\': c = '\\'; break;
          case 'n': c = '\n'; break;
          case 't': c = '\t'; break;
          default: fail(std::string("unsupported escape \\") + e + " in a string");
        }
      }
      out += c;
    }
    if (i_ >= s_.size()) fail("unterminated string");
    ++i_;  // the closing quote
    return out;
  }

 private:
  const std::string& s_;
  std::string where_;
  size_t i_ = 0;
};

std::vector<Entry> parse_toml(const std::string& text, const std::string& file,
                              const std::string& command) {
  std::vector<Entry> entries;
  std::istringstream in(text);
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const std::string where = file + ":" + std::to_string(n);
    LineParser p(line, where);
    if (p.at_end_or_comment()) continue;
    if (p.eat('[')) {
      const std::string name = trim(line.substr(line.find('[') + 1, line.find(']') - line.find('[') - 1));
      if (line.find(']') == std::string::npos || name != command)
        OPD_FAIL(InvalidData, where, ": section [", name, "]: this file is read by `opd ", command,
                 "`, whose flags take no section (or [", command, "])");
      continue;
    }
    Entry e;
    e.where = where;
    e.key = p.key();
    if (!p.eat('=')) p.fail("expected `=` after `" + e.key + "`");
    if (p.eat('[')) {
      e.is_array = true;
      if (!p.eat(']')) {
        do {
          e.values.push_back(p.scalar());
        } while (p.eat(','));
        if (!p.eat(']')) p.fail("expected `]` closing the array of `" + e.key + "` (one line)");
      }
    } else {
      e.values.push_back(p.scalar());
    }
    if (!p.at_end_or_comment()) p.fail("unexpected text after the value of `" + e.key + "`");
    entries.push_back(std::move(e));
  }
  return entries;
}

// ---- JSON ---------------------------------------------------------------------------------

Scalar json_scalar(const nlohmann::json& v, const std::string& where, const std::string& key) {
  if (v.is_string()) return Scalar{v.get<std::string>(), false};
  if (v.is_boolean()) return Scalar{v.get<bool>() ? "true" : "false", true};
  if (v.is_number()) return Scalar{v.dump(), false};
  OPD_FAIL(InvalidData, where, ": the value of \"", key, "\" is ", v.type_name(),
           " (flags take strings, numbers, booleans or arrays of them)");
}

std::vector<Entry> parse_json(const std::string& text, const std::string& file) {
  nlohmann::json doc;
  check_json_depth(text, file);
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse errors, and numbers out of range
    OPD_FAIL(InvalidData, file, ": invalid JSON: ", e.what());
  }
  if (!doc.is_object())
    OPD_FAIL(InvalidData, file, ": a flags file in JSON is one object of flags, got ", doc.type_name());
  std::vector<Entry> entries;
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    Entry e;
    e.key = it.key();
    e.where = file;
    if (it->is_array()) {
      e.is_array = true;
      for (const auto& v : *it) e.values.push_back(json_scalar(v, file, e.key));
    } else {
      e.values.push_back(json_scalar(*it, file, e.key));
    }
    entries.push_back(std::move(e));
  }
  return entries;
}

}  // namespace

std::vector<FlagsEntry> parse_flags_text(const std::string& text, const std::string& file,
                                         bool json, const std::string& section) {
  return json ? parse_json(text, file) : parse_toml(text, file, section);
}

}  // namespace opd
