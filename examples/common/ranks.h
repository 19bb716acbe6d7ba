// Connecting the trainers' ranks (examples/common/): the communicator and this rank's device, and
// the check that every replica holds the same weights.
#pragma once

#include <memory>
#include <string>
#include <vector>

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


// The settings that must agree across ranks ("--batch 64", a data file's size and checksum, the
// model's shape, the precision, the strategies), compared once at the start: a rank started
// with another --batch would otherwise train with mixed batches, or fail much later as a
// collective mismatch. A difference is an error on every rank naming the setting and two ranks.
void require_same_settings(comm::Communicator& comm, const std::vector<std::string>& settings,
                           const std::string& trainer);
// A file as a setting: "<flag> <bytes> bytes, xxh64 <digest>" (the same data on every rank, not
// just the same name); "<flag> none" for an empty path.
std::string file_setting(const std::string& flag, const std::string& path);
// A number as a setting, exactly ("--lr 0.050000000000000003").
std::string number_setting(const std::string& flag, double value);

// Every rank holds bit-identical weights (an allgather of a checksum of the bits); throws
// naming the first rank that differs.
void require_identical_replicas(comm::Communicator& comm, const ParameterRegistry& registry);

}  // namespace gradsync::examples
