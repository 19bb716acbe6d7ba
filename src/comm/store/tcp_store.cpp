// The TCP store of the Gloo rendezvous (tcp_store.h): the client and the job's token (the
// server is tcp_store_server.cpp). The wire format is protocol.h's.
#include "tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include "core/environment.h"
#include "gradsync/core/error.h"
#include "socket_io.h"
#include "protocol.h"

namespace gradsync::comm {

namespace {

using Clock = std::chrono::steady_clock;

// FNV-1a over `text`, from `seed`: the token's digest (not a secret hash: the secret is the job
// id it digests; the digest only gives every token one length).
std::uint64_t fnv1a(std::string_view text, std::uint64_t seed) {
  std::uint64_t hash = seed;
  for (const char c : text) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

}  // namespace

// ---- The client ------------------------------------------------------------------------------

TcpStore::TcpStore(const std::string& host, int port, bool serve, std::chrono::milliseconds timeout, std::string token)
    : host_(host), port_(port), endpoint_(host + ":" + std::to_string(port)), token_(std::move(token)),
      timeout_(timeout) {
  GRADSYNC_CHECK(port > 0 && port < 65536, "tcp store: MASTER_PORT ", port, " is not a TCP port");
  if (serve) {
    TcpStoreServerOptions options;
    const std::optional<std::string> bind = environment::store_bind();
    options.bind_host = bind.value_or(host);
    options.bind_required = bind.has_value();
    options.port = port;
    options.token = token_;
    options.secret_token = environment::store_token().has_value();
    options.max_stored_bytes = environment::store_max_bytes();
    server_ = start_tcp_store_server(options);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  connect_until(Clock::now() + timeout);
}

TcpStore::~TcpStore() {
  if (socket_ >= 0) ::close(socket_);
}

std::shared_ptr<void> TcpStore::server() const { return server_; }

// Connects and presents the token, retrying until the deadline while the server is not up yet
// or full (it closes at once); a server that says the token is wrong ends it at once.
void TcpStore::connect_until(Clock::time_point deadline, bool reconnecting) {
  std::string last_error = "no attempt";
  do {
    if (socket_ >= 0) {
      ::close(socket_);
      socket_ = -1;
    }
    bool refused = false;
    socket_ = connect_tcp(host_, port_, timeout_, last_error, refused);
    // The server was up and stops listening only when it goes: rank 0 has ended or died. Waiting
    // out the timeout would only delay the error (a peer that is merely slow still answers).
    if (refused && reconnecting) {
      throw StoreGone("tcp store at " + endpoint_ +
                      ": the store is gone (connection refused): rank 0, which serves it, has ended or died");
    }
    if (socket_ >= 0) {
      const std::string hello = store::encode_request(store::kHello, store::kHelloKey, token_);
      char ack = 2;
      if (write_exact(socket_, hello.data(), hello.size()) && read_exact(socket_, &ack, 1, Clock::now() + timeout_) &&
          ack == 1) {
        return;
      }
      ::close(socket_);
      socket_ = -1;
      if (ack == 0) {
        detail::throw_error("tcp store at ", endpoint_, ": the store refused this rank's token (the ranks of one job ",
                            "share it: GRADSYNC_STORE_TOKEN, or the launcher's job id; see docs/environment.md)");
      }
      last_error = "the store closed the connection at the hello (full, or shutting down)";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // rank 0 may not listen yet
  } while (Clock::now() < deadline);
  detail::throw_error("tcp store: cannot reach the rank-0 store at ", endpoint_, " (MASTER_ADDR:MASTER_PORT) within ",
                      timeout_.count(), " ms: ", last_error, " (rank 0, which serves it, has not started, or has died)");
}


bool TcpStore::exchange(const std::string& request, char& status, std::vector<char>* value) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (attempt > 0) connect_until(Clock::now() + timeout_, /*reconnecting=*/true);
    // The whole reply by one deadline: a server trickling bytes cannot hold a rank past it.
    const auto deadline = Clock::now() + timeout_;
    bool ok = socket_ >= 0 && write_exact(socket_, request.data(), request.size()) &&
              read_exact(socket_, &status, 1, deadline);
    if (ok && value != nullptr && status == 1) {
      unsigned char length_bytes[4];
      ok = read_exact(socket_, length_bytes, 4, deadline);
      const std::uint32_t length = static_cast<std::uint32_t>(length_bytes[0]) |
                                   static_cast<std::uint32_t>(length_bytes[1]) << 8 |
                                   static_cast<std::uint32_t>(length_bytes[2]) << 16 |
                                   static_cast<std::uint32_t>(length_bytes[3]) << 24;
      ok = ok && length <= store::kMaxValueBytes;
      ok = ok && read_value(socket_, *value, length, deadline);
    }
    if (ok) return true;
  }
  return false;
}

void TcpStore::set(const std::string& key, const std::vector<char>& data) {
  GRADSYNC_CHECK(key.size() <= store::kMaxKeyBytes && data.size() <= store::kMaxValueBytes, "tcp store: set('", key,
                 "') of ", data.size(), " bytes is over the store's caps (keys ", store::kMaxKeyBytes, ", values ",
                 store::kMaxValueBytes, " bytes)");
  std::lock_guard<std::mutex> lock(mutex_);
  char status = 0;
  const bool ok = exchange(store::encode_request(store::kSet, key, std::string_view(data.data(), data.size())), status,
                           nullptr);
  if (ok && status == 2) {
    detail::throw_error("tcp store at ", endpoint_, ": set('", key, "') of ", data.size(), " bytes refused: the store ",
                        "holds all it may (GRADSYNC_STORE_MAX_MB, default 256)");
  }
  if (!ok || status != 1) throw StoreGone("tcp store at " + endpoint_ + ": set('" + key + "') failed: the store (rank 0) is gone");
}

bool TcpStore::try_get(const std::string& key, std::vector<char>& value) {
  std::lock_guard<std::mutex> lock(mutex_);
  char found = 0;
  const bool ok = exchange(store::encode_request(store::kGet, key), found, &value);
  if (!ok) throw StoreGone("tcp store at " + endpoint_ + ": get('" + key + "') failed: the store (rank 0) is gone");
  return found == 1;
}

bool TcpStore::erase(const std::string& key) {
  GRADSYNC_CHECK(key.size() <= store::kMaxKeyBytes, "tcp store: erase('", key.substr(0, 64), "...') of a key over ",
                 store::kMaxKeyBytes, " bytes");
  std::lock_guard<std::mutex> lock(mutex_);
  char erased = 0;
  if (!exchange(store::encode_request(store::kDelete, key), erased, nullptr)) {
    throw StoreGone("tcp store at " + endpoint_ + ": erase('" + key + "') failed: the store (rank 0) is gone");
  }
  return erased == 1;
}

void TcpStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  const auto deadline = Clock::now() + timeout;
  std::vector<char> ignored;
  for (const std::string& key : keys) {
    while (!try_get(key, ignored)) {
      GRADSYNC_CHECK(Clock::now() < deadline, "tcp store at ", endpoint_, ": key '", key, "' did not appear within ",
                     timeout.count(), " ms (has every rank started?)");
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

// ---- The job's token ---------------------------------------------------------------------------

std::string store_token(const std::string& host, int port, int size) {
  std::string material;
  if (const auto explicit_token = environment::store_token()) {
    GRADSYNC_CHECK(!explicit_token->empty(), "GRADSYNC_STORE_TOKEN is set but empty: give every rank the same ",
                   "secret, or unset it (a token derived from the launch is then used, which is no secret)");
    material = "explicit:" + *explicit_token;
  } else {
    for (const char* name : {"TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "OMPI_MCA_ess_base_jobid",
                             "PMIX_NAMESPACE", "LSB_JOBID", "PBS_JOBID"}) {
      if (const auto value = environment::launcher(name)) material += std::string(name) + "=" + *value + ";";
    }
    material += "rendezvous=" + host + ":" + std::to_string(port) + "/" + std::to_string(size);
  }
  char digest[33];
  std::snprintf(digest, sizeof digest, "%016llx%016llx", static_cast<unsigned long long>(fnv1a(material, 0xcbf29ce484222325ULL)),
                static_cast<unsigned long long>(fnv1a(material, 0x84222325cbf29ce4ULL)));
  return digest;
}

}  // namespace gradsync::comm
