// `opd launch`: starts the local ranks of a job with the torchrun environment (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT; CUDA_VISIBLE_DEVICES is
// left alone, each rank picks its GPU by LOCAL_RANK) and supervises them:
// - output: each rank's stdout/stderr lines go to the launcher's stdout/stderr prefixed with
//   "[rank R] " (stdin is /dev/null);
// - signals: SIGTERM and SIGINT are forwarded to every rank (opd train checkpoints and exits 0;
//   a second SIGINT makes it exit at once); SIGHUP is ignored and not forwarded (a closed
//   terminal must not kill a run: shared/context's 7-GPU report); SIGPIPE is ignored;
// - failure: when a rank exits non-zero or is killed, the others get SIGTERM at once and SIGKILL
//   kill_after_s later (default 30 s, so the job is down in well under 60 s even when the
//   survivors are stuck in a collective); the result names the first rank that failed and how;
// - hangs it can see: a rank stopped (SIGSTOP, SIGTSTP, ...) for stopped_timeout_s while another
//   local rank still runs holds that rank in its next collective until OPD_DIST_TIMEOUT (600 s):
//   it is SIGKILLed and counts as the failed rank ("was stopped by signal 19 (SIGSTOP) for 30 s").
//   Every local rank stopped is a paused job and is left alone; a rank stopped by a debugger
//   (ptrace) is reported to the debugger, not to the launcher. A rank that hangs while running is
//   left to the collectives' timeout (OPD_DIST_TIMEOUT);
// - each rank runs in its own process group (signals reach only what the launcher sends) and
//   gets SIGTERM if the launcher itself dies (PR_SET_PDEATHSIG).
// Multi-node: run one launcher per node with the same --nnodes/--master-addr/--master-port and
// its --node-rank.
#pragma once

#include <string>
#include <vector>

namespace opd::dist {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // torchrun's default; 0 = a free port (single node only)
  double kill_after_s = 30;  // SIGTERM -> SIGKILL grace after a failure or a forwarded signal
  double stopped_timeout_s = 30;  // a rank stopped this long (others running) fails the job
  bool prefix_output = true;
  std::string error_file;   // when set: JSON record of the first failure (or {} on success)
};

struct RankExit {
  int rank = -1;
  int local_rank = -1;
  int pid = 0;
  bool signaled = false;
  int code = 0;    // exit status when !signaled
  int signal = 0;  // terminating signal when signaled
  int stopped_by = 0;   // > 0: killed by the launcher after being stopped by this signal
  double stopped_s = 0;  // for how long it was stopped then
  double seconds = 0;  // since launch
  std::string describe() const;  // "rank 3 (local 3, pid 1234) was killed by signal 11 (SIGSEGV)"
};

struct LaunchResult {
  // 0 when every rank exited 0; otherwise the first failed rank's status (its exit code, or
  // 128 + signal when it was killed), as a shell reports it.
  int exit_code = 0;
  int failed_rank = -1;        // global rank of the first failure, -1 if none
  std::string message;         // one line naming the failed rank and what happened
  std::vector<RankExit> exits; // in the order the ranks ended
};

// Validates the options (InvalidArgument naming the flag), runs the job to its end and returns
// how it ended. Installs its signal handlers for the duration and restores the previous ones.
LaunchResult launch(const LaunchOptions& options, const std::vector<std::string>& command);

}  // namespace opd::dist
