// gradsync/dist/zero/shard_groups.h - HSDP's two communicators: shard inside a group of ranks (a node
// by default), replicate across the groups (FSDP2's 2-D DeviceMesh, ("replicate", "shard")).
//
//   dist::ShardGroups groups(world);                      // one group per node; or (world, 4)
//   dist::DataParallelOptions options{.shard_gradients = true, .replicas = &groups.replicas()};
//   options.units = units;                                // stage 3 (or none: stage 2)
//   dist::DataParallel ddp(registry, groups.shard(), options);
//   dist::ZeroOptimizer zero(adam, ddp, {.stage = 3});
//
// Stage 3 (or 2) then runs over shard() as it would over a world of that size: units gathered
// inside the group, each bucket reduce-scattered inside it; then this rank's reduced piece is
// allreduced over replicas(), the ranks of the other groups that own the same piece, so only
// one piece per rank crosses between groups (docs/zero.md, "HSDP").
#pragma once

#include <memory>

#include "gradsync/comm/communicator.h"

namespace gradsync::dist {

// The shard group and the replica group of this rank (above).
class ShardGroups {
 public:
  // Collective over `world`. `group_size` > 0: consecutive ranks [g x size, (g + 1) x size) form
  // group g (it must divide the world). 0: one group per node (comm::node_name()), every node
  // with the same number of ranks. The replica group of a rank holds the ranks with its place in
  // every group, in group order. Errors (on every rank) name the sizes or the nodes at fault.
  explicit ShardGroups(comm::Communicator& world, int group_size = 0);

  comm::Communicator& shard() const { return *shard_; }        // this rank's group: it shards the model
  comm::Communicator& replicas() const { return *replicas_; }  // the same place in every group
  int group() const { return group_; }    // which group this rank is in
  int groups() const { return groups_; }  // how many there are
  int group_size() const { return group_size_; }  // ranks in each

 private:
  std::unique_ptr<comm::Communicator> shard_;
  std::unique_ptr<comm::Communicator> replicas_;
  int group_ = 0;
  int groups_ = 1;
  int group_size_ = 1;
};

}  // namespace gradsync::dist
