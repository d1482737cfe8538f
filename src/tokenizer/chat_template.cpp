// The Jinja2-subset interpreter behind ChatTemplate: lexer (Jinja2's whitespace rules with
// trim_blocks and lstrip_blocks), recursive-descent parser to an AST (Jinja2's operator
// precedence), and a tree-walking evaluator with Python value semantics (str(), repr(), truthiness,
// slicing by code point, json.dumps for tojson). jinja2/lexer.py, parser.py and filters.py are the
// specification; each rule that is easy to get subtly wrong cites what it mirrors.
#include "tokenizer/chat_template.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "core/text_io.h"
#include "core/sha256.h"

namespace opd {
namespace {

// Limits that keep a hostile template or conversation from overflowing the stack, hanging, or
// exhausting memory (each is an InvalidData error naming the limit). Real chat templates nest a
// handful of levels, loop over messages and tools, and render a few MB at most.
constexpr int kMaxJsonDepth = 128;        // nesting of message/tool/extra JSON values
constexpr int kMaxParseDepth = 128;       // nested expressions/blocks in the template source
constexpr int kMaxEvalDepth = 256;        // expression/statement depth at render time (macro recursion too)
// Work units per render: a for-loop iteration costs 4, a macro call 1, every item iterated,
// built by range() or compared by unique/in costs 1, and every 64 bytes of a built string 1.
// About 2-5 s of pathological work at most; a real render spends a few thousand.
constexpr int64_t kMaxSteps = 10'000'000;
constexpr int kMaxValueDepth = 128;       // nesting of a value stored into a namespace attribute
constexpr size_t kMaxStringBytes = size_t{64} << 20;   // any string or the output (1M tokens is ~5 MB)
constexpr size_t kMaxListItems = size_t{1} << 24;      // a list built by '*' or '+'
constexpr int64_t kMaxRange = 100'000;    // jinja2.sandbox.MAX_RANGE (transformers' environment)

// ---------------------------------------------------------------------------------------------
// UTF-8 and Python string helpers

// Decodes UTF-8; an invalid byte becomes U+FFFD (inputs come from parsed JSON, which is valid).
std::u32string to_u32(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = s[i];
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    char32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    bool ok = true;
    for (int k = 1; k < n; ++k) {
      unsigned char cc = s[i + k];
      if ((cc & 0xC0) != 0x80) { ok = false; break; }
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (!ok) { out.push_back(0xFFFD); ++i; continue; }
    out.push_back(cp);
    i += n;
  }
  return out;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string from_u32(const std::u32string& s) {
  std::string out;
  for (char32_t c : s) append_utf8(out, c);
  return out;
}

// Python's str.isspace() set (what str.strip()/split() with no argument and regex \s remove).
bool is_py_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000;
}

enum class StripSide { Left, Right, Both };

// str.strip/lstrip/rstrip: chars == nullptr strips whitespace, else any code point in *chars.
std::string py_strip(std::string_view s, const std::string* chars, StripSide side) {
  std::u32string u = to_u32(s);
  std::u32string set = chars ? to_u32(*chars) : std::u32string();
  auto strip_it = [&](char32_t c) {
    return chars ? set.find(c) != std::u32string::npos : is_py_space(c);
  };
  size_t b = 0, e = u.size();
  if (side != StripSide::Right) while (b < e && strip_it(u[b])) ++b;
  if (side != StripSide::Left) while (e > b && strip_it(u[e - 1])) --e;
  return from_u32(u.substr(b, e - b));
}

std::string ascii_lower(std::string s) {
  for (char& c : s) if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}
std::string ascii_upper(std::string s) {
  for (char& c : s) if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  return s;
}

// float.__repr__: shortest round-trip digits, fixed notation for 1e-4 <= |x| < 1e16, else
// d.ddde+XX (CPython's format_float_short with 'r': exponent when decpt <= -4 or decpt > 16).
std::string py_float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (x == 0) return std::signbit(x) ? "-0.0" : "0.0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // e.g. "-1.2345e+02"
  bool neg = sci[0] == '-';
  if (neg) sci = sci.substr(1);
  size_t epos = sci.find('e');
  std::string mant = sci.substr(0, epos);
  int exp10 = std::stoi(sci.substr(epos + 1));
  std::string digits;
  for (char c : mant) if (c != '.') digits += c;
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  int decpt = exp10 + 1;  // value = 0.DIGITS * 10^decpt
  std::string out = neg ? "-" : "";
  if (decpt <= -4 || decpt > 16) {
    out += digits[0];
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    out += eb;
  } else if (decpt <= 0) {
    out += "0." + std::string(-decpt, '0') + digits;
  } else if (static_cast<size_t>(decpt) >= digits.size()) {
    out += digits + std::string(decpt - digits.size(), '0') + ".0";
  } else {
    out += digits.substr(0, decpt) + "." + digits.substr(decpt);
  }
  return out;
}

// repr() of a str: single quotes unless the text has ' and no ", escapes as CPython does for
// the characters chat data holds (non-printable ASCII as \xNN; printable Unicode kept).
std::string py_str_repr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  for (char32_t c : to_u32(s)) {
    if (c == static_cast<char32_t>(q) || c == '\\') { out += '\\'; out += static_cast<char>(c); }
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7F || (c >= 0x80 && c < 0xA0)) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", static_cast<unsigned>(c));
      out += b;
    } else append_utf8(out, c);
  }
  out += q;
  return out;
}

// ---------------------------------------------------------------------------------------------
// Values

enum class VKind { Undefined, None, Bool, Int, Float, String, Array, Object, Callable };

struct Value;
struct ObjectData;
struct CallArgs;
using Array = std::vector<Value>;
using NativeFn = std::function<Value(CallArgs&, int line)>;

struct Value {
  VKind kind = VKind::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // String: the text; Undefined: why it is undefined (for error messages)
  std::shared_ptr<Array> arr;
  std::shared_ptr<ObjectData> obj;
  std::shared_ptr<NativeFn> fn;
  std::string fn_name;

  static Value undefined(std::string why) { Value v; v.s = std::move(why); return v; }
  static Value none() { Value v; v.kind = VKind::None; return v; }
  static Value boolean(bool x) { Value v; v.kind = VKind::Bool; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.kind = VKind::Int; v.i = x; return v; }
  static Value floating(double x) { Value v; v.kind = VKind::Float; v.f = x; return v; }
  static Value string(std::string x) { Value v; v.kind = VKind::String; v.s = std::move(x); return v; }
  static Value array(Array a = {}) {
    Value v; v.kind = VKind::Array; v.arr = std::make_shared<Array>(std::move(a)); return v;
  }
  static Value object(bool is_namespace = false);
  static Value callable(std::string name, NativeFn f) {
    Value v; v.kind = VKind::Callable; v.fn_name = std::move(name);
    v.fn = std::make_shared<NativeFn>(std::move(f)); return v;
  }
  bool is_undefined() const { return kind == VKind::Undefined; }
  bool is_number() const { return kind == VKind::Int || kind == VKind::Float || kind == VKind::Bool; }
  double as_double() const { return kind == VKind::Float ? f : kind == VKind::Bool ? (b ? 1 : 0) : static_cast<double>(i); }
  int64_t as_int() const { return kind == VKind::Bool ? (b ? 1 : 0) : i; }
};

// Insertion-ordered like a Python dict (tojson and iteration must keep the input's key order).
struct ObjectData {
  std::vector<std::pair<std::string, Value>> items;
  std::unordered_map<std::string, size_t> index;
  bool is_namespace = false;
  const Value* find(const std::string& k) const {
    auto it = index.find(k);
    return it == index.end() ? nullptr : &items[it->second].second;
  }
  void set(const std::string& k, Value v) {
    auto it = index.find(k);
    if (it != index.end()) { items[it->second].second = std::move(v); return; }
    index.emplace(k, items.size());
    items.emplace_back(k, std::move(v));
  }
};

Value Value::object(bool is_namespace) {
  Value v;
  v.kind = VKind::Object;
  v.obj = std::make_shared<ObjectData>();
  v.obj->is_namespace = is_namespace;
  return v;
}

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  const Value* kwarg(const std::string& name) const {
    for (const auto& [k, v] : kw) if (k == name) return &v;
    return nullptr;
  }
};

// Python type names, for error messages shaped like Python's.
const char* type_name(const Value& v) {
  switch (v.kind) {
    case VKind::Undefined: return "Undefined";
    case VKind::None: return "NoneType";
    case VKind::Bool: return "bool";
    case VKind::Int: return "int";
    case VKind::Float: return "float";
    case VKind::String: return "str";
    case VKind::Array: return "list";
    case VKind::Object: return v.obj->is_namespace ? "Namespace" : "dict";
    case VKind::Callable: return "function";
  }
  return "?";
}

Value from_json(const nlohmann::ordered_json& j, int depth = 0) {
  OPD_CHECK(depth < kMaxJsonDepth, InvalidArgument, "chat template input: JSON nested deeper than ",
            kMaxJsonDepth, " levels");
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      OPD_CHECK(u <= static_cast<uint64_t>(INT64_MAX), InvalidArgument,
                "chat template input: integer ", u, " does not fit in int64");
      return Value::integer(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value::floating(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      Array a;
      for (const auto& e : j) a.push_back(from_json(e, depth + 1));
      return Value::array(std::move(a));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value o = Value::object();
      for (auto it = j.begin(); it != j.end(); ++it) o.obj->set(it.key(), from_json(it.value(), depth + 1));
      return o;
    }
    default: OPD_FAIL(InvalidArgument, "chat template input: unsupported JSON value (binary)");
  }
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case VKind::Undefined: case VKind::None: return false;
    case VKind::Bool: return v.b;
    case VKind::Int: return v.i != 0;
    case VKind::Float: return v.f != 0;
    case VKind::String: return !v.s.empty();
    case VKind::Array: return !v.arr->empty();
    case VKind::Object: return v.obj->is_namespace || !v.obj->items.empty();
    case VKind::Callable: return true;
  }
  return false;
}

std::string repr(const Value& v);

// str(): what {{ x }} prints.
std::string to_str(const Value& v) {
  switch (v.kind) {
    case VKind::Undefined: return "";
    case VKind::None: return "None";
    case VKind::Bool: return v.b ? "True" : "False";
    case VKind::Int: return std::to_string(v.i);
    case VKind::Float: return py_float_repr(v.f);
    case VKind::String: return v.s;
    default: return repr(v);
  }
}

std::string repr(const Value& v) {
  switch (v.kind) {
    case VKind::String: return py_str_repr(v.s);
    case VKind::Array: {
      std::string out = "[";
      for (size_t k = 0; k < v.arr->size(); ++k) out += (k ? ", " : "") + repr((*v.arr)[k]);
      return out + "]";
    }
    case VKind::Object: {
      std::string out = v.obj->is_namespace ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& [k, e] : v.obj->items) {
        out += (first ? "" : ", ") + py_str_repr(k) + ": " + repr(e);
        first = false;
      }
      return out + (v.obj->is_namespace ? "}>" : "}");
    }
    case VKind::Callable: return "<function " + v.fn_name + ">";
    default: return to_str(v);
  }
}

// json.dumps(x, ensure_ascii, indent, separators, sort_keys) exactly as Python writes it.
struct JsonStyle {
  bool ensure_ascii = false;
  int indent = -1;  // -1: None (one line)
  std::string item_sep = ", ", key_sep = ": ";
  bool sort_keys = false;
};

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (char32_t c : to_u32(s)) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default: {
        char b[16];
        if (c < 0x20 || (ensure_ascii && c >= 0x7F)) {
          if (c >= 0x10000) {  // surrogate pair, as Python's ensure_ascii writes it
            char32_t v = c - 0x10000;
            std::snprintf(b, sizeof b, "\\u%04x\\u%04x", 0xD800 + (unsigned)(v >> 10), 0xDC00 + (unsigned)(v & 0x3FF));
          } else {
            std::snprintf(b, sizeof b, "\\u%04x", static_cast<unsigned>(c));
          }
          out += b;
        } else {
          append_utf8(out, c);
        }
      }
    }
  }
  out += '"';
}

void json_dump(std::string& out, const Value& v, const JsonStyle& st, int depth, int line);

void json_newline(std::string& out, const JsonStyle& st, int depth) {
  out += '\n';
  out.append(static_cast<size_t>(st.indent) * depth, ' ');
}

