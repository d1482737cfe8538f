// The subcommand table (one register_* per src/cli/<name>.cpp) and the shared `bench` parent.
#include "cli/commands.h"

#include <CLI/CLI.hpp>

namespace opd::cli {

namespace { int g_exit_code = 0; }
int exit_code() { return g_exit_code; }
void set_exit_code(int code) { g_exit_code = code; }

CLI::App& bench_command(CLI::App& app) {
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
    if (sub->get_name() == "bench") return *sub;
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks (BENCHMARKS.md workloads and kernels)");
  bench->require_subcommand(1);
  return *bench;
}

void register_commands(CLI::App& app) {
  register_info(app);
  register_predict(app);
  register_generate(app);
  register_tokenize(app);
  register_chat_template(app);
  register_bench_attention(app);
  register_bench_loss(bench_command(app));
  register_bench_kernels(app);
  register_bench_train(bench_command(app));
  register_bench_dist(bench_command(app));
  register_bench_w1(bench_command(app));
  register_bench_w2(bench_command(app));
  register_bench_score(bench_command(app));
  register_bench_rollout(bench_command(app));
  register_bench_overlap(bench_command(app));
  register_serve(app);
  register_score(app);
  register_train(app);
  register_eval(app);
  register_init(app);
  register_doctor(app);
  register_report(app);
  register_convert(app);
  register_shrink(app);
  register_launch(app);
}

}  // namespace opd::cli
