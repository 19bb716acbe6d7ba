// The chain broadcast (chain_broadcast.h).
#include "chain_broadcast.h"

namespace gradsync::comm::algorithms {

void chain_broadcast(Transport& transport, std::byte* data, std::size_t bytes, int root, std::size_t segment) {
  const int position = transport.wrap(transport.rank() - root);  // 0 for the root
  const bool forwards = position < transport.size() - 1;
  std::vector<Message> receives;
  if (position > 0) receives = post_segments(transport, data, bytes, segment, transport.left(), 0, /*receive=*/true);
  std::vector<Message> sends;
  for (std::size_t i = 0, offset = 0; offset < bytes; ++i, offset += segment) {
    if (position > 0) receives[i]->wait("chain broadcast (receive)");
    if (forwards) sends.push_back(transport.send(data + offset, std::min(segment, bytes - offset), transport.right(), 0));
  }
  for (Message& message : sends) message->wait("chain broadcast (send)");
}

}  // namespace gradsync::comm::algorithms