void json_dump(std::string& out, const Value& v, const JsonStyle& st, int depth, int line) {
  switch (v.kind) {
    case VKind::None: out += "null"; return;
    case VKind::Bool: out += v.b ? "true" : "false"; return;
    case VKind::Int: out += std::to_string(v.i); return;
    case VKind::Float:
      if (std::isnan(v.f)) out += "NaN";
      else if (std::isinf(v.f)) out += v.f > 0 ? "Infinity" : "-Infinity";
      else out += py_float_repr(v.f);
      return;
    case VKind::String: json_string(out, v.s, st.ensure_ascii); return;
    case VKind::Array: {
      if (v.arr->empty()) { out += "[]"; return; }
      out += '[';
      for (size_t k = 0; k < v.arr->size(); ++k) {
        if (k) out += st.item_sep;
        if (st.indent >= 0) json_newline(out, st, depth + 1);
        json_dump(out, (*v.arr)[k], st, depth + 1, line);
      }
      if (st.indent >= 0) json_newline(out, st, depth);
      out += ']';
      return;
    }
    case VKind::Object: {
      if (v.obj->is_namespace) break;
      if (v.obj->items.empty()) { out += "{}"; return; }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.obj->items) items.push_back(&kv);
      if (st.sort_keys) {
        std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return to_u32(a->first) < to_u32(b->first); });
      }
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += st.item_sep;
        if (st.indent >= 0) json_newline(out, st, depth + 1);
        json_string(out, items[k]->first, st.ensure_ascii);
        out += st.key_sep;
        json_dump(out, items[k]->second, st, depth + 1, line);
      }
      if (st.indent >= 0) json_newline(out, st, depth);
      out += '}';
      return;
    }
    default: break;
  }
  OPD_FAIL(InvalidData, "line ", line, ": tojson: Object of type ", type_name(v), " is not JSON serializable");
}

bool values_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == VKind::Float || b.kind == VKind::Float) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case VKind::Undefined: case VKind::None: return true;
    case VKind::String: return a.s == b.s;
    case VKind::Array:
      if (a.arr->size() != b.arr->size()) return false;
      for (size_t k = 0; k < a.arr->size(); ++k) if (!values_equal((*a.arr)[k], (*b.arr)[k])) return false;
      return true;
    case VKind::Object:
      if (a.obj == b.obj) return true;
      if (a.obj->is_namespace || b.obj->is_namespace) return false;
      if (a.obj->items.size() != b.obj->items.size()) return false;
      for (const auto& [k, v] : a.obj->items) {
        const Value* o = b.obj->find(k);
        if (!o || !values_equal(v, *o)) return false;
      }
      return true;
    case VKind::Callable: return a.fn == b.fn;
    default: return false;
  }
}

// ---------------------------------------------------------------------------------------------
// Lexer (jinja2/lexer.py with trim_blocks=True, lstrip_blocks=True)

enum class Tok { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };

struct Token {
  Tok type;
  std::string text;  // Data text, name, decoded string, operator
  int line;
  int64_t ival = 0;
  double fval = 0;
};

[[noreturn]] void syntax_error(const std::string& origin, int line, const std::string& what) {
  OPD_FAIL(InvalidData, origin, ":", line, ": chat template syntax error: ", what);
}
[[noreturn]] void unsupported(const std::string& origin, int line, const std::string& what) {
  OPD_FAIL(Unsupported, origin, ":", line, ": chat template uses ", what,
           ", which opd's Jinja subset does not implement (pass --chat-template FILE with a "
           "template that avoids it)");
}

// Python's str.rstrip() on UTF-8 text.
std::string rstrip_ws(const std::string& s) { return py_strip(s, nullptr, StripSide::Right); }

// Python string literal unescape (value.encode("ascii", "backslashreplace").decode("unicode-escape")).
std::string unescape(std::string_view body, const std::string& origin, int line) {
  std::string out;
  for (size_t k = 0; k < body.size(); ++k) {
    char c = body[k];
    if (c != '\\' || k + 1 >= body.size()) { out += c; continue; }
    char e = body[++k];
    auto hex = [&](int n) {
      if (k + n >= body.size()) syntax_error(origin, line, "truncated \\x/\\u escape in a string literal");
      uint32_t v = 0;
      for (int d = 0; d < n; ++d) {
        char h = body[k + 1 + d];
        int x = (h >= '0' && h <= '9') ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10 : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
        if (x < 0) syntax_error(origin, line, "bad hex digit in a string literal escape");
        v = v * 16 + x;
      }
      k += n;
      return v;
    };
    switch (e) {
      case 'n': out += '\n'; break;
      case 't': out += '\t'; break;
      case 'r': out += '\r'; break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'v': out += '\v'; break;
      case '\n': break;  // line continuation
      case 'x': append_utf8(out, hex(2)); break;
      case 'u': append_utf8(out, hex(4)); break;
      case 'U': append_utf8(out, hex(8)); break;
      case '0': case '1': case '2': case '3': case '4': case '5': case '6': case '7': {
        uint32_t v = e - '0';
        for (int d = 0; d < 2 && k + 1 < body.size() && body[k + 1] >= '0' && body[k + 1] <= '7'; ++d) v = v * 8 + (body[++k] - '0');
        append_utf8(out, v);
        break;
      }
      default: out += '\\'; out += e;  // unknown escapes stay as written, as in Python
    }
  }
  return out;
}

bool is_name_start(unsigned char c) { return std::isalpha(c) || c == '_' || c >= 0x80; }
bool is_name_char(unsigned char c) { return std::isalnum(c) || c == '_' || c >= 0x80; }

class Lexer {
 public:
  Lexer(std::string src, std::string origin) : origin_(std::move(origin)) {
    // Newlines normalized to \n and one trailing newline dropped (keep_trailing_newline=False).
    std::string s;
    for (size_t k = 0; k < src.size(); ++k) {
      if (src[k] == '\r') { s += '\n'; if (k + 1 < src.size() && src[k + 1] == '\n') ++k; }
      else s += src[k];
    }
    if (!s.empty() && s.back() == '\n') s.pop_back();
    src_ = std::move(s);
  }

  std::vector<Token> run() {
    size_t n = src_.size();
    bool line_starting = true;  // the previous match ended with \n (jinja2: line_starting)
    while (pos_ < n) {
      size_t open = std::string::npos;
      for (size_t k = pos_; k + 1 < n; ++k) {
        if (src_[k] == '{' && (src_[k + 1] == '{' || src_[k + 1] == '%' || src_[k + 1] == '#')) { open = k; break; }
      }
      if (open == std::string::npos) {
        emit_data(src_.substr(pos_));
        pos_ = n;
        break;
      }
      std::string text = src_.substr(pos_, open - pos_);
      char kind = src_[open + 1];
      char sign = open + 2 < n ? src_[open + 2] : '\0';
      if (sign != '-' && sign != '+') sign = '\0';
      if (sign == '-') {
        text = rstrip_ws(text);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: drop spaces/tabs between the line start and a block/comment tag.
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
        if (l_pos > 0 || line_starting) {
          std::string tail = text.substr(l_pos);
          if (!tail.empty() && py_strip(tail, nullptr, StripSide::Both).empty()) text.resize(l_pos);
        }
      }
      line_ += count_newlines(src_.substr(pos_, open - pos_)) - count_newlines(text);
      emit_data(text);
      line_ += count_newlines(text);
      pos_ = open + 2 + (sign ? 1 : 0);
      if (kind == '#') line_starting = lex_comment();
      else line_starting = lex_tag(kind == '{');
    }
    toks_.push_back({Tok::Eof, "", line_});
    return std::move(toks_);
  }

 private:
  static int count_newlines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

  void emit_data(const std::string& text) {
    if (!text.empty()) toks_.push_back({Tok::Data, text, line_});
  }

  // After a tag: '-' strips all following whitespace, '+' nothing, else trim_blocks drops one \n.
  // Returns whether the consumed end ended with \n (lstrip_blocks' line_starting).
  bool after_tag_end(char sign) {
    size_t n = src_.size();
    if (sign == '-') {
      size_t start = pos_;
      size_t k = pos_;  // strip Python whitespace, which may be multi-byte
      while (k < n) {
        size_t len = 1;
        unsigned char c = src_[k];
        if (c >= 0x80) len = (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
        std::u32string cp = to_u32(src_.substr(k, len));
        if (cp.size() != 1 || !is_py_space(cp[0])) break;
        k += len;
      }
      line_ += count_newlines(src_.substr(start, k - start));
      pos_ = k;
      return k > start && src_[k - 1] == '\n';
    }
    return false;
  }
  bool trim_newline(char sign) {
    if (sign == '\0' && pos_ < src_.size() && src_[pos_] == '\n') {
      ++pos_;
      ++line_;
      return true;
    }
    return false;
  }

  bool lex_comment() {
    size_t close = src_.find("#}", pos_);
    if (close == std::string::npos) syntax_error(origin_, line_, "missing end of comment tag '#}'");
    char sign = close > pos_ && (src_[close - 1] == '-' || src_[close - 1] == '+') ? src_[close - 1] : '\0';
    line_ += count_newlines(src_.substr(pos_, close - pos_));
    pos_ = close + 2;
    if (sign == '-') return after_tag_end('-');
    return trim_newline(sign);
  }

  // Tokens of a {{ ... }} or {% ... %} tag up to and including its end.
  bool lex_tag(bool is_var) {
    int start_line = line_;
    toks_.push_back({is_var ? Tok::VarBegin : Tok::BlockBegin, "", line_});
    std::vector<char> balance;
    size_t n = src_.size();
    while (true) {
      while (pos_ < n && std::isspace(static_cast<unsigned char>(src_[pos_]))) {
        if (src_[pos_] == '\n') ++line_;
        ++pos_;
      }
      if (pos_ >= n) {
        syntax_error(origin_, start_line, is_var ? "unclosed '{{' (missing '}}')" : "unclosed '{%' (missing '%}')");
      }
      if (balance.empty()) {
        const char* close = is_var ? "}}" : "%}";
        char sign = '\0';
        size_t at = pos_;
        if ((src_[pos_] == '-' || (!is_var && src_[pos_] == '+')) && src_.compare(pos_ + 1, 2, close) == 0) {
          sign = src_[pos_];
          at = pos_ + 1;
        }
        if (src_.compare(at, 2, close) == 0) {
          toks_.push_back({is_var ? Tok::VarEnd : Tok::BlockEnd, "", line_});
          pos_ = at + 2;
          if (sign == '-') return after_tag_end('-');
          if (is_var) return false;  // trim_blocks applies to block tags only
          return trim_newline(sign);
        }
      }
      unsigned char c = src_[pos_];
      if (is_name_start(c)) {
        size_t b = pos_;
        while (pos_ < n && is_name_char(src_[pos_])) ++pos_;
        toks_.push_back({Tok::Name, src_.substr(b, pos_ - b), line_});
      } else if (std::isdigit(c)) {
        lex_number();
      } else if (c == '\'' || c == '"') {
        size_t b = ++pos_;
        while (pos_ < n && src_[pos_] != static_cast<char>(c)) {
          if (src_[pos_] == '\\') ++pos_;
          ++pos_;
        }
        if (pos_ >= n) syntax_error(origin_, line_, "unterminated string literal");
        std::string body = src_.substr(b, pos_ - b);
        ++pos_;
        toks_.push_back({Tok::String, unescape(body, origin_, line_), line_});
        line_ += count_newlines(body);
      } else {
        static const char* ops[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "*", "/", "%", "~",
                                    "[", "]", "(", ")", "{", "}", "<", ">", "=", ".", ":", "|", ",", ";"};
        bool found = false;
        for (const char* op : ops) {
          size_t len = std::strlen(op);
          if (src_.compare(pos_, len, op) == 0) {
            std::string o(op);
            if (o == "(" || o == "[" || o == "{") balance.push_back(o == "(" ? ')' : o == "[" ? ']' : '}');
            if (o == ")" || o == "]" || o == "}") {
              if (balance.empty()) syntax_error(origin_, line_, "unexpected '" + o + "'");
              if (balance.back() != o[0]) {
                syntax_error(origin_, line_, "unexpected '" + o + "', expected '" + std::string(1, balance.back()) + "'");
              }
              balance.pop_back();
            }
            toks_.push_back({Tok::Op, o, line_});
            pos_ += len;
            found = true;
            break;
          }
        }
        if (!found) syntax_error(origin_, line_, std::string("unexpected character '") + static_cast<char>(c) + "'");
      }
    }
  }

  void lex_number() {
    size_t b = pos_, n = src_.size();
    while (pos_ < n && (std::isdigit(static_cast<unsigned char>(src_[pos_])) || src_[pos_] == '_')) ++pos_;
    bool is_float = false;
    if (pos_ + 1 < n && src_[pos_] == '.' && std::isdigit(static_cast<unsigned char>(src_[pos_ + 1]))) {
      is_float = true;
      ++pos_;
      while (pos_ < n && (std::isdigit(static_cast<unsigned char>(src_[pos_])) || src_[pos_] == '_')) ++pos_;
    }
    if (pos_ < n && (src_[pos_] == 'e' || src_[pos_] == 'E')) {
      size_t k = pos_ + 1;
      if (k < n && (src_[k] == '+' || src_[k] == '-')) ++k;
      if (k < n && std::isdigit(static_cast<unsigned char>(src_[k]))) {
        is_float = true;
        pos_ = k;
        while (pos_ < n && std::isdigit(static_cast<unsigned char>(src_[pos_]))) ++pos_;
      }
    }
    std::string t;
    for (char ch : src_.substr(b, pos_ - b)) if (ch != '_') t += ch;
    Token tok{is_float ? Tok::Float : Tok::Int, t, line_};
    if (is_float) tok.fval = std::strtod(t.c_str(), nullptr);
    else {
      auto r = std::from_chars(t.data(), t.data() + t.size(), tok.ival);
      if (r.ec != std::errc()) syntax_error(origin_, line_, "integer literal out of range: " + t);
    }
    toks_.push_back(tok);
  }

  std::string src_, origin_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> toks_;
};

// ---------------------------------------------------------------------------------------------
// AST

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;
using Args = std::vector<std::pair<std::string, ExprPtr>>;  // name "" = positional

enum class EK { Literal, Name, List, Dict, Attr, Item, Slice, Call, Filter, Test, Neg, Pos, Not,
                Binary, And, Or, Cond };

struct Expr {
  EK k;
  int line;
  Value literal;
  std::string name;               // Name, Attr, Filter, Test; Binary: the operator
  std::vector<ExprPtr> kids;      // operands (Slice: object, start, stop, step; null = omitted)
  Args args;                      // Call, Filter, Test
  bool negated = false;           // Test: "is not"
  Expr() = default;
  Expr(const Expr&) = delete;
  Expr& operator=(const Expr&) = delete;
  // Iterative: a left-associative chain (1+1+...+1) is as deep as it is long, and a recursive
  // destructor would overflow the stack on a long one.
  ~Expr() {
    std::vector<ExprPtr> pending;
    auto take = [&pending](Expr& e) {
      for (ExprPtr& k : e.kids) if (k) pending.push_back(std::move(k));
      for (auto& a : e.args) if (a.second) pending.push_back(std::move(a.second));
    };
    take(*this);
    while (!pending.empty()) {
      ExprPtr e = std::move(pending.back());
      pending.pop_back();
      take(*e);
    }
  }
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

enum class NK { Text, Print, If, For, Set, SetBlock, Macro, Break, Continue, Generation };

struct Node {
  NK k;
  int line;
  std::string text;                       // Text; Set/SetBlock/Macro: target name
  std::string attr;                       // Set: namespace attribute ("" = plain name)
  ExprPtr expr;                           // Print, Set, For (iterable)
  ExprPtr filter;                         // For ... if cond
  std::vector<std::string> targets;       // For targets; Macro parameter names
  std::vector<ExprPtr> defaults;          // Macro parameter defaults (null = required)
  std::vector<std::pair<ExprPtr, Body>> branches;  // If
  Body body, else_body;                   // For/SetBlock/Macro/Generation body; If/For else
};

// ---------------------------------------------------------------------------------------------
// Parser (jinja2/parser.py precedence)

class Parser {
 public:
  Parser(std::vector<Token> toks, std::string origin) : t_(std::move(toks)), origin_(std::move(origin)) {}

