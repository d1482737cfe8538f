// PCRE2 wrapper and Oniguruma-to-PCRE2 pattern translation (see regex.h).
#include "tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace opd {
namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

// Per-thread match scratch: match data and a JIT stack large enough for long whitespace runs
// (the default 32 KiB machine stack fails on patterns like \s+(?!\S) over megabytes of spaces).
struct Scratch {
  pcre2_match_data* data = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  pcre2_match_context* context = nullptr;
  Scratch() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, nullptr);
    if (jit_stack) pcre2_jit_stack_assign(context, nullptr, jit_stack);
    if (!data || !context) OPD_FAIL(OutOfMemory, "PCRE2: cannot allocate match data");
  }
  ~Scratch() {
    pcre2_match_data_free(data);
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(jit_stack);
  }
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

}  // namespace

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

std::string translate_pattern(std::string_view p) {
  const std::string space = unicode::regex_space_class();
  const std::string letter = "\\p{L}" + unicode::regex_letter_delta();
  const std::string number = "\\p{N}" + unicode::regex_number_delta();
  std::string out;
  out.reserve(p.size() * 2);
  bool in_class = false;
  size_t class_start = 0;  // index in p just after '[' or '[^'
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      std::string_view prop;
      size_t len = 2;
      if ((e == 'p' || e == 'P') && p.substr(i + 2, 3) == "{L}") prop = "L", len = 5;
      if ((e == 'p' || e == 'P') && p.substr(i + 2, 3) == "{N}") prop = "N", len = 5;
      const std::string* body = nullptr;
      bool negated = false;
      if (e == 's' || e == 'S') {
        body = &space;
        negated = e == 'S';
      } else if (!prop.empty()) {
        body = prop == "L" ? &letter : &number;
        negated = e == 'P';
      }
      if (body) {
        if (in_class) {
          if (negated)
            OPD_FAIL(Unsupported, "tokenizer regex: '\\", e,
                     "' inside a character class cannot be translated to PCRE2: ", p);
          out += *body;
        } else {
          out += negated ? "[^" : "[";
          out += *body;
          out += "]";
        }
        i += len - 1;
        continue;
      }
      out += c;
      out += e;
      ++i;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      class_start = i + 1;
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:]
      const size_t end = p.find(":]", i + 2);
      if (end != std::string_view::npos) {
        out += p.substr(i, end + 2 - i);
        i = end + 1;
        continue;
      }
    }
    if (in_class && c == '[')
      OPD_FAIL(Unsupported, "tokenizer regex: nested character class is not supported: ", p);
    if (in_class && c == ']' && i != class_start) in_class = false;
    out += c;
  }
  return out;
}

Regex::Regex(const std::string& pattern, const std::string& what)
    : code_(std::make_unique<Code>()), pattern_(pattern), what_(what) {
  int err = 0;
  PCRE2_SIZE offset = 0;
  code_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
  if (!code_->code)
    OPD_FAIL(InvalidData, what, ": regex does not compile (PCRE2: ", pcre2_message(err),
             " at offset ", offset, "): ", pattern);
  // JIT is an optimization: without it (a PCRE2 built without JIT) the interpreter runs.
  pcre2_jit_compile(code_->code, PCRE2_JIT_COMPLETE);
}

Regex::~Regex() = default;

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const {
  Scratch& s = scratch();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  while (pos < text.size()) {
    // The caller guarantees valid UTF-8 (the tokenizer replaces invalid bytes first).
    const int rc = pcre2_match(code_->code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK,
                               s.data, s.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    // PCRE2's own resource limits (match steps, depth, heap, JIT stack) stop catastrophic
    // backtracking, e.g. (a+)+$ over a long run of 'a': the pattern (from tokenizer.json) is
    // at fault, not opd, so it is InvalidData naming it, in bounded time.
    if (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT || rc == PCRE2_ERROR_HEAPLIMIT ||
        rc == PCRE2_ERROR_JIT_STACKLIMIT)
      OPD_FAIL(InvalidData, what_, ": regex hit a PCRE2 resource limit (", pcre2_message(rc),
               ") on a text of ", text.size(), " bytes: a pathological pattern? ", pattern_);
    if (rc < 0)
      OPD_FAIL(Internal, what_, ": regex match failed (PCRE2: ", pcre2_message(rc),
               ") on a text of ", text.size(), " bytes");
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(s.data);
    const size_t start = ov[0], end = ov[1];
    if (end > start) {
      out.emplace_back(start, end);
      pos = end;
    } else {
      // Empty match: step over one whole character.
      pos = start + 1;
      while (pos < text.size() && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80) ++pos;
    }
  }
}

}  // namespace opd
