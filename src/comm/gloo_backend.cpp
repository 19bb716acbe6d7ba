// The Gloo backend: Gloo's collectives over its TCP transport, with our reduce functions
// (every dtype, f16/bf16 combined in f32), and every call bounded by the timeout.
#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <csignal>
#include <atomic>
#include <map>
#include <set>
#include <sstream>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "backend.h"
#include "core/environment.h"
#include "gradsync/comm/gloo.h"
#include "reduce_functions.h"
#include "tcp_store.h"

namespace gradsync::comm {

namespace {

// Point-to-point messages use their own slot range, far from the collectives' tags; so do the
// rings we build from point-to-point buffers.
constexpr std::uint64_t kP2PSlotBase = std::uint64_t{1} << 40;
constexpr std::uint64_t kRingSlotBase = std::uint64_t{1} << 48;

std::shared_ptr<gloo::Context> connect(gloo::rendezvous::Store& store, const std::string& where, int rank, int size,
                                       std::chrono::milliseconds timeout,
                                       std::shared_ptr<gloo::transport::Device> device);

// How a Gloo world met: the store (kept, so that duplicate() can meet again under a fresh
// prefix), this rank's transport device, and whatever must outlive the store's clients.
struct Rendezvous {
  std::shared_ptr<gloo::rendezvous::Store> store;
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<void> keepalive;  // rank 0 of a TCP rendezvous: the store server
  std::string where;                // "the TCP store at host:port", for messages
  std::chrono::milliseconds timeout{300000};  // the rendezvous timeout
};

class GlooBackend final : public Backend {
 public:
  GlooBackend(std::shared_ptr<gloo::Context> context, Rendezvous rendezvous, std::string prefix)
      : context_(std::move(context)), rendezvous_(std::move(rendezvous)), prefix_(std::move(prefix)) {
    learn_peer_addresses();
  }

  const char* name() const override { return "gloo"; }
  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }
  void set_timeout(std::chrono::milliseconds timeout) override {
    timeout_ = timeout;
    context_->setTimeout(timeout);
  }

  void allreduce(void* data, std::int64_t count, DType dtype, ReduceOp op) override {
    if (count == 0) return;
    gloo::AllreduceOptions options(context_);
    // Gloo's typed setters only record the element size; a byte-sized view with our own
    // function keeps one code path for all dtypes.
    set_buffers(options, data, count, dtype);
    const ReduceFunction reduce = reduce_function(dtype, op);
    options.setReduceFunction([reduce](void* c, const void* a, const void* b, size_t n) { reduce(c, a, b, n); });
    options.setTag(next_tag());
    options.setTimeout(timeout_);
    gloo::allreduce(options);
  }

  void broadcast(void* data, std::int64_t count, DType dtype, int root) override {
    if (count == 0) return;
    gloo::BroadcastOptions options(context_);
    with_element_type(dtype, [&]<typename E>(E*) { options.setOutput(static_cast<E*>(data), static_cast<size_t>(count)); });
    options.setRoot(root);
    options.setTag(next_tag());
    options.setTimeout(timeout_);
    gloo::broadcast(options);
  }

  void allgather(const void* input, void* output, std::int64_t count, DType dtype) override {
    if (count == 0) return;
    gloo::AllgatherOptions options(context_);
    with_element_type(dtype, [&]<typename E>(E*) {
      options.setInput(static_cast<E*>(const_cast<void*>(input)), static_cast<size_t>(count));
      options.setOutput(static_cast<E*>(output), static_cast<size_t>(count) * static_cast<size_t>(size()));
    });
    options.setTag(next_tag());
    options.setTimeout(timeout_);
    gloo::allgather(options);
  }

