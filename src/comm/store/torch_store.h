// Internal: a client of PyTorch's TCPStore (c10d's, torch.distributed.TCPStore), the store
// torchrun's agent serves on MASTER_ADDR:MASTER_PORT for its workers. Under torchrun gradsync's
// ranks meet there instead of at a store of their own (rank 0 could not listen on a port the
// agent holds), and any job can point gradsync at a TCPStore it already runs.
//
// The protocol, as torch 2.x clients speak it (checked against torch's own servers, both the
// libuv one and the classic one, in tests/multirank/torch_store.sh): a connection opens with
// VALIDATE (0) and the 32-bit magic number 0x3C85F7CE, then PING (13) with a 32-bit nonce the
// server echoes. Every request is one query byte and its arguments; strings and byte vectors are
// a 64-bit little-endian length and the bytes:
//   SET (1) key value                     no reply
//   GET (3) key                           the value (after a WAIT for the key: GET of a missing
//                                         key is an error on the server)
//   ADD (4) key int64                     the new int64
//   CHECK (5) count keys...               1 byte: 0 all present, 1 not yet
//   WAIT (6) count keys...                1 byte 0 once all are present; a client that gives up
//                                         sends CANCEL_WAIT (12) and reads 1 (canceled), or 0 then 1
//                                         when the keys arrived meanwhile
// Keys travel under a prefix (the run id and the restart count under torchrun), so that a
// restarted group never reads what an earlier attempt wrote. Every reply is checked: a closed
// connection, a reply past the timeout, a length over the cap or a byte that is not one of the
// protocol's are errors naming the store and the request.
#pragma once

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace gradsync::comm {

class TorchStore final : public gloo::rendezvous::Store {
 public:
  // Connects (retrying until `timeout`: the server may not listen yet) and validates.
  TorchStore(const std::string& host, int port, std::chrono::milliseconds timeout, std::string prefix);
  ~TorchStore() override;
  TorchStore(const TorchStore&) = delete;
  TorchStore& operator=(const TorchStore&) = delete;

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  // torch's counter: adds `delta` to the key's integer value and returns the sum.
  std::int64_t add(const std::string& key, std::int64_t delta);
  // Whether every key is present now.
  bool check(const std::vector<std::string>& keys);

  // The largest value a reply may carry (a store that claims more is not one).
  static constexpr std::uint64_t kMaxValueBytes = std::uint64_t{1} << 30;

 private:
  void send(const std::string& request, const char* what);
  // Exactly `bytes` of a reply by `deadline` (by default the timeout from now: the whole read,
  // so that a server trickling bytes cannot hold a rank past it).
  void receive(void* data, std::size_t bytes, const char* what,
               std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::min());
  [[noreturn]] void fail(const std::string& why);

  std::mutex mutex_;  // one request at a time on the socket
  int socket_ = -1;
  std::string endpoint_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

}  // namespace gradsync::comm
