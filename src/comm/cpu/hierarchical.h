// Internal: hierarchical allreduce, for ranks spread over several nodes (machines).
//
// Between machines the network, not memory, is the limit. A flat ring over W ranks on N nodes
// sends 2 (W - 1)/W of the buffer over every link of the ring, including the slow ones between
// nodes, and pays a slow link's latency in each of its 2 (W - 1) steps. The hierarchical
// allreduce keeps most of the work inside the nodes:
//
//   1. inside each node, a ring reduce-scatter: local rank l holds slice l of the node's sum;
//   2. across nodes, local rank l allreduces slice l with the local rank l of every other node
//      (one allreduce per local rank, all at once: every rank's own link is busy);
//   3. inside each node, a ring allgather of the reduced slices.
//
// Only step 2 crosses nodes, with 1/L of the buffer per rank (L ranks per node): across the
// node boundary each node sends 2 (N - 1)/N of the buffer in all, as a ring over the N nodes
// would, but in one phase whose latency is that of N ranks, not W.
//
// It is a Backend around the flat one: every other operation, and allreduces it does not take,
// go to the flat backend unchanged. The node groups are split from the flat backend the first
// time an allreduce qualifies (every rank decides alike: the rule depends on the size and the
// topology, both the same everywhere).
#pragma once

#include <memory>

#include "backend.h"

namespace gradsync::comm {

// `flat` wrapped. Always, even with hierarchy off: the first allreduce compares every rank's
// settings, so that ranks that would decide differently fail instead of mismatching messages.
std::unique_ptr<Backend> with_hierarchy(std::unique_ptr<Backend> flat, const CommOptions& options);

}  // namespace gradsync::comm
