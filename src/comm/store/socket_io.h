// Internal: the blocking TCP client sockets the two store clients share (tcp_store.h for our
// own store, torch_store.h for PyTorch's): connect with a bound on every later read and write,
// and read or write exactly n bytes.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

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

// Exactly n bytes by `deadline`: the whole read, not each recv(), so that a peer sending one
// byte at a time still runs out of time. False on end of stream, an error or the deadline.
bool read_exact(int fd, void* data, std::size_t n, std::chrono::steady_clock::time_point deadline);
// A value of `length` bytes by `deadline`, into `value`, which grows only as the bytes arrive
// (1 MiB at a time): a length a lying peer claims costs the memory of what it sends, not of the
// claim. False as read_exact, with `value` holding what did arrive.
bool read_value(int fd, std::vector<char>& value, std::size_t length, std::chrono::steady_clock::time_point deadline);
bool write_exact(int fd, const void* data, std::size_t n);

// Whether `fd` has something to read within `timeout` (poll); false when the time ran out.
bool readable_within(int fd, std::chrono::milliseconds timeout);

}  // namespace gradsync::comm
