// opd command-line entry point: parses the subcommand and turns opd::Error into an exit code.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/flags_file.h"
#include "core/error.h"
#include "core/log.h"
#include "train/signals.h"  // install_training_signal_handlers

namespace {

// A training run's signal policy holds from its first moment. Installed when the trainer started,
// a SIGTERM or SIGINT in the first ~100 ms (library constructors: OpenBLAS, cuBLAS; flag parsing)
// killed the run without a checkpoint (exit 143) and a SIGHUP killed it outright. A .preinit_array
// entry runs before any shared library's constructor, with main's arguments (glibc).
void install_early_training_signal_handlers(int argc, char** argv, char**) {
  if (argc > 1 && (std::strcmp(argv[1], "train") == 0 || std::strcmp(argv[1], "sft") == 0))
    opd::install_training_signal_handlers();
}
__attribute__((section(".preinit_array"), used)) void (*const kEarlySignals)(int, char**, char**) =
    &install_early_training_signal_handlers;

}  // namespace

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
