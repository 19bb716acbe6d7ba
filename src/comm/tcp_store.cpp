// The TCP store of the Gloo rendezvous (tcp_store.h).
//
// Wire format, little-endian, one request at a time per connection:
//   request  : op (1 byte: 'S' set, 'G' get), key length (u32), key, and for 'S' value length (u64), value
//   response : for 'S' one byte 1; for 'G' found (1 byte), and when found value length (u64), value
// GET never blocks on the server; clients poll, so the server needs no waiting lists and a
// client's timeout is entirely its own.
#include "tcp_store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "gradsync/core/error.h"

namespace gradsync::comm {

namespace {

// Reads or writes exactly n bytes; false on end of stream or error.
bool read_exact(int fd, void* data, std::size_t n) {
  auto* bytes = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t got = ::recv(fd, bytes, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    bytes += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
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

}  // namespace

class TcpStoreServer {
 public:
  explicit TcpStoreServer(int port) {
    listener_ = ::socket(AF_INET6, SOCK_STREAM, 0);
    GRADSYNC_CHECK(listener_ >= 0, "tcp store: socket() failed: ", std::strerror(errno));
    const int on = 1;
    const int off = 0;
    ::setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    ::setsockopt(listener_, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof(off));  // IPv4 clients too
    sockaddr_in6 address{};
    address.sin6_family = AF_INET6;
    address.sin6_addr = in6addr_any;
    address.sin6_port = htons(static_cast<std::uint16_t>(port));
    if (::bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 || ::listen(listener_, 128) != 0) {
      const std::string reason = std::strerror(errno);
      ::close(listener_);
      detail::throw_error("tcp store: cannot listen on port ", port, " (MASTER_PORT): ", reason,
                          "; is another job using it?");
    }
    acceptor_ = std::thread([this] { accept_loop(); });
  }

  ~TcpStoreServer() {
    stopping_ = true;
    acceptor_.join();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const int fd : clients_) ::shutdown(fd, SHUT_RDWR);  // unblocks the handlers' reads
    }
    for (std::thread& handler : handlers_) handler.join();
    for (const int fd : clients_) ::close(fd);
    ::close(listener_);
  }

 private:
  void accept_loop() {
    while (!stopping_) {
      pollfd waiting{listener_, POLLIN, 0};
      if (::poll(&waiting, 1, 50) <= 0) continue;
      const int client = ::accept(listener_, nullptr, nullptr);
      if (client < 0) continue;
      const int on = 1;
      ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
      std::lock_guard<std::mutex> lock(mutex_);
      clients_.push_back(client);
      handlers_.emplace_back([this, client] { serve(client); });
    }
  }

  void serve(int fd) {
    for (;;) {
      char op = 0;
      std::uint32_t key_length = 0;
      if (!read_exact(fd, &op, 1) || !read_exact(fd, &key_length, sizeof(key_length))) return;
      std::string key(key_length, '\0');
      if (!read_exact(fd, key.data(), key_length)) return;
      if (op == 'S') {
        std::uint64_t length = 0;
        if (!read_exact(fd, &length, sizeof(length))) return;
        std::vector<char> value(length);
        if (!read_exact(fd, value.data(), length)) return;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          data_[key] = std::move(value);
        }
        const char ack = 1;
        if (!write_exact(fd, &ack, 1)) return;
      } else if (op == 'G') {
        std::vector<char> value;
        char found = 0;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          const auto it = data_.find(key);
          if (it != data_.end()) {
            found = 1;
            value = it->second;
          }
        }
        const std::uint64_t length = value.size();
        if (!write_exact(fd, &found, 1)) return;
        if (found && (!write_exact(fd, &length, sizeof(length)) || !write_exact(fd, value.data(), length))) return;
      } else {
        return;  // not our protocol: drop the connection
      }
    }
  }

  int listener_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  std::mutex mutex_;  // guards data_, clients_, handlers_
  std::map<std::string, std::vector<char>> data_;
  std::vector<int> clients_;
  std::vector<std::thread> handlers_;
};

