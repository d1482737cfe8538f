// The subcommand table (one register_* per src/cli/<name>.cpp).
#include "cli/commands.h"

#include <CLI/CLI.hpp>

namespace opd::cli {

namespace { int g_exit_code = 0; }
int exit_code() { return g_exit_code; }
void set_exit_code(int code) { g_exit_code = code; }

void register_commands(CLI::App& app) {
  register_info(app);
  register_predict(app);
  register_tokenize(app);
  register_serve(app);
  register_score(app);
}

}  // namespace opd::cli
