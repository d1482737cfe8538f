// Flags files (cli/flags_file.h): a TOML subset or a JSON object, expanded into command-line
// flags before CLI11 parses.
#include "cli/flags_file.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include "core/error.h"

namespace opd::cli {
namespace {

std::mutex g_mu;
std::set<const CLI::App*>& accepting() {
  static std::set<const CLI::App*> s;
  return s;
}

// One scalar of a file: its text as a flag value, and whether it was a boolean.
struct Scalar {
  std::string text;
  bool is_bool = false;
};
// One `key = value` entry; where = "FILE:LINE" (TOML) or "FILE" (JSON) for messages.
struct Entry {
  std::string key, where;
  std::vector<Scalar> values;
  bool is_array = false;
};

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
  try {
    doc = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
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

// ---- keys to flags ------------------------------------------------------------------------

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

const CLI::Option* find_flag(const CLI::App& cmd, const std::string& key) {
  if (key.empty() || key[0] == '-') return nullptr;
  if (const CLI::Option* o = cmd.get_option_no_throw("--" + key)) return o;
  std::string dashed = key;
  std::replace(dashed.begin(), dashed.end(), '_', '-');
  return cmd.get_option_no_throw("--" + dashed);
}

[[noreturn]] void unknown_key(const CLI::App& cmd, const Entry& e) {
  std::string best;
  std::string dashed = e.key;
  std::replace(dashed.begin(), dashed.end(), '_', '-');
  size_t best_d = std::max<size_t>(2, dashed.size() / 3) + 1;  // a suggestion must be close
  for (const CLI::Option* o : cmd.get_options()) {
    for (const std::string& name : o->get_lnames()) {
      if (name == "help" || name == "config") continue;
      const size_t d = edit_distance(dashed, name);
      if (d < best_d) {
        best_d = d;
        best = name;
      }
    }
  }
  OPD_FAIL(InvalidData, e.where, ": `", e.key, "` is not a flag of `opd ", cmd.get_name(), "`",
           best.empty() ? std::string() : " (did you mean `" + best + "`?)",
           "; `opd ", cmd.get_name(), " --help` lists them");
}

// The option a command-line token names ("--x", "--x=v", "-x"), or nullptr.
const CLI::Option* named_by(const CLI::App& cmd, const std::string& token) {
  if (token.size() < 2 || token[0] != '-' || token == "--") return nullptr;
  const std::string name = token.substr(0, token.find('='));
  return cmd.get_option_no_throw(name);
}

void append_flag(const CLI::App& cmd, const Entry& e, const CLI::Option* opt,
                 std::vector<std::string>& out) {
  const std::string flag = "--" + opt->get_lnames().front();
  const bool is_flag = opt->get_expected_max() == 0;  // add_flag: takes no value
  const bool repeatable = opt->get_items_expected_max() > 1;
  if (is_flag) {
    if (e.is_array || !e.values[0].is_bool)
      OPD_FAIL(InvalidData, e.where, ": `", e.key, "` is a switch of `opd ", cmd.get_name(),
               "`: true or false");
    out.push_back(flag + "=" + e.values[0].text);
    return;
  }
  if (e.is_array && !repeatable)
    OPD_FAIL(InvalidData, e.where, ": `", e.key, "` takes one value, not an array");
  if (e.values.empty())
    OPD_FAIL(InvalidData, e.where, ": `", e.key, "` = []: an empty array sets nothing");
  // `--flag=value`: a value that starts with '-' stays a value.
  for (const Scalar& v : e.values) out.push_back(flag + "=" + v.text);
}

}  // namespace

void accept_flags_file(CLI::App* cmd) {
  cmd->add_option("--config", "flags file: TOML `key = value` lines (or a .json object), key = a "
                  "flag's name without -- (learning_rate or learning-rate); flags given on the "
                  "command line win (README: \"Flags files\")")
      ->type_name("FILE");
  std::lock_guard<std::mutex> lock(g_mu);
  accepting().insert(cmd);
}

std::vector<std::string> expand_flags_files(const CLI::App& app, int argc,
                                            const char* const* argv, std::string* file_used) {
  std::vector<std::string> args(argv, argv + argc);
  // The selected command: the leading words that name subcommands.
  const CLI::App* cmd = &app;
  size_t i = 1;
  while (i < args.size() && !args[i].empty() && args[i][0] != '-') {
    const CLI::App* next = nullptr;
    for (const CLI::App* sub : cmd->get_subcommands([](const CLI::App*) { return true; }))
      if (sub->check_name(args[i])) next = sub;
    if (!next) break;
    cmd = next;
    ++i;
  }
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!accepting().count(cmd)) return args;
  }
  const size_t first_flag = i;
  std::string file;
  int given = 0;
  for (size_t j = first_flag; j < args.size(); ++j) {
    if (args[j] == "--") break;
    if (args[j] == "--config" && j + 1 < args.size()) {
      file = args[j + 1];
      ++given;
    } else if (args[j].rfind("--config=", 0) == 0) {
      file = args[j].substr(9);
      ++given;
    }
  }
  if (given == 0) return args;
  OPD_CHECK(given == 1, InvalidArgument, "`opd ", cmd->get_name(), "`: --config given ", given,
            " times (one flags file)");
  std::ifstream f(file, std::ios::binary);
  OPD_CHECK(f.good(), Io, "flags file ", file, ": cannot be read (--config)");
  std::stringstream ss;
  ss << f.rdbuf();
  const bool json = file.size() >= 5 && file.compare(file.size() - 5, 5, ".json") == 0;
  const std::vector<Entry> entries =
      json ? parse_json(ss.str(), file) : parse_toml(ss.str(), file, cmd->get_name());

  // Flags the command line gives itself: the file's value for them is not used.
  std::set<const CLI::Option*> on_command_line;
  for (size_t j = first_flag; j < args.size() && args[j] != "--"; ++j)
    if (const CLI::Option* o = named_by(*cmd, args[j])) on_command_line.insert(o);
  std::set<const CLI::Option*> seen;
  std::vector<std::string> from_file;
  for (const Entry& e : entries) {
    const CLI::Option* opt = find_flag(*cmd, e.key);
    if (!opt) unknown_key(*cmd, e);
    if (opt->get_lnames().empty() || opt->get_lnames().front() == "config" ||
        opt->get_lnames().front() == "help")
      OPD_FAIL(InvalidData, e.where, ": `", e.key, "` cannot be set from a flags file");
    if (!seen.insert(opt).second)
      OPD_FAIL(InvalidData, e.where, ": `", e.key, "` is set twice in the file");
    if (on_command_line.count(opt)) continue;
    append_flag(*cmd, e, opt, from_file);
  }
  args.insert(args.begin() + static_cast<std::ptrdiff_t>(first_flag), from_file.begin(),
              from_file.end());
  if (file_used) *file_used = file;
  return args;
}

}  // namespace opd::cli
