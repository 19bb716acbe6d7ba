// Internal: the ring allreduce (algorithms/transport.h): the in-place ring reduce-scatter,
// after which rank r holds chunk r+1 reduced, then the ring allgather of the reduced chunks.
// Chunk c is elements [c * count / size, (c + 1) * count / size). Each rank sends and receives
// 2 (size-1)/size of the buffer, the bound of any allreduce (docs/communication.md), what
// MPI_Allreduce does for large messages.
#pragma once

#include <cstddef>
#include <cstdint>

#include "reduce_functions.h"
#include "transport.h"

namespace gradsync::comm::algorithms {

void ring_allreduce(Transport& transport, std::byte* data, std::int64_t count, DType dtype, ReduceOp op);

}  // namespace gradsync::comm::algorithms