  Body parse_template() {
    std::string end;
    Body b = parse_body({}, end);
    return b;
  }

 private:
  const Token& peek(size_t ahead = 0) const { return t_[std::min(p_ + ahead, t_.size() - 1)]; }
  const Token& next() { const Token& tk = t_[p_]; if (p_ + 1 < t_.size()) ++p_; return tk; }
  bool is_op(const char* op, size_t ahead = 0) const { return peek(ahead).type == Tok::Op && peek(ahead).text == op; }
  bool is_name(const char* nm, size_t ahead = 0) const { return peek(ahead).type == Tok::Name && peek(ahead).text == nm; }
  [[noreturn]] void fail(const std::string& what) const { syntax_error(origin_, peek().line, what); }
  // Counts the recursion of the descent; deeper nesting than kMaxParseDepth is an error, not a
  // stack overflow ("((((...", "not not not ...", "{% if %}" inside "{% if %}" ...).
  struct Nest {
    Parser& p;
    explicit Nest(Parser& parser) : p(parser) {
      if (++p.depth_ > kMaxParseDepth) {
        --p.depth_;
        p.fail("nesting deeper than " + std::to_string(kMaxParseDepth) + " levels");
      }
    }
    ~Nest() { --p.depth_; }
  };
  int depth_ = 0;
  void expect_op(const char* op) {
    if (!is_op(op)) fail(std::string("expected '") + op + "', got '" + describe(peek()) + "'");
    next();
  }
  std::string expect_name() {
    if (peek().type != Tok::Name) fail("expected a name, got '" + describe(peek()) + "'");
    return next().text;
  }
  void expect_block_end() {
    if (peek().type != Tok::BlockEnd) fail("expected end of statement '%}', got '" + describe(peek()) + "'");
    next();
  }
  static std::string describe(const Token& tk) {
    switch (tk.type) {
      case Tok::Eof: return "end of template";
      case Tok::BlockEnd: return "%}";
      case Tok::VarEnd: return "}}";
      case Tok::Data: return "text";
      default: return tk.text;
    }
  }

  // Statements until a block tag named in `ends`; its name is returned in `end` (tag consumed up
  // to its name; the caller parses the rest of that tag).
  Body parse_body(const std::vector<std::string>& ends, std::string& end) {
    Nest nest(*this);
    Body body;
    while (true) {
      const Token& tk = peek();
      if (tk.type == Tok::Eof) {
        if (!ends.empty()) {
          std::string want;
          for (const auto& e : ends) want += (want.empty() ? "" : " or ") + ("'{% " + e + " %}'");
          fail("unexpected end of template, expected " + want);
        }
        end.clear();
        return body;
      }
      if (tk.type == Tok::Data) {
        auto n = std::make_unique<Node>();
        n->k = NK::Text;
        n->line = tk.line;
        n->text = tk.text;
        next();
        body.push_back(std::move(n));
      } else if (tk.type == Tok::VarBegin) {
        next();
        auto n = std::make_unique<Node>();
        n->k = NK::Print;
        n->line = tk.line;
        n->expr = parse_expr();
        if (peek().type != Tok::VarEnd) fail("expected end of print statement '}}', got '" + describe(peek()) + "'");
        next();
        body.push_back(std::move(n));
      } else if (tk.type == Tok::BlockBegin) {
        next();
        if (peek().type != Tok::Name) fail("expected a statement name after '{%'");
        std::string name = peek().text;
        if (std::find(ends.begin(), ends.end(), name) != ends.end()) {
          next();
          end = name;
          return body;
        }
        body.push_back(parse_statement());
      } else {
        fail("unexpected '" + describe(tk) + "'");
      }
    }
  }

  NodePtr parse_statement() {
    const Token& tk = next();
    const std::string& s = tk.text;
    auto n = std::make_unique<Node>();
    n->line = tk.line;
    if (s == "if") {
      n->k = NK::If;
      ExprPtr cond = parse_expr();
      expect_block_end();
      while (true) {
        std::string end;
        Body b = parse_body({"elif", "else", "endif"}, end);
        n->branches.emplace_back(std::move(cond), std::move(b));
        if (end == "elif") {
          cond = parse_expr();
          expect_block_end();
          continue;
        }
        if (end == "else") {
          expect_block_end();
          std::string e2;
          n->else_body = parse_body({"endif"}, e2);
        }
        expect_block_end();
        break;
      }
    } else if (s == "for") {
      n->k = NK::For;
      n->targets.push_back(expect_name());
      while (is_op(",")) { next(); n->targets.push_back(expect_name()); }
      if (!is_name("in")) fail("expected 'in' in a for statement");
      next();
      n->expr = parse_expr(/*no_cond=*/true);
      if (is_name("if")) { next(); n->filter = parse_expr(true); }
      if (is_name("recursive")) unsupported(origin_, tk.line, "'{% for ... recursive %}'");
      expect_block_end();
      std::string end;
      n->body = parse_body({"else", "endfor"}, end);
      if (end == "else") {
        expect_block_end();
        n->else_body = parse_body({"endfor"}, end);
      }
      expect_block_end();
    } else if (s == "set") {
      std::string target = expect_name();
      if (is_op(".")) { next(); n->attr = expect_name(); }
      else if (is_op(",")) unsupported(origin_, tk.line, "'{% set a, b = ... %}' (tuple assignment)");
      n->text = target;
      if (is_op("=")) {
        next();
        n->k = NK::Set;
        n->expr = parse_expr();
        expect_block_end();
      } else {
        if (!n->attr.empty()) fail("a block set cannot assign a namespace attribute");
        if (is_op("|")) unsupported(origin_, tk.line, "a filtered block set '{% set x | filter %}'");
        n->k = NK::SetBlock;
        expect_block_end();
        std::string end;
        n->body = parse_body({"endset"}, end);
        expect_block_end();
      }
    } else if (s == "macro") {
      n->k = NK::Macro;
      n->text = expect_name();
      expect_op("(");
      while (!is_op(")")) {
        n->targets.push_back(expect_name());
        if (is_op("=")) { next(); n->defaults.push_back(parse_expr()); }
        else n->defaults.push_back(nullptr);
        if (!is_op(")")) expect_op(",");
      }
      next();
      expect_block_end();
      std::string end;
      n->body = parse_body({"endmacro"}, end);
      if (peek().type == Tok::Name) next();  // {% endmacro name %}
      expect_block_end();
    } else if (s == "break" || s == "continue") {
      n->k = s == "break" ? NK::Break : NK::Continue;
      expect_block_end();
    } else if (s == "generation") {
      // transformers' AssistantTracker: marks assistant spans; the text is the body's.
      n->k = NK::Generation;
      expect_block_end();
      std::string end;
      n->body = parse_body({"endgeneration"}, end);
      expect_block_end();
    } else {
      unsupported(origin_, tk.line, "the statement '{% " + s + " %}'");
    }
    return n;
  }

  ExprPtr make(EK k, int line) {
    auto e = std::make_unique<Expr>();
    e->k = k;
    e->line = line;
    return e;
  }

