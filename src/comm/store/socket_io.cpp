// Blocking TCP client sockets (socket_io.h).
#include "socket_io.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace gradsync::comm {

int connect_tcp(const std::string& host, int port, std::chrono::milliseconds timeout, std::string& error, bool& refused) {
  refused = false;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int status = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (status != 0) {
    error = std::string("cannot resolve host: ") + gai_strerror(status);
    return -1;
  }
  int connected = -1;
  for (addrinfo* candidate = found; candidate != nullptr && connected < 0; candidate = candidate->ai_next) {
    const int fd = ::socket(candidate->ai_family, candidate->ai_socktype | SOCK_CLOEXEC, candidate->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, candidate->ai_addr, candidate->ai_addrlen) == 0) {
      connected = fd;
    } else {
      error = std::strerror(errno);
      refused = errno == ECONNREFUSED;
      ::close(fd);
    }
  }
  ::freeaddrinfo(found);
  if (connected < 0) return -1;
  const int on = 1;
  ::setsockopt(connected, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
  timeval limit{};
  limit.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  limit.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  ::setsockopt(connected, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  ::setsockopt(connected, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
  return connected;
}

namespace {

// Some of n bytes, waiting for them only as long as `deadline` leaves: how many arrived, 0 at the
// end of the stream, -1 on an error or at the deadline. Both reads below are loops over it.
ssize_t receive_some(int fd, char* data, std::size_t n, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 || !readable_within(fd, left)) return -1;
    const ssize_t got = ::recv(fd, data, n, MSG_DONTWAIT);
    if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    return got;
  }
}

}  // namespace

bool read_exact(int fd, void* data, std::size_t n, std::chrono::steady_clock::time_point deadline) {
  auto* bytes = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t got = receive_some(fd, bytes, n, deadline);
    if (got <= 0) return false;
    bytes += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
}

bool read_value(int fd, std::vector<char>& value, std::size_t length, std::chrono::steady_clock::time_point deadline) {
  constexpr std::size_t kStep = std::size_t{1} << 20;
  value.clear();
  std::size_t have = 0;
  while (have < length) {
    if (value.size() == have) value.resize(have + std::min(kStep, length - have));  // room for the next MiB
    const ssize_t got = receive_some(fd, value.data() + have, value.size() - have, deadline);
    if (got <= 0) break;
    have += static_cast<std::size_t>(got);
  }
  value.resize(have);  // on a failure, what did arrive
  return have == length;
}

bool write_exact(int fd, const void* data, std::size_t n) {
  const auto* bytes = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t put = ::send(fd, bytes, n, MSG_NOSIGNAL);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    bytes += put;
    n -= static_cast<std::size_t>(put);
  }
  return true;
}

bool readable_within(int fd, std::chrono::milliseconds timeout) {
  pollfd entry{fd, POLLIN, 0};
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    const int ready = ::poll(&entry, 1, static_cast<int>(std::max<std::int64_t>(0, left.count())));
    if (ready < 0 && errno == EINTR) continue;
    return ready > 0;
  }
}

}  // namespace gradsync::comm
