// Recursive doubling (recursive_doubling.h).
#include "recursive_doubling.h"

namespace gradsync::comm::algorithms {

void recursive_doubling_allreduce(Transport& transport, std::byte* data, std::int64_t count, DType dtype, ReduceOp op) {
  const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
  const ReduceFunction reduce = reduce_function(dtype, op);
  std::byte* received = transport.scratch(bytes);
  int round = 0;
  for (int distance = 1; distance < transport.size(); distance *= 2, ++round) {
    const int partner = transport.rank() ^ distance;
    Message receive = transport.receive(received, bytes, partner, round);
    Message send = transport.send(data, bytes, partner, round);
    receive->wait("allreduce (recursive doubling receive)");
    send->wait("allreduce (recursive doubling send)");
    reduce(data, data, received, static_cast<std::size_t>(count));
  }
}

}  // namespace gradsync::comm::algorithms
