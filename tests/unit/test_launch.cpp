// comm::launch_from_environment and the Slurm host list: which launcher a process believes
// started it, with simulated environments (no Slurm, mpirun or torchrun needed).
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <string>

#include "gradsync/comm/connect.h"
#include "gradsync/config.h"
#include "test_util.h"

namespace gradsync {
namespace {

// Sets exactly the given launcher variables for one test, and restores the environment after.
class Environment {
 public:
  explicit Environment(const std::map<std::string, std::string>& values) {
    for (const char* name : kNames) {
      if (const char* old = std::getenv(name)) saved_[name] = old;
      unsetenv(name);
    }
    for (const auto& [name, value] : values) setenv(name.c_str(), value.c_str(), 1);
  }
  ~Environment() {
    for (const char* name : kNames) unsetenv(name);
    for (const auto& [name, value] : saved_) setenv(name.c_str(), value.c_str(), 1);
  }

 private:
  static constexpr const char* kNames[] = {
      "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GRADSYNC_GLOO_STORE_DIR",
      "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID", "SLURM_STEP_NODELIST",
      "SLURM_JOB_NODELIST", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_SIZE", "PMIX_RANK",
      "MPI_LOCALNRANKS", "MPI_LOCALRANKID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID",
      "TORCHELASTIC_RESTART_COUNT", "GRADSYNC_TORCH_STORE"};
  std::map<std::string, std::string> saved_;
};

TEST(Launch, SlurmHostLists) {
  EXPECT_EQ(comm::first_host_of_nodelist("node[01-04]"), "node01");
  EXPECT_EQ(comm::first_host_of_nodelist("node[07,01-04],gpu5"), "node07");
  EXPECT_EQ(comm::first_host_of_nodelist("login1"), "login1");
  EXPECT_EQ(comm::first_host_of_nodelist("a1,b[2-3]"), "a1");
  EXPECT_EQ(comm::first_host_of_nodelist("rack[1-2]-n[003-004]"), "rack1-n003");
  EXPECT_EQ(comm::first_host_of_nodelist("gpu-[10-11].cluster"), "gpu-10.cluster");
  EXPECT_GRADSYNC_ERROR(comm::first_host_of_nodelist("node[01-04"), "'node[01-04'", "unbalanced '['");
  EXPECT_GRADSYNC_ERROR(comm::first_host_of_nodelist("node01]"), "unbalanced ']'");
  EXPECT_GRADSYNC_ERROR(comm::first_host_of_nodelist(""), "no host");
  EXPECT_GRADSYNC_ERROR(comm::first_host_of_nodelist("node[]"), "empty range");
  EXPECT_GRADSYNC_ERROR(comm::first_host_of_nodelist("n[5-1]"), "'n[5-1]'", "descending");
  EXPECT_GRADSYNC_ERROR(comm::first_host_of_nodelist(" node01"), "white space");
  EXPECT_GRADSYNC_ERROR(comm::first_host_of_nodelist("node[01-a]"), "not numbers");
  EXPECT_GRADSYNC_ERROR(comm::first_host_of_nodelist("node[01,,03]"), "empty range");
  EXPECT_EQ(comm::first_host_of_nodelist("node[3-3,7]"), "node3");
}

TEST(Launch, PlainSrun) {
  Environment env({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "2"},
                   {"SLURM_JOB_ID", "123456"}, {"SLURM_STEP_NODELIST", "gpu[03-06]"},
                   {"SLURM_JOB_NODELIST", "gpu[01-06]"}});
  const comm::LaunchEnvironment launch = comm::launch_from_environment();
  EXPECT_EQ(launch.launcher, "slurm");
  EXPECT_EQ(launch.rank, 5);
  EXPECT_EQ(launch.size, 8);
  EXPECT_EQ(launch.local_rank, 1);
  EXPECT_EQ(launch.host, "gpu03");  // the step's first node, where task 0 runs
  EXPECT_EQ(launch.port, 20000 + 123456 % 20000);
}

TEST(Launch, SrunFallsBackToTheJobNodelistAndHonoursMasterVariables) {
  {
    Environment env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "7"},
                     {"SLURM_JOB_NODELIST", "cn[100-101]"}});
    EXPECT_EQ(comm::launch_from_environment().host, "cn100");
  }
  {
    Environment env({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "cn[100-101]"},
                     {"MASTER_ADDR", "10.0.0.9"}, {"MASTER_PORT", "29500"}});
    const comm::LaunchEnvironment launch = comm::launch_from_environment();
    EXPECT_EQ(launch.host, "10.0.0.9");
    EXPECT_EQ(launch.port, 29500);
  }
  {
    Environment env({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}});
    EXPECT_GRADSYNC_ERROR(comm::launch_from_environment(), "SLURM_STEP_NODELIST", "MASTER_ADDR");
  }
}

