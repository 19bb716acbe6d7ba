// Internal: ZeRO's checkpoints (gradsync/dist/zero/zero.h), over the layout of the shards.
//  * consolidated: every rank's pieces gathered into an ordinary optimizer checkpoint (the
//    tensors and metadata Optimizer::state_tensors/state_metadata would give unsharded);
//  * sharded sets: each rank writes its pieces to folder/set-<n>/rank<R>.safetensors; rank 0
//    points folder/manifest.json at the set once every piece is on disk (an atomic rename), so
//    a failure anywhere leaves the previous set in force; loading reads this rank's pieces from
//    whichever files hold them when the world size or the buckets changed (reshard).
// Every phase that could fail on one rank ends with a flag from every rank, so a failure is an
// error on all of them, never a rank left waiting.
#pragma once

#include <filesystem>
#include <vector>

#include "gradsync/dist/zero/zero.h"

namespace gradsync::dist {

// Who owns what: this rank's element ranges per arena (as handed to Optimizer::shard), every
// rank's ([rank][arena], the same computation on each rank), and the stage.
struct ShardLayout {
  std::vector<std::vector<optim::Optimizer::ElementRange>> ranges;
  std::vector<std::vector<std::vector<optim::Optimizer::ElementRange>>> all_ranges;
  int stage = 1;
};

// Each is collective over `comm`, the ZeroOptimizer's own communicator; its gathers must have
// landed (the ZeroOptimizer waits for them first).
ZeroOptimizer::State consolidated_state(optim::Optimizer& optimizer, comm::Communicator& comm, const ShardLayout& layout);
void save_consolidated(optim::Optimizer& optimizer, comm::Communicator& comm, const ShardLayout& layout,
                       const std::filesystem::path& path);
void save_sharded(optim::Optimizer& optimizer, comm::Communicator& comm, const ShardLayout& layout,
                  const std::filesystem::path& folder);
void load_sharded(optim::Optimizer& optimizer, comm::Communicator& comm, const ShardLayout& layout,
                  const std::filesystem::path& folder, bool reshard);

}  // namespace gradsync::dist
