// Training loops in which one rank dies at a chosen point, written once for ranks as threads
// (tests/multirank/test_failures.cpp: the victim throws, its objects unwind and close their
// connections) and ranks as processes (tests/multirank/peer_death.cpp: the victim ends with
// _Exit, as a killed process would). `die` runs on `victim` there and must not return.
#pragma once

#include <functional>

#include "gradsync/comm/communicator.h"

namespace gradsync::testing {

// Three steps of DataParallel + ZeRO (`stage` 1, 2 or 3) with Adam; at step 2 the victim dies
// right after its begin_backward (`in_backward`: the others are in the backward's
// reduce-scatters) or after its end_backward (the others are in the step's gathers; stage 3:
// before its forward, the others in the gathers of the units).
void zero_training_with_a_death(comm::Communicator& comm, int stage, bool in_backward, int victim,
                                const std::function<void()>& die);

// Rank 0 has one batch, the others four, inside a Join; the victim dies at its step 2, while
// rank 0 shadows the others' steps.
void join_training_with_a_death(comm::Communicator& comm, int victim, const std::function<void()>& die);

}  // namespace gradsync::testing
