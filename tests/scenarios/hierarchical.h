// Hierarchical allreduce (src/comm/cpu/hierarchical.h) on simulated nodes: ranks say which node they
// run on through CommOptions::node; run on Gloo ranks-as-threads and on MPI processes.
#pragma once

#include <cstdint>
#include <string>

#include "gradsync/comm/communicator.h"

namespace gradsync::testing {

// The node name of `rank` when `size` ranks run on `nodes` nodes: contiguous blocks, or round
// robin (a node's ranks need not be neighbours).
std::string simulated_node(int rank, int size, int nodes, bool round_robin);

// Every allreduce form, dtype and op, sizes 0 to `largest` elements, against the exact result (whole
// numbers) and the f64 sum (within 1e-6 relative). With `pairwise_order` (2 round-robin nodes x
// 2 ranks, hierarchy on) also bitwise the order only the hierarchy takes, (x0 + x2) + (x1 + x3);
// with hierarchy off on that layout, the flat result must differ from it somewhere (the inputs
// tell the orders apart).
// Sizes up to `largest` elements (1 Mi crosses the automatic mode's 2 MiB threshold in every
// dtype; the other modes need no more than 100003).
enum class Expect { any_order, pairwise_order, not_pairwise };
void hierarchical_values(comm::Communicator& world, Expect expect, std::int64_t largest = 100003);

// DataParallel and the DistributedOptimizer over a hierarchical world reach what one process
// reaches; a duplicate and a split of it stay correct.
void hierarchical_front_ends(comm::Communicator& world);

// Ranks whose hierarchy settings differ (rank 1's are not the others'): the first allreduce fails
// on every rank, naming rank 1 and the knobs.
void hierarchical_settings_must_agree(comm::Communicator& world);

}  // namespace gradsync::testing
