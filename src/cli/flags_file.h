// Flags files: `opd train --config run.toml` (and the other commands that call
// accept_flags_file) read flags from a file. CLI11's own config support (2.1, Debian's) ignores
// a config option set on a subcommand, so opd expands the file itself, before CLI11 parses (the
// text is parsed by core/flags_text.h, fuzzed in tests/core; this file maps keys to flags):
//   - TOML: `key = value` lines, `#` comments, an optional `[train]` header naming the command;
//     values are strings ("..." with \" \\ \n \t escapes, or '...'), integers and floats (`_`
//     separators allowed), true / false, and one-line arrays of those (for repeatable flags).
//   - JSON (a file ending in .json): one object of the same keys and values.
// A key is a flag's long name without `--`; `learning_rate` finds `--learning-rate` (TRL and
// ms-swift configs spell them with underscores). A flag also given on the command line keeps
// the command line's value. An unknown key, a malformed line or a value of the wrong shape is
// an error naming the file, the line and the key (CLI11 then checks the values themselves, as
// it does for the command line).
#pragma once

#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace opd::cli {

// Adds `--config FILE` to `cmd` (shown in its --help) and marks it for expand_flags_files.
void accept_flags_file(CLI::App* cmd);

// argv as strings, with the --config FILE of the selected command (if it accepts one) expanded
// into the flags the file holds, placed right after the command's name (before the command
// line's own flags). Throws opd::Error: InvalidData for the file's content, Io when it cannot
// be read, InvalidArgument for --config given twice. `file_used` (optional) gets the file's
// path when one was expanded.
std::vector<std::string> expand_flags_files(const CLI::App& app, int argc, const char* const* argv,
                                            std::string* file_used = nullptr);

}  // namespace opd::cli
