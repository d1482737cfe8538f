// Registration of every opd subcommand on the CLI11 app; each lives in src/cli/<name>.cpp.
#pragma once

namespace CLI { class App; }

namespace opd::cli {

void register_commands(CLI::App& app);
int exit_code();         // set by the subcommand that ran
void set_exit_code(int code);

void register_info(CLI::App& app);
void register_predict(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_serve(CLI::App& app);
void register_score(CLI::App& app);

}  // namespace opd::cli
