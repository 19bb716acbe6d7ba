// Internal: recursive doubling allreduce for small messages on a power-of-two world
// (algorithms/transport.h): log2(size) exchanges of the whole buffer with the partner
// rank ^ distance, distance 1, 2, 4, ..., each followed by the reduction. The fewest message
// latencies of any allreduce, what MPI_Allreduce itself does for small messages. The
// reductions are commutative, so both partners compute the same bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "reduce_functions.h"
#include "transport.h"

namespace gradsync::comm::algorithms {

void recursive_doubling_allreduce(Transport& transport, std::byte* data, std::int64_t count, DType dtype, ReduceOp op);

}  // namespace gradsync::comm::algorithms
