// Internal: the ring allgather (algorithms/transport.h).
//
// Chunk c of the buffer is offsets[c] to offsets[c + 1] (bytes; chunks may differ in size, as an
// allgatherv's). Rank r owns chunk (r + first_owned); in step s of size-1 steps it sends chunk
// (r + first_owned - s) to its right neighbour and receives chunk (r + first_owned - s - 1) from
// its left one, straight into place, in segments. Every link carries each chunk once.
// With `own_source`, rank r's own chunk is not in place yet: step 0 sends it from there, and it
// is copied into place while the first messages travel (sending the freshly copied bytes
// instead costs up to 1.6x at 64 KiB-1 MiB with Open MPI's single-copy transport).
#pragma once

#include <cstddef>
#include <vector>

#include "transport.h"

namespace gradsync::comm::algorithms {

void ring_allgather(Transport& transport, std::byte* data, const std::vector<std::size_t>& offsets, std::size_t element,
                    int first_owned = 0, const std::byte* own_source = nullptr);

}  // namespace gradsync::comm::algorithms
