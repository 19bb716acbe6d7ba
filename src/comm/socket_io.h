// Internal: the blocking TCP client sockets the two store clients share (tcp_store.h for our
// own store, torch_store.h for PyTorch's): connect with a bound on every later read and write,
// and read or write exactly n bytes.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

#include "gradsync/core/error.h"

namespace gradsync::comm {

// What a store client throws when its server is gone (refused, closed, silent past the
// timeout), as opposed to a key that has not appeared yet: a rendezvous that waits for keys
// gives up at once on this one instead of asking again until its own timeout.
class StoreGone : public Error {
 public:
  using Error::Error;
};

// One attempt to connect to host:port (any of its addresses). Returns the socket, or -1 with
// `error` saying why and `refused` set when nobody listens there. Reads and writes on the socket
// give up after `timeout` (SO_RCVTIMEO, SO_SNDTIMEO), so a peer that stops answering fails a
// request instead of hanging it.
int connect_tcp(const std::string& host, int port, std::chrono::milliseconds timeout, std::string& error, bool& refused);

// Exactly n bytes; false on end of stream, an error or the socket's timeout.
bool read_exact(int fd, void* data, std::size_t n);
bool write_exact(int fd, const void* data, std::size_t n);

// Whether `fd` has something to read within `timeout` (poll); false when the time ran out.
bool readable_within(int fd, std::chrono::milliseconds timeout);

}  // namespace gradsync::comm
