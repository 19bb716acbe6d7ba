// Reproducible reductions (CommOptions::reproducible), checked once and run on any CPU
// communicator: Gloo ranks-as-threads in the multirank suite, MPI processes under mpirun.
// Inputs spread over 2^-11 .. 2^11, so that the order of the additions shows in the last bits;
// the expected result is the ascending-rank fold ((x0 + x1) + x2) + ... computed here, with the
// dtype's rounding after every addition (16-bit floats: added in f32, rounded once).
#pragma once

#include <cstdint>
#include <vector>

#include "gradsync/comm/communicator.h"

namespace gradsync::testing {

// Rank r's value at element i (the same formula the expected fold uses).
double reproducible_input(int rank, std::int64_t i);

// `comm` in reproducible mode: allreduce (sum, avg, max), reduce-scatter (into a separate
// tensor and in place) and the coalesced allreduce of every floating dtype equal the fold,
// bitwise, for every size in `sizes`.
void reproducible_reductions(comm::Communicator& comm, const std::vector<std::int64_t>& sizes);

// The same inputs through a communicator *not* in reproducible mode: whether some bit differs
// from the fold (the sanity check that the inputs can tell an order from another).
bool ordinary_allreduce_differs(comm::Communicator& comm, std::int64_t size);

// DataParallel over `comm` (reproducible): three steps of training with bucket caps of 1 KB,
// 16 KB and the default, returning each run's parameters; bitwise equal when the mode works.
std::vector<std::vector<char>> train_with_three_bucket_caps(comm::Communicator& comm);

}  // namespace gradsync::testing
