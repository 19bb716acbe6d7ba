// The ring reduce-scatter (ring_reduce_scatter.h).
#include "ring_reduce_scatter.h"

#include <cstring>

namespace gradsync::comm::algorithms {

void ring_reduce_scatter(Transport& transport, std::byte* data, std::byte* output, const std::vector<std::size_t>& offsets,
                         int shift, DType dtype, ReduceOp op) {
  const int n = transport.size();
  const int rank = transport.rank();
  const std::size_t element = dtype_size(dtype);
  const ReduceFunction reduce = reduce_function(dtype, op);
  const auto begin = [&](int chunk) { return offsets[static_cast<std::size_t>(chunk)]; };
  const auto bytes = [&](int chunk) { return begin(chunk + 1) - begin(chunk); };
  std::size_t largest = 0;
  for (int chunk = 0; chunk < n; ++chunk) largest = std::max(largest, bytes(chunk));
  const std::size_t segment = transport.ring_segment(largest, element);
  const bool in_place = output == nullptr;
  // The arriving partial sums, and out of place the two accumulators.
  std::byte* received = transport.scratch((in_place ? 1 : 3) * largest + element);
  std::byte* partial[2] = {received + largest, received + 2 * largest};

  const std::byte* send_from = data + begin(transport.wrap(rank + shift - 1));
  for (int step = 0; step < n - 1; ++step) {
    const int send_chunk = transport.wrap(rank + shift - 1 - step);
    const int receive_chunk = transport.wrap(rank + shift - 2 - step);
    const std::byte* own = data + begin(receive_chunk);  // this rank's contribution to the arriving chunk
    std::byte* target = in_place ? data + begin(receive_chunk) : (step == n - 2 ? output : partial[step % 2]);
    if (in_place) send_from = data + begin(send_chunk);
    std::vector<Message> receives =
        post_segments(transport, received, bytes(receive_chunk), segment, transport.left(), step, /*receive=*/true);
    std::vector<Message> sends = post_segments(transport, const_cast<std::byte*>(send_from), bytes(send_chunk), segment,
                                               transport.right(), step, /*receive=*/false);
    for (std::size_t i = 0; i < receives.size(); ++i) {
      receives[i]->wait("ring reduce-scatter (receive)");
      const std::size_t offset = i * segment;
      const std::size_t length = std::min(segment, bytes(receive_chunk) - offset);
      reduce(target + offset, own + offset, received + offset, length / element);
    }
    for (Message& message : sends) message->wait("ring reduce-scatter (send)");
    send_from = target;
  }
}

void ring_reduce_scatter(Transport& transport, const std::byte* input, std::byte* output, std::int64_t count,
                         DType dtype, ReduceOp op) {
  const std::size_t chunk = static_cast<std::size_t>(count) * dtype_size(dtype);
  if (transport.size() == 1 || chunk == 0) {
    std::memcpy(output, input, chunk);
    return;
  }
  std::vector<std::size_t> offsets;
  for (int c = 0; c <= transport.size(); ++c) offsets.push_back(static_cast<std::size_t>(c) * chunk);
  ring_reduce_scatter(transport, const_cast<std::byte*>(input), output, offsets, /*shift=*/0, dtype, op);
}

}  // namespace gradsync::comm::algorithms