  void allgatherv(const void* input, void* output, const std::vector<std::int64_t>& counts, DType dtype) override {
    std::vector<size_t> elements(counts.begin(), counts.end());
    std::int64_t total = 0;
    for (const std::int64_t count : counts) total += count;
    if (total == 0) return;
    gloo::AllgathervOptions options(context_);
    with_element_type(dtype, [&]<typename E>(E*) {
      options.setInput(static_cast<E*>(const_cast<void*>(input)), elements[static_cast<std::size_t>(rank())]);
      options.setOutput(static_cast<E*>(output), elements);
    });
    options.setTag(next_tag());
    options.setTimeout(timeout_);
    gloo::allgatherv(options);
  }

  // Ring reduce-scatter (Gloo has no option-style one): in step s rank r sends chunk r-s-1 of
  // its partial sums to the right neighbour and adds chunk r-s-2 arriving from the left; after
  // n-1 steps it holds chunk r summed over every rank. Each rank sends (n-1)/n of the input,
  // the minimum, over Gloo's point-to-point buffers with their own slot range.
  void reduce_scatter(const void* input, void* output, std::int64_t count, DType dtype, ReduceOp op) override {
    const int n = size();
    const std::size_t chunk = static_cast<std::size_t>(count) * dtype_size(dtype);
    if (n == 1 || chunk == 0) {
      std::memcpy(output, input, chunk);
      return;
    }
    std::vector<std::byte> partial(chunk * static_cast<std::size_t>(n));
    std::memcpy(partial.data(), input, partial.size());
    std::vector<std::byte> incoming(chunk);
    const ReduceFunction reduce = reduce_function(dtype, op);
    const int right = (rank() + 1) % n;
    const int left = (rank() + n - 1) % n;
    const auto wrap = [n](int c) { return ((c % n) + n) % n; };
    auto whole = context_->createUnboundBuffer(partial.data(), partial.size());
    auto arriving = context_->createUnboundBuffer(incoming.data(), incoming.size());
    const std::uint64_t slot = kRingSlotBase + (static_cast<std::uint64_t>(ring_operations_++) << 16);
    for (int step = 0; step < n - 1; ++step) {
      const auto send_chunk = static_cast<std::size_t>(wrap(rank() - step - 1));
      const auto recv_chunk = static_cast<std::size_t>(wrap(rank() - step - 2));
      arriving->recv(left, slot + static_cast<std::uint64_t>(step));
      whole->send(right, slot + static_cast<std::uint64_t>(step), send_chunk * chunk, chunk);
      await(*arriving, /*receive=*/true, "gloo reduce_scatter: step " + std::to_string(step) + " receive from rank " +
                                             std::to_string(left));
      std::byte* target = partial.data() + recv_chunk * chunk;
      reduce(target, target, incoming.data(), static_cast<std::size_t>(count));
      await(*whole, /*receive=*/false, "gloo reduce_scatter: step " + std::to_string(step) + " send to rank " +
                                        std::to_string(right));
    }
    std::memcpy(output, partial.data() + static_cast<std::size_t>(rank()) * chunk, chunk);
  }

  void barrier() override {
    gloo::BarrierOptions options(context_);
    options.setTag(next_tag());
    options.setTimeout(timeout_);
    gloo::barrier(options);
  }

  void send(const void* data, std::size_t nbytes, int peer, int tag) override {
    auto buffer = context_->createUnboundBuffer(const_cast<void*>(data), nbytes);
    buffer->send(peer, kP2PSlotBase + static_cast<std::uint64_t>(tag));
    await(*buffer, /*receive=*/false, "gloo send to rank " + std::to_string(peer));
  }

  void recv(void* data, std::size_t nbytes, int peer, int tag) override {
    auto buffer = context_->createUnboundBuffer(data, nbytes);
    buffer->recv(peer, kP2PSlotBase + static_cast<std::uint64_t>(tag));
    await(*buffer, /*receive=*/true, "gloo recv from rank " + std::to_string(peer));
  }

  // A new context over the same store under a fresh prefix: every rank duplicates in the same
  // sequence, so the n-th duplicate of this context meets under the same name everywhere.
  std::unique_ptr<Backend> duplicate() override {
    const std::string prefix = prefix_ + "dup" + std::to_string(duplicates_++) + "/";
    gloo::rendezvous::PrefixStore store(prefix, *rendezvous_.store);
    auto context = connect(store, rendezvous_.where, rank(), size(), rendezvous_.timeout, rendezvous_.device);
    auto child = std::make_unique<GlooBackend>(std::move(context), rendezvous_, prefix);
    child->set_timeout(timeout_);
    return child;
  }

