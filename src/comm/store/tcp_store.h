// Internal: the TCP key-value store of the Gloo rendezvous between processes (MASTER_ADDR:
// MASTER_PORT, as torchrun sets them). Rank 0 serves it for the whole run (a duplicate()
// meets again through it); every rank, rank 0 included, is a client. Gloo's connectFullMesh
// publishes each rank's addresses under a key and waits for the others': SET and a polling GET,
// every wait bounded by the timeout and failing with the key it waited for.
//
// The server faces whatever reaches its port, so it is built not to be crashed, filled or held:
//  * it listens on the address the launch names (MASTER_ADDR, when that is an address of this
//    machine; GRADSYNC_STORE_BIND to choose), not on every interface;
//  * a connection must first present the job's token (store_token: GRADSYNC_STORE_TOKEN, or
//    derived from the launcher's job id), compared in constant time, within a couple of seconds;
//    a stranger's bytes are refused and cost a few hundred bytes while they last;
//  * every length is checked against a small cap (protocol.h) before anything is buffered;
//    a malformed or oversized request closes that connection with a logged line, nothing else;
//  * one thread serves every connection (poll), connections are capped, a request stalled half
//    way is dropped after a few seconds and an idle connection after a few minutes (clients
//    reconnect by themselves), and no exception leaves the loop.
#pragma once

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace gradsync::comm {

class TcpStoreServer;

struct TcpStoreServerOptions {
  std::string bind_host = "127.0.0.1";  // an address of this machine, or "" for every interface
  // bind_host was asked for by name (GRADSYNC_STORE_BIND): an address this machine cannot listen
  // on is an error, never a fallback to every interface.
  bool bind_required = false;
  // Whether `token` is a secret (GRADSYNC_STORE_TOKEN) rather than derived from what the launch
  // shows (job ids, the address): a derived one on an address beyond this machine is warned about.
  bool secret_token = true;
  // Beyond this machine, a token that is no secret is refused (an error) rather than warned about
  // (the coordinator of replica groups).
  bool refuse_derived_token = false;
  // Every key and value stored, together (each entry also counts kEntryOverhead): a set past it
  // is refused with "full", whoever sends it, so the store's memory is bounded for token holders
  // too. GRADSYNC_STORE_MAX_MB.
  std::size_t max_stored_bytes = std::size_t{256} << 20;
  int port = 0;                         // 0: any free port (see port())
  std::string token{};                  // what clients must present
  int max_connections = 256;            // authenticated and not, together
  int max_unauthenticated = 32;         // connections still to present the token
  std::chrono::milliseconds handshake_timeout{2000};
  std::chrono::milliseconds stall_timeout{5000};   // a request begun and not finished
  std::chrono::milliseconds idle_timeout{300000};  // an authenticated connection silent this long
  // Called on the server's thread after every stored set, with its key and value: the
  // coordinator (gradsync/comm/quorum/coordinator.h) hears requests as they arrive instead of polling for them. It
  // must not block; it must not throw (what it throws is logged and dropped).
  std::function<void(const std::string& key, const std::string& value)> on_set{};
};

// What the server has done, for tests and messages.
struct TcpStoreServerCounters {
  std::int64_t accepted = 0;
  std::int64_t authenticated = 0;
  std::int64_t refused_token = 0;
  std::int64_t refused_full = 0;  // over max_connections or max_unauthenticated
  std::int64_t malformed = 0;
  std::int64_t timed_out = 0;
  std::int64_t refused_full_store = 0;  // sets refused at max_stored_bytes
  std::int64_t stored_bytes = 0;        // what the stored keys and values count now
  std::int64_t open = 0;  // connections open now
};

// Starts serving on construction; stops, closing every connection, on destruction.
std::shared_ptr<TcpStoreServer> start_tcp_store_server(const TcpStoreServerOptions& options);
int tcp_store_server_port(const TcpStoreServer& server);
TcpStoreServerCounters tcp_store_server_counters(const TcpStoreServer& server);
// Stores key = value from another thread of the serving process (the coordinator's answers):
// queued, and applied by the server's thread before it next answers a request. A value over the
// caps is refused; max_stored_bytes does not apply (it bounds what clients send).
void tcp_store_server_set(TcpStoreServer& server, const std::string& key, const std::string& value);
// Erases every key that starts with `prefix`, except those that start with `keep` (empty: none
// kept), from another thread of the serving process (the coordinator's cleanup of a quorum's
// keys): queued and applied like tcp_store_server_set.
void tcp_store_server_erase_prefix(TcpStoreServer& server, const std::string& prefix, const std::string& keep = {});

class TcpStore final : public gloo::rendezvous::Store {
 public:
  // A client of the store at host:port, presenting `token`. With `serve` (rank 0), the server
  // is started first, on the address host names (or GRADSYNC_STORE_BIND). Connecting retries
  // until the timeout: the server may not be up yet.
  TcpStore(const std::string& host, int port, bool serve, std::chrono::milliseconds timeout, std::string token);
  ~TcpStore() override;

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  // One get, without waiting: whether `key` is there (its value in `value`). StoreGone when the
  // server is.
  bool try_get(const std::string& key, std::vector<char>& value);
  // Deletes `key`; whether it was there.
  bool erase(const std::string& key);

  // Keeps the server (rank 0) alive after the store object is gone.
  std::shared_ptr<void> server() const;

 private:
  // Connects, retrying until `deadline` (rank 0 may not listen yet); when `reconnecting` (the
  // server was reached before), a refused connection fails at once: the server is gone.
  void connect_until(std::chrono::steady_clock::time_point deadline, bool reconnecting = false);
  // One request and its response; reconnects once when the connection was closed (the server
  // drops idle connections), so a request fails only when the server is gone.
  bool exchange(const std::string& request, char& status, std::vector<char>* value);

  std::shared_ptr<TcpStoreServer> server_;
  std::mutex mutex_;  // one request at a time on the socket (duplicates may meet from several threads)
  int socket_ = -1;
  std::string host_;
  int port_;
  std::string endpoint_;
  std::string token_;
  std::chrono::milliseconds timeout_;
};

// The token of this job, the same on every rank: GRADSYNC_STORE_TOKEN when set, else derived from
// the job id the launcher exports (torchrun's run id, Slurm's job and step, Open MPI's or PMIx's
// job, LSF's, PBS's) and the rendezvous itself. Without a job id it only tells one job's store
// from another's (PyTorch's magic number does as much); scripts/launch.sh sets a random one.
std::string store_token(const std::string& host, int port, int size);

}  // namespace gradsync::comm
