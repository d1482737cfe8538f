// Rendezvous environment parsing (dist/rendezvous.h): torchrun and Slurm variables, defaults,
// Slurm node lists, and a clear error naming the variable for every malformed value.
#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "dist/rendezvous.h"

namespace opd::dist {
namespace {

struct FakeEnv {
  std::map<std::string, std::string> vars;
  EnvLookup lookup() const {
    return [this](const char* n) -> const char* {
      auto it = vars.find(n);
      return it == vars.end() ? nullptr : it->second.c_str();
    };
  }
};

std::string error_of(const FakeEnv& e) {
  try {
    dist_env_from(e.lookup());
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::InvalidArgument);
    return err.what();
  }
  return "";
}

// One variable of an otherwise valid environment set to `value` (unset when it is nullptr),
// and a part of the error that must name it.
struct EnvCase {
  const char* var;
  const char* value;
  const char* expect;
};

// Each case, applied alone to `base`, fails with InvalidArgument and a message holding `expect`.
void expect_errors(const FakeEnv& base, const std::vector<EnvCase>& cases) {
  for (const EnvCase& c : cases) {
    FakeEnv e = base;
    if (c.value) e.vars[c.var] = c.value;
    else e.vars.erase(c.var);
    std::string msg = error_of(e);
    EXPECT_NE(msg.find(c.expect), std::string::npos)
        << c.var << "=" << (c.value ? c.value : "(unset)") << " gave: " << msg;
  }
}

TEST(Rendezvous, SingleProcessWithoutVariables) {
  FakeEnv e;
  DistEnv d = dist_env_from(e.lookup());
  EXPECT_EQ(d.source, LaunchSource::Single);
  EXPECT_EQ(d.rank, 0);
  EXPECT_EQ(d.world_size, 1);
  EXPECT_EQ(d.local_rank, 0);
}

TEST(Rendezvous, Torchrun) {
  FakeEnv e{{{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
             {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "29511"}}};
  DistEnv d = dist_env_from(e.lookup());
  EXPECT_EQ(d.source, LaunchSource::Torchrun);
  EXPECT_EQ(d.rank, 5);
  EXPECT_EQ(d.world_size, 8);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.local_world_size, 4);
  EXPECT_EQ(d.master_addr, "10.1.2.3");
  EXPECT_EQ(d.master_port, 29511);
  EXPECT_NE(d.describe().find("rank 5/8"), std::string::npos);
}

TEST(Rendezvous, TorchrunWinsOverSlurm) {
  FakeEnv e{{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "h"},
             {"MASTER_PORT", "1234"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}};
  DistEnv d = dist_env_from(e.lookup());
  EXPECT_EQ(d.source, LaunchSource::Torchrun);
  EXPECT_EQ(d.rank, 1);
  EXPECT_EQ(d.local_world_size, 2);  // defaults to WORLD_SIZE
}

TEST(Rendezvous, TorchrunErrorsNameTheVariable) {
  const FakeEnv base{{{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                      {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"}}};
  expect_errors(base, {{"RANK", "4", "RANK=4 is outside [0, 4)"},
                       {"RANK", "-1", "RANK=-1 is outside"},
                       {"RANK", "1x", "RANK='1x' is not an integer"},
                       {"RANK", "", "RANK='' is not an integer"},
                       {"RANK", nullptr, "RANK is not set"},
                       {"WORLD_SIZE", nullptr, "WORLD_SIZE is not set"},
                       {"WORLD_SIZE", "0", "WORLD_SIZE=0 must be >= 1"},
                       {"WORLD_SIZE", "99999999999", "WORLD_SIZE='99999999999' is not an integer"},
                       {"LOCAL_RANK", nullptr, "LOCAL_RANK is not set"},
                       {"LOCAL_RANK", "4", "LOCAL_RANK=4 is outside [0, 4)"},
                       {"LOCAL_WORLD_SIZE", "5", "LOCAL_WORLD_SIZE=5 is outside [1, WORLD_SIZE=4]"},
                       {"MASTER_PORT", "0", "MASTER_PORT=0 is outside [1, 65535]"},
                       {"MASTER_PORT", "65536", "MASTER_PORT=65536 is outside"},
                       {"MASTER_PORT", "http", "MASTER_PORT='http' is not an integer"},
                       {"MASTER_PORT", nullptr, "MASTER_ADDR and MASTER_PORT must be set"},
                       {"MASTER_ADDR", nullptr, "MASTER_ADDR and MASTER_PORT must be set"},
                       {"MASTER_ADDR", "", "MASTER_ADDR is empty"}});
}

TEST(Rendezvous, Slurm) {
  FakeEnv e{{{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"},
             {"SLURM_NTASKS_PER_NODE", "4(x2)"}, {"SLURM_JOB_NODELIST", "gpu[007-008,010]"},
             {"MASTER_PORT", "29600"}}};
  DistEnv d = dist_env_from(e.lookup());
  EXPECT_EQ(d.source, LaunchSource::Slurm);
  EXPECT_EQ(d.rank, 6);
  EXPECT_EQ(d.world_size, 8);
  EXPECT_EQ(d.local_rank, 2);
  EXPECT_EQ(d.local_world_size, 4);
  EXPECT_EQ(d.master_addr, "gpu007");
  EXPECT_EQ(d.master_port, 29600);
  e.vars["MASTER_ADDR"] = "head";
  EXPECT_EQ(dist_env_from(e.lookup()).master_addr, "head");  // MASTER_ADDR wins
}

TEST(Rendezvous, SlurmErrors) {
  const FakeEnv base{{{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"},
                      {"SLURM_NTASKS_PER_NODE", "2"}, {"SLURM_JOB_NODELIST", "n[1-2]"}}};
  expect_errors(base,
                {{"SLURM_PROCID", "2", "SLURM_PROCID=2 is outside [0, 2)"},
                 {"SLURM_NTASKS", nullptr, "SLURM_NTASKS is not set"},
                 {"SLURM_LOCALID", nullptr, "SLURM_LOCALID is not set"},
                 {"SLURM_LOCALID", "2", "SLURM_LOCALID=2 is outside [0, 2)"},
                 {"SLURM_NTASKS_PER_NODE", "3", "SLURM_NTASKS_PER_NODE='3' is outside [1, 2]"},
                 {"SLURM_JOB_NODELIST", nullptr, "neither MASTER_ADDR nor SLURM_JOB_NODELIST"},
                 {"SLURM_JOB_NODELIST", "n[1-2", "unbalanced brackets"},
                 {"SLURM_JOB_NODELIST", "n[a-b]", "non-numeric range"}});
}

TEST(Rendezvous, SlurmFirstHost) {
  EXPECT_EQ(slurm_first_host("node7"), "node7");
  EXPECT_EQ(slurm_first_host("a1,b2"), "a1");
  EXPECT_EQ(slurm_first_host("gpu[003-007,010],cpu1"), "gpu003");
  EXPECT_EQ(slurm_first_host("rack[2,4]-n1"), "rack2-n1");
  EXPECT_THROW(slurm_first_host(""), Error);
  EXPECT_THROW(slurm_first_host(",a"), Error);
  EXPECT_THROW(slurm_first_host("x[]"), Error);
  EXPECT_THROW(slurm_first_host("x]1["), Error);
}

TEST(Rendezvous, Timeout) {
  FakeEnv e;
  EXPECT_EQ(dist_timeout_seconds(e.lookup()), 600.0);
  e.vars["OPD_DIST_TIMEOUT"] = "2.5";
  EXPECT_EQ(dist_timeout_seconds(e.lookup()), 2.5);
  for (const char* bad : {"0", "-1", "abc", "", "1e9"}) {
    e.vars["OPD_DIST_TIMEOUT"] = bad;
    EXPECT_THROW(dist_timeout_seconds(e.lookup()), Error) << bad;
  }
}

}  // namespace
}  // namespace opd::dist