  // Our own point-to-point waits (send, recv, the reduce-scatter ring) are woken at once. Gloo's own algorithms (allreduce, broadcast, allgather) cannot be interrupted
  // from outside (closing the context's connections does not wake their waits): they end by
  // their timeout, and the communicator waits for that before anyone may reuse the buffers.
  void abort() override {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    aborted_ = true;
    if (waiting_ == nullptr) return;
    if (waiting_receive_) {
      waiting_->abortWaitRecv();
    } else {
      waiting_->abortWaitSend();
    }
  }

  // Gloo names a vanished peer by an address ("[127.0.0.1]:40123") taken from its own pair
  // bookkeeping, which does not always match the kernel's addresses (and so can point at the
  // wrong rank). First ask the kernel: which peer's connection, recorded at rendezvous, is now
  // closed or gone? When exactly one is, that is the peer. Else fall back to the addresses.
  std::string explain(const std::string& message) const override {
    std::set<int> vanished;
    if (message.find("closed") != std::string::npos || message.find("reset") != std::string::npos) {
      for (const auto& [fd, connection] : connections_) {
        sockaddr_storage remote{};
        socklen_t length = sizeof remote;
        char byte = 0;
        const bool gone = ::getpeername(fd, reinterpret_cast<sockaddr*>(&remote), &length) != 0 ||
                          address_text(remote) != connection.remote ||
                          ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
        if (gone) vanished.insert(connection.rank);
      }
      if (vanished.size() == 1) {
        const std::string rank_text = std::to_string(*vanished.begin());
        return message + " (the connection to rank " + rank_text + " is closed: the peer is rank " + rank_text + ")";
      }
    }
    for (std::size_t peer = 0; peer < peer_addresses_.size(); ++peer) {
      const std::string& address = peer_addresses_[peer];
      if (!address.empty() && message.find(address) != std::string::npos) {
        return message + " (" + address + " is rank " + std::to_string(peer) + ")";
      }
    }
    for (const auto& [address, peer] : socket_owner_) {
      if (message.find(address) != std::string::npos) {
        return message + " (" + address + " is rank " + std::to_string(peer) + ")";
      }
    }
    if (!vanished.empty()) {  // several connections closed, and the address names none of them
      std::string ranks;
      for (const int peer : vanished) ranks += (ranks.empty() ? "rank " : " or rank ") + std::to_string(peer);
      return message + " (connections closed: the peer is " + ranks + ")";
    }
    return message;
  }

 private:
  // Calls fn((E*)nullptr) with an element type of the dtype's size; Gloo only moves bytes.
  template <typename Fn>
  static void with_element_type(DType dtype, Fn&& fn) {
    switch (dtype_size(dtype)) {
      case 2: return fn(static_cast<std::uint16_t*>(nullptr));
      case 4: return fn(static_cast<std::uint32_t*>(nullptr));
      default: return fn(static_cast<std::uint64_t*>(nullptr));
    }
  }

  void set_buffers(gloo::AllreduceOptions& options, void* data, std::int64_t count, DType dtype) {
    with_element_type(dtype, [&]<typename E>(E*) {
      options.setOutput(static_cast<E*>(data), static_cast<size_t>(count));
    });
  }

  std::uint32_t next_tag() { return tag_++; }

