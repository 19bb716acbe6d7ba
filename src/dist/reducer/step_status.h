// Internal: the status word that ends every synchronized step, shared by DataParallel and the
// DistributedOptimizer (docs/data_parallel.md, docs/join.md).
//
// One small allreduce (sum) at a fixed position of the step carries everything the ranks must
// decide alike. Each rank writes into the fields it owns, the sum merges them, and every rank
// reads the same result:
//   * usage: one word per parameter, 1 when this rank used it in the accumulation window; the
//     sum is how many ranks did (find_unused_parameters' defined/undefined decision);
//   * one flags word per rank of the job, which only that rank writes (RankFlag: who missed
//     gradients, who has joined, who joined in this very step); under HSDP the job is every
//     shard group, its ranks numbered group by group (job_rank below);
//   * carry: this step's average is carried into the next synchronized step of the same window
//     (MULTI_AUTO_SYNC before the final microbatch), which a joined rank must then repeat;
//   * AUTO's decision: a flag and the three strategies' trial times, summed over ranks.
// Doubles: the counts stay exact and the times fit. Nothing outside this unit knows where a
// field sits in the word.
#pragma once

#include <array>
#include <cstddef>
#include <functional>
#include <optional>
#include <vector>

#include "gradsync/comm/communicator.h"

namespace gradsync::dist {

// The bits of a rank's flags word.
enum RankFlag : int {
  kMissedGradients = 1,  // find_unused_parameters off and this rank did not produce them all
  kJoined = 2,           // out of data: this step is a shadow step (gradsync/dist/join/join.h)
  kJoinedThisStep = 4,   // ... and its first one
};

// Who did what in one step, as every rank reads it from the summed flags.
struct Census {
  int joined = 0;  // ranks in a shadow step
  std::vector<int> joined_ranks;
  int last_joiner = -1;     // the highest rank whose first shadow step this is (-1: none)
  std::vector<int> missed;  // ranks that missed gradients
};

class StepStatus {
 public:
  // A status with `parameters` usage words, over the ranks of `comm` and, under HSDP, of every
  // shard group (`replicas`: the same place in each group).
  StepStatus(std::size_t parameters, const comm::Communicator& comm, const comm::Communicator* replicas = nullptr);

  // This rank's number in the job: group g's rank r is g * (group size) + r, as ShardGroups
  // lays the world out (the rank itself without HSDP). Census ranks are these.
  static int job_rank(const comm::Communicator& comm, const comm::Communicator* replicas);
  static int job_size(const comm::Communicator& comm, const comm::Communicator* replicas);

  // --- This rank's contribution, before exchange().
  void set_used(std::size_t parameter);
  void set_flags(int flags);
  void set_carried();
  void propose_auto(const std::array<double, 3>& trial_seconds);

  // The allreduce: launched, then `meanwhile` runs (the Reducer's waits, sparse allgathers:
  // whatever the step overlaps with it), then the status is waited for. Whatever throws, the
  // allreduce is waited for before this returns (it writes into this object); the first error
  // is the one rethrown.
  // `replicas` (HSDP, as given to the constructor): the status is then summed over them too,
  // so every group reads the job's status and decides alike.
  void exchange(comm::Communicator& comm, const std::function<void()>& meanwhile,
                comm::Communicator* replicas = nullptr);

  // --- The summed status, after exchange().
  int used_count(std::size_t parameter) const;
  Census census() const;
  bool carried() const;
  // AUTO's trial times summed over ranks, when some rank proposed a decision.
  std::optional<std::array<double, 3>> auto_times() const;

 private:
  double* words();
  const double* words() const;

  std::size_t parameters_;
  int world_;  // ranks in the job
  int rank_;   // this rank's job_rank
  Tensor words_;  // [usage | flags per rank | carry | AUTO flag | 3 trial times]
};

}  // namespace gradsync::dist
