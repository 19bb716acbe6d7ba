// The per-rank words of a step's status allreduce, shared by DataParallel and the
// DistributedOptimizer: each rank writes flags into its own word only, the allreduce sums, and
// every rank reads the same census of who missed gradients, who has joined, and who joined in
// this very step (docs/join.md).
#pragma once

#include <string>
#include <vector>

#include "gradsync/core/error.h"

namespace gradsync::dist::join_detail {

enum RankFlag : int {
  kMissedGradients = 1,   // find_unused_parameters off and this rank did not produce them all
  kJoined = 2,            // out of data: this step is a shadow step
  kJoinedThisStep = 4,    // ... and its first one
};

struct Census {
  int joined = 0;              // ranks in a shadow step
  std::vector<int> joined_ranks;
  int last_joiner = -1;        // the highest rank whose first shadow step this is (-1: none)
  std::vector<int> missed;     // ranks that missed gradients
};

// `words`: the world's summed words, one per rank.
inline Census read_census(const double* words, int world) {
  Census census;
  for (int r = 0; r < world; ++r) {
    const int flags = static_cast<int>(words[r]);
    if (flags & kMissedGradients) census.missed.push_back(r);
    if (flags & kJoined) census.joined_ranks.push_back(r);
    if (flags & kJoinedThisStep) census.last_joiner = r;
  }
  census.joined = static_cast<int>(census.joined_ranks.size());
  return census;
}

// A failure during a shadow step, with what a joined rank was doing: most often the active
// ranks issued a collective of their own, which has no partner here.
[[noreturn]] inline void rethrow_from_shadow_step(const std::exception& error) {
  throw Error(std::string("while this rank was joined (out of inputs) and shadowing the others' synchronized steps: ") +
              error.what() +
              "\n(a collective the active ranks issue outside their synchronized steps, such as a GradScaler with a "
              "communicator or a metrics allreduce, has no partner on a joined rank: see docs/join.md)");
}

}  // namespace gradsync::dist::join_detail
