// Environment parsing of the job placement (torchrun and Slurm conventions, see rendezvous.h).
// Integers are parsed strictly (whole string, base 10, in int range) so "1x" or "" is an
// error rather than a silent 1 or 0.
#include "dist/rendezvous.h"

#include <cerrno>
#include <cstdlib>
#include <limits>

#include "core/error.h"

namespace opd::dist {

const char* launch_source_name(LaunchSource s) {
  switch (s) {
    case LaunchSource::Single: return "single process";
    case LaunchSource::Torchrun: return "torchrun environment";
    case LaunchSource::Slurm: return "Slurm environment";
  }
  return "?";
}

std::string DistEnv::describe() const {
  return cat("rank ", rank, "/", world_size, " (local ", local_rank, "/", local_world_size,
             ") via ", launch_source_name(source), ", store ", master_addr, ":", master_port);
}

namespace {

int parse_int(const char* name, const char* text) {
  OPD_CHECK(text != nullptr, InvalidArgument, "environment variable ", name, " is not set");
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text, &end, 10);
  OPD_CHECK(*text != '\0' && end != nullptr && *end == '\0' && errno == 0 &&
                v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max(),
            InvalidArgument, "environment variable ", name, "='", text,
            "' is not an integer");
  return static_cast<int>(v);
}

int require_int(const EnvLookup& env, const char* name, const char* why) {
  const char* v = env(name);
  OPD_CHECK(v != nullptr, InvalidArgument, "environment variable ", name, " is not set (", why,
            ")");
  return parse_int(name, v);
}

void check_range(const char* name, int value, int lo, int hi_exclusive, const char* limit_name) {
  OPD_CHECK(value >= lo && value < hi_exclusive, InvalidArgument, "environment variable ", name,
            "=", value, " is outside [", lo, ", ", hi_exclusive, ") (", limit_name, ")");
}

int parse_port(const EnvLookup& env) {
  const char* p = env("MASTER_PORT");
  if (p == nullptr) return 29500;
  int port = parse_int("MASTER_PORT", p);
  OPD_CHECK(port >= 1 && port <= 65535, InvalidArgument, "environment variable MASTER_PORT=",
            port, " is outside [1, 65535]");
  return port;
}

std::string parse_addr(const EnvLookup& env, const std::string& fallback) {
  const char* a = env("MASTER_ADDR");
  if (a == nullptr) return fallback;
  OPD_CHECK(*a != '\0', InvalidArgument, "environment variable MASTER_ADDR is empty");
  return a;
}

}  // namespace

std::string slurm_first_host(const std::string& list) {
  OPD_CHECK(!list.empty(), InvalidArgument, "Slurm node list is empty");
  // The first entry ends at the first comma outside brackets.
  size_t end = 0;
  int depth = 0;
  for (; end < list.size(); ++end) {
    char c = list[end];
    if (c == '[') ++depth;
    if (c == ']') --depth;
    OPD_CHECK(depth == 0 || depth == 1, InvalidArgument, "Slurm node list '", list,
              "' has unbalanced brackets");
    if (c == ',' && depth == 0) break;
  }
  OPD_CHECK(depth == 0, InvalidArgument, "Slurm node list '", list, "' has unbalanced brackets");
  std::string entry = list.substr(0, end);
  size_t lb = entry.find('[');
  if (lb == std::string::npos) {
    OPD_CHECK(!entry.empty(), InvalidArgument, "Slurm node list '", list,
              "' starts with an empty host");
    return entry;
  }
  size_t rb = entry.find(']', lb);
  OPD_CHECK(rb != std::string::npos && rb > lb + 1, InvalidArgument, "Slurm node list '", list,
            "' has an empty range");
  // "prefix[003-007,010]suffix": the first number of the range, zero padding kept as written.
  std::string range = entry.substr(lb + 1, rb - lb - 1);
  size_t stop = range.find_first_of(",-");
  std::string first = range.substr(0, stop);
  OPD_CHECK(!first.empty() && first.find_first_not_of("0123456789") == std::string::npos,
            InvalidArgument, "Slurm node list '", list, "' has a non-numeric range '", range, "'");
  return entry.substr(0, lb) + first + entry.substr(rb + 1);
}

