// Rendezvous of a multi-process job from the launch conventions clusters already use:
// torchrun / `opd launch` (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT) and Slurm srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
// SLURM_NTASKS_PER_NODE, the first host of SLURM_JOB_NODELIST or MASTER_ADDR). Every value is
// validated where it enters, with an error naming the variable, its value and the limit.
#pragma once

#include <functional>
#include <string>

namespace opd::dist {

enum class LaunchSource { Single, Torchrun, Slurm };
const char* launch_source_name(LaunchSource s);

struct DistEnv {
  LaunchSource source = LaunchSource::Single;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // torchrun's default
  std::string describe() const;  // "rank 1/4 (local 1/2) via torchrun, store 10.0.0.1:29500"
};

// Reads one environment variable (nullptr when unset); std::getenv by default, a map in tests.
using EnvLookup = std::function<const char*(const char*)>;

// The job's placement. torchrun variables win when RANK or WORLD_SIZE is set; otherwise Slurm
// when SLURM_PROCID is set; otherwise a single process (rank 0 of 1). Throws
// InvalidArgument naming the variable on a missing companion variable, a non-integer, a rank
// outside [0, world), a local rank outside [0, local world), a port outside [1, 65535], an
// empty address, or a Slurm node list that cannot be parsed.
DistEnv dist_env_from(const EnvLookup& lookup);
DistEnv dist_env_from_process();  // dist_env_from(std::getenv)

// First host name of a Slurm node list: "gpu[003-007,010],cpu1" -> "gpu003",
// "a1,b2" -> "a1", "node7" -> "node7". Throws InvalidArgument on malformed lists.
std::string slurm_first_host(const std::string& nodelist);

// Seconds before a collective, a store wait or the NCCL set-up counts as hung:
// OPD_DIST_TIMEOUT (seconds, > 0) or 600 when unset. Validated like the variables above.
double dist_timeout_seconds(const EnvLookup& lookup);

}  // namespace opd::dist
