// Internal: which rank a Gloo error means. Gloo names a vanished peer by an address
// ("[127.0.0.1]:40123") taken from its own pair bookkeeping; this directory, built once when a
// context connects, turns that into a rank: every rank publishes its end of each pair and the
// local addresses of its connected sockets, and at the time of an error the kernel says which
// recorded connection is closed.
#pragma once

#include <gloo/context.h>
#include <sys/socket.h>

#include <map>
#include <string>
#include <vector>

#include "comm/cpu/backend.h"

namespace gradsync::comm {

class PeerDirectory {
 public:
  // Collective over `backend` (two allgathers and an allgatherv on its context).
  void learn(gloo::Context& context, Backend& backend);
  // `message` with the rank it is about appended, when the directory can tell, named as
  // `backend` names its ranks (a group's rank with its world rank). `left[r]`: whether rank r
  // said it was leaving after a failure of its own (so, of several closed connections, the ones
  // that did not are the ranks that died); null when that is not known.
  std::string explain(const std::string& message, const Backend& backend,
                      const std::vector<bool>* left = nullptr) const;
  // Whether `message` is a lost connection (closed or reset by the peer).
  static bool lost_connection(const std::string& message);

 private:
  void learn_socket_addresses(Backend& backend);
  // "[127.0.0.1]:40123", as Gloo prints addresses; empty for what is not IPv4/IPv6.
  static std::string address_text(const sockaddr_storage& address);

  std::vector<std::string> peer_addresses_;  // by rank: how Gloo's messages name that peer
  std::map<std::string, int> socket_owner_;   // connected sockets' local addresses, by owning rank
  struct Connection {
    std::string remote;  // the peer's address, as the kernel reported it at rendezvous
    int rank;
  };
  std::map<int, Connection> connections_;  // our sockets (fd) to single known peers
};

}  // namespace gradsync::comm
