// Reductions in ascending rank order (ordered_reduce.h).
#include "ordered_reduce.h"

#include <cstring>

#include "chain_broadcast.h"
#include "ring_allgather.h"

namespace gradsync::comm::algorithms {

namespace {

// The owner algorithm's reduce-scatter into `output`, with the others' slices of this rank's
// chunk received into `arriving` ((size - 1) x the chunk's bytes).
void owner_reduce_scatter(Transport& transport, const std::byte* input, std::byte* output,
                          const std::vector<std::size_t>& offsets, DType dtype, ReduceOp op, std::byte* arriving) {
  const int n = transport.size();
  const int rank = transport.rank();
  const std::size_t element = dtype_size(dtype);
  const auto begin = [&](int chunk) { return offsets[static_cast<std::size_t>(chunk)]; };
  const auto bytes = [&](int chunk) { return begin(chunk + 1) - begin(chunk); };
  const std::size_t mine = bytes(rank);
  std::size_t largest = 0;
  for (int chunk = 0; chunk < n; ++chunk) largest = std::max(largest, bytes(chunk));
  const std::size_t segment = segment_size(largest, element);  // the same on every rank
  // Rank q's slice of this rank's chunk: where it arrives, or, for this rank's own, where it is.
  const auto slice = [&](int q) -> const std::byte* {
    if (q == rank) return input + begin(rank);
    return arriving + static_cast<std::size_t>(q < rank ? q : q - 1) * mine;
  };

  std::vector<std::vector<Message>> receives(static_cast<std::size_t>(n));
  std::vector<Message> sends;
  for (int q = 0; q < n; ++q) {
    if (q == rank) continue;
    receives[static_cast<std::size_t>(q)] =
        post_segments(transport, const_cast<std::byte*>(slice(q)), mine, segment, q, 0, /*receive=*/true);
    for (Message& message : post_segments(transport, const_cast<std::byte*>(input + begin(q)), bytes(q), segment, q, 0,
                                          /*receive=*/false)) {
      sends.push_back(std::move(message));
    }
  }
  // Segment by segment, as the slices arrive: ((x0 op x1) op x2) op ...
  const ReduceFunction reduce = reduce_function(dtype, op);
  for (std::size_t i = 0, offset = 0; offset < mine; ++i, offset += segment) {
    for (int q = 0; q < n; ++q) {
      if (q != rank) receives[static_cast<std::size_t>(q)][i]->wait("ordered reduce-scatter (receive)");
    }
    const std::size_t count = std::min(segment, mine - offset) / element;
    if (n == 1) {
      std::memcpy(output + offset, slice(0) + offset, count * element);
      continue;
    }
    reduce(output + offset, slice(0) + offset, slice(1) + offset, count);
    for (int q = 2; q < n; ++q) reduce(output + offset, output + offset, slice(q) + offset, count);
  }
  for (Message& message : sends) message->wait("ordered reduce-scatter (send)");
}

// The chain: partial sums from rank 0 to rank size - 1, then broadcast back down the chain.
void chain_allreduce(Transport& transport, std::byte* data, std::size_t bytes, DType dtype, ReduceOp op) {
  const int n = transport.size();
  const int rank = transport.rank();
  const std::size_t element = dtype_size(dtype);
  const std::size_t segment = n == 2 ? std::max(bytes, element) : segment_size(bytes / 4, element);
  const ReduceFunction reduce = reduce_function(dtype, op);
  std::byte* arriving = transport.scratch(bytes);
  std::vector<Message> receives;
  if (rank > 0) receives = post_segments(transport, arriving, bytes, segment, rank - 1, 0, /*receive=*/true);
  std::vector<Message> sends;
  for (std::size_t i = 0, offset = 0; offset < bytes; ++i, offset += segment) {
    const std::size_t length = std::min(segment, bytes - offset);
    if (rank > 0) {
      receives[i]->wait("ordered chain reduce (receive)");
      // What ranks 0..rank-1 added up, then this rank's own.
      reduce(data + offset, arriving + offset, data + offset, length / element);
    }
    if (rank < n - 1) sends.push_back(transport.send(data + offset, length, rank + 1, 0));
  }
  for (Message& message : sends) message->wait("ordered chain reduce (send)");
  chain_broadcast(transport, data, bytes, /*root=*/n - 1, segment);
}

}  // namespace

void ordered_reduce_scatter(Transport& transport, const std::byte* input, std::byte* output,
                            const std::vector<std::size_t>& offsets, DType dtype, ReduceOp op) {
  const std::size_t mine = offsets[static_cast<std::size_t>(transport.rank()) + 1] -
                           offsets[static_cast<std::size_t>(transport.rank())];
  const std::size_t others = static_cast<std::size_t>(transport.size() - 1) * mine;
  // The reduction reads this rank's own slice while it writes the result: when the output is
  // (or overlaps) the input, as in an in-place reduce-scatter, it is reduced aside first.
  const std::byte* input_end = input + offsets.back();
  const bool overlapping = output < input_end && input < output + mine;
  std::byte* arriving = transport.scratch(others + (overlapping ? mine : 0) + 1);
  if (!overlapping) return owner_reduce_scatter(transport, input, output, offsets, dtype, op, arriving);
  owner_reduce_scatter(transport, input, arriving + others, offsets, dtype, op, arriving);
  std::memcpy(output, arriving + others, mine);
}

void ordered_allreduce(Transport& transport, std::byte* data, std::int64_t count, DType dtype, ReduceOp op,
                       OrderedAlgorithm algorithm) {
  const int n = transport.size();
  const std::size_t element = dtype_size(dtype);
  const std::size_t bytes = static_cast<std::size_t>(count) * element;
  if (n == 1 || bytes == 0) return;
  if (algorithm == OrderedAlgorithm::chain) return chain_allreduce(transport, data, bytes, dtype, op);
  // Chunk c is elements [c count / n, (c + 1) count / n), as the ring's.
  std::vector<std::size_t> offsets;
  for (int chunk = 0; chunk <= n; ++chunk) offsets.push_back(static_cast<std::size_t>(count * chunk / n) * element);
  const std::size_t mine = offsets[static_cast<std::size_t>(transport.rank()) + 1] -
                           offsets[static_cast<std::size_t>(transport.rank())];
  // One scratch area: the arriving slices, then this rank's reduced chunk (it cannot be reduced
  // in place: its own slice is one of the inputs).
  std::byte* arriving = transport.scratch(static_cast<std::size_t>(n) * mine + element);
  std::byte* reduced = arriving + static_cast<std::size_t>(n - 1) * mine;
  owner_reduce_scatter(transport, data, reduced, offsets, dtype, op, arriving);
  ring_allgather(transport, data, offsets, element, /*first_owned=*/0, reduced);
}

}  // namespace gradsync::comm::algorithms