TcpStore::TcpStore(const std::string& host, int port, bool serve, std::chrono::milliseconds timeout)
    : endpoint_(host + ":" + std::to_string(port)), timeout_(timeout) {
  GRADSYNC_CHECK(port > 0 && port < 65536, "tcp store: MASTER_PORT ", port, " is not a TCP port");
  if (serve) server_ = std::make_shared<TcpStoreServer>(port);

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string last_error = "no attempt";
  while (std::chrono::steady_clock::now() < deadline) {
    addrinfo* found = nullptr;
    const int status = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
    if (status != 0) {
      last_error = std::string("cannot resolve host: ") + gai_strerror(status);
    } else {
      for (addrinfo* candidate = found; candidate != nullptr && socket_ < 0; candidate = candidate->ai_next) {
        const int fd = ::socket(candidate->ai_family, candidate->ai_socktype, candidate->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, candidate->ai_addr, candidate->ai_addrlen) == 0) {
          socket_ = fd;
        } else {
          last_error = std::strerror(errno);
          ::close(fd);
        }
      }
      ::freeaddrinfo(found);
    }
    if (socket_ >= 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // rank 0 may not listen yet
  }
  GRADSYNC_CHECK(socket_ >= 0, "tcp store: cannot reach the rank-0 store at ", endpoint_, " (MASTER_ADDR:MASTER_PORT) within ",
                 timeout.count(), " ms: ", last_error);
  const int on = 1;
  ::setsockopt(socket_, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
}

TcpStore::~TcpStore() {
  if (socket_ >= 0) ::close(socket_);
}

std::shared_ptr<void> TcpStore::server() const { return server_; }

void TcpStore::set(const std::string& key, const std::vector<char>& data) {
  std::lock_guard<std::mutex> lock(mutex_);
  const char op = 'S';
  const auto key_length = static_cast<std::uint32_t>(key.size());
  const std::uint64_t length = data.size();
  char ack = 0;
  const bool ok = write_exact(socket_, &op, 1) && write_exact(socket_, &key_length, sizeof(key_length)) &&
                  write_exact(socket_, key.data(), key.size()) && write_exact(socket_, &length, sizeof(length)) &&
                  write_exact(socket_, data.data(), data.size()) && read_exact(socket_, &ack, 1);
  GRADSYNC_CHECK(ok && ack == 1, "tcp store at ", endpoint_, ": set('", key, "') failed: the store (rank 0) is gone");
}

bool TcpStore::try_get(const std::string& key, std::vector<char>& value) {
  std::lock_guard<std::mutex> lock(mutex_);
  const char op = 'G';
  const auto key_length = static_cast<std::uint32_t>(key.size());
  char found = 0;
  bool ok = write_exact(socket_, &op, 1) && write_exact(socket_, &key_length, sizeof(key_length)) &&
            write_exact(socket_, key.data(), key.size()) && read_exact(socket_, &found, 1);
  if (ok && found) {
    std::uint64_t length = 0;
    ok = read_exact(socket_, &length, sizeof(length));
    value.resize(length);
    ok = ok && read_exact(socket_, value.data(), length);
  }
  GRADSYNC_CHECK(ok, "tcp store at ", endpoint_, ": get('", key, "') failed: the store (rank 0) is gone");
  return found != 0;
}

void TcpStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<char> ignored;
  for (const std::string& key : keys) {
    while (!try_get(key, ignored)) {
      GRADSYNC_CHECK(std::chrono::steady_clock::now() < deadline, "tcp store at ", endpoint_, ": key '", key,
                     "' did not appear within ", timeout.count(), " ms (has every rank started?)");
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
}

std::vector<char> TcpStore::get(const std::string& key) {
  wait({key}, timeout_);
  std::vector<char> value;
  try_get(key, value);
  return value;
}

}  // namespace gradsync::comm
