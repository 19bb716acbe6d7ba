// gradsync/comm/nccl/nccl.h - the NCCL communicator (CUDA tensors), one GPU per rank.
//
// The ranks first meet through any CPU communicator (MPI under mpirun, or Gloo through a
// store): rank 0 creates the ncclUniqueId and broadcasts it over that `bootstrap`. The GPU is
// chosen by local rank (LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID or
// SLURM_LOCALID; else the bootstrap rank) modulo the visible devices, unless `device` names one.
// NCCL refuses two ranks on one GPU, so a machine with G GPUs runs at most G ranks.
//
// Ordering: an operation is queued on the communicator's own CUDA stream after an event
// recorded on the caller's stream (gradsync's kernels use the default stream), so it sees
// every gradient written before the call and runs beside later compute. Work::wait blocks
// the host until the operation finished on the GPU.
//
// Never hang: the communicator is created non-blocking, every wait polls the completion
// event and ncclCommGetAsyncError, and on timeout or an asynchronous NCCL error it calls
// ncclCommAbort, so the ranks still waiting elsewhere fail within their own timeout instead
// of blocking forever. The communicator is then broken: later operations fail at once.
#pragma once

#include <memory>

#include "gradsync/comm/communicator.h"

namespace gradsync::comm {

// True when this build has NCCL and at least one CUDA device is usable.
bool nccl_available();
// The reason nccl_available() is false ("built without NCCL", "no CUDA device: ...").
std::string nccl_unavailable_reason();

// Collective over the bootstrap's ranks: every rank of `bootstrap` must call it.
// device < 0: chosen by local rank as described above.
std::unique_ptr<Communicator> nccl_communicator(Communicator& bootstrap, const CommOptions& options = {},
                                                int device = -1);

}  // namespace gradsync::comm