  // expr := or ['if' or ['else' expr]]   (no_cond: inside for-targets, where 'if' filters)
  ExprPtr parse_expr(bool no_cond = false) {
    Nest nest(*this);
    ExprPtr e = parse_or();
    if (no_cond) return e;
    while (is_name("if")) {
      int line = next().line;
      auto c = make(EK::Cond, line);
      ExprPtr cond = parse_or();
      ExprPtr other;
      if (is_name("else")) { next(); other = parse_expr(); }
      c->kids.push_back(std::move(cond));
      c->kids.push_back(std::move(e));
      c->kids.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }
  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (is_name("or")) {
      int line = next().line;
      auto o = make(EK::Or, line);
      o->kids.push_back(std::move(e));
      o->kids.push_back(parse_and());
      e = std::move(o);
    }
    return e;
  }
  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (is_name("and")) {
      int line = next().line;
      auto o = make(EK::And, line);
      o->kids.push_back(std::move(e));
      o->kids.push_back(parse_not());
      e = std::move(o);
    }
    return e;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      Nest nest(*this);
      int line = next().line;
      auto o = make(EK::Not, line);
      o->kids.push_back(parse_not());
      return o;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    ExprPtr e = parse_math1();
    while (true) {
      std::string op;
      if (peek().type == Tok::Op && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                     peek().text == ">" || peek().text == "<=" || peek().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        next();
        next();
        op = "not in";
      } else {
        return e;
      }
      auto b = make(EK::Binary, peek().line);
      b->name = op;
      b->kids.push_back(std::move(e));
      b->kids.push_back(parse_math1());
      e = std::move(b);
    }
  }
  ExprPtr binary(ExprPtr lhs, const std::string& op, ExprPtr rhs, int line) {
    auto b = make(EK::Binary, line);
    b->name = op;
    b->kids.push_back(std::move(lhs));
    b->kids.push_back(std::move(rhs));
    return b;
  }
  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& o = next();
      e = binary(std::move(e), o.text, parse_concat(), o.line);
    }
    return e;
  }
  ExprPtr parse_concat() {
    ExprPtr e = parse_math2();
    while (is_op("~")) {
      const Token& o = next();
      e = binary(std::move(e), "~", parse_math2(), o.line);
    }
    return e;
  }
  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& o = next();
      e = binary(std::move(e), o.text, parse_pow(), o.line);
    }
    return e;
  }
  ExprPtr parse_pow() {
    ExprPtr e = parse_unary();
    while (is_op("**")) {
      const Token& o = next();
      e = binary(std::move(e), "**", parse_unary(), o.line);
    }
    return e;
  }
  ExprPtr parse_unary(bool with_filter = true) {
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      Nest nest(*this);
      const Token& o = next();
      e = make(o.text == "-" ? EK::Neg : EK::Pos, o.line);
      e->kids.push_back(parse_unary(false));
    } else {
      e = parse_postfix(parse_primary());
    }
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }
  ExprPtr parse_primary() {
    const Token& tk = peek();
    if (tk.type == Tok::Name) {
      next();
      if (tk.text == "true" || tk.text == "True") { auto e = make(EK::Literal, tk.line); e->literal = Value::boolean(true); return e; }
      if (tk.text == "false" || tk.text == "False") { auto e = make(EK::Literal, tk.line); e->literal = Value::boolean(false); return e; }
      if (tk.text == "none" || tk.text == "None") { auto e = make(EK::Literal, tk.line); e->literal = Value::none(); return e; }
      auto e = make(EK::Name, tk.line);
      e->name = tk.text;
      return e;
    }
    if (tk.type == Tok::String) {
      std::string s;
      int line = tk.line;
      while (peek().type == Tok::String) s += next().text;  // adjacent literals concatenate
      auto e = make(EK::Literal, line);
      e->literal = Value::string(std::move(s));
      return e;
    }
    if (tk.type == Tok::Int || tk.type == Tok::Float) {
      next();
      auto e = make(EK::Literal, tk.line);
      e->literal = tk.type == Tok::Int ? Value::integer(tk.ival) : Value::floating(tk.fval);
      return e;
    }
    if (is_op("(")) {
      next();
      if (is_op(")")) { next(); auto e = make(EK::List, tk.line); return e; }  // () = empty tuple
      ExprPtr first = parse_expr();
      if (is_op(",")) {  // tuple: evaluated as a list
        auto e = make(EK::List, tk.line);
        e->kids.push_back(std::move(first));
        while (is_op(",")) {
          next();
          if (is_op(")")) break;
          e->kids.push_back(parse_expr());
        }
        expect_op(")");
        return e;
      }
      expect_op(")");
      return first;
    }
    if (is_op("[")) {
      next();
      auto e = make(EK::List, tk.line);
      while (!is_op("]")) {
        e->kids.push_back(parse_expr());
        if (!is_op("]")) expect_op(",");
      }
      next();
      return e;
    }
    if (is_op("{")) {
      next();
      auto e = make(EK::Dict, tk.line);
      while (!is_op("}")) {
        e->kids.push_back(parse_expr());
        expect_op(":");
        e->kids.push_back(parse_expr());
        if (!is_op("}")) expect_op(",");
      }
      next();
      return e;
    }
    fail("unexpected '" + describe(tk) + "' in an expression");
  }
  Args parse_call_args() {
    // '(' already consumed
    Args args;
    while (!is_op(")")) {
      if (is_op("*") || is_op("**")) unsupported(origin_, peek().line, "*args/**kwargs in a call");
      if (peek().type == Tok::Name && is_op("=", 1)) {
        std::string nm = next().text;
        next();
        args.emplace_back(nm, parse_expr());
      } else {
        args.emplace_back("", parse_expr());
      }
      if (!is_op(")")) expect_op(",");
    }
    next();
    return args;
  }
  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".")) {
        int line = next().line;
        auto a = make(EK::Attr, line);
        if (peek().type == Tok::Name) a->name = next().text;
        else if (peek().type == Tok::Int) {  // foo.0 is foo[0]
          auto idx = make(EK::Literal, line);
          idx->literal = Value::integer(next().ival);
          a->k = EK::Item;
          a->kids.push_back(std::move(e));
          a->kids.push_back(std::move(idx));
          e = std::move(a);
          continue;
        } else fail("expected an attribute name after '.'");
        a->kids.push_back(std::move(e));
        e = std::move(a);
      } else if (is_op("[")) {
        int line = next().line;
        ExprPtr parts[3];
        bool is_slice = false;
        int idx = 0;
        while (!is_op("]")) {
          if (is_op(":")) {
            next();
            is_slice = true;
            if (++idx > 2) fail("too many ':' in a slice");
            continue;
          }
          parts[idx] = parse_expr();
          if (!is_slice && is_op(",")) unsupported(origin_, line, "tuple subscripts x[a, b]");
        }
        next();
        if (is_slice) {
          auto s = make(EK::Slice, line);
          s->kids.push_back(std::move(e));
          for (auto& p : parts) s->kids.push_back(std::move(p));
          e = std::move(s);
        } else {
          if (!parts[0]) fail("empty subscript []");
          auto it = make(EK::Item, line);
          it->kids.push_back(std::move(e));
          it->kids.push_back(std::move(parts[0]));
          e = std::move(it);
        }
      } else if (is_op("(")) {
        int line = next().line;
        auto c = make(EK::Call, line);
        c->kids.push_back(std::move(e));
        c->args = parse_call_args();
        e = std::move(c);
      } else {
        return e;
      }
    }
  }
  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        int line = next().line;
        auto f = make(EK::Filter, line);
        f->name = expect_name();
        while (is_op(".")) { next(); f->name += "." + expect_name(); }
        if (is_op("(")) { next(); f->args = parse_call_args(); }
        f->kids.push_back(std::move(e));
        e = std::move(f);
      } else if (is_name("is")) {
        int line = next().line;
        auto t = make(EK::Test, line);
        if (is_name("not")) { next(); t->negated = true; }
        t->name = expect_name();
        while (is_op(".")) { next(); t->name += "." + expect_name(); }
        if (is_op("(")) {
          next();
          t->args = parse_call_args();
        } else if ((peek().type == Tok::Name || peek().type == Tok::String || peek().type == Tok::Int ||
                    peek().type == Tok::Float || is_op("[") || is_op("{")) &&
                   !(is_name("else") || is_name("or") || is_name("and"))) {
          // `x is sameas false`, `x is divisibleby 3`: one argument without parentheses.
          ExprPtr arg = parse_postfix(parse_primary());
          t->args.emplace_back("", std::move(arg));
        }
        t->kids.push_back(std::move(e));
        e = std::move(t);
      } else if (is_op("(")) {
        int line = next().line;
        auto c = make(EK::Call, line);
        c->kids.push_back(std::move(e));
        c->args = parse_call_args();
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  size_t p_ = 0;
  std::string origin_;
};

}  // namespace

struct ChatTemplate::Program {
  std::string source, origin;
  Body body;
};

namespace {

// ---------------------------------------------------------------------------------------------
// Evaluator

struct BreakSignal {};
struct ContinueSignal {};

class Renderer {
 public:
  Renderer(const ChatTemplate::Program& prog, std::optional<std::chrono::system_clock::time_point> now)
      : prog_(prog), now_(now) {
    scopes_.emplace_back();  // globals (filled by the caller)
    scopes_.emplace_back();  // template-level sets
    install_globals();
  }

  void set_global(const std::string& name, Value v) { scopes_[0][name] = std::move(v); }

  std::string run() {
    std::string out;
    try {
      exec_body(prog_.body, out);
    } catch (const BreakSignal&) {
      fail(0, "'break' outside a for loop");
    } catch (const ContinueSignal&) {
      fail(0, "'continue' outside a for loop");
    }
    return out;
  }

 private:
  using Scope = std::unordered_map<std::string, Value>;

  [[noreturn]] void fail(int line, const std::string& what) const {
    OPD_FAIL(InvalidData, prog_.origin, ":", line, ": chat template error: ", what);
  }
  [[noreturn]] void unsupported_at(int line, const std::string& what) const { unsupported(prog_.origin, line, what); }

  void install_globals() {
    set_global("raise_exception", Value::callable("raise_exception", [this](CallArgs& a, int line) -> Value {
      std::string msg = a.pos.empty() ? std::string() : to_str(a.pos[0]);
      OPD_FAIL(InvalidData, prog_.origin, ":", line, ": chat template raised an exception: ", msg);
    }));
    set_global("strftime_now", Value::callable("strftime_now", [this](CallArgs& a, int line) -> Value {
      if (a.pos.size() != 1 || a.pos[0].kind != VKind::String) fail(line, "strftime_now(format) takes one string");
      std::time_t t = std::chrono::system_clock::to_time_t(now_ ? *now_ : std::chrono::system_clock::now());
      std::tm tm{};
      localtime_r(&t, &tm);
      char buf[256];
      size_t n = std::strftime(buf, sizeof buf, a.pos[0].s.c_str(), &tm);
      return Value::string(std::string(buf, n));
    }));
    auto make_dict = [this](CallArgs& a, int line, bool ns) {
      Value o = Value::object(ns);
      for (const Value& p : a.pos) {
        if (p.kind != VKind::Object) fail(line, std::string(ns ? "namespace" : "dict") + "() positional argument must be a mapping");
        for (const auto& [k, v] : p.obj->items) o.obj->set(k, v);
      }
      for (auto& [k, v] : a.kw) {
        if (ns && !k.empty() && k[0] == '_') fail(line, "namespace attributes cannot start with '_': " + k);
        o.obj->set(k, v);
      }
      return o;
    };
    set_global("namespace", Value::callable("namespace", [make_dict](CallArgs& a, int line) { return make_dict(a, line, true); }));
    set_global("dict", Value::callable("dict", [make_dict](CallArgs& a, int line) { return make_dict(a, line, false); }));
    set_global("range", Value::callable("range", [this](CallArgs& a, int line) {
      int64_t start = 0, stop = 0, step = 1;
      for (const Value& v : a.pos) if (v.kind != VKind::Int && v.kind != VKind::Bool) fail(line, "range() takes integers");
      if (a.pos.size() == 1) stop = a.pos[0].as_int();
      else if (a.pos.size() >= 2) { start = a.pos[0].as_int(); stop = a.pos[1].as_int(); if (a.pos.size() > 2) step = a.pos[2].as_int(); }
      else fail(line, "range() needs 1 to 3 arguments");
      if (step == 0) fail(line, "range() step must not be zero");
      Array out;
      for (int64_t x = start; step > 0 ? x < stop : x > stop;) {
        out.push_back(Value::integer(x));
        charge(line);
        if (static_cast<int64_t>(out.size()) > kMaxRange)
          fail(line, "range() has more than " + std::to_string(kMaxRange) + " items (jinja2.sandbox.MAX_RANGE)");
        if (__builtin_add_overflow(x, step, &x)) break;  // the next value would pass any stop
      }
      return Value::array(std::move(out));
    }));
  }

  // ---- statements
  void exec_body(const Body& body, std::string& out) {
    for (const auto& n : body) exec(*n, out);
  }

  // Render-time depth: nested expressions and statements, and macro calls (a macro that calls
  // itself recurses through exec and eval), bounded by kMaxEvalDepth.
  struct Depth {
    Renderer& r;
    Depth(Renderer& renderer, int line) : r(renderer) {
      if (++r.depth_ > kMaxEvalDepth) {
        --r.depth_;
        r.fail(line, "expressions, statements or macro calls nested deeper than " +
                         std::to_string(kMaxEvalDepth) + " levels (a recursive macro?)");
      }
    }
    ~Depth() { --r.depth_; }
  };
  int depth_ = 0;
  int64_t steps_ = 0;
  void charge(int line, size_t units = 1) {
    steps_ += static_cast<int64_t>(std::min<size_t>(units, kMaxSteps));
    if (steps_ > kMaxSteps)
      fail(line, "more than " + std::to_string(kMaxSteps) + " work units (loop iterations, items iterated, "
                 "macro calls) in one render: a runaway loop?");
  }
  // A value about to be stored into namespace `target`: at most kMaxValueDepth deep and not
  // holding the namespace itself (ns.a = ns, or ns.a = [ns], would make a cycle that printing
  // recurses through forever). Visited items are charged as work.
  void check_storable(const Value& v, const ObjectData* target, int line, int level = 0) {
    if (level > kMaxValueDepth)
      fail(line, "a value nested deeper than " + std::to_string(kMaxValueDepth) + " levels stored in a namespace");
    charge(line);
    if (v.kind == VKind::Array) {
      for (const Value& e : *v.arr) check_storable(e, target, line, level + 1);
    } else if (v.kind == VKind::Object) {
      if (v.obj.get() == target) fail(line, "a namespace cannot hold itself");
      for (const auto& kv : v.obj->items) check_storable(kv.second, target, line, level + 1);
    }
  }
  void check_string(size_t bytes, int line) const {
    if (bytes > kMaxStringBytes)
      fail(line, "a string of " + std::to_string(bytes) + " bytes exceeds the " +
                     std::to_string(kMaxStringBytes) + "-byte limit");
  }
  void append_out(std::string& out, const std::string& s, int line) const {
    check_string(out.size() + s.size(), line);
    out += s;
  }

  void exec(const Node& n, std::string& out) {
    Depth depth(*this, n.line);
    switch (n.k) {
      case NK::Text: append_out(out, n.text, n.line); return;
      case NK::Print: append_out(out, to_str(eval(*n.expr)), n.line); return;
      case NK::If:
        for (const auto& [cond, body] : n.branches) {
          if (truthy(eval(*cond))) { exec_body(body, out); return; }
        }
        exec_body(n.else_body, out);
        return;
      case NK::For: exec_for(n, out); return;
      case NK::Set: {
        Value v = eval(*n.expr);
        if (n.attr.empty()) { scopes_.back()[n.text] = std::move(v); return; }
        Value target = lookup(n.text, n.line);
        if (target.kind != VKind::Object || !target.obj->is_namespace) {
          fail(n.line, "cannot assign attribute on non-namespace object '" + n.text + "'");
        }
        check_storable(v, target.obj.get(), n.line);
        target.obj->set(n.attr, std::move(v));
        return;
      }
      case NK::SetBlock: {
        std::string captured;
        exec_body(n.body, captured);
        scopes_.back()[n.text] = Value::string(std::move(captured));
        return;
      }
      case NK::Macro: scopes_.back()[n.text] = make_macro(n); return;
      case NK::Break: throw BreakSignal{};
      case NK::Continue: throw ContinueSignal{};
      case NK::Generation: exec_body(n.body, out); return;
    }
  }

