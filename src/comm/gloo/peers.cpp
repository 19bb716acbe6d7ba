// The peer directory (peers.h).
#include "peers.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>

#include "core/environment.h"
#include "comm/store/socket_address.h"

namespace gradsync::comm {

// Every rank publishes the address of its end of each pair; rank j's end of the pair with
// this rank is the address this rank's Gloo errors name for rank j.
void PeerDirectory::learn(gloo::Context& context, Backend& backend) {
  constexpr std::size_t kWidth = 64;
  const auto n = static_cast<std::size_t>(context.size);
  const int rank = context.rank;
  std::vector<char> mine(kWidth * n, '\0');
  for (int peer = 0; peer < context.size; ++peer) {
    if (peer == rank) continue;
    const std::string address = context.getPair(peer)->address().str();
    std::memcpy(mine.data() + kWidth * static_cast<std::size_t>(peer), address.data(), std::min(address.size(), kWidth - 1));
  }
  std::vector<char> all(kWidth * n * n, '\0');
  if (n > 1) backend.allgather(mine.data(), all.data(), static_cast<std::int64_t>(mine.size() / 8), DType::i64);
  peer_addresses_.assign(n, std::string());
  for (std::size_t peer = 0; peer < n; ++peer) {
    if (peer == static_cast<std::size_t>(rank)) continue;
    peer_addresses_[peer] = std::string(all.data() + kWidth * (n * peer + static_cast<std::size_t>(rank)));
  }
  learn_socket_addresses(backend);
}

// The side of a connection that accepted it sees the connecting side's ephemeral address, not
// its listening one: every rank also publishes the local addresses of its process's
// connected TCP sockets. An address only one rank claims names that rank (ranks that are
// threads of one process all claim the same sockets, and are left to the table above).
void PeerDirectory::learn_socket_addresses(Backend& backend) {
  std::string mine;
  std::vector<std::pair<int, std::string>> remotes;  // our connected sockets: fd, peer address
  std::error_code error;
  for (std::filesystem::directory_iterator it("/proc/self/fd", error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const int fd = std::stoi(name);
    sockaddr_storage remote{};
    socklen_t remote_length = sizeof remote;
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&remote), &remote_length) == 0) {
      const std::string text = address_text(remote);
      if (!text.empty()) remotes.emplace_back(fd, text);
    }
    // Every socket, connected or not yet: a connection Gloo is still completing already has
    // its local (ephemeral) port, and a listening socket's address is its owner's anyway.
    sockaddr_storage local{};
    socklen_t local_length = sizeof local;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_length) != 0) continue;
    const std::string text = address_text(local);
    if (!text.empty()) mine += text + "\n";
    // A socket listening on every address is reached at any of them: publish its port too.
    if (text.rfind("[::]:", 0) == 0 || text.rfind("[0.0.0.0]:", 0) == 0) mine += text.substr(text.rfind(':')) + "\n";
  }
  mine.append((8 - mine.size() % 8) % 8, '\0');
  std::int64_t words = static_cast<std::int64_t>(mine.size() / 8);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(backend.size()));
  backend.allgather(&words, counts.data(), 1, DType::i64);
  std::int64_t total = 0;
  for (const std::int64_t count : counts) total += count;
  std::string all(static_cast<std::size_t>(total) * 8, '\0');
  backend.allgatherv(mine.data(), all.data(), counts, DType::i64);
  std::map<std::string, int> owner;  // address -> rank, or -1 when several ranks claim it
  std::size_t offset = 0;
  for (int peer = 0; peer < backend.size(); ++peer) {
    std::istringstream lines(all.substr(offset, static_cast<std::size_t>(counts[static_cast<std::size_t>(peer)]) * 8));
    offset += static_cast<std::size_t>(counts[static_cast<std::size_t>(peer)]) * 8;
    std::string line;
    while (std::getline(lines, line)) {
      line.erase(std::find(line.begin(), line.end(), '\0'), line.end());
      if (line.empty()) continue;
      const auto [at, inserted] = owner.emplace(line, peer);
      if (!inserted && at->second != peer) at->second = -1;
    }
  }
  for (const auto& [address, peer] : owner) {
    if (peer >= 0 && peer != backend.rank()) socket_owner_[address] = peer;
  }
  // Our connections whose other end a single peer claims (its local address, or its
  // listening port when it listens on every address), for explain().
  for (const auto& [fd, remote] : remotes) {
    auto found = socket_owner_.find(remote);
    if (found == socket_owner_.end()) found = socket_owner_.find(remote.substr(remote.rfind(':')));  // ":port"
    if (found != socket_owner_.end()) connections_[fd] = Connection{remote, found->second};
  }
}

// "[127.0.0.1]:40123", as Gloo prints addresses; empty for what is not IPv4/IPv6.
std::string PeerDirectory::address_text(const sockaddr_storage& address) {
  const std::optional<HostPort> named = host_and_port(address);
  return named ? "[" + named->host + "]:" + std::to_string(named->port) : "";
}