  // Waits for one side of a point-to-point buffer, bounded by the timeout. The buffer is
  // published for abort(), which wakes the wait from another thread (Gloo's abortWait*; a
  // wait with a shorter timeout would not do: an expired wait closes the connection).
  void await(gloo::transport::UnboundBuffer& buffer, bool receive, const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(abort_mutex_);
      if (aborted_) detail::throw_error(what, " was aborted: the communicator broke");
      waiting_ = &buffer;
      waiting_receive_ = receive;
    }
    bool done = false;
    try {
      done = receive ? buffer.waitRecv(timeout_) : buffer.waitSend(timeout_);
    } catch (...) {
      std::lock_guard<std::mutex> lock(abort_mutex_);
      waiting_ = nullptr;
      throw;
    }
    std::lock_guard<std::mutex> lock(abort_mutex_);
    waiting_ = nullptr;
    if (done) return;
    if (aborted_) detail::throw_error(what, " was aborted: the communicator broke while it was in flight");
    detail::throw_error(what, " did not complete within ", timeout_.count(), " ms");
  }

  // Every rank publishes the address of its end of each pair; rank j's end of the pair with
  // this rank is the address this rank's Gloo errors name for rank j.
  void learn_peer_addresses() {
    constexpr std::size_t kWidth = 64;
    const auto n = static_cast<std::size_t>(size());
    std::vector<char> mine(kWidth * n, '\0');
    for (int peer = 0; peer < size(); ++peer) {
      if (peer == rank()) continue;
      const std::string address = context_->getPair(peer)->address().str();
      std::memcpy(mine.data() + kWidth * static_cast<std::size_t>(peer), address.data(), std::min(address.size(), kWidth - 1));
    }
    std::vector<char> all(kWidth * n * n, '\0');
    if (n > 1) allgather(mine.data(), all.data(), static_cast<std::int64_t>(mine.size() / 8), DType::i64);
    peer_addresses_.assign(n, std::string());
    for (std::size_t peer = 0; peer < n; ++peer) {
      if (peer == static_cast<std::size_t>(rank())) continue;
      peer_addresses_[peer] = std::string(all.data() + kWidth * (n * peer + static_cast<std::size_t>(rank())));
    }
    learn_socket_addresses();
  }

  // The side of a connection that accepted it sees the connecting side's ephemeral address, not
  // its listening one: every rank also publishes the local addresses of its process's
  // connected TCP sockets. An address only one rank claims names that rank (ranks that are
  // threads of one process all claim the same sockets, and are left to the table above).
  void learn_socket_addresses() {
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
    std::vector<std::int64_t> counts(static_cast<std::size_t>(size()));
    allgather(&words, counts.data(), 1, DType::i64);
    std::int64_t total = 0;
    for (const std::int64_t count : counts) total += count;
    std::string all(static_cast<std::size_t>(total) * 8, '\0');
    allgatherv(mine.data(), all.data(), counts, DType::i64);
    std::map<std::string, int> owner;  // address -> rank, or -1 when several ranks claim it
    std::size_t offset = 0;
    for (int peer = 0; peer < size(); ++peer) {
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
      if (peer >= 0 && peer != rank()) socket_owner_[address] = peer;
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
  static std::string address_text(const sockaddr_storage& address) {
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
      return "";
    }
    std::string text(host);
    if (text.rfind("::ffff:", 0) == 0 && text.find('.') != std::string::npos) text = text.substr(7);  // v4-mapped
    return "[" + text + "]:" + std::to_string(port);
  }

  std::shared_ptr<gloo::Context> context_;
  Rendezvous rendezvous_;
  std::string prefix_;
  int duplicates_ = 0;
  std::mutex abort_mutex_;  // guards aborted_ and the buffer being waited for
  bool aborted_ = false;
  gloo::transport::UnboundBuffer* waiting_ = nullptr;
  bool waiting_receive_ = false;
  std::vector<std::string> peer_addresses_;  // by rank: how Gloo's messages name that peer
  std::map<std::string, int> socket_owner_;   // connected sockets' local addresses, by owning rank
  struct Connection {
    std::string remote;  // the peer's address, as the kernel reported it at rendezvous
    int rank;
  };
  std::map<int, Connection> connections_;  // our sockets (fd) to single known peers
  std::chrono::milliseconds timeout_{300000};
  std::uint32_t tag_ = 0;
  std::uint32_t ring_operations_ = 0;
};

// The address this rank listens on: GRADSYNC_GLOO_HOST (an address or host name other ranks
// can reach, for ranks on several machines), else loopback.
std::shared_ptr<gloo::transport::Device> loopback_device() {
  // A peer that died has closed its sockets, and Gloo's writes to them raise SIGPIPE, whose
  // default action kills this process before the write can fail with EPIPE and become our
  // error naming the peer. Python ignores SIGPIPE at startup (so PyTorch's Gloo never sees
  // it); a C++ program starts with the default: ignore it, unless the program has its own
  // handler.
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
  gloo::transport::tcp::attr attributes;
  attributes.hostname = environment::gloo_host().value_or("127.0.0.1");
  return gloo::transport::tcp::CreateDevice(attributes);
}

// A store that reports while it waits: every GRADSYNC_RENDEZVOUS_REPORT_MS (10 s) a rank
// says on stderr which ranks it is still waiting for and where, instead of waiting silently
// until the rendezvous timeout; the timeout's error names them too.
class ReportingStore final : public gloo::rendezvous::Store {
 public:
  ReportingStore(gloo::rendezvous::Store& inner, std::string where, int rank, int size)
      : inner_(inner), where_(std::move(where)), rank_(rank), size_(size),
        report_every_(environment::rendezvous_report_interval()) {}

