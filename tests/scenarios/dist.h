// Scenarios of the dist layer (Reducer, DistributedOptimizer, Adasum, DataParallel), written
// once against a Communicator: run on Gloo ranks-as-threads (multirank/test_dist.cpp,
// test_data_parallel.cpp, test_devices.cpp), on MPI processes (multirank/test_mpi.cpp) and on
// NCCL (gpu/test_nccl.cpp). Each is a reference-checked behaviour from docs/semantics/horovod.md
// section 6 or docs/semantics/ddp.md; the checklist item numbers are quoted. Those taking a
// Device also run with the parameters on a GPU.
#pragma once

#include <string>

#include "gradsync/comm/communicator.h"
#include "gradsync/dist/data_parallel/sync_strategy.h"

namespace gradsync::testing {

// Equivalence: N ranks with Average reach the parameters of one process training on the
// concatenated batch (each rank's slice has the same size), with `kind` ("sgd" with momentum,
// or "adam").
void equivalence_with_single_process(comm::Communicator& comm, const std::string& kind,
                                     Device device = Device::cpu());

// Checklist 19: a rank whose graph skips a parameter (its gradient never defined, never
// marked ready) still completes step(); the parameter gets the others' contributions.
void force_allreduce_when_a_rank_skips_a_parameter(comm::Communicator& comm, Device device = Device::cpu());

// Checklist 39-42 on whatever world this is (a power of two).
void adasum_math(comm::Communicator& comm);

// DataParallel: N ranks reach the parameters of one process on the concatenated batch, with
// 2 microbatches per step under each strategy (docs/semantics/ddp.md checklist 9 and 11).
void data_parallel_equivalence(comm::Communicator& comm, dist::DDPSyncStrategy strategy,
                               Device device = Device::cpu());

// DataParallel: a rank that misses a gradient (find_unused off) fails at the end of that
// backward naming it; the others fail naming that rank; nobody hangs.
void data_parallel_missing_gradient(comm::Communicator& comm, Device device = Device::cpu());

// Several Reducers (and the user's own collectives) on one communicator,
// each rank signalling readiness in its own random order. Every bucket has the same size, so
// pairing the wrong buckets across ranks would go unnoticed by any size check: only the values
// tell. Each Reducer reduces on its own duplicate, so every value must be the exact sum.
void random_ready_orders_across_reducers(comm::Communicator& comm, int reducers, int trials,
                                         Device device = Device::cpu());

}  // namespace gradsync::testing