// torchrun-style variables win over Slurm's (torchrun inside an srun allocation).
TEST(Launch, TorchrunVariablesTakePrecedenceOverSlurm) {
  Environment env({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "3"}, {"MASTER_ADDR", "h0"},
                   {"MASTER_PORT", "29400"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_LOCALID", "0"}});
  const comm::LaunchEnvironment launch = comm::launch_from_environment();
  EXPECT_EQ(launch.launcher, "torchrun");
  EXPECT_EQ(launch.rank, 3);
  EXPECT_EQ(launch.size, 4);
  EXPECT_EQ(launch.local_rank, 3);
  EXPECT_EQ(launch.host, "h0");
  EXPECT_EQ(launch.port, 29400);
}

// Under torchrun's agent store every rank is a client of it, each attempt under its own prefix;
// GRADSYNC_TORCH_STORE says so for any TCPStore, or overrides.
TEST(Launch, TorchrunsAgentStoreIsUsedWithAPrefixPerAttempt) {
  {
    Environment env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29400"},
                     {"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RUN_ID", "job7"},
                     {"TORCHELASTIC_RESTART_COUNT", "2"}});
    const comm::LaunchEnvironment launch = comm::launch_from_environment();
    EXPECT_TRUE(launch.torch_store);
    EXPECT_EQ(launch.store_prefix, "/gradsync/job7/2/");
  }
  {
    Environment env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29400"},
                     {"TORCHELASTIC_USE_AGENT_STORE", "False"}});
    EXPECT_FALSE(comm::launch_from_environment().torch_store);
  }
  {
    Environment env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29400"},
                     {"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"GRADSYNC_TORCH_STORE", "0"}});
    EXPECT_FALSE(comm::launch_from_environment().torch_store);
  }
  {
    Environment env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29400"}, {"GRADSYNC_TORCH_STORE", "1"}});
    const comm::LaunchEnvironment launch = comm::launch_from_environment();
    EXPECT_TRUE(launch.torch_store);
    EXPECT_EQ(launch.store_prefix, "/gradsync/none/0/");
  }
}

TEST(Launch, NothingSetIsAWorldOfOne) {
  Environment env({});
  const comm::LaunchEnvironment launch = comm::launch_from_environment();
  EXPECT_EQ(launch.launcher, "single");
  EXPECT_EQ(launch.size, 1);
  EXPECT_EQ(launch.rank, 0);
}

TEST(Launch, MalformedVariablesAreNamed) {
  {
    Environment env({{"SLURM_PROCID", "two"}, {"SLURM_NTASKS", "4"}, {"SLURM_STEP_NODELIST", "n1"}});
    EXPECT_GRADSYNC_ERROR(comm::launch_from_environment(), "SLURM_PROCID", "'two'");
  }
  {
    Environment env({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}, {"SLURM_STEP_NODELIST", "n1"}});
    EXPECT_GRADSYNC_ERROR(comm::launch_from_environment(), "rank 4 is outside a world of 4", "slurm");
  }
}

// An MPI launcher (mpirun, or srun with an MPI plugin: PMIX_RANK) selects MPI over everything
// else; a plain srun selects Gloo.
TEST(Launch, MpiLaunchersSelectMpi) {
  {
    Environment env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"PMIX_RANK", "0"}});
    EXPECT_EQ(comm::choose_backend("auto", Device::cpu()), GRADSYNC_WITH_MPI ? "mpi" : "gloo");
  }
  {
    Environment env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_STEP_NODELIST", "n1"}});
    EXPECT_EQ(comm::choose_backend("auto", Device::cpu()), "gloo");
  }
}

}  // namespace
}  // namespace gradsync
