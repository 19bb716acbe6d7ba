// Internal: the one join loop (join.h), for Join and for front ends that join on their own
// (DistributedOptimizer::join, Horovod's hvd.join).
#pragma once

#include <vector>

#include "gradsync/dist/join/join.h"

namespace gradsync::dist {

// Shadow steps over `participants` until every rank has joined, then each participant's
// finish_join(last joiner). Returns the last joiner, the same on every rank. Collective.
int run_join_loop(const std::vector<Joinable*>& participants, bool throw_on_early_termination);

}  // namespace gradsync::dist
