// Internal: the pipelined chain broadcast (algorithms/transport.h): root -> root+1 -> ... ->
// root-1, segment by segment, each rank forwarding a segment as soon as it has it, so every
// link of the chain is busy at once and carries the buffer once.
#pragma once

#include <cstddef>

#include "transport.h"

namespace gradsync::comm::algorithms {

void chain_broadcast(Transport& transport, std::byte* data, std::size_t bytes, int root, std::size_t segment);

}  // namespace gradsync::comm::algorithms
