// `opd predict` (placeholder until model/ lands in this session).
#include <CLI/CLI.hpp>
#include "cli/commands.h"
namespace opd::cli {
void register_predict(CLI::App& app) { app.add_subcommand("predict", "next-token predictions"); }
}  // namespace opd::cli