  void set(const std::string& key, const std::vector<char>& data) override { inner_.set(key, data); }
  std::vector<char> get(const std::string& key) override {
    wait({key}, std::chrono::milliseconds(0));
    return inner_.get(key);
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, std::chrono::milliseconds(0)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    const auto limit = timeout.count() > 0 ? timeout : timeout_;
    const auto start = std::chrono::steady_clock::now();
    auto next_report = start + report_every_;
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      const auto slice = std::min<std::chrono::milliseconds>(
          std::chrono::milliseconds(200),
          std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(start + limit - now)));
      try {
        inner_.wait(keys, slice);
        return;
      } catch (const std::exception&) {
        // not there yet: report or give up below
      }
      const auto after = std::chrono::steady_clock::now();
      if (after >= start + limit) {
        detail::throw_error("rendezvous of rank ", rank_, " through ", where_, ": still waiting for ", missing(keys),
                            " after ", limit.count(), " ms (the rendezvous timeout; GRADSYNC_RENDEZVOUS_TIMEOUT_MS)");
      }
      if (after >= next_report) {
        std::fprintf(stderr, "gradsync: rank %d waiting %.0f s at the rendezvous (%s) for %s\n", rank_,
                     std::chrono::duration<double>(after - start).count(), where_.c_str(), missing(keys).c_str());
        next_report = after + report_every_;
      }
    }
  }
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

 private:
  // Gloo's full mesh publishes every rank's addresses under its rank number ("3") and waits
  // for the others' one by one: report every rank whose key is not there yet, not only the one
  // waited for now.
  bool present(const std::string& key) {
    try {
      inner_.wait({key}, std::chrono::milliseconds(1));
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }

  std::string missing(const std::vector<std::string>& keys) {
    bool rank_keys = true;
    for (const std::string& key : keys) {
      rank_keys = rank_keys && !key.empty() && key.find_first_not_of("0123456789") == std::string::npos;
    }
    std::string text;
    if (rank_keys) {
      for (int other = 0; other < size_; ++other) {
        if (other != rank_ && !present(std::to_string(other))) text += (text.empty() ? "" : ", ") + std::to_string(other);
      }
      return text.empty() ? "peers that were slow to publish" : "rank(s) " + text + " (not arrived yet)";
    }
    for (const std::string& key : keys) {
      if (!present(key)) text += (text.empty() ? "'" : ", '") + key + "'";
    }
    return "key(s) " + text;
  }

  gloo::rendezvous::Store& inner_;
  std::string where_;
  int rank_;
  int size_;
  std::chrono::milliseconds report_every_;
  std::chrono::milliseconds timeout_{300000};
};

