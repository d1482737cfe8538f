// opd command-line entry point: parses the subcommand and turns opd::Error into an exit code.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/flags_file.h"
#include "core/error.h"
#include "core/log.h"

int main(int argc, char** argv) {
  CLI::App app{"opd: on-policy distillation engine (native C++/CUDA)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "opd 0.1.0");
  opd::cli::register_commands(app);
  std::string flags_file;
  try {
    // `--config FILE` of the commands that take a flags file, expanded before CLI11 parses.
    const std::vector<std::string> args = opd::cli::expand_flags_files(app, argc, argv, &flags_file);
    std::vector<char*> ptrs;
    for (const std::string& a : args) ptrs.push_back(const_cast<char*>(a.c_str()));
    app.parse(static_cast<int>(ptrs.size()), ptrs.data());
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    if (code != 0 && !flags_file.empty())
      std::fprintf(stderr, "(the flags above include those of the flags file %s)\n",
                   flags_file.c_str());
    return code;
  } catch (const opd::Error& e) {
    opd::log_error(opd::error_kind_name(e.kind()), ": ", e.what());
    return 1;
  } catch (const std::exception& e) {
    opd::log_error("unexpected error: ", e.what());
    return 1;
  }
  return opd::cli::exit_code();
}
