// Internal: a small TCP key-value store for the Gloo rendezvous of processes
// (MASTER_ADDR:MASTER_PORT, as torchrun sets them). Rank 0 serves; every rank, rank 0
// included, is a client. Gloo's connectFullMesh publishes each rank's address under a key and
// waits for the others'; that is all the store does, so it is kept small: SET and a polling
// GET, every wait bounded by the timeout and failing with the key it waited for.
#pragma once

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

namespace gradsync::comm {

class TcpStoreServer;  // the listening side, alive as long as any rank of this process needs it

class TcpStore final : public gloo::rendezvous::Store {
 public:
  // rank 0 also starts the server on `port` (all interfaces). Connecting retries until the
  // timeout: the server may not be up yet.
  TcpStore(const std::string& host, int port, bool serve, std::chrono::milliseconds timeout);
  ~TcpStore() override;

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  // Keeps the server (rank 0) alive after the store object is gone.
  std::shared_ptr<void> server() const;

 private:
  bool try_get(const std::string& key, std::vector<char>& value);

  std::shared_ptr<TcpStoreServer> server_;
  std::mutex mutex_;  // one request at a time on the socket (duplicates may meet from several threads)
  int socket_ = -1;
  std::string endpoint_;
  std::chrono::milliseconds timeout_;
};

}  // namespace gradsync::comm
