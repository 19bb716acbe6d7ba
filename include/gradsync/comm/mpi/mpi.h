// gradsync/comm/mpi/mpi.h - the MPI communicator (CPU tensors), for processes started by mpirun.
//
// mpi_world() initializes MPI when nobody has (asking for MPI_THREAD_SERIALIZED: only our
// communication thread calls MPI, one call at a time, and the level obtained is checked),
// and returns a communicator over MPI_COMM_WORLD. MPI is finalized at process exit if we
// initialized it.
#pragma once

#include <memory>

#include "gradsync/comm/communicator.h"

namespace gradsync::comm {

bool mpi_available();  // this build has MPI
// True when this process looks like it was started by mpirun/srun (OMPI_COMM_WORLD_SIZE, PMI_SIZE, ...).
bool launched_by_mpi();
// A communicator over MPI_COMM_WORLD (MPI initialized on first use, finalized at exit).
std::unique_ptr<Communicator> mpi_world(const CommOptions& options = {});

}  // namespace gradsync::comm
