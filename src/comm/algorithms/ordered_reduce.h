// Internal: reductions that add every element in ascending rank order, ((x0 + x1) + x2) + ...,
// whatever the chunking, the algorithm or the backend (algorithms/transport.h). Floating-point
// addition is not associative: the ring adds chunk c starting from rank c + 1, recursive
// doubling pairs ranks up in a tree, so the same inputs reduce to different bits with another
// bucket size, world or library. Here the order of every element is fixed, so the bits are too.
//
//  * owner: rank r receives every rank's slice of chunk r (an all-to-all: each rank sends and
//    receives (W - 1)/W of the buffer, the bytes of a ring reduce-scatter), adds them in rank
//    order, and the reduced chunks are then allgathered around the ring: the bytes of a ring
//    allreduce, in one round of W - 1 concurrent messages instead of W - 1 ring steps, with
//    (W - 1)/W of the buffer as receive space.
//  * chain: the partial sums travel 0 -> 1 -> ... -> W - 1, segment by segment, each rank adding
//    its own, then the last rank's result is broadcast down the chain: each link carries the
//    buffer twice (a ring: 2 (W - 1)/W), no extra memory, W - 1 hops of latency each way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "reduce_functions.h"
#include "transport.h"

namespace gradsync::comm::algorithms {

enum class OrderedAlgorithm { owner, chain };

// Chunk c is bytes [offsets[c], offsets[c + 1]) of `input`; rank r's reduced chunk r goes to
// `output` (which may be rank r's chunk of `input`). The owner algorithm's first half.
void ordered_reduce_scatter(Transport& transport, const std::byte* input, std::byte* output,
                            const std::vector<std::size_t>& offsets, DType dtype, ReduceOp op);

// In place on `data` (count elements).
void ordered_allreduce(Transport& transport, std::byte* data, std::int64_t count, DType dtype, ReduceOp op,
                       OrderedAlgorithm algorithm);

}  // namespace gradsync::comm::algorithms
