// gradsync/comm/connect.h - one call that gives a process its communicator, whatever launched it.
//
//   auto comm = gradsync::comm::connect();            // "auto"
//   auto comm = gradsync::comm::connect("gloo");      // or "mpi", "nccl"
//
// Which backend "auto" picks, in order:
//   1. nccl  when `device` is a CUDA device and this build has NCCL and a GPU is visible;
//   2. mpi   when an MPI launcher started the process: mpirun, or srun with an MPI plugin
//            (OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK, MPI_LOCALNRANKS);
//   3. gloo  otherwise, with the rank, size and rendezvous of launch_from_environment():
//            torchrun-style variables, else a plain srun, else a world of one.
// NCCL needs a CPU communicator once, to carry its unique id: MPI when launched by an MPI
// launcher, else the Gloo rendezvous above; each rank takes the GPU of its local rank
// (gradsync/comm/nccl/nccl.h), so only the device *type* of `device` matters. Call comm::nccl_communicator to pin
// a device yourself. docs/communication.md shows launching 1..N ranks on one machine and on
// several, with mpirun, scripts/launch.sh, torchrun and srun.
#pragma once

#include <exception>
#include <memory>
#include <string>
#include <string_view>

#include "gradsync/comm/communicator.h"

namespace gradsync::comm {

// The communicator of this process's job: `backend` "auto" (above), "nccl", "mpi" or "gloo";
// collective over every rank the launcher started (each waits for the others at the rendezvous).
std::unique_ptr<Communicator> connect(std::string_view backend = "auto", Device device = Device::cpu(),
                                      const CommOptions& options = {});

// The backend connect(backend, device) would use ("nccl", "mpi" or "gloo"), after checking
// that this build has it. An unknown name is an error listing the valid ones.
std::string choose_backend(std::string_view backend, Device device);

// This process's rank among the processes of its machine: LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK,
// MPI_LOCALRANKID or SLURM_LOCALID, else `fallback`.
int local_rank_from_environment(int fallback);

// Where the Gloo rendezvous of this process is, as the environment describes it. Precedence,
// first match wins:
//   1. "torchrun": RANK and WORLD_SIZE set (torchrun, scripts/launch.sh, or by hand), with
//      MASTER_ADDR (default 127.0.0.1) and MASTER_PORT;
//   2. "slurm": SLURM_PROCID and SLURM_NTASKS set (a plain `srun`): the rendezvous host is
//      MASTER_ADDR when set, else the first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST);
//      the port is MASTER_PORT when set, else 20000 + SLURM_JOB_ID % 20000, the same on every
//      task of the job;
//   3. "single": a world of one.
// GRADSYNC_GLOO_STORE_DIR, when set, replaces the TCP store by a shared folder (host and port
// are then unused). Variables that are set but malformed are errors naming them.
struct LaunchEnvironment {
  std::string launcher;  // "torchrun", "slurm" or "single"
  int rank = 0;          // this process's rank in the job
  int size = 1;          // the job's number of ranks
  int local_rank = 0;    // its rank among the processes of its machine
  std::string host;      // rendezvous host (rank 0's machine)
  int port = 0;          // rendezvous port; 0 when unknown
  std::string store_dir; // GRADSYNC_GLOO_STORE_DIR, when set
  // The store at host:port is a PyTorch TCPStore served by someone else (torchrun's agent):
  // every rank is its client, under `store_prefix` (run id and restart count).
  bool torch_store = false;
  std::string store_prefix;  // the keys' prefix in torchrun's store
};
LaunchEnvironment launch_from_environment();  // (above)

// A process that ends on an error tells its launcher why: prints "program: message" to stderr
// and, under torchrun (TORCHELASTIC_ERROR_FILE), writes the message in torchelastic's error-file
// format, so that torchrun's failure summary shows it instead of "error_file: <N/A>". Returns the
// exit status to end with (1). The example trainers end every failure through it.
int report_fatal_error(const char* program, const std::exception& error);

// The first host of a Slurm host list, as scontrol would expand it: "node[01-04,07],gpu5" ->
// "node01", "rack[1-2]-n[3-4]" -> "rack1-n3", "login1" -> "login1". Malformed lists (unbalanced
// brackets, an empty list) are errors quoting the list.
std::string first_host_of_nodelist(std::string_view nodelist);

}  // namespace gradsync::comm
