// Gloo's rendezvous (rendezvous.h) and the public ways to start a Gloo world
// (gradsync/comm/gloo/gloo.h): threads of one process, processes sharing a folder, processes meeting
// at rank 0's TCP store.
#include "rendezvous.h"

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "core/environment.h"
#include "gradsync/comm/gloo/gloo.h"
#include "comm/store/socket_io.h"
#include "comm/store/tcp_store.h"
#include "comm/store/torch_store.h"

namespace gradsync::comm {

namespace {

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
// until the rendezvous timeout; the timeout's error names them too. The timeout is one deadline
// for the whole rendezvous, not one per wait: Gloo's full mesh waits for each peer's key in turn,
// and a timeout per wait let a rendezvous of N ranks with a peer gone take N - 1 times as long.
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
    const auto start = std::chrono::steady_clock::now();
    if (deadline_ == std::chrono::steady_clock::time_point{}) deadline_ = start + timeout_;  // the first wait starts it
    const auto left = std::max(std::chrono::milliseconds(1),
                               std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - start));
    const auto limit = timeout.count() > 0 ? std::min<std::chrono::milliseconds>(timeout, left) : left;
    auto next_report = start + report_every_;
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      const auto slice = std::min<std::chrono::milliseconds>(
          std::chrono::milliseconds(200),
          std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(start + limit - now)));
      try {
        inner_.wait(keys, slice);
        return;
      } catch (const StoreGone&) {
        throw;  // nobody will ever answer: say so now
      } catch (const std::exception&) {
        // not there yet: report or give up below
      }
      const auto after = std::chrono::steady_clock::now();
      if (after >= start + limit) {
        detail::throw_error("rendezvous of rank ", rank_, " through ", where_, ": still waiting for ", missing(keys),
                            " after ", timeout_.count(), " ms (the rendezvous timeout; GRADSYNC_RENDEZVOUS_TIMEOUT_MS)");
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
    } catch (const StoreGone&) {
      throw;
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
  std::chrono::steady_clock::time_point deadline_{};  // the whole rendezvous's
};

}  // namespace

std::shared_ptr<gloo::Context> connect_full_mesh(gloo::rendezvous::Store& store, const Rendezvous& rendezvous, int rank,
                                                 int size) {
  ReportingStore reporting(store, rendezvous.where, rank, size);
  reporting.set_timeout(rendezvous.timeout);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->setTimeout(rendezvous.timeout);
  try {
    std::shared_ptr<gloo::transport::Device> device = rendezvous.device;  // Gloo takes it by non-const reference
    context->connectFullMesh(reporting, device);
  } catch (const std::exception& error) {
    detail::throw_error("gloo rendezvous of rank ", rank, " of ", size, " failed (within ", rendezvous.timeout.count(),
                        " ms): ", error.what());
  }
  return context;
}

bool gloo_available() { return true; }

namespace {

// A rank's communicator once the store exists: meet, then hand the backend to the engine.
std::unique_ptr<Communicator> meet(Rendezvous rendezvous, int rank, int size, const CommOptions& options,
                                   bool barrier_after = false) {
  auto context = connect_full_mesh(*rendezvous.store, rendezvous, rank, size);
  auto backend = make_gloo_backend(std::move(context), std::move(rendezvous), "");
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
  rendezvous.interruptible = options.interruptible;
  return rendezvous;
}

}  // namespace

void run_gloo_thread_group(int size, const std::function<void(Communicator&)>& body, const CommOptions& options) {
  run_gloo_thread_group(size, body, [&options](int) { return options; });
}

void run_gloo_thread_group(int size, const std::function<void(Communicator&)>& body,
                           const std::function<CommOptions(int rank)>& options_of) {
  GRADSYNC_CHECK(size >= 1, "run_gloo_thread_group: size must be positive, got ", size);
  const Rendezvous shared =
      rendezvous_through(std::make_shared<gloo::rendezvous::HashStore>(), "the in-process store", options_of(0));
  std::mutex errors_mutex;
  std::exception_ptr first_error;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      ThreadRankScope label(rank);
      try {
        auto communicator = meet(shared, rank, size, options_of(rank));
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
  auto store = std::make_shared<TcpStore>(host, port, /*serve=*/rank == 0, timeout, store_token(host, port, size));
  Rendezvous rendezvous = rendezvous_through(store, "the TCP store at " + host + ":" + std::to_string(port), options);
  rendezvous.keepalive = store->server();
  return meet(std::move(rendezvous), rank, size, options, /*barrier_after=*/true);
}

std::unique_ptr<Communicator> gloo_torch_store(const std::string& host, int port, int rank, int size,
                                               const std::string& prefix, const CommOptions& options) {
  GRADSYNC_CHECK(rank >= 0 && rank < size, "gloo_torch_store: rank ", rank, " is outside a world of ", size);
  const auto timeout = resolve_rendezvous_timeout(options.rendezvous_timeout, options.timeout);
  auto store = std::make_shared<TorchStore>(host, port, timeout, prefix);
  return meet(rendezvous_through(store, "the PyTorch TCPStore at " + host + ":" + std::to_string(port), options), rank,
              size, options, /*barrier_after=*/false);
}

std::unique_ptr<Communicator> gloo_prefixed_communicator(std::shared_ptr<gloo::rendezvous::Store> store,
                                                         const std::string& prefix, std::string where, int rank, int size,
                                                         const CommOptions& options) {
  GRADSYNC_CHECK(rank >= 0 && rank < size, "gloo_prefixed_communicator: rank ", rank, " is outside a world of ", size);
  auto prefixed = std::make_shared<gloo::rendezvous::PrefixStore>(prefix, *store);
  Rendezvous rendezvous = rendezvous_through(prefixed, std::move(where), options);
  rendezvous.keepalive = store;  // the prefixed view holds a reference to it
  return meet(std::move(rendezvous), rank, size, options);
}

}  // namespace gradsync::comm
