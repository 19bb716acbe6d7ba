// Sub-communicators (Communicator::split), checked once and run on Gloo ranks-as-threads and on
// MPI processes: the groups and their orders, every collective on them, the front ends over a
// data-parallel axis while another axis's work is in flight.
#pragma once

#include "gradsync/comm/communicator.h"

namespace gradsync::testing {

// Splits by parity with reversed keys, and with some ranks out: sizes, ranks and an allreduce of
// the members' old ranks; every collective of every dtype on a group; a split of a split.
void split_groups(comm::Communicator& world);

// 4 ranks (or any even number) as a grid of 2 columns: a "tensor-parallel" allreduce over each
// row (ranks 2i, 2i + 1) stays in flight while DataParallel, ZeRO-1, ZeRO-2 and the
// DistributedOptimizer train over each column (the data-parallel axis), each reaching what one
// process reaches on the column's concatenated batches; the row's sum is exact.
void two_axes(comm::Communicator& world);

// Horovod's process sets (3 ranks or more): the DistributedOptimizer over {0, 2} (ranks 1, 3, ...
// idle) reaches what one process reaches on the members' batches; a non-member asking for the
// set's communicator or building a front end over it is told it is not a member; a list that
// differs on one rank, a duplicate or an out-of-range rank are errors naming them.
void process_sets(comm::Communicator& world);

}  // namespace gradsync::testing
