// Internal: the wire format of the rendezvous store (tcp_store.h) and its parser, on their own so
// that the parser can be fuzzed alone (tests/fuzz/store_parser_fuzz.cpp).
//
// Every request is a fixed 9-byte header and a payload, little-endian:
//   op (1 byte) | key length (u32) | value length (u32) | key | value
// with op 'H' (hello: key = kHelloKey, value = the job's token), 'S' (set key = value), 'G'
// (get key; no value) or 'D' (delete key; no value). Responses: hello, one byte 1 (0: not this
// job's token); set, one byte 1 (2: refused, the store holds all it may); get, found (1 byte),
// and when found the value length (u32) and the value; delete, one byte 1 (0: there was no such
// key).
//
// The lengths are checked against small caps *before* a byte of payload is buffered: a key of at
// most kMaxKeyBytes, a value of at most kMaxValueBytes, and, before a connection has presented
// the token, a hello of at most kMaxHelloBytes in all. So a stranger's bytes cost at most a few
// hundred bytes of memory, and a peer claiming a 4 GiB value is refused at its header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace gradsync::comm::store {

constexpr std::size_t kHeaderBytes = 9;
constexpr std::size_t kMaxKeyBytes = 4096;
constexpr std::size_t kMaxValueBytes = std::size_t{1} << 20;  // Gloo's addresses: tens of KiB at 1024 ranks
constexpr std::size_t kMaxHelloBytes = 512;
constexpr std::string_view kHelloKey = "gradsync-store/2";
// What one stored entry counts beyond its key and value bytes (the map's node), against the
// store's bound on what it holds (TcpStoreServerOptions::max_stored_bytes).
constexpr std::size_t kEntryOverhead = 96;

enum Op : char { kHello = 'H', kSet = 'S', kGet = 'G', kDelete = 'D' };

struct Request {
  char op = 0;
  std::string key;
  std::string value;
};

struct Parsed {
  enum Status { incomplete, complete, malformed } status = incomplete;
  std::size_t consumed = 0;  // bytes of the buffer the request took (complete only)
  Request request;
  std::string error;  // why it is malformed
};

// Parses the first request in `buffer`. `authenticated`: whether the connection has presented the
// token; before, only a hello is accepted. Never reads past the buffer, never allocates more than
// the request it returns.
Parsed parse_request(std::string_view buffer, bool authenticated);

// The bytes of a request (clients, and the fuzz target's seeds).
std::string encode_request(char op, std::string_view key, std::string_view value = {});

// Whether two tokens are equal, in time that depends on their lengths only (so a stranger learns
// nothing about the token from how fast it is refused).
bool same_token(std::string_view a, std::string_view b);

}  // namespace gradsync::comm::store