// Gloo names a vanished peer by an address ("[127.0.0.1]:40123") taken from its own pair
// bookkeeping, which does not always match the kernel's addresses (and so can point at the
// wrong rank). First ask the kernel: which peer's connection, recorded at rendezvous, is now
// closed or gone? When exactly one is, that is the peer. Else fall back to the addresses.
bool PeerDirectory::lost_connection(const std::string& message) {
  return message.find("closed") != std::string::npos || message.find("reset") != std::string::npos;
}

std::string PeerDirectory::explain(const std::string& message, const Backend& backend,
                                   const std::vector<bool>* left) const {
  std::set<int> vanished;
  if (lost_connection(message)) {
    const auto gone = [this](int fd, const Connection& connection) {
      sockaddr_storage remote{};
      socklen_t length = sizeof remote;
      // POLLRDHUP: the peer's FIN has arrived, even behind bytes nobody has read yet (which a
      // peeking recv would return instead of the end of the stream).
      pollfd entry{fd, POLLRDHUP, 0};
      const bool hung_up = ::poll(&entry, 1, 0) > 0 && (entry.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
      char byte = 0;
      return ::getpeername(fd, reinterpret_cast<sockaddr*>(&remote), &length) != 0 ||
             address_text(remote) != connection.remote || hung_up || ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
    };
    for (const auto& [fd, connection] : connections_) {
      if (gone(fd, connection)) vanished.insert(connection.rank);
    }
    // One peer gone may be one that only failed first and left: the rank that died can be
    // slower to show, its process still closing its sockets on a loaded machine (a ring rank
    // then blamed its healthy neighbour, in 1 of 8 runs of peer_death.sh under load). Before
    // naming a single peer, give the other connections a moment to show a hang-up too.
    if (vanished.size() == 1) {
      std::vector<pollfd> others;
      std::vector<int> other_ranks;
      for (const auto& [fd, connection] : connections_) {
        if (vanished.count(connection.rank) == 0) {
          others.push_back({fd, POLLRDHUP, 0});  // hang-ups only: data waiting does not wake it
          other_ranks.push_back(connection.rank);
        }
      }
      constexpr int kGraceMs = 500;
      if (!others.empty() && ::poll(others.data(), others.size(), kGraceMs) > 0) {
        for (std::size_t k = 0; k < others.size(); ++k) {
          if ((others[k].revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) vanished.insert(other_ranks[k]);
        }
      }
    }
    if (vanished.size() == 1) {
      const std::string peer = backend.rank_name(*vanished.begin());
      return message + " (the connection to " + peer + " is closed: the peer is " + peer + ")";
    }
    // Several: one died, and the others failed because of it and left too (a ring waits on its
    // neighbour, which is not the rank that died). A rank that fails says so in the rendezvous
    // store before it leaves (GlooBackend::explain); those that did not say so are the ones that
    // died. Name them; when that cannot be told, name every one: blaming only the one whose
    // address Gloo printed would send the reader to a rank that merely followed.
    if (vanished.size() > 1) {
      const auto names = [&](const std::vector<int>& peers) {
        std::string ranks;
        for (std::size_t i = 0; i < peers.size(); ++i) {
          if (i > 0) ranks += i + 1 == peers.size() ? " and " : ", ";
          ranks += backend.rank_name(peers[i]);
        }
        return ranks;
      };
      const std::vector<int> all(vanished.begin(), vanished.end());
      std::vector<int> died, followed;
      for (const int peer : all) (left != nullptr && (*left)[static_cast<std::size_t>(peer)] ? followed : died).push_back(peer);
      if (left != nullptr && !died.empty()) {  // what each said before it left
        return message + " (the connections to " + names(all) + " are closed: " + names(died) + " died" +
               (followed.empty() ? "" : "; " + names(followed) + " left after failing because of it") + ")";
      }
      const bool recorded = environment::flight_recorder_dir().has_value();
      return message + " (the connections to " + names(all) + " are closed: one of them died and the others left " +
             "after failing; " +
             (recorded ? "their flight records say which went first)"
                       : "the first error in their output names the one that died)");
    }
  }
  for (std::size_t peer = 0; peer < peer_addresses_.size(); ++peer) {
    const std::string& address = peer_addresses_[peer];
    if (!address.empty() && message.find(address) != std::string::npos) {
      return message + " (" + address + " is " + backend.rank_name(static_cast<int>(peer)) + ")";
    }
  }
  for (const auto& [address, peer] : socket_owner_) {
    if (message.find(address) != std::string::npos) {
      return message + " (" + address + " is " + backend.rank_name(static_cast<int>(peer)) + ")";
    }
  }
  return message;
}

}  // namespace gradsync::comm
