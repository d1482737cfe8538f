// opd command-line entry point: parses the subcommand and turns opd::Error into an exit code.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"

int main(int argc, char** argv) {
  CLI::App app{"opd: on-policy distillation engine (native C++/CUDA)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "opd 0.1.0");
  opd::cli::register_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const opd::Error& e) {
    opd::log_error(opd::error_kind_name(e.kind()), ": ", e.what());
    return 1;
  } catch (const std::exception& e) {
    opd::log_error("unexpected error: ", e.what());
    return 1;
  }
  return opd::cli::exit_code();
}
