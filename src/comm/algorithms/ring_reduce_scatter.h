// Internal: the ring reduce-scatter (algorithms/transport.h).
//
// The buffer is cut into `size` chunks (offsets[c] to offsets[c + 1], in bytes). In step s of
// size-1 steps, rank r sends its partial sum of chunk (r + shift - 1 - s) to its right neighbour
// and receives the left neighbour's partial sum of chunk (r + shift - 2 - s), adding its own
// input to it; after the last step rank r holds chunk (r + shift) reduced over every rank. Each
// rank sends (size-1)/size of the buffer, the least any algorithm can, and each chunk travels in
// segments, so that the reduction of one segment overlaps the transfer of the next.
//  * In place (`output` == nullptr): the partial sums accumulate in `data` itself, and the
//    reduced chunk ends at its own place (the first half of the ring allreduce, shift 1).
//  * Out of place: `data` is only read; partial sums alternate between two scratch chunks (one
//    is on the wire while the other fills) and the last step writes the reduced chunk into
//    `output` (shift 0: rank r receives chunk r, MPI_Reduce_scatter_block's contract).
#pragma once

#include <cstddef>
#include <vector>

#include "reduce_functions.h"
#include "transport.h"

namespace gradsync::comm::algorithms {

void ring_reduce_scatter(Transport& transport, std::byte* data, std::byte* output, const std::vector<std::size_t>& offsets,
                         int shift, DType dtype, ReduceOp op);

// `count` elements per rank: rank r receives chunk r of `input` (size * count elements),
// reduced over every rank, in `output`.
void ring_reduce_scatter(Transport& transport, const std::byte* input, std::byte* output, std::int64_t count,
                         DType dtype, ReduceOp op);

}  // namespace gradsync::comm::algorithms
