// Internal: a socket address as text, for messages (the store's log, Gloo's peer names).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <optional>
#include <string>

namespace gradsync::comm {

struct HostPort {
  std::string host;  // "127.0.0.1", "fe80::1"; an IPv4 address mapped into IPv6 as plain IPv4
  int port = 0;
};

// Nothing for an address that is neither IPv4 nor IPv6.
inline std::optional<HostPort> host_and_port(const sockaddr_storage& address) {
  char host[INET6_ADDRSTRLEN] = {};
  int port = 0;
  if (address.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&address);
    ::inet_ntop(AF_INET, &v4->sin_addr, host, sizeof host);
    port = ntohs(v4->sin_port);
  } else if (address.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&address);
    ::inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof host);
    port = ntohs(v6->sin6_port);
  } else {
    return std::nullopt;
  }
  std::string text(host);
  if (text.starts_with("::ffff:") && text.find('.') != std::string::npos) text = text.substr(7);
  return HostPort{text, port};
}

}  // namespace gradsync::comm
