// `opd report RUN_DIR [--out FILE] [--max-points N]`: writes a self-contained HTML page with one
// plot per numeric series of RUN_DIR/metrics.jsonl and the run's config.json (train/report.h).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "core/log.h"
#include "train/report.h"

namespace opd::cli {

void register_report(CLI::App& app) {
  struct Options {
    std::string run_dir, out;
    int64_t max_points = 4000;
  };
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand(
      "report", "HTML page of a run's metrics: one plot per numeric series of metrics.jsonl "
                "(x = step) and the run's config.json; no external resources");
  cmd->add_option("run_dir", o->run_dir, "run directory (holds metrics.jsonl)")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--out", o->out, "output HTML file (default: RUN_DIR/report.html)");
  cmd->add_option("--max-points", o->max_points,
                  "per series; longer series are decimated to min/max per bucket (0 = keep all)")
      ->default_val(4000)
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  cmd->callback([o] {
    ReportOptions ro;
    ro.max_points = o->max_points;
    const std::string path = write_report(o->run_dir, o->out, ro);
    log_info("report written to ", path);
    std::printf("%s\n", path.c_str());
  });
}

}  // namespace opd::cli
