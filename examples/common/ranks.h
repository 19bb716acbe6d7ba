// Connecting the trainers' ranks (examples/common/): the communicator and this rank's device, and
// the check that every replica holds the same weights.
#pragma once

#include <memory>
#include <string>

#include "gradsync/comm/communicator.h"
#include "gradsync/registry/parameter_registry.h"

namespace gradsync::examples {

// The ranks of the job and this rank's device: `device` as --device names it (any_gpu: plain
// "cuda", which means the GPU of this rank's local rank); NCCL picks its own.
struct Ranks {
  std::unique_ptr<comm::Communicator> comm;
  Device device;
};
Ranks connect_ranks(const std::string& backend, Device device, bool any_gpu);


// Every rank holds bit-identical weights (an allgather of a checksum of the bits); throws
// naming the first rank that differs.
void require_identical_replicas(comm::Communicator& comm, const ParameterRegistry& registry);

}  // namespace gradsync::examples
