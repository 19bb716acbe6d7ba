// gradsync/dist/horovod/process_set.h - Horovod's process sets: a subset of the ranks that reduces on its
// own.
//
//   dist::ProcessSet even(world, {0, 2});          // on every rank, with the same list
//   if (even.includes(world.rank())) {
//     dist::DistributedOptimizer opt(adam, even);  // reduces over ranks 0 and 2 only
//     ...
//   }
//
// Made collectively over the world, like hvd.add_process_set: every rank passes the same list
// (a list that differs on some rank is an error on every rank naming it). The members get a
// communicator over the set's ranks in ascending order (Communicator::split); a non-member that
// asks for it, or builds a front end over the set, gets an error naming the set and its rank.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "gradsync/comm/communicator.h"

namespace gradsync::dist {

// Horovod's process set: a subset of the world's ranks with a communicator of their own.
class ProcessSet {
 public:
  // Collective over `world`. `ranks`: distinct world ranks, in any order (kept sorted).
  ProcessSet(comm::Communicator& world, std::vector<int> ranks);

  const std::vector<int>& ranks() const { return ranks_; }  // its members' world ranks, sorted
  bool includes(int world_rank) const;  // `world_rank` is a member
  // The set's communicator (set rank i is world rank ranks()[i]); members only.
  comm::Communicator& communicator();
  std::string describe() const;  // "process set {0, 2}"

 private:
  std::vector<int> ranks_;
  int world_rank_ = 0;
  std::unique_ptr<comm::Communicator> communicator_;  // nullptr on non-members
};

}  // namespace gradsync::dist
