// HSDP's shard and replica groups (gradsync/dist/zero/shard_groups.h).
#include "gradsync/dist/zero/shard_groups.h"

#include <map>
#include <vector>

#include "gradsync/core/error.h"
#include "gradsync/io/checksum.h"

namespace gradsync::dist {

ShardGroups::ShardGroups(comm::Communicator& world, int group_size) {
  const int size = world.size();
  GRADSYNC_CHECK(group_size >= 0, "ShardGroups: a group size of ", group_size, " ranks");
  std::vector<int> group_of(static_cast<std::size_t>(size));
  if (group_size > 0) {
    GRADSYNC_CHECK(size % group_size == 0, "ShardGroups: groups of ", group_size, " ranks do not divide the world of ",
                   size);
    for (int r = 0; r < size; ++r) group_of[static_cast<std::size_t>(r)] = r / group_size;
  } else {
    // One group per node, numbered in order of first appearance: every rank learns every rank's
    // node (a hash of its name) and computes the same groups.
    const std::string node = comm::node_name();
    Tensor mine = Tensor::zeros({1}, DType::i64);
    mine.data_as<std::int64_t>()[0] = static_cast<std::int64_t>(io::xxh64(node.data(), node.size()));
    Tensor all = Tensor::zeros({size}, DType::i64);
    world.allgather_host(mine, all);
    std::map<std::int64_t, int> number;
    std::vector<int> ranks_on;
    for (int r = 0; r < size; ++r) {
      const auto [it, fresh] = number.emplace(all.data_as<std::int64_t>()[r], static_cast<int>(number.size()));
      if (fresh) ranks_on.push_back(0);
      group_of[static_cast<std::size_t>(r)] = it->second;
      ++ranks_on[static_cast<std::size_t>(it->second)];
    }
    group_size = ranks_on[0];
    for (std::size_t g = 0; g < ranks_on.size(); ++g) {
      GRADSYNC_CHECK(ranks_on[g] == group_size, "ShardGroups: node ", g, " runs ", ranks_on[g], " ranks and node 0 ",
                     group_size, "; shard groups by node need the same number on every node (this rank is on '", node,
                     "'; pass a group size instead)");
    }
  }
  group_size_ = group_size;
  groups_ = size / group_size;
  group_ = group_of[static_cast<std::size_t>(world.rank())];
  // Place in the group: how many ranks before this one are in it (groups keep rank order).
  int place = 0;
  for (int r = 0; r < world.rank(); ++r) place += group_of[static_cast<std::size_t>(r)] == group_ ? 1 : 0;
  shard_ = world.split(group_, world.rank());
  replicas_ = world.split(place, world.rank());
}

}  // namespace gradsync::dist
