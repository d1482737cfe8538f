// `opd launch --nproc-per-node N [options] -- COMMAND ...`: starts N local ranks of COMMAND with
// the torchrun environment and supervises them (dist/launcher.h: output prefixes, signal
// forwarding, SIGHUP ignored, a failed rank takes the job down within --kill-after seconds).
// Exit status: 0 when every rank exited 0, else the first failed rank's status (128 + signal
// when it was killed); the last line on stderr names that rank.
#include <CLI/CLI.hpp>

#include <memory>

#include "cli/commands.h"
#include "core/log.h"
#include "dist/launcher.h"

namespace opd::cli {

void register_launch(CLI::App& app) {
  auto o = std::make_shared<dist::LaunchOptions>();
  auto command = std::make_shared<std::vector<std::string>>();
  auto no_prefix = std::make_shared<bool>(false);
  CLI::App* c = app.add_subcommand(
      "launch", "Start the local ranks of a multi-process job (torchrun environment) and supervise them");
  c->add_option("--nproc-per-node", o->nproc_per_node,
                "ranks on this node (usually one per GPU; LOCAL_RANK picks the GPU)")
      ->capture_default_str();
  c->add_option("--nnodes", o->nnodes, "nodes in the job (run one launcher per node)")
      ->capture_default_str();
  c->add_option("--node-rank", o->node_rank, "this node's index in [0, nnodes)")->capture_default_str();
  c->add_option("--master-addr", o->master_addr, "host of rank 0 (its TCP store)")
      ->capture_default_str();
  c->add_option("--master-port", o->master_port,
                "port of rank 0's TCP store (0: a free port, one node only)")
      ->capture_default_str();
  c->add_option("--kill-after", o->kill_after_s,
                "seconds between SIGTERM and SIGKILL for the remaining ranks after a rank fails "
                "or a signal is forwarded")
      ->capture_default_str();
  c->add_option("--stopped-timeout", o->stopped_timeout_s,
                "seconds a rank may stay stopped (SIGSTOP/SIGTSTP) while another local rank runs "
                "before it is killed and fails the job (every rank stopped: a paused job, left alone)")
      ->capture_default_str();
  c->add_option("--error-file", o->error_file,
                "write a JSON record of the first failed rank here ({} when none)");
  c->add_flag("--no-prefix", *no_prefix, "do not prefix output lines with [rank R]");
  c->add_option("command", *command, "the command each rank runs, after --")->required();
  c->callback([o, command, no_prefix] {
    o->prefix_output = !*no_prefix;
    dist::LaunchResult r = dist::launch(*o, *command);
    if (r.exit_code != 0) log_error("opd launch: ", r.message);
    else log_info("opd launch: ", r.message);
    set_exit_code(r.exit_code);
  });
}

}  // namespace opd::cli
