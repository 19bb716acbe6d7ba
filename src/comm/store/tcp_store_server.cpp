// The TCP store's server (tcp_store.h): one thread, one poll loop over every connection, each
// bounded in what it may buffer and how long it may take. The wire format is protocol.h's.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "gradsync/core/error.h"
#include "socket_address.h"
#include "protocol.h"
#include "tcp_store.h"

namespace gradsync::comm {

namespace {

using Clock = std::chrono::steady_clock;

std::string peer_name(const sockaddr_storage& address) {
  const std::optional<HostPort> named = host_and_port(address);
  return named ? named->host + ":" + std::to_string(named->port) : "an unknown address";
}

}  // namespace

class TcpStoreServer {
 public:
  explicit TcpStoreServer(const TcpStoreServerOptions& options) : options_(options) {
    listen();
    if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
      ::close(listener_);
      detail::throw_error("tcp store: pipe() failed: ", std::strerror(errno));
    }
    loop_ = std::thread([this] { loop(); });
  }

  ~TcpStoreServer() {
    stopping_ = true;
    const char byte = 1;
    [[maybe_unused]] const ssize_t woken = ::write(wake_[1], &byte, 1);
    loop_.join();
    for (const Connection& connection : connections_) ::close(connection.fd);
    ::close(listener_);
    ::close(wake_[0]);
    ::close(wake_[1]);
  }

  int port() const { return port_; }
  // tcp_store_server_set and tcp_store_server_erase_prefix: queued for the loop, which owns data_.
  void post(const std::string& key, const std::string& value) {
    GRADSYNC_CHECK(key.size() <= store::kMaxKeyBytes && value.size() <= store::kMaxValueBytes, "tcp store: a posted value for '",
                   key, "' of ", value.size(), " bytes is over the store's caps");
    queue({key, value, {}, false});
  }
  void erase_prefix(const std::string& prefix, const std::string& keep) { queue({prefix, {}, keep, true}); }
  TcpStoreServerCounters counters() const {
    std::lock_guard<std::mutex> lock(counters_mutex_);
    return counters_;
  }

 private:
  struct Posted {  // from another thread: a value to store, or the keys under `key` but `keep` to erase
    std::string key, value, keep;
    bool erase_prefix = false;
  };

  void queue(Posted change) {
    {
      std::lock_guard<std::mutex> lock(posted_mutex_);
      posted_.push_back(std::move(change));
    }
    const char byte = 1;
    [[maybe_unused]] const ssize_t woken = ::write(wake_[1], &byte, 1);
  }

  struct Connection {
    int fd;
    std::string peer;
    bool authenticated = false;
    std::string in;   // received bytes not yet parsed: at most one request's worth
    std::string out;  // response bytes not yet sent
    Clock::time_point opened;
    Clock::time_point last_activity;
  };