std::shared_ptr<gloo::Context> connect(gloo::rendezvous::Store& raw_store, const std::string& where, int rank, int size,
                                       std::chrono::milliseconds timeout,
                                       std::shared_ptr<gloo::transport::Device> device) {
  ReportingStore store(raw_store, where, rank, size);
  store.set_timeout(timeout);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->setTimeout(timeout);
  try {
    context->connectFullMesh(store, device);
  } catch (const std::exception& error) {
    detail::throw_error("gloo rendezvous of rank ", rank, " of ", size, " failed (within ", timeout.count(),
                        " ms): ", error.what());
  }
  return context;
}

}  // namespace

bool gloo_available() { return true; }

namespace {

// A rank's communicator once the store exists: meet, then hand the backend to the engine.
std::unique_ptr<Communicator> meet(Rendezvous rendezvous, int rank, int size, const CommOptions& options,
                                   bool barrier_after = false) {
  auto context = connect(*rendezvous.store, rendezvous.where, rank, size, rendezvous.timeout, rendezvous.device);
  auto backend = std::make_unique<GlooBackend>(std::move(context), std::move(rendezvous), "");
  if (barrier_after) {
    // Everyone has read what it needed from the store once all ranks are connected; the
    // barrier lets rank 0 know that before its server may go away.
    backend->set_timeout(resolve_timeout(options.timeout));
    backend->barrier();
  }
  return make_cpu_communicator(std::move(backend), options);
}

Rendezvous rendezvous_through(std::shared_ptr<gloo::rendezvous::Store> store, std::string where, const CommOptions& options) {
  Rendezvous rendezvous;
  rendezvous.store = std::move(store);
  rendezvous.device = loopback_device();
  rendezvous.where = std::move(where);
  rendezvous.timeout = resolve_rendezvous_timeout(options.rendezvous_timeout, options.timeout);
  return rendezvous;
}

}  // namespace

void run_gloo_thread_group(int size, const std::function<void(Communicator&)>& body, const CommOptions& options) {
  GRADSYNC_CHECK(size >= 1, "run_gloo_thread_group: size must be positive, got ", size);
  const Rendezvous shared = rendezvous_through(std::make_shared<gloo::rendezvous::HashStore>(), "the in-process store", options);
  std::mutex errors_mutex;
  std::exception_ptr first_error;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      ThreadRankScope label(rank);
      try {
        auto communicator = meet(shared, rank, size, options);
        body(*communicator);
      } catch (...) {
        std::lock_guard<std::mutex> lock(errors_mutex);
        if (!first_error) first_error = std::current_exception();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  if (first_error) std::rethrow_exception(first_error);
}

std::unique_ptr<Communicator> gloo_file_store(const std::filesystem::path& folder, int rank, int size,
                                              const CommOptions& options) {
  GRADSYNC_CHECK(rank >= 0 && rank < size, "gloo_file_store: rank ", rank, " is outside a world of ", size);
  std::filesystem::create_directories(folder);
  return meet(rendezvous_through(std::make_shared<gloo::rendezvous::FileStore>(folder.string()),
                                 "the file store in " + folder.string(), options),
              rank, size, options);
}

std::unique_ptr<Communicator> gloo_tcp_store(const std::string& host, int port, int rank, int size,
                                             const CommOptions& options) {
  GRADSYNC_CHECK(rank >= 0 && rank < size, "gloo_tcp_store: rank ", rank, " is outside a world of ", size);
  if (size == 1) {  // nobody to meet: no server, no port
    return meet(rendezvous_through(std::make_shared<gloo::rendezvous::HashStore>(), "the in-process store", options), 0, 1,
                options);
  }
  const auto timeout = resolve_rendezvous_timeout(options.rendezvous_timeout, options.timeout);
  auto store = std::make_shared<TcpStore>(host, port, /*serve=*/rank == 0, timeout);
  Rendezvous rendezvous = rendezvous_through(store, "the TCP store at " + host + ":" + std::to_string(port), options);
  rendezvous.keepalive = store->server();
  return meet(std::move(rendezvous), rank, size, options, /*barrier_after=*/true);
}

}  // namespace gradsync::comm
