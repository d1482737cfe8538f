// Flags files (cli/flags_file.h): a TOML subset or a JSON object, expanded into command-line
// flags before CLI11 parses.
#include "cli/flags_file.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/flags_text.h"

namespace opd::cli {
namespace {

using Entry = FlagsEntry;
using Scalar = FlagsScalar;

// The commands that take a flags file (filled while main registers the commands, before any
// thread starts).
std::set<const CLI::App*>& accepting() {
  static std::set<const CLI::App*> s;
  return s;
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
  if (!accepting().count(cmd)) return args;
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
  const std::vector<Entry> entries = parse_flags_text(ss.str(), file, json, cmd->get_name());

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
