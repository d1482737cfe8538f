// Registration of every opd subcommand on the CLI11 app; each lives in src/cli/<name>.cpp.
// Benchmarks hang under one `opd bench` parent (bench_command); each registers its own child.
#pragma once

namespace CLI { class App; }

namespace opd::cli {

void register_commands(CLI::App& app);
int exit_code();         // set by the subcommand that ran
void set_exit_code(int code);

// The shared `opd bench` subcommand (created on first use).
CLI::App& bench_command(CLI::App& app);

void register_info(CLI::App& app);
void register_predict(CLI::App& app);
void register_generate(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_chat_template(CLI::App& app);
void register_bench_attention(CLI::App& app);  // `opd bench attention`
void register_bench_loss(CLI::App& bench);     // `opd bench loss` (takes the bench parent)
void register_bench_kernels(CLI::App& app);  // `opd bench kernels`
void register_bench_train(CLI::App& bench);  // `opd bench train` (takes the bench parent)
void register_bench_dist(CLI::App& bench);     // `opd bench dist` (takes the bench parent)
void register_bench_w1(CLI::App& bench);       // `opd bench w1` (takes the bench parent)
void register_bench_w2(CLI::App& bench);       // `opd bench w2` (bench_w1.cpp)
void register_bench_score(CLI::App& bench);    // `opd bench score` (takes the bench parent)
void register_bench_rollout(CLI::App& bench);  // `opd bench rollout` (takes the bench parent)
void register_bench_overlap(CLI::App& bench);  // `opd bench overlap`
void register_serve(CLI::App& app);
void register_score(CLI::App& app);
void register_train(CLI::App& app);  // `opd train` and `opd sft`
void register_eval(CLI::App& app);
void register_init(CLI::App& app);
void register_doctor(CLI::App& app);
void register_report(CLI::App& app);  // `opd report RUN_DIR`
void register_convert(CLI::App& app);
void register_shrink(CLI::App& app);
void register_launch(CLI::App& app);  // `opd launch` (multi-process jobs, dist/launcher.h)

}  // namespace opd::cli