  Array iterate(const Value& v, int line) {
    charge(line, v.kind == VKind::Array ? v.arr->size() : v.kind == VKind::Object ? v.obj->items.size()
                                                        : v.kind == VKind::String ? v.s.size() : 0);
    switch (v.kind) {
      case VKind::Undefined: return {};  // jinja2.Undefined iterates as empty
      case VKind::Array: return *v.arr;
      case VKind::Object: {
        if (v.obj->is_namespace) break;
        Array keys;
        for (const auto& kv : v.obj->items) keys.push_back(Value::string(kv.first));
        return keys;
      }
      case VKind::String: {
        Array chars;
        for (char32_t c : to_u32(v.s)) { std::string s; append_utf8(s, c); chars.push_back(Value::string(s)); }
        return chars;
      }
      default: break;
    }
    fail(line, std::string("'") + type_name(v) + "' object is not iterable");
  }

  void exec_for(const Node& n, std::string& out) {
    Value seq = eval(*n.expr);
    Array items = iterate(seq, n.line);
    auto bind = [&](Scope& scope, const Value& item) {
      if (n.targets.size() == 1) { scope[n.targets[0]] = item; return; }
      Array parts = iterate(item, n.line);
      if (parts.size() != n.targets.size()) {
        fail(n.line, cat("cannot unpack ", parts.size(), " values into ", n.targets.size(), " loop variables"));
      }
      for (size_t k = 0; k < parts.size(); ++k) scope[n.targets[k]] = parts[k];
    };
    if (n.filter) {  // {% for x in xs if cond %}: filtered before loop.* is computed
      Array kept;
      for (const Value& item : items) {
        scopes_.emplace_back();
        bind(scopes_.back(), item);
        bool keep = truthy(eval(*n.filter));
        scopes_.pop_back();
        if (keep) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) { exec_body(n.else_body, out); return; }
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < len; ++k) {
      scopes_.emplace_back();  // a fresh scope per iteration: sets do not survive it (as Jinja2)
      Value loop = Value::object();
      loop.obj->set("index0", Value::integer(k));
      loop.obj->set("index", Value::integer(k + 1));
      loop.obj->set("revindex0", Value::integer(len - k - 1));
      loop.obj->set("revindex", Value::integer(len - k));
      loop.obj->set("first", Value::boolean(k == 0));
      loop.obj->set("last", Value::boolean(k == len - 1));
      loop.obj->set("length", Value::integer(len));
      loop.obj->set("depth", Value::integer(1));
      loop.obj->set("depth0", Value::integer(0));
      loop.obj->set("previtem", k > 0 ? items[k - 1] : Value::undefined("there is no previous item"));
      loop.obj->set("nextitem", k + 1 < len ? items[k + 1] : Value::undefined("there is no next item"));
      loop.obj->set("cycle", Value::callable("loop.cycle", [k](CallArgs& a, int) {
        return a.pos.empty() ? Value::none() : a.pos[k % a.pos.size()];
      }));
      charge(n.line, 4);
      scopes_.back()["loop"] = loop;
      bind(scopes_.back(), items[k]);
      bool stop = false;
      try {
        exec_body(n.body, out);
      } catch (const BreakSignal&) {
        stop = true;
      } catch (const ContinueSignal&) {
      }
      scopes_.pop_back();
      if (stop) break;
    }
  }

  Value make_macro(const Node& n) {
    const Node* node = &n;
    return Value::callable(n.text, [this, node](CallArgs& a, int line) {
      charge(line);
      Scope frame;
      if (a.pos.size() > node->targets.size()) fail(line, "macro '" + node->text + "' takes " + std::to_string(node->targets.size()) + " arguments");
      for (size_t k = 0; k < node->targets.size(); ++k) {
        const std::string& p = node->targets[k];
        if (k < a.pos.size()) frame[p] = a.pos[k];
        else if (const Value* kv = a.kwarg(p)) frame[p] = *kv;
        else if (node->defaults[k]) frame[p] = eval(*node->defaults[k]);
        else frame[p] = Value::undefined("'" + p + "' is undefined");
      }
      for (const auto& [k, v] : a.kw) {
        if (std::find(node->targets.begin(), node->targets.end(), k) == node->targets.end()) {
          fail(line, "macro '" + node->text + "' has no argument '" + k + "'");
        }
      }
      // A macro sees the globals and template-level names, not the caller's loop variables.
      std::vector<Scope> saved;
      saved.swap(scopes_);
      scopes_.push_back(saved[0]);
      scopes_.push_back(saved[1]);
      scopes_.push_back(std::move(frame));
      std::string out;
      try {
        exec_body(node->body, out);
      } catch (...) {
        scopes_.swap(saved);
        throw;
      }
      scopes_.swap(saved);
      return Value::string(std::move(out));
    });
  }

  Value lookup(const std::string& name, int line) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return Value::undefined("'" + name + "' is undefined");
  }

  // ---- expressions
  [[noreturn]] void undefined_error(const Value& v, int line) const {
    fail(line, v.s.empty() ? "undefined value" : v.s);
  }

  Value get_attr(const Value& obj, const std::string& name, int line) {
    switch (obj.kind) {
      case VKind::Undefined: undefined_error(obj, line);
      case VKind::Object: {
        if (const Value* v = obj.obj->find(name)) return *v;
        if (!obj.obj->is_namespace) {
          if (name == "items" || name == "keys" || name == "values" || name == "get") return bound_method(obj, name);
        }
        return Value::undefined(std::string("'") + (obj.obj->is_namespace ? "Namespace" : "dict object") + "' has no attribute '" + name + "'");
      }
      case VKind::String: {
        static const char* methods[] = {"startswith", "endswith", "split", "rsplit", "strip", "lstrip", "rstrip",
                                        "upper", "lower", "title", "capitalize", "replace", "find", "rfind",
                                        "count", "join", "splitlines", "isdigit", "isspace", "isalpha", "isalnum",
                                        "removeprefix", "removesuffix", "index"};
        for (const char* m : methods) if (name == m) return bound_method(obj, name);
        return Value::undefined("'str object' has no attribute '" + name + "'");
      }
      case VKind::Array:
        if (name == "index" || name == "count") return bound_method(obj, name);
        if (name == "append" || name == "pop" || name == "extend" || name == "insert" || name == "remove" ||
            name == "sort" || name == "reverse" || name == "clear") {
          fail(line, "list." + name + "() modifies a list, which the sandbox transformers uses forbids");
        }
        return Value::undefined("'list object' has no attribute '" + name + "'");
      default:
        return Value::undefined(std::string("'") + type_name(obj) + " object' has no attribute '" + name + "'");
    }
  }

  Value get_item(const Value& obj, const Value& key, int line) {
    switch (obj.kind) {
      case VKind::Undefined: undefined_error(obj, line);
      case VKind::Object:
        if (key.kind == VKind::String) {
          if (const Value* v = obj.obj->find(key.s)) return *v;
          return Value::undefined(std::string("'") + (obj.obj->is_namespace ? "Namespace" : "dict object") + "' has no attribute '" + key.s + "'");
        }
        return Value::undefined(std::string("'dict object' has no attribute ") + repr(key));
      case VKind::Array:
      case VKind::String: {
        if (key.kind == VKind::String) return get_attr(obj, key.s, line);
        if (key.kind != VKind::Int && key.kind != VKind::Bool) {
          return Value::undefined(std::string(type_name(obj)) + " object has no element " + repr(key));
        }
        int64_t i = key.as_int();
        if (obj.kind == VKind::Array) {
          int64_t n = static_cast<int64_t>(obj.arr->size());
          int64_t j = i < 0 ? i + n : i;
          if (j < 0 || j >= n) return Value::undefined("list object has no element " + std::to_string(i));
          return (*obj.arr)[j];
        }
        std::u32string u = to_u32(obj.s);
        int64_t n = static_cast<int64_t>(u.size());
        int64_t j = i < 0 ? i + n : i;
        if (j < 0 || j >= n) return Value::undefined("str object has no element " + std::to_string(i));
        std::string c;
        append_utf8(c, u[j]);
        return Value::string(c);
      }
      default:
        return Value::undefined(std::string("'") + type_name(obj) + " object' has no attribute " + repr(key));
    }
  }

  // Python slice semantics (PySlice_AdjustIndices) over code points or list elements.
  template <typename Seq>
  Seq slice_seq(const Seq& s, const Value& start, const Value& stop, const Value& step, int line) {
    int64_t n = static_cast<int64_t>(s.size());
    auto num = [&](const Value& v, const char* what) -> std::optional<int64_t> {
      if (v.kind == VKind::None || v.is_undefined()) return std::nullopt;
      if (v.kind != VKind::Int && v.kind != VKind::Bool) fail(line, std::string("slice ") + what + " must be an integer");
      return v.as_int();
    };
    int64_t st = num(step, "step").value_or(1);
    if (st == 0) fail(line, "slice step cannot be zero");
    auto adjust = [&](std::optional<int64_t> x, int64_t dflt) {
      if (!x) return dflt;
      int64_t v = *x;
      if (v < 0) { v += n; if (v < 0) v = st < 0 ? -1 : 0; }
      else if (v >= n) v = st < 0 ? n - 1 : n;
      return v;
    };
    int64_t b = adjust(num(start, "start"), st < 0 ? n - 1 : 0);
    int64_t e = adjust(num(stop, "stop"), st < 0 ? -1 : n);
    Seq out;
    if (st > 0) for (int64_t k = b; k < e; k += st) out.push_back(s[k]);
    else for (int64_t k = b; k > e; k += st) out.push_back(s[k]);
    return out;
  }

  CallArgs eval_args(const Args& args) {
    CallArgs a;
    for (const auto& [name, e] : args) {
      if (name.empty()) a.pos.push_back(eval(*e));
      else a.kw.emplace_back(name, eval(*e));
    }
    return a;
  }

  Value call(const Value& callee, CallArgs& a, int line, const std::string& what) {
    if (callee.is_undefined()) undefined_error(callee, line);
    if (callee.kind != VKind::Callable) fail(line, "'" + what + "' (" + type_name(callee) + ") is not callable");
    return (*callee.fn)(a, line);
  }

  Value eval(const Expr& e) {
    Depth depth(*this, e.line);
    switch (e.k) {
      case EK::Literal: return e.literal;
      case EK::Name: return lookup(e.name, e.line);
      case EK::List: {
        Array a;
        for (const auto& k : e.kids) a.push_back(eval(*k));
        return Value::array(std::move(a));
      }
      case EK::Dict: {
        Value o = Value::object();
        for (size_t k = 0; k + 1 < e.kids.size(); k += 2) {
          Value key = eval(*e.kids[k]);
          if (key.kind != VKind::String) unsupported_at(e.line, "a dict literal with a non-string key");
          o.obj->set(key.s, eval(*e.kids[k + 1]));
        }
        return o;
      }
      case EK::Attr: return get_attr(eval(*e.kids[0]), e.name, e.line);
      case EK::Item: {
        Value obj = eval(*e.kids[0]);
        return get_item(obj, eval(*e.kids[1]), e.line);
      }
      case EK::Slice: {
        Value obj = eval(*e.kids[0]);
        Value parts[3];
        for (int k = 0; k < 3; ++k) parts[k] = e.kids[k + 1] ? eval(*e.kids[k + 1]) : Value::none();
        if (obj.kind == VKind::Array) return Value::array(slice_seq(*obj.arr, parts[0], parts[1], parts[2], e.line));
        if (obj.kind == VKind::String) return Value::string(from_u32(slice_seq(to_u32(obj.s), parts[0], parts[1], parts[2], e.line)));
        if (obj.is_undefined()) undefined_error(obj, e.line);
        fail(e.line, std::string("cannot slice a '") + type_name(obj) + "'");
      }
      case EK::Call: {
        Value callee = eval(*e.kids[0]);
        CallArgs a = eval_args(e.args);
        std::string what = e.kids[0]->k == EK::Name ? e.kids[0]->name : e.kids[0]->k == EK::Attr ? e.kids[0]->name : "expression";
        return call(callee, a, e.line, what);
      }
      case EK::Filter: {
        Value v = eval(*e.kids[0]);
        CallArgs a = eval_args(e.args);
        return apply_filter(e.name, v, a, e.line);
      }
      case EK::Test: {
        Value v = eval(*e.kids[0]);
        CallArgs a = eval_args(e.args);
        bool r = apply_test(e.name, v, a, e.line);
        return Value::boolean(e.negated ? !r : r);
      }
      case EK::Neg: case EK::Pos: {
        Value v = eval(*e.kids[0]);
        if (v.kind == VKind::Float) return Value::floating(e.k == EK::Neg ? -v.f : v.f);
        if (v.kind == VKind::Int || v.kind == VKind::Bool) {
          if (e.k == EK::Neg && v.as_int() == INT64_MIN) overflow_error("-", e.line);
          return Value::integer(e.k == EK::Neg ? -v.as_int() : v.as_int());
        }
        if (v.is_undefined()) undefined_error(v, e.line);
        fail(e.line, std::string("bad operand type for unary ") + (e.k == EK::Neg ? "-" : "+") + ": '" + type_name(v) + "'");
      }
      case EK::Not: return Value::boolean(!truthy(eval(*e.kids[0])));
      case EK::And: {
        Value a = eval(*e.kids[0]);
        return truthy(a) ? eval(*e.kids[1]) : a;
      }
      case EK::Or: {
        Value a = eval(*e.kids[0]);
        return truthy(a) ? a : eval(*e.kids[1]);
      }
      case EK::Cond: {
        if (truthy(eval(*e.kids[0]))) return eval(*e.kids[1]);
        if (e.kids[2]) return eval(*e.kids[2]);
        return Value::undefined("the inline if-expression evaluated to false and has no else section");
      }
      case EK::Binary: return binary(e.name, eval(*e.kids[0]), eval(*e.kids[1]), e.line);
    }
    fail(e.line, "internal: unknown expression");
  }

