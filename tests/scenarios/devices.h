// The device-parameterised suite: the sync strategy set and every DistributedOptimizer option,
// written once against a Communicator and a Device, so that one suite proves them with host
// parameters on Gloo and MPI (every machine), with CUDA parameters staged through Gloo and MPI
// (2-4 ranks sharing one GPU), and on NCCL (a world of one on a one-GPU machine, G ranks where
// there are G GPUs).
//
// Expected values are computed here, independently, and differ from the input even with one
// rank (where every reduction is the identity): microbatches accumulate (sum of two buffers),
// a hook scales, compression rounds, duplicate sparse rows add up. So a wrong op mapping, a
// missing ordering between the engine's stream and the wire, or a lost copy back fails here.
// The DistributedOptimizer runs its distributed path at world 1 too (reduce_with_one_rank).
#pragma once

#include <optional>

#include "gradsync/comm/communicator.h"
#include "gradsync/dist/data_parallel/sync_strategy.h"

namespace gradsync::testing {

// Composer's strategies over two microbatches per step, two steps, one bucket per parameter:
// whatever the strategy, each parameter ends with the mean over ranks of its microbatches' sum.
void ddp_strategy_set(comm::Communicator& comm, Device device, dist::DDPSyncStrategy strategy);

// find_unused_parameters, no_sync, synchronize_all, a comm hook and compression.
void ddp_unused_no_sync_hook_compression(comm::Communicator& comm, Device device);

// Every option of the DistributedOptimizer (each op, backward_passes_per_step, predivide, groups,
// compression, sparse rows and sparse_as_dense, Adasum) against values computed here.
void distributed_optimizer_options(comm::Communicator& comm, Device device);

// ZeRO stages 1 and 2 against unsharded DataParallel, and uneven inputs under dist::Join (with
// ZeRO too), with the model on `device`.
void zero_and_join(comm::Communicator& comm, Device device);

// Every scenario with parameters on `device` (the NCCL and MPI suites run them in one test).
void all_device_scenarios(comm::Communicator& comm, Device device);

// A rank that skips a collective (and issues nothing after it, like a stuck rank): the others'
// wait times out and aborts; a Work that was in flight behind it reports failure, never
// success, even where the abort completes its event (NCCL); every later operation fails at
// once naming that first failure. Nobody hangs.
void a_rank_that_skips_a_collective(comm::Communicator& comm, std::optional<Device> on = std::nullopt);

}  // namespace gradsync::testing
