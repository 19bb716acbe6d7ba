// The ring allgather (ring_allgather.h).
#include "ring_allgather.h"

#include <cstring>

namespace gradsync::comm::algorithms {

void ring_allgather(Transport& transport, std::byte* data, const std::vector<std::size_t>& offsets, std::size_t element,
                    int first_owned, const std::byte* own_source) {
  const int rank = transport.rank();
  const auto begin = [&](int chunk) { return offsets[static_cast<std::size_t>(chunk)]; };
  const auto bytes = [&](int chunk) { return begin(chunk + 1) - begin(chunk); };
  std::size_t largest = 0;
  for (int chunk = 0; chunk < transport.size(); ++chunk) largest = std::max(largest, bytes(chunk));
  const std::size_t segment = transport.ring_segment(largest, element);
  for (int step = 0; step < transport.size() - 1; ++step) {
    const int send_chunk = transport.wrap(rank + first_owned - step);
    const int receive_chunk = transport.wrap(rank + first_owned - step - 1);
    const bool from_source = step == 0 && own_source != nullptr;
    std::byte* send_from = from_source ? const_cast<std::byte*>(own_source) : data + begin(send_chunk);
    std::vector<Message> receives = post_segments(transport, data + begin(receive_chunk), bytes(receive_chunk), segment,
                                                  transport.left(), step, /*receive=*/true);
    std::vector<Message> sends =
        post_segments(transport, send_from, bytes(send_chunk), segment, transport.right(), step, /*receive=*/false);
    if (from_source) std::memcpy(data + begin(send_chunk), own_source, bytes(send_chunk));
    for (Message& message : receives) message->wait("ring allgather (receive)");
    for (Message& message : sends) message->wait("ring allgather (send)");
  }
}

}  // namespace gradsync::comm::algorithms
