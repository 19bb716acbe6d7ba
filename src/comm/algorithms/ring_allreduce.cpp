// The ring allreduce (ring_allreduce.h).
#include "ring_allreduce.h"

#include <vector>

#include "ring_allgather.h"
#include "ring_reduce_scatter.h"

namespace gradsync::comm::algorithms {

void ring_allreduce(Transport& transport, std::byte* data, std::int64_t count, DType dtype, ReduceOp op) {
  const int n = transport.size();
  const std::size_t element = dtype_size(dtype);
  std::vector<std::size_t> offsets;
  for (int chunk = 0; chunk <= n; ++chunk) offsets.push_back(static_cast<std::size_t>(count * chunk / n) * element);
  // Rank r ends the reduce-scatter holding the final chunk r+1 in place, then passes it around.
  ring_reduce_scatter(transport, data, /*output=*/nullptr, offsets, /*shift=*/1, dtype, op);
  ring_allgather(transport, data, offsets, element, /*first_owned=*/1);
}

}  // namespace gradsync::comm::algorithms