  [[noreturn]] void op_error(const std::string& op, const Value& a, const Value& b, int line) const {
    if (a.is_undefined()) undefined_error(a, line);
    if (b.is_undefined()) undefined_error(b, line);
    if (op == "+" && a.kind == VKind::String) fail(line, std::string("can only concatenate str (not \"") + type_name(b) + "\") to str");
    fail(line, "unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
  }

  bool contains(const Value& container, const Value& item, int line) {
    switch (container.kind) {
      case VKind::String:
        if (item.kind != VKind::String) fail(line, std::string("'in <string>' requires string as left operand, not ") + type_name(item));
        return container.s.find(item.s) != std::string::npos;
      case VKind::Array:
        charge(line, container.arr->size());
        for (const Value& v : *container.arr) if (values_equal(v, item)) return true;
        return false;
      case VKind::Object:
        return item.kind == VKind::String && container.obj->find(item.s) != nullptr;
      case VKind::Undefined: return false;
      default:
        fail(line, std::string("argument of type '") + type_name(container) + "' is not iterable");
    }
  }

  int compare_order(const Value& a, const Value& b, const std::string& op, int line) {
    if (a.is_number() && b.is_number()) {
      double x = a.as_double(), y = b.as_double();
      if (a.kind != VKind::Float && b.kind != VKind::Float) return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int();
      return x < y ? -1 : x > y;
    }
    if (a.kind == VKind::String && b.kind == VKind::String) {
      std::u32string x = to_u32(a.s), y = to_u32(b.s);
      return x < y ? -1 : x > y;
    }
    if (a.is_undefined()) undefined_error(a, line);
    if (b.is_undefined()) undefined_error(b, line);
    fail(line, "'" + op + "' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
  }

  // int(x) of a float: truncation toward zero, an error where int64 cannot hold it (NaN, inf,
  // |x| >= 2^63), which would be undefined behaviour in a plain cast.
  int64_t float_to_int(double x, int line) const {
    if (!(x > -9223372036854775808.0 && x < 9223372036854775808.0))
      fail(line, "int() of " + std::to_string(x) + " does not fit in a 64-bit integer");
    return static_cast<int64_t>(x);
  }
  [[noreturn]] void overflow_error(const std::string& op, int line) const {
    fail(line, "integer overflow in '" + op + "' (opd's integers are 64-bit; Python's are unbounded)");
  }
  int64_t checked_int(const std::string& op, const Value& a, const Value& b, int line) const {
    int64_t r = 0;
    const int64_t x = a.as_int(), y = b.as_int();
    const bool over = op == "+" ? __builtin_add_overflow(x, y, &r)
                    : op == "-" ? __builtin_sub_overflow(x, y, &r)
                                : __builtin_mul_overflow(x, y, &r);
    if (over) overflow_error(op, line);
    return r;
  }
  void check_list(size_t items, int line) const {
    if (items > kMaxListItems)
      fail(line, "a list of " + std::to_string(items) + " items exceeds the limit of " + std::to_string(kMaxListItems));
  }

  Value binary(const std::string& op, const Value& a, const Value& b, int line) {
    if (op == "==") return Value::boolean(values_equal(a, b));
    if (op == "!=") return Value::boolean(!values_equal(a, b));
    if (op == "<") return Value::boolean(compare_order(a, b, op, line) < 0);
    if (op == ">") return Value::boolean(compare_order(a, b, op, line) > 0);
    if (op == "<=") return Value::boolean(compare_order(a, b, op, line) <= 0);
    if (op == ">=") return Value::boolean(compare_order(a, b, op, line) >= 0);
    if (op == "in") return Value::boolean(contains(b, a, line));
    if (op == "not in") return Value::boolean(!contains(b, a, line));
    if (op == "~") {
      std::string l = to_str(a), r = to_str(b);
      check_string(l.size() + r.size(), line);
      charge(line, (l.size() + r.size()) / 64);
      return Value::string(l + r);
    }
    bool ints = (a.kind == VKind::Int || a.kind == VKind::Bool) && (b.kind == VKind::Int || b.kind == VKind::Bool);
    bool nums = a.is_number() && b.is_number();
    if (op == "+") {
      if (ints) return Value::integer(checked_int(op, a, b, line));
      if (nums) return Value::floating(a.as_double() + b.as_double());
      if (a.kind == VKind::String && b.kind == VKind::String) {
        check_string(a.s.size() + b.s.size(), line);
        charge(line, (a.s.size() + b.s.size()) / 64);
        return Value::string(a.s + b.s);
      }
      if (a.kind == VKind::Array && b.kind == VKind::Array) {
        check_list(a.arr->size() + b.arr->size(), line);
        charge(line, a.arr->size() + b.arr->size());
        Array r = *a.arr;
        r.insert(r.end(), b.arr->begin(), b.arr->end());
        return Value::array(std::move(r));
      }
      op_error(op, a, b, line);
    }
    if (op == "-") {
      if (ints) return Value::integer(checked_int(op, a, b, line));
      if (nums) return Value::floating(a.as_double() - b.as_double());
      op_error(op, a, b, line);
    }
    if (op == "*") {
      if (ints) return Value::integer(checked_int(op, a, b, line));
      if (nums) return Value::floating(a.as_double() * b.as_double());
      const Value* seq = a.kind == VKind::String || a.kind == VKind::Array ? &a : &b;
      const Value* cnt = seq == &a ? &b : &a;
      if ((seq->kind == VKind::String || seq->kind == VKind::Array) && (cnt->kind == VKind::Int || cnt->kind == VKind::Bool)) {
        int64_t times = std::max<int64_t>(0, cnt->as_int());
        const size_t unit = seq->kind == VKind::String ? seq->s.size() : seq->arr->size();
        if (unit > 0) {  // checked before anything is allocated
          const size_t limit = seq->kind == VKind::String ? kMaxStringBytes : kMaxListItems;
          if (static_cast<uint64_t>(times) > limit / unit) {
            fail(line, "'*' would build " + std::string(seq->kind == VKind::String ? "a string of " : "a list of ") +
                           std::to_string(times) + " x " + std::to_string(unit) + (seq->kind == VKind::String ? " bytes" : " items") +
                           ", over the limit of " + std::to_string(limit));
          }
        } else {
          times = std::min<int64_t>(times, 1);  // empty either way; do not loop 2^62 times
        }
        charge(line, static_cast<size_t>(times) * unit / (seq->kind == VKind::String ? 64 : 1));
        if (seq->kind == VKind::String) {
          std::string r;
          r.reserve(static_cast<size_t>(times) * unit);
          for (int64_t k = 0; k < times; ++k) r += seq->s;
          return Value::string(std::move(r));
        }
        Array r;
        for (int64_t k = 0; k < times; ++k) r.insert(r.end(), seq->arr->begin(), seq->arr->end());
        return Value::array(std::move(r));
      }
      op_error(op, a, b, line);
    }
    if (op == "/" || op == "//" || op == "%") {
      if (!nums) op_error(op, a, b, line);
      if (b.as_double() == 0) fail(line, op == "%" ? "integer modulo by zero" : "division by zero");
      if (op == "/") return Value::floating(a.as_double() / b.as_double());
      if (ints) {
        int64_t x = a.as_int(), y = b.as_int();
        if (x == INT64_MIN && y == -1) fail(line, "integer overflow in '" + op + "' (opd's integers are 64-bit)");
        int64_t q = x / y, r = x % y;
        if (r != 0 && ((r < 0) != (y < 0))) { --q; r += y; }  // Python floors
        return Value::integer(op == "//" ? q : r);
      }
      double x = a.as_double(), y = b.as_double();
      double q = std::floor(x / y);
      return Value::floating(op == "//" ? q : x - q * y);
    }
    if (op == "**") {
      if (ints && b.as_int() >= 0) {
        // Square-and-multiply with overflow checks: a huge exponent is 64 steps, not 2^63.
        int64_t r = 1, base = a.as_int();
        for (int64_t n = b.as_int(); n > 0; n >>= 1) {
          if ((n & 1) && __builtin_mul_overflow(r, base, &r)) overflow_error(op, line);
          if (n > 1 && __builtin_mul_overflow(base, base, &base)) overflow_error(op, line);
        }
        return Value::integer(r);
      }
      if (nums) return Value::floating(std::pow(a.as_double(), b.as_double()));
      op_error(op, a, b, line);
    }
    fail(line, "internal: unknown operator " + op);
  }

  // ---- methods of str, dict and list
  Value bound_method(const Value& self, const std::string& name) {
    return Value::callable(name, [this, self, name](CallArgs& a, int line) { return call_method(self, name, a, line); });
  }

  static const Value* arg(const CallArgs& a, size_t pos, const char* name) {
    if (pos < a.pos.size()) return &a.pos[pos];
    return a.kwarg(name);
  }

  std::string str_arg(const CallArgs& a, size_t pos, const char* name, const std::string& method, int line) {
    const Value* v = arg(a, pos, name);
    if (!v || v->kind != VKind::String) fail(line, method + "() argument '" + name + "' must be a string");
    return v->s;
  }

  Value call_method(const Value& self, const std::string& m, CallArgs& a, int line) {
    if (self.kind == VKind::String) {
      const std::string& s = self.s;
      if (m == "startswith" || m == "endswith") {
        const Value* p = arg(a, 0, "prefix");
        if (!p) fail(line, m + "() takes one argument");
        auto test = [&](const std::string& x) {
          if (x.size() > s.size()) return false;
          return m == "startswith" ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0;
        };
        if (p->kind == VKind::String) return Value::boolean(test(p->s));
        if (p->kind == VKind::Array) {
          for (const Value& x : *p->arr) {
            if (x.kind != VKind::String) fail(line, m + "() tuple items must be strings");
            if (test(x.s)) return Value::boolean(true);
          }
          return Value::boolean(false);
        }
        fail(line, m + "() first arg must be str or a tuple of str, not " + type_name(*p));
      }
      if (m == "strip" || m == "lstrip" || m == "rstrip") {
        const Value* c = arg(a, 0, "chars");
        std::string chars;
        bool have = c && c->kind != VKind::None;
        if (have) {
          if (c->kind != VKind::String) fail(line, m + "() arg must be None or str");
          chars = c->s;
        }
        return Value::string(py_strip(s, have ? &chars : nullptr,
                                      m == "strip" ? StripSide::Both : m == "lstrip" ? StripSide::Left : StripSide::Right));
      }
      if (m == "split" || m == "rsplit") return Value::array(py_split(s, a, m == "rsplit", line));
      if (m == "upper") return Value::string(ascii_upper(s));
      if (m == "lower") return Value::string(ascii_lower(s));
      if (m == "title" || m == "capitalize") {
        std::string r = ascii_lower(s);
        bool start = true;
        for (char& c : r) {
          bool letter = std::isalpha(static_cast<unsigned char>(c));
          if (letter && start) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
          if (m == "title") start = !letter;
          else start = false;
        }
        return Value::string(r);
      }
      if (m == "replace") {
        std::string from = str_arg(a, 0, "old", m, line), to = str_arg(a, 1, "new", m, line);
        const Value* cnt = arg(a, 2, "count");
        int64_t limit = cnt ? cnt->as_int() : -1;
        return Value::string(py_replace(s, from, to, limit));
      }
      if (m == "find" || m == "rfind" || m == "index") {
        std::string x = str_arg(a, 0, "sub", m, line);
        size_t at = m == "rfind" ? s.rfind(x) : s.find(x);
        if (at == std::string::npos) {
          if (m == "index") fail(line, "substring not found");
          return Value::integer(-1);
        }
        return Value::integer(static_cast<int64_t>(to_u32(s.substr(0, at)).size()));
      }
      if (m == "count") {
        std::string x = str_arg(a, 0, "sub", m, line);
        if (x.empty()) return Value::integer(static_cast<int64_t>(to_u32(s).size()) + 1);
        int64_t c = 0;
        for (size_t at = s.find(x); at != std::string::npos; at = s.find(x, at + x.size())) ++c;
        return Value::integer(c);
      }
      if (m == "join") {
        const Value* seq = arg(a, 0, "iterable");
        if (!seq) fail(line, "join() takes one argument");
        std::string r;
        bool first = true;
        for (const Value& v : iterate(*seq, line)) {
          if (v.kind != VKind::String) fail(line, std::string("sequence item: expected str instance, ") + type_name(v) + " found");
          if (!first) r += s;
          r += v.s;
          first = false;
        }
        return Value::string(r);
      }
      if (m == "removeprefix" || m == "removesuffix") {
        std::string x = str_arg(a, 0, m == "removeprefix" ? "prefix" : "suffix", m, line);
        if (m == "removeprefix" && s.compare(0, x.size(), x) == 0) return Value::string(s.substr(x.size()));
        if (m == "removesuffix" && !x.empty() && s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0) {
          return Value::string(s.substr(0, s.size() - x.size()));
        }
        return self;
      }
      if (m == "splitlines") {
        Array out;
        std::string cur;
        for (size_t k = 0; k < s.size(); ++k) {
          if (s[k] == '\n' || s[k] == '\r') {
            out.push_back(Value::string(cur));
            cur.clear();
            if (s[k] == '\r' && k + 1 < s.size() && s[k + 1] == '\n') ++k;
          } else cur += s[k];
        }
        if (!cur.empty()) out.push_back(Value::string(cur));
        return Value::array(std::move(out));
      }
      if (m == "isdigit" || m == "isspace" || m == "isalpha" || m == "isalnum") {
        std::u32string u = to_u32(s);
        if (u.empty()) return Value::boolean(false);
        for (char32_t c : u) {
          bool ok = m == "isspace" ? is_py_space(c)
                    : c < 0x80 && (m == "isdigit" ? std::isdigit(static_cast<int>(c))
                                   : m == "isalpha" ? std::isalpha(static_cast<int>(c))
                                                    : std::isalnum(static_cast<int>(c)));
          if (!ok) {
            if (c >= 0x80 && m != "isspace") unsupported_at(line, "str." + m + "() on non-ASCII text");
            return Value::boolean(false);
          }
        }
        return Value::boolean(true);
      }
    }
    if (self.kind == VKind::Object) {
      if (m == "items") {
        Array out;
        for (const auto& [k, v] : self.obj->items) out.push_back(Value::array({Value::string(k), v}));
        return Value::array(std::move(out));
      }
      if (m == "keys") {
        Array out;
        for (const auto& kv : self.obj->items) out.push_back(Value::string(kv.first));
        return Value::array(std::move(out));
      }
      if (m == "values") {
        Array out;
        for (const auto& kv : self.obj->items) out.push_back(kv.second);
        return Value::array(std::move(out));
      }
      if (m == "get") {
        const Value* k = arg(a, 0, "key");
        if (!k) fail(line, "get() takes a key");
        if (k->kind == VKind::String) if (const Value* v = self.obj->find(k->s)) return *v;
        const Value* d = arg(a, 1, "default");
        return d ? *d : Value::none();
      }
    }
    if (self.kind == VKind::Array) {
      const Value* x = arg(a, 0, "value");
      if (!x) fail(line, m + "() takes one argument");
      int64_t c = 0;
      for (size_t k = 0; k < self.arr->size(); ++k) {
        if (values_equal((*self.arr)[k], *x)) {
          if (m == "index") return Value::integer(static_cast<int64_t>(k));
          ++c;
        }
      }
      if (m == "index") fail(line, "list.index(x): x not in list");
      return Value::integer(c);
    }
    unsupported_at(line, std::string("the method ") + type_name(self) + "." + m + "()");
  }

  static std::string py_replace(const std::string& s, const std::string& from, const std::string& to, int64_t limit) {
    if (from.empty()) {  // Python inserts `to` between every code point
      std::u32string u = to_u32(s);
      std::string r;
      int64_t done = 0;
      for (size_t k = 0; k <= u.size(); ++k) {
        if (limit < 0 || done < limit) { r += to; ++done; }
        if (k < u.size()) append_utf8(r, u[k]);
      }
      return r;
    }
    std::string r;
    size_t at = 0;
    int64_t done = 0;
    while (limit < 0 || done < limit) {
      size_t f = s.find(from, at);
      if (f == std::string::npos) break;
      r += s.substr(at, f - at) + to;
      at = f + from.size();
      ++done;
    }
    return r + s.substr(at);
  }

  Array py_split(const std::string& s, const CallArgs& a, bool from_right, int line) {
    const Value* sep = arg(a, 0, "sep");
    const Value* mx = arg(a, 1, "maxsplit");
    int64_t maxsplit = mx ? mx->as_int() : -1;
    Array out;
    if (!sep || sep->kind == VKind::None) {  // runs of whitespace; no empty strings
      std::u32string u = to_u32(s);
      std::vector<std::u32string> words;
      if (!from_right) {
        size_t k = 0;
        int64_t splits = 0;
        while (k < u.size()) {
          while (k < u.size() && is_py_space(u[k])) ++k;
          if (k >= u.size()) break;
          if (maxsplit >= 0 && splits >= maxsplit) {
            size_t e = u.size();
            while (e > k && is_py_space(u[e - 1])) --e;
            words.push_back(u.substr(k, e - k));
            break;
          }
          size_t b = k;
          while (k < u.size() && !is_py_space(u[k])) ++k;
          words.push_back(u.substr(b, k - b));
          ++splits;
        }
      } else {
        if (maxsplit >= 0) unsupported_at(line, "str.rsplit() with maxsplit and no separator");
        size_t k = 0;
        while (k < u.size()) {
          while (k < u.size() && is_py_space(u[k])) ++k;
          if (k >= u.size()) break;
          size_t b = k;
          while (k < u.size() && !is_py_space(u[k])) ++k;
          words.push_back(u.substr(b, k - b));
        }
      }
      for (auto& w : words) out.push_back(Value::string(from_u32(w)));
      return out;
    }
    if (sep->kind != VKind::String) fail(line, "split() separator must be a string or None");
    const std::string& d = sep->s;
    if (d.empty()) fail(line, "empty separator");
    std::vector<std::string> parts;
    if (!from_right) {
      size_t at = 0;
      int64_t splits = 0;
      while (maxsplit < 0 || splits < maxsplit) {
        size_t f = s.find(d, at);
        if (f == std::string::npos) break;
        parts.push_back(s.substr(at, f - at));
        at = f + d.size();
        ++splits;
      }
      parts.push_back(s.substr(at));
    } else {
      size_t end = s.size();
      int64_t splits = 0;
      std::vector<std::string> rev;
      while (maxsplit < 0 || splits < maxsplit) {
        if (end < d.size()) break;
        size_t f = s.rfind(d, end - d.size());
        if (f == std::string::npos) break;
        rev.push_back(s.substr(f + d.size(), end - f - d.size()));
        end = f;
        ++splits;
      }
      rev.push_back(s.substr(0, end));
      parts.assign(rev.rbegin(), rev.rend());
    }
    for (auto& p : parts) out.push_back(Value::string(p));
    return out;
  }

  // ---- filters (jinja2/filters.py; tojson is transformers' json.dumps)
  Value apply_filter(const std::string& name, const Value& v, CallArgs& a, int line) {
    // Jinja's string filters take str(value); an undefined value is "".
    auto need_string = [&](const char*) -> std::string { return to_str(v); };
    if (name == "trim") {
      const Value* c = arg(a, 0, "chars");
      std::string s = need_string("trim");
      if (c && c->kind != VKind::None) return Value::string(py_strip(s, &c->s, StripSide::Both));
      return Value::string(py_strip(s, nullptr, StripSide::Both));
    }
    if (name == "tojson") {
      JsonStyle st;
      // transformers: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
      if (const Value* e = arg(a, 0, "ensure_ascii")) st.ensure_ascii = truthy(*e);
      if (const Value* ind = arg(a, 1, "indent"); ind && ind->kind != VKind::None) {
        if (ind->kind == VKind::String) unsupported_at(line, "tojson(indent=<string>)");
        if (ind->as_int() > 1024) fail(line, "tojson indent " + std::to_string(ind->as_int()) + " is over 1024");
        st.indent = static_cast<int>(std::max<int64_t>(0, ind->as_int()));
        st.item_sep = ",";
      }
      if (const Value* sep = arg(a, 2, "separators"); sep && sep->kind != VKind::None) {
        if (sep->kind != VKind::Array || sep->arr->size() != 2 || (*sep->arr)[0].kind != VKind::String ||
            (*sep->arr)[1].kind != VKind::String) {
          fail(line, "tojson separators must be a pair of strings");
        }
        st.item_sep = (*sep->arr)[0].s;
        st.key_sep = (*sep->arr)[1].s;
      }
      if (const Value* sk = arg(a, 3, "sort_keys")) st.sort_keys = truthy(*sk);
      std::string out;
      json_dump(out, v, st, 0, line);
      return Value::string(out);
    }
    if (name == "length" || name == "count") {
      switch (v.kind) {
        case VKind::Undefined: return Value::integer(0);
        case VKind::String: return Value::integer(static_cast<int64_t>(to_u32(v.s).size()));
        case VKind::Array: return Value::integer(static_cast<int64_t>(v.arr->size()));
        case VKind::Object: if (!v.obj->is_namespace) return Value::integer(static_cast<int64_t>(v.obj->items.size())); break;
        default: break;
      }
      fail(line, std::string("object of type '") + type_name(v) + "' has no len()");
    }
    if (name == "items") {
      if (v.is_undefined()) return Value::array();
      if (v.kind != VKind::Object || v.obj->is_namespace) fail(line, std::string("items filter: can only get item pairs from a mapping, not ") + type_name(v));
      return call_method(v, "items", a, line);
    }
    if (name == "list") return Value::array(iterate(v, line));
    if (name == "string") return Value::string(to_str(v));
    if (name == "safe") return v;
    if (name == "upper") return Value::string(ascii_upper(need_string("upper")));
    if (name == "lower") return Value::string(ascii_lower(need_string("lower")));
    if (name == "capitalize" || name == "title") {
      CallArgs none;
      return call_method(Value::string(need_string(name.c_str())), name, none, line);
    }
    if (name == "replace") {
      std::string s = need_string("replace");
      const Value* from = arg(a, 0, "old");
      const Value* to = arg(a, 1, "new");
      const Value* cnt = arg(a, 2, "count");
      if (!from || !to) fail(line, "replace filter needs old and new");
      return Value::string(py_replace(s, to_str(*from), to_str(*to), cnt && cnt->kind != VKind::None ? cnt->as_int() : -1));
    }
    if (name == "first" || name == "last") {
      Array items = iterate(v, line);
      if (items.empty()) return Value::undefined("No " + name + " item, sequence was empty.");
      return name == "first" ? items.front() : items.back();
    }
    if (name == "reverse") {
      if (v.kind == VKind::String) {
        std::u32string u = to_u32(v.s);
        std::reverse(u.begin(), u.end());
        return Value::string(from_u32(u));
      }
      Array items = iterate(v, line);
      std::reverse(items.begin(), items.end());
      return Value::array(std::move(items));
    }
    if (name == "join") {
      const Value* d = arg(a, 0, "d");
      const Value* attr = arg(a, 1, "attribute");
      std::string sep = d ? to_str(*d) : "";
      std::string out;
      bool first = true;
      for (const Value& item : iterate(v, line)) {
        if (!first) out += sep;
        out += to_str(attr ? get_item(item, *attr, line) : item);
        first = false;
      }
      return Value::string(out);
    }
    if (name == "default" || name == "d") {
      const Value* dflt = arg(a, 0, "default_value");
      const Value* boolean = arg(a, 1, "boolean");
      bool use = v.is_undefined() || (boolean && truthy(*boolean) && !truthy(v));
      if (use) return dflt ? *dflt : Value::string("");
      return v;
    }
    if (name == "int") {
      if (v.kind == VKind::Int || v.kind == VKind::Bool) return Value::integer(v.as_int());
      if (v.kind == VKind::Float) return Value::integer(float_to_int(v.f, line));
      if (v.kind == VKind::String) {
        std::string t = py_strip(v.s, nullptr, StripSide::Both);
        int64_t x = 0;
        auto r = std::from_chars(t.data(), t.data() + t.size(), x);
        if (r.ec == std::errc() && r.ptr == t.data() + t.size()) return Value::integer(x);
        char* end = nullptr;
        double d = std::strtod(t.c_str(), &end);
        if (!t.empty() && end == t.c_str() + t.size()) return Value::integer(float_to_int(d, line));
      }
      const Value* dflt = arg(a, 0, "default");
      return dflt ? *dflt : Value::integer(0);
    }
    if (name == "float") {
      if (v.is_number()) return Value::floating(v.as_double());
      if (v.kind == VKind::String) {
        std::string t = py_strip(v.s, nullptr, StripSide::Both);
        char* end = nullptr;
        double d = std::strtod(t.c_str(), &end);
        if (!t.empty() && end == t.c_str() + t.size()) return Value::floating(d);
      }
      const Value* dflt = arg(a, 0, "default");
      return dflt ? *dflt : Value::floating(0);
    }
    if (name == "abs") {
      if (v.kind == VKind::Float) return Value::floating(std::fabs(v.f));
      if (v.kind == VKind::Int || v.kind == VKind::Bool) {
        if (v.as_int() == INT64_MIN) overflow_error("abs", line);
        return Value::integer(std::llabs(v.as_int()));
      }
      fail(line, std::string("bad operand type for abs(): '") + type_name(v) + "'");
    }
    if (name == "unique") {
      Array out;
      for (const Value& item : iterate(v, line)) {
        bool seen = false;
        charge(line, out.size());
        for (const Value& o : out) if (values_equal(o, item)) { seen = true; break; }
        if (!seen) out.push_back(item);
      }
      return Value::array(std::move(out));
    }
    if (name == "indent") {
      const Value* w = arg(a, 0, "width");
      const Value* first = arg(a, 1, "first");
      const Value* blank = arg(a, 2, "blank");
      if (w && w->kind == VKind::String) unsupported_at(line, "indent(width=<string>)");
      const int64_t width = w ? w->as_int() : 4;
      if (width < 0 || width > 1024) fail(line, "indent width " + std::to_string(width) + " is outside 0..1024");
      std::string pad(static_cast<size_t>(width), ' ');
      std::string s = need_string("indent");
      // jinja2 do_indent: lines after the first get the pad (blank lines only with blank=True).
      std::string out;
      std::vector<std::string> lines;
      size_t at = 0;
      while (true) {
        size_t nl = s.find('\n', at);
        if (nl == std::string::npos) { lines.push_back(s.substr(at)); break; }
        lines.push_back(s.substr(at, nl - at));
        at = nl + 1;
      }
      for (size_t k = 0; k < lines.size(); ++k) {
        if (k) out += '\n';
        bool pad_it = k == 0 ? (first && truthy(*first)) : (blank && truthy(*blank)) || !lines[k].empty();
        check_string(out.size() + pad.size() + lines[k].size(), line);
        if (pad_it) out += pad;
        out += lines[k];
      }
      return Value::string(out);
    }
    if (name == "map") {
      Array items = iterate(v, line);
      Array out;
      if (const Value* attr = a.kwarg("attribute")) {
        const Value* dflt = a.kwarg("default");
        for (const Value& item : items) {
          Value got = attr->kind == VKind::String ? get_attr_path(item, attr->s, line) : get_item(item, *attr, line);
          out.push_back(got.is_undefined() && dflt ? *dflt : got);
        }
        return Value::array(std::move(out));
      }
      if (a.pos.empty() || a.pos[0].kind != VKind::String) fail(line, "map needs attribute= or a filter name");
      std::string f = a.pos[0].s;
      CallArgs rest;
      rest.pos.assign(a.pos.begin() + 1, a.pos.end());
      rest.kw = a.kw;
      for (const Value& item : items) out.push_back(apply_filter(f, item, rest, line));
      return Value::array(std::move(out));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      bool by_attr = name == "selectattr" || name == "rejectattr";
      bool keep_if = name == "select" || name == "selectattr";
      size_t p = 0;
      std::string attr;
      if (by_attr) {
        if (a.pos.empty() || a.pos[0].kind != VKind::String) fail(line, name + " needs an attribute name");
        attr = a.pos[0].s;
        p = 1;
      }
      std::string test = p < a.pos.size() ? to_str(a.pos[p]) : "";
      CallArgs targs;
      if (p + 1 < a.pos.size()) targs.pos.assign(a.pos.begin() + p + 1, a.pos.end());
      Array out;
      for (const Value& item : iterate(v, line)) {
        Value x = by_attr ? get_attr_path(item, attr, line) : item;
        bool r = test.empty() ? truthy(x) : apply_test(test, x, targs, line);
        if (r == keep_if) out.push_back(item);
      }
      return Value::array(std::move(out));
    }
    if (name == "dictsort" || name == "sort" || name == "batch" || name == "slice" || name == "groupby" ||
        name == "sum" || name == "min" || name == "max" || name == "round" || name == "format" ||
        name == "wordcount" || name == "truncate" || name == "center" || name == "escape" || name == "e" ||
        name == "urlencode" || name == "xmlattr" || name == "striptags" || name == "wordwrap" ||
        name == "filesizeformat" || name == "pprint" || name == "random" || name == "attr" ||
        name == "forceescape" || name == "urlize" || name == "mark_safe") {
      unsupported_at(line, "the filter '" + name + "'");
    }
    unsupported_at(line, "the unknown filter '" + name + "'");
  }

  // jinja2's attribute paths for map/selectattr: "a.b" and integer parts.
  Value get_attr_path(const Value& item, const std::string& path, int line) {
    Value cur = item;
    size_t at = 0;
    while (true) {
      size_t dot = path.find('.', at);
      std::string part = path.substr(at, dot == std::string::npos ? std::string::npos : dot - at);
      bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
      if (cur.is_undefined()) return cur;
      cur = digits ? get_item(cur, Value::integer(std::stoll(part)), line) : get_item(cur, Value::string(part), line);
      if (dot == std::string::npos) return cur;
      at = dot + 1;
    }
  }

  // ---- tests (jinja2/tests.py)
  bool apply_test(const std::string& name, const Value& v, CallArgs& a, int line) {
    auto other = [&]() -> const Value& {
      if (a.pos.empty()) fail(line, "the test '" + name + "' needs an argument");
      return a.pos[0];
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.kind == VKind::None;
    if (name == "string") return v.kind == VKind::String;
    if (name == "number") return v.is_number();
    if (name == "integer") return v.kind == VKind::Int;
    if (name == "float") return v.kind == VKind::Float;
    if (name == "boolean") return v.kind == VKind::Bool;
    if (name == "true") return v.kind == VKind::Bool && v.b;
    if (name == "false") return v.kind == VKind::Bool && !v.b;
    if (name == "mapping") return v.kind == VKind::Object && !v.obj->is_namespace;
    if (name == "iterable") return v.kind == VKind::Array || v.kind == VKind::String || v.kind == VKind::Undefined ||
                                   (v.kind == VKind::Object && !v.obj->is_namespace);
    if (name == "sequence") return v.kind == VKind::Array || v.kind == VKind::String ||
                                   (v.kind == VKind::Object && !v.obj->is_namespace);
    if (name == "callable") return v.kind == VKind::Callable;
    if (name == "equalto" || name == "eq" || name == "==") return values_equal(v, other());
    if (name == "ne" || name == "!=") return !values_equal(v, other());
    if (name == "sameas") {
      const Value& o = other();
      if (v.kind != o.kind) return false;
      if (v.kind == VKind::None || v.kind == VKind::Undefined) return true;
      if (v.kind == VKind::Bool) return v.b == o.b;
      if (v.kind == VKind::Array) return v.arr == o.arr;
      if (v.kind == VKind::Object) return v.obj == o.obj;
      return values_equal(v, o);
    }
    if (name == "lt" || name == "lessthan" || name == "<") return compare_order(v, other(), "<", line) < 0;
    if (name == "gt" || name == "greaterthan" || name == ">") return compare_order(v, other(), ">", line) > 0;
    if (name == "le" || name == "<=") return compare_order(v, other(), "<=", line) <= 0;
    if (name == "ge" || name == ">=") return compare_order(v, other(), ">=", line) >= 0;
    if (name == "in") return contains(other(), v, line);
    if (name == "odd" || name == "even" || name == "divisibleby") {
      if (v.kind != VKind::Int && v.kind != VKind::Bool) fail(line, "the test '" + name + "' needs an integer");
      int64_t x = v.as_int();
      if (name == "odd") return ((x % 2) + 2) % 2 == 1;
      if (name == "even") return x % 2 == 0;
      int64_t d = other().as_int();
      if (d == 0) fail(line, "divisibleby 0");
      return x % d == 0;
    }
    if (name == "lower" || name == "upper") {
      std::string s = to_str(v);
      return name == "lower" ? ascii_lower(s) == s : ascii_upper(s) == s;
    }
    unsupported_at(line, "the test '" + name + "'");
  }

  const ChatTemplate::Program& prog_;
  std::optional<std::chrono::system_clock::time_point> now_;
  std::vector<Scope> scopes_;
};


bool file_exists(const std::string& path) {
  std::ifstream f(path);
  return f.good();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// ChatTemplate

ChatTemplate ChatTemplate::from_string(const std::string& source, const std::string& origin) {
  auto prog = std::make_shared<Program>();
  prog->source = source;
  prog->origin = origin;
  Lexer lexer(source, origin);
  Parser parser(lexer.run(), origin);
  prog->body = parser.parse_template();
  ChatTemplate t;
  t.program_ = std::move(prog);
  return t;
}

ChatTemplate ChatTemplate::from_file(const std::string& path) {
  return from_string(read_text_file(path), path);
}

std::map<std::string, std::string> special_tokens_from_config(const nlohmann::json& cfg) {
  std::map<std::string, std::string> out;
  if (!cfg.is_object()) return out;
  auto take = [&](const std::string& key, const nlohmann::json& v) {
    if (v.is_string()) out[key] = v.get<std::string>();
    else if (v.is_object() && v.contains("content") && v["content"].is_string()) out[key] = v["content"].get<std::string>();
  };
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    if (cfg.contains(key)) take(key, cfg[key]);
  }
  if (cfg.contains("extra_special_tokens") && cfg["extra_special_tokens"].is_object()) {
    for (auto it = cfg["extra_special_tokens"].begin(); it != cfg["extra_special_tokens"].end(); ++it) take(it.key(), it.value());
  }
  return out;
}

ChatTemplate ChatTemplate::from_model_dir(const std::string& dir) {
  const std::string cfg_path = dir + "/tokenizer_config.json";
  const std::string jinja_path = dir + "/chat_template.jinja";
  nlohmann::json cfg;
  if (file_exists(cfg_path)) {
    try {
      const std::string text = read_text_file(cfg_path);
      check_json_depth(text, cfg_path);
      cfg = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {  // out_of_range too (1e999)
      OPD_FAIL(InvalidData, cfg_path, ": invalid JSON: ", e.what());
    }
  }
  std::optional<ChatTemplate> t;
  if (file_exists(jinja_path)) {
    t = from_file(jinja_path);
  } else if (cfg.is_object() && cfg.contains("chat_template") && !cfg["chat_template"].is_null()) {
    const auto& ct = cfg["chat_template"];
    if (ct.is_string()) {
      t = from_string(ct.get<std::string>(), cfg_path + " (chat_template)");
    } else if (ct.is_array()) {
      for (const auto& entry : ct) {
        if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") && entry["template"].is_string()) {
          t = from_string(entry["template"].get<std::string>(), cfg_path + " (chat_template 'default')");
        }
      }
      OPD_CHECK(t.has_value(), InvalidData, cfg_path, ": chat_template is a list without a 'default' entry; pass --chat-template FILE");
    } else {
      OPD_FAIL(InvalidData, cfg_path, ": chat_template must be a string or a list of {name, template}, got ", ct.type_name());
    }
  }
  OPD_CHECK(t.has_value(), InvalidData, dir, ": no chat template (neither chat_template.jinja nor a \"chat_template\" in tokenizer_config.json); pass --chat-template FILE");
  t->set_special_tokens(special_tokens_from_config(cfg));
  return std::move(*t);
}

const std::string& ChatTemplate::source() const { return program_->source; }
const std::string& ChatTemplate::origin() const { return program_->origin; }
std::string ChatTemplate::sha256() const { return sha256_hex(program_->source); }

std::string ChatTemplate::render(const nlohmann::ordered_json& messages, const ChatTemplateOptions& options) const {
  OPD_CHECK(messages.is_array(), InvalidArgument, "chat template ", origin(), ": messages must be a JSON array, got ",
            messages.type_name());
  Array msgs;
  for (size_t k = 0; k < messages.size(); ++k) {
    const auto& m = messages[k];
    OPD_CHECK(m.is_object(), InvalidArgument, "chat template ", origin(), ": message ", k,
              " must be a JSON object, got ", m.type_name());
    // transformers' _normalize_chat_messages drops keys whose value is None...
    Value obj = Value::object();
    for (auto it = m.begin(); it != m.end(); ++it) {
      if (!it.value().is_null()) obj.obj->set(it.key(), from_json(it.value()));
    }
    // ...and _alias_reasoning_fields: {"thinking": r, **message, "reasoning_content": r}.
    const Value* reasoning = nullptr;
    for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
      if (const Value* r = obj.obj->find(key)) { reasoning = r; break; }
    }
    if (reasoning) {
      Value r = *reasoning;
      Value aliased = Value::object();
      aliased.obj->set("thinking", r);
      for (const auto& [key, v] : obj.obj->items) aliased.obj->set(key, key == "thinking" ? r : v);
      aliased.obj->set("reasoning_content", r);
      obj = aliased;
    }
    msgs.push_back(obj);
  }
  Renderer r(*program_, options.now);
  for (const auto& [k, v] : special_tokens_) r.set_global(k, Value::string(v));
  if (options.enable_thinking) r.set_global("enable_thinking", Value::boolean(*options.enable_thinking));
  OPD_CHECK(options.extra.is_object(), InvalidArgument, "chat template extra variables must be a JSON object");
  for (auto it = options.extra.begin(); it != options.extra.end(); ++it) r.set_global(it.key(), from_json(it.value()));
  r.set_global("messages", Value::array(std::move(msgs)));
  OPD_CHECK(options.tools.is_null() || options.tools.is_array(), InvalidArgument,
            "chat template tools must be a JSON array or null, got ", options.tools.type_name());
  r.set_global("tools", from_json(options.tools));
  r.set_global("documents", Value::none());
  r.set_global("add_generation_prompt", Value::boolean(options.add_generation_prompt));
  return r.run();
}

}  // namespace opd