DistEnv dist_env_from(const EnvLookup& env) {
  DistEnv d;
  const bool torchrun = env("RANK") != nullptr || env("WORLD_SIZE") != nullptr;
  const bool slurm = env("SLURM_PROCID") != nullptr;
  if (torchrun) {
    d.source = LaunchSource::Torchrun;
    d.world_size = require_int(env, "WORLD_SIZE", "set together with RANK");
    OPD_CHECK(d.world_size >= 1, InvalidArgument, "environment variable WORLD_SIZE=",
              d.world_size, " must be >= 1");
    d.rank = require_int(env, "RANK", "set together with WORLD_SIZE");
    check_range("RANK", d.rank, 0, d.world_size, "WORLD_SIZE");
    const char* lr = env("LOCAL_RANK");
    const char* lws = env("LOCAL_WORLD_SIZE");
    if (d.world_size > 1) {
      OPD_CHECK(lr != nullptr, InvalidArgument,
                "environment variable LOCAL_RANK is not set (it picks this rank's GPU)");
    }
    d.local_rank = lr ? parse_int("LOCAL_RANK", lr) : d.rank;
    d.local_world_size = lws ? parse_int("LOCAL_WORLD_SIZE", lws) : d.world_size;
    OPD_CHECK(d.local_world_size >= 1 && d.local_world_size <= d.world_size, InvalidArgument,
              "environment variable LOCAL_WORLD_SIZE=", d.local_world_size,
              " is outside [1, WORLD_SIZE=", d.world_size, "]");
    check_range("LOCAL_RANK", d.local_rank, 0, d.local_world_size, "LOCAL_WORLD_SIZE");
    if (d.world_size > 1) {
      OPD_CHECK(env("MASTER_ADDR") != nullptr && env("MASTER_PORT") != nullptr, InvalidArgument,
                "environment variables MASTER_ADDR and MASTER_PORT must be set when WORLD_SIZE=",
                d.world_size, " > 1 (rank 0's host and the port of its store)");
    }
    d.master_addr = parse_addr(env, "127.0.0.1");
    d.master_port = parse_port(env);
    return d;
  }
  if (slurm) {
    d.source = LaunchSource::Slurm;
    d.world_size = require_int(env, "SLURM_NTASKS", "set by srun with SLURM_PROCID");
    OPD_CHECK(d.world_size >= 1, InvalidArgument, "environment variable SLURM_NTASKS=",
              d.world_size, " must be >= 1");
    d.rank = parse_int("SLURM_PROCID", env("SLURM_PROCID"));
    check_range("SLURM_PROCID", d.rank, 0, d.world_size, "SLURM_NTASKS");
    d.local_rank = require_int(env, "SLURM_LOCALID", "set by srun with SLURM_PROCID");
    // SLURM_NTASKS_PER_NODE is "4" or "4(x2)"; the local world only sizes per-node work, so
    // its leading integer is enough. Without it the local rank bounds it from below.
    if (const char* tpn = env("SLURM_NTASKS_PER_NODE")) {
      std::string s(tpn);
      std::string lead = s.substr(0, s.find('('));
      d.local_world_size = parse_int("SLURM_NTASKS_PER_NODE", lead.c_str());
      OPD_CHECK(d.local_world_size >= 1 && d.local_world_size <= d.world_size, InvalidArgument,
                "environment variable SLURM_NTASKS_PER_NODE='", s, "' is outside [1, ",
                d.world_size, "]");
    } else {
      d.local_world_size = d.local_rank + 1;
    }
    check_range("SLURM_LOCALID", d.local_rank, 0, d.local_world_size, "SLURM_NTASKS_PER_NODE");
    std::string fallback;
    if (const char* nl = env("SLURM_JOB_NODELIST")) fallback = slurm_first_host(nl);
    else if (const char* nl2 = env("SLURM_NODELIST")) fallback = slurm_first_host(nl2);
    if (env("MASTER_ADDR") == nullptr) {
      OPD_CHECK(!fallback.empty() || d.world_size == 1, InvalidArgument,
                "neither MASTER_ADDR nor SLURM_JOB_NODELIST is set: no host for rank 0's store");
      d.master_addr = fallback.empty() ? "127.0.0.1" : fallback;
    } else {
      d.master_addr = parse_addr(env, fallback);
    }
    d.master_port = parse_port(env);
    return d;
  }
  return d;
}

DistEnv dist_env_from_process() {
  return dist_env_from([](const char* n) { return static_cast<const char*>(std::getenv(n)); });
}

double dist_timeout_seconds(const EnvLookup& env) {
  const char* t = env("OPD_DIST_TIMEOUT");
  if (t == nullptr) return 600.0;
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(t, &end);
  OPD_CHECK(*t != '\0' && *end == '\0' && errno == 0 && v > 0 && v <= 86400 * 7, InvalidArgument,
            "environment variable OPD_DIST_TIMEOUT='", t,
            "' is not a number of seconds in (0, 604800]");
  return v;
}

}  // namespace opd::dist