  // The address MASTER_ADDR names when it is one of this machine's, GRADSYNC_STORE_BIND when
  // set ("" or "*": every interface); a host that is not local falls back to every interface,
  // saying so once.
  void listen() {
    const std::string host = options_.bind_host;
    const bool everywhere = host.empty() || host == "*" || host == "0.0.0.0" || host == "::";
    std::string failure = "no address";
    if (!everywhere) {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      hints.ai_flags = AI_PASSIVE;
      addrinfo* found = nullptr;
      const int status = ::getaddrinfo(host.c_str(), std::to_string(options_.port).c_str(), &hints, &found);
      if (status != 0) failure = std::string("cannot resolve '") + host + "': " + gai_strerror(status);
      for (addrinfo* candidate = found; candidate != nullptr && listener_ < 0; candidate = candidate->ai_next) {
        if (!bind_to(candidate->ai_addr, candidate->ai_addrlen, candidate->ai_family, failure)) continue;
      }
      if (found != nullptr) ::freeaddrinfo(found);
      if (listener_ < 0 && options_.bind_required) {
        detail::throw_error("tcp store: cannot listen on GRADSYNC_STORE_BIND=", host, " port ", options_.port, ": ",
                            failure, " (an address of this machine, or * for every interface)");
      }
      if (listener_ < 0 && failure.find("Address already in use") != std::string::npos) {
        detail::throw_error("tcp store: cannot listen on ", host, ":", options_.port, " (MASTER_PORT): ", failure,
                            "; is another job using it?");
      }
      if (listener_ < 0) {
        std::fprintf(stderr,
                     "gradsync: tcp store: cannot listen on %s (%s); listening on every interface (set "
                     "GRADSYNC_STORE_BIND to an address of this machine)\n",
                     host.c_str(), failure.c_str());
      }
    }
    if (listener_ < 0) {
      sockaddr_in6 any{};
      any.sin6_family = AF_INET6;
      any.sin6_addr = in6addr_any;
      any.sin6_port = htons(static_cast<std::uint16_t>(options_.port));
      if (!bind_to(reinterpret_cast<sockaddr*>(&any), sizeof any, AF_INET6, failure)) {
        detail::throw_error("tcp store: cannot listen on port ", options_.port, " (MASTER_PORT): ", failure,
                            "; is another job using it?");
      }
    }
    sockaddr_storage bound{};
    socklen_t length = sizeof bound;
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&bound), &length);
    port_ = bound.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port)
                                       : ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
    if (!options_.secret_token && !loopback(bound)) {
      GRADSYNC_CHECK(!options_.refuse_derived_token, "tcp store on port ", port_, " listens beyond this machine and ",
                     "has no secret token: set GRADSYNC_STORE_TOKEN to the same secret everywhere (a token derived ",
                     "from the port or the launch is no secret: whoever reaches the port may compute it)");
      warn("the rendezvous store listens beyond this machine (port " + std::to_string(port_) + ") with a token " +
           "derived from what the launch shows (its job id and MASTER_ADDR:MASTER_PORT), which whoever can reach " +
           "the port may compute: set GRADSYNC_STORE_TOKEN to a secret shared by the ranks (docs/communication.md)");
    }
  }

  static bool loopback(const sockaddr_storage& address) {
    if (address.ss_family == AF_INET) {
      return (ntohl(reinterpret_cast<const sockaddr_in*>(&address)->sin_addr.s_addr) >> 24) == 127;
    }
    const in6_addr& six = reinterpret_cast<const sockaddr_in6*>(&address)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(&six)) return true;
    return IN6_IS_ADDR_V4MAPPED(&six) && six.s6_addr[12] == 127;
  }

  bool bind_to(const sockaddr* address, socklen_t length, int family, std::string& failure) {
    const int fd = ::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      failure = std::strerror(errno);
      return false;
    }
    const int on = 1, off = 0;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    if (family == AF_INET6) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off);  // IPv4 clients too
    if (::bind(fd, address, length) != 0 || ::listen(fd, 128) != 0) {
      failure = std::strerror(errno);
      ::close(fd);
      return false;
    }
    listener_ = fd;
    return true;
  }

  // One thread, every connection: poll, read what arrived, answer whole requests, write what
  // waits, drop what is malformed, stalled or idle.
  void loop() {
    std::vector<pollfd> fds;
    std::vector<std::list<Connection>::iterator> order;
    while (!stopping_) {
      fds.clear();
      order.clear();
      fds.push_back({wake_[0], POLLIN, 0});
      fds.push_back({listener_, POLLIN, 0});
      for (auto it = connections_.begin(); it != connections_.end(); ++it) {
        fds.push_back({it->fd, static_cast<short>(POLLIN | (it->out.empty() ? 0 : POLLOUT)), 0});
        order.push_back(it);
      }
      const int ready = ::poll(fds.data(), fds.size(), 200);
      if (ready < 0 && errno != EINTR) break;
      if (stopping_) break;
      if (ready > 0 && (fds[0].revents & POLLIN)) {
        char drained[64];
        while (::read(wake_[0], drained, sizeof drained) > 0) {
        }
      }
      apply_posted();
      const auto now = Clock::now();
      if (ready > 0 && (fds[1].revents & POLLIN)) accept_all(now);
      for (std::size_t k = 0; k < order.size(); ++k) {
        Connection& connection = *order[k];
        const short events = fds[k + 2].revents;
        std::string why;
        try {
          if (events & (POLLIN | POLLHUP | POLLERR)) why = receive(connection, now);
          if (why.empty() && (events & POLLOUT)) why = send_pending(connection);
          if (why.empty()) why = expired(connection, now);
        } catch (const std::exception& error) {  // nothing leaves the loop (bad_alloc included)
          why = std::string("an internal error: ") + error.what();
        }
        if (!why.empty()) close(order[k], why);
      }
    }
  }

  void accept_all(Clock::time_point now) {
    for (;;) {
      sockaddr_storage address{};
      socklen_t length = sizeof address;
      const int fd = ::accept4(listener_, reinterpret_cast<sockaddr*>(&address), &length, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN: all taken; anything else: try again at the next poll
      count([](TcpStoreServerCounters& c) { ++c.accepted; });
      int unauthenticated = 0;
      for (const Connection& connection : connections_) unauthenticated += connection.authenticated ? 0 : 1;
      if (static_cast<int>(connections_.size()) >= options_.max_connections ||
          unauthenticated >= options_.max_unauthenticated) {
        log("refused a connection from " + peer_name(address) + ": " + std::to_string(connections_.size()) +
            " connections open (" + std::to_string(unauthenticated) + " yet to present the token)");
        count([](TcpStoreServerCounters& c) { ++c.refused_full; });
        ::close(fd);
        continue;
      }
      const int on = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
      connections_.push_back({fd, peer_name(address), false, {}, {}, now, now});
      count([](TcpStoreServerCounters& c) { ++c.open; });
    }
  }

  // Reads what arrived and answers every whole request; returns why the connection must close.
  std::string receive(Connection& connection, Clock::time_point now) {
    char chunk[16384];
    for (;;) {
      const ssize_t got = ::recv(connection.fd, chunk, sizeof chunk, 0);
      if (got == 0) return "closed by the peer";
      if (got < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        return std::string("receive failed: ") + std::strerror(errno);
      }
      connection.last_activity = now;
      connection.in.append(chunk, static_cast<std::size_t>(got));
      // Parse as bytes arrive: a header over the caps is refused before its payload is kept.
      if (std::string why = answer(connection); !why.empty()) return why;
      if (connection.out.size() > 4 * store::kMaxValueBytes) return "not reading its responses";
    }
    return {};
  }

  std::string answer(Connection& connection) {
    for (;;) {
      store::Parsed parsed = store::parse_request(connection.in, connection.authenticated);
      if (parsed.status == store::Parsed::incomplete) return {};
      if (parsed.status == store::Parsed::malformed) {
        count([](TcpStoreServerCounters& c) { ++c.malformed; });
        return "malformed: " + parsed.error;
      }
      connection.in.erase(0, parsed.consumed);
      const store::Request& request = parsed.request;
      if (request.op == store::kHello) {
        if (!store::same_token(request.value, options_.token)) {
          count([](TcpStoreServerCounters& c) { ++c.refused_token; });
          connection.out.push_back(0);  // says "wrong token" (a full server just closes)
          send_pending(connection);
          return "refused: not this job's token";
        }
        if (!connection.authenticated) count([](TcpStoreServerCounters& c) { ++c.authenticated; });
        connection.authenticated = true;
        connection.out.push_back(1);
      } else if (request.op == store::kSet) {
        connection.out.push_back(store_value(connection, request) ? 1 : 2);
      } else if (request.op == store::kDelete) {
        const auto found = data_.find(request.key);
        connection.out.push_back(found != data_.end() ? 1 : 0);
        if (found != data_.end()) erase(found);
      } else {
        const auto found = data_.find(request.key);
        connection.out.push_back(found != data_.end() ? 1 : 0);
        if (found != data_.end()) {
          const auto length = static_cast<std::uint32_t>(found->second.size());
          for (int shift = 0; shift < 32; shift += 8) connection.out.push_back(static_cast<char>((length >> shift) & 0xFF));
          connection.out += found->second;
        }
      }
      if (std::string why = send_pending(connection); !why.empty()) return why;
    }
  }

  // Stores a set's value unless the store would then hold more than max_stored_bytes (an entry
  // counts its key, its value and kEntryOverhead): whoever sends it, token or not.
  bool store_value(const Connection& connection, const store::Request& request) {
    const auto existing = data_.find(request.key);
    const std::size_t freed = existing == data_.end() ? 0 : entry_bytes(existing->first, existing->second);
    const std::size_t added = entry_bytes(request.key, request.value);
    if (stored_bytes_ - freed + added > options_.max_stored_bytes) {
      log("refused a set of " + std::to_string(request.value.size()) + " bytes from " + connection.peer +
          ": the store holds " + std::to_string(stored_bytes_) + " of its " + std::to_string(options_.max_stored_bytes) +
          " bytes (GRADSYNC_STORE_MAX_MB)");
      count([](TcpStoreServerCounters& c) { ++c.refused_full_store; });
      return false;
    }
    data_[request.key] = request.value;
    stored_bytes_ = stored_bytes_ - freed + added;
    count([this](TcpStoreServerCounters& c) { c.stored_bytes = static_cast<std::int64_t>(stored_bytes_); });
    if (options_.on_set) {
      try {
        options_.on_set(request.key, request.value);
      } catch (const std::exception& error) {
        log(std::string("the set hook failed: ") + error.what());
      }
    }
    return true;
  }

  // What other threads of this process posted. A value is stored even past max_stored_bytes: the
  // bound is for clients, and the coordinator's answers are how a full store is told to the groups.
  void apply_posted() {
    std::vector<Posted> posted;
    {
      std::lock_guard<std::mutex> lock(posted_mutex_);
      posted.swap(posted_);
    }
    for (auto& [key, value, keep, erase_prefix] : posted) {
      if (erase_prefix) {
        for (auto entry = data_.lower_bound(key); entry != data_.end() && entry->first.rfind(key, 0) == 0;) {
          const auto next = std::next(entry);
          if (keep.empty() || entry->first.rfind(keep, 0) != 0) erase(entry);
          entry = next;
        }
        continue;
      }
      const auto existing = data_.find(key);
      const std::size_t freed = existing == data_.end() ? 0 : entry_bytes(existing->first, existing->second);
      stored_bytes_ = stored_bytes_ - freed + entry_bytes(key, value);
      data_[key] = std::move(value);
    }
    count([this](TcpStoreServerCounters& c) { c.stored_bytes = static_cast<std::int64_t>(stored_bytes_); });
  }

  void erase(std::map<std::string, std::string>::iterator entry) {
    stored_bytes_ -= entry_bytes(entry->first, entry->second);
    data_.erase(entry);
    count([this](TcpStoreServerCounters& c) { c.stored_bytes = static_cast<std::int64_t>(stored_bytes_); });
  }

  static std::size_t entry_bytes(const std::string& key, const std::string& value) {
    return key.size() + value.size() + store::kEntryOverhead;
  }

  std::string send_pending(Connection& connection) {
    while (!connection.out.empty()) {
      const ssize_t put = ::send(connection.fd, connection.out.data(), connection.out.size(), MSG_NOSIGNAL);
      if (put < 0 && errno == EINTR) continue;
      if (put < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return {};
      if (put <= 0) return std::string("send failed: ") + std::strerror(errno);
      connection.out.erase(0, static_cast<std::size_t>(put));
    }
    return {};
  }

  std::string expired(const Connection& connection, Clock::time_point now) {
    const auto age = now - connection.opened;
    const auto silent = now - connection.last_activity;
    std::string why;
    if (!connection.authenticated && age > options_.handshake_timeout) {
      why = "did not present the token within " + std::to_string(options_.handshake_timeout.count()) + " ms";
    } else if (!connection.in.empty() && silent > options_.stall_timeout) {
      why = "a request stalled half way for " + std::to_string(options_.stall_timeout.count()) + " ms";
    } else if (connection.authenticated && silent > options_.idle_timeout) {
      return "idle";  // quietly: the client reconnects when it needs the store again
    }
    if (!why.empty()) count([](TcpStoreServerCounters& c) { ++c.timed_out; });
    return why;
  }

  void close(std::list<Connection>::iterator connection, const std::string& why) {
    const bool quiet = why == "idle" || why == "closed by the peer";
    if (!quiet) log("closed the connection from " + connection->peer + ": " + why);
    ::close(connection->fd);
    connections_.erase(connection);
    count([](TcpStoreServerCounters& c) { --c.open; });
  }

  // stderr, at most 10 lines every 10 s: a flood of strangers must not flood the log too.
  void log(const std::string& line) {
    const auto now = Clock::now();
    if (now - log_window_ > std::chrono::seconds(10)) {
      if (suppressed_ > 0) std::fprintf(stderr, "gradsync: tcp store: %d more such lines suppressed\n", suppressed_);
      log_window_ = now;
      logged_ = 0;
      suppressed_ = 0;
    }
    if (logged_++ < 10) {
      std::fprintf(stderr, "gradsync: tcp store: %s\n", line.c_str());
    } else {
      ++suppressed_;
    }
  }

  template <typename Update>
  void count(Update update) {
    std::lock_guard<std::mutex> lock(counters_mutex_);
    update(counters_);
  }

  TcpStoreServerOptions options_;
  int listener_ = -1;
  int port_ = 0;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stopping_{false};
  std::thread loop_;
  std::list<Connection> connections_;  // the loop's only
  std::map<std::string, std::string> data_;
  std::mutex posted_mutex_;
  std::vector<Posted> posted_;  // post()ed and erase_prefix()ed, for the loop to apply
  std::size_t stored_bytes_ = 0;  // data_'s entries as entry_bytes counts them
  Clock::time_point log_window_{};
  int logged_ = 0;
  int suppressed_ = 0;
  mutable std::mutex counters_mutex_;
  TcpStoreServerCounters counters_;
};

std::shared_ptr<TcpStoreServer> start_tcp_store_server(const TcpStoreServerOptions& options) {
  return std::make_shared<TcpStoreServer>(options);
}
int tcp_store_server_port(const TcpStoreServer& server) { return server.port(); }
TcpStoreServerCounters tcp_store_server_counters(const TcpStoreServer& server) { return server.counters(); }
void tcp_store_server_set(TcpStoreServer& server, const std::string& key, const std::string& value) {
  server.post(key, value);
}
void tcp_store_server_erase_prefix(TcpStoreServer& server, const std::string& prefix, const std::string& keep) {
  server.erase_prefix(prefix, keep);
}

}  // namespace gradsync::comm
