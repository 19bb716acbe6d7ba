// gradsync/comm/connect.h - one call that gives a process its communicator, whatever launched it.
//
//   auto comm = gradsync::comm::connect();            // "auto"
//   auto comm = gradsync::comm::connect("gloo");      // or "mpi", "nccl"
//
// Which backend "auto" picks, in order:
//   1. nccl  when `device` is a CUDA device and this build has NCCL and a GPU is visible;
//   2. mpi   when the process was started by mpirun/srun (OMPI_COMM_WORLD_SIZE, PMI_SIZE, ...);
//   3. gloo  otherwise: through the TCP store when RANK and WORLD_SIZE are set (MASTER_ADDR,
//            default 127.0.0.1, and MASTER_PORT, as torchrun sets them), through a folder when
//            GRADSYNC_GLOO_STORE_DIR is set with RANK and WORLD_SIZE, else as a world of one.
// NCCL needs a CPU communicator once, to carry its unique id: MPI when launched by mpirun,
// else the Gloo rendezvous above; each rank takes the GPU of its local rank (nccl.h), so only
// the device *type* of `device` matters. Call comm::nccl_communicator to pin a device yourself. See docs/communication.md for launching 1..N ranks on one
// machine and on several.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "gradsync/comm/communicator.h"

namespace gradsync::comm {

std::unique_ptr<Communicator> connect(std::string_view backend = "auto", Device device = Device::cpu(),
                                      const CommOptions& options = {});

// The backend connect(backend, device) would use ("nccl", "mpi" or "gloo"), after checking
// that this build has it. An unknown name is an error listing the valid ones.
std::string choose_backend(std::string_view backend, Device device);

// This process's rank among the processes of its machine: LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK,
// MPI_LOCALRANKID or SLURM_LOCALID, else `fallback`.
int local_rank_from_environment(int fallback);

}  // namespace gradsync::comm
