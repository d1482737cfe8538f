// `opd info DIR [--json]` (placeholder until model/ lands in this session).
#include <CLI/CLI.hpp>
#include "cli/commands.h"
namespace opd::cli {
void register_info(CLI::App& app) { app.add_subcommand("info", "describe a model directory"); }
}  // namespace opd::cli
