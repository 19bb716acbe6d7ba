// Gloo's rendezvous (rendezvous.h) and the public ways to start a Gloo world
// (gradsync/comm/gloo/gloo.h): threads of one process, processes sharing a folder, processes meeting
// at rank 0's TCP store.
#include "rendezvous.h"

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <map>
#include <string_view>
#include <csignal>
#include <cstdio>
#include <exception>
#include <future>
#include <mutex>
#include <optional>
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

// The rank a key of Gloo's rendezvous belongs to: its full mesh publishes each rank's addresses
// under "3", its pairs' exchange under "rank_3". -1 for any other key.
int rank_of_key(const std::string& key) {
  const std::string number = key.rfind("rank_", 0) == 0 ? key.substr(5) : key;
  if (number.empty() || number.size() > 9 || number.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoi(number);
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
    std::vector<char> value = inner_.get(key);
    published_[key] = value;  // a peer's addresses: which rank a failing pair's address is
    return value;
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, std::chrono::milliseconds(0)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    const auto start = std::chrono::steady_clock::now();
    if (deadline_ == std::chrono::steady_clock::time_point{}) deadline_ = start + timeout_;  // the first wait starts it
    const auto left = std::max(std::chrono::milliseconds(1),
                               std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - start));
    // Gloo passes its context's timeout, which connect_full_mesh shortens for the pairs' sake:
    // the rendezvous keeps its own deadline.
    static_cast<void>(timeout);
    const auto limit = left;
    auto next_report = start + report_every_;
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      const auto slice = std::min<std::chrono::milliseconds>(
          std::chrono::milliseconds(200),
          std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(start + limit - now)));
      try {
        inner_.wait(keys, slice);
        return;
      } catch (const StoreGone& gone) {
        // Nobody will ever answer: say so now, and whom this rank was waiting for (the store's
        // server may have ended at its own timeout, waiting for the same rank).
        throw StoreGone(std::string(gone.what()) + "; this rank was waiting for " + awaited(keys));
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

  // The rank whose published addresses hold the IPv4 address Gloo names in `message`
  // ("Connect timeout [127.0.0.1]:35209": the pair's peer), or -1. Each rank publishes the
  // sockaddr of its end of every pair under its rank number (Gloo's full mesh).
  int rank_of_address(const std::string& message) const {
    unsigned a = 0, b = 0, c = 0, d = 0, port = 0;
    bool found = false;  // (the first bracket may be Gloo's source location, "[./gloo/...]")
    for (std::size_t open = message.find('['); open != std::string::npos && !found; open = message.find('[', open + 1)) {
      found = std::sscanf(message.c_str() + open, "[%u.%u.%u.%u]:%u", &a, &b, &c, &d, &port) == 5 && port <= 65535;
    }
    if (!found) return -1;
    // sockaddr_in as stored: family (AF_INET, host order), port, address. The port is looked for
    // in both byte orders: the pair's end as published is not always printed through ntohs.
    const sa_family_t family = AF_INET;
    const auto pattern_of = [&](unsigned first, unsigned second) {
      std::string bytes(reinterpret_cast<const char*>(&family), sizeof family);
      bytes += {static_cast<char>(first), static_cast<char>(second), static_cast<char>(a), static_cast<char>(b),
                static_cast<char>(c), static_cast<char>(d)};
      return bytes;
    };
    const std::string network = pattern_of(port >> 8, port & 0xff), swapped = pattern_of(port & 0xff, port >> 8);
    for (const auto& [key, value] : published_) {
      const std::string_view blob(value.data(), value.size());
      if (blob.find(network) == std::string_view::npos && blob.find(swapped) == std::string_view::npos) continue;
      if (const int rank = rank_of_key(key); rank >= 0) return rank;
    }
    return -1;
  }

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

  // The keys waited for, as ranks where they are Gloo's rank keys ("1", or "rank_1"): what to say
  // when the store cannot be asked any more.
  static std::string awaited(const std::vector<std::string>& keys) {
    std::string text;
    for (const std::string& key : keys) {
      const int rank = rank_of_key(key);
      text += (text.empty() ? "" : ", ") + (rank >= 0 ? "rank " + std::to_string(rank) : "key '" + key + "'");
    }
    return text + " (not arrived yet)";
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
      if (present(key)) continue;
      if (!text.empty()) text += ", ";
      // Gloo's per-rank keys ("rank_1") are a rank's: say so.
      const int rank = key.rfind("rank_", 0) == 0 ? rank_of_key(key) : -1;
      text += rank >= 0 ? "rank " + std::to_string(rank) + " (its key '" + key + "' not published yet)" : "key '" + key + "'";
    }
    return text;
  }

  gloo::rendezvous::Store& inner_;
  std::string where_;
  int rank_;
  int size_;
  std::chrono::milliseconds report_every_;
  std::chrono::milliseconds timeout_{300000};
  std::chrono::steady_clock::time_point deadline_{};  // the whole rendezvous's
  std::map<std::string, std::vector<char>> published_;  // what get() returned, by key
};

}  // namespace

std::shared_ptr<gloo::Context> connect_full_mesh(std::shared_ptr<gloo::rendezvous::Store> store, const Rendezvous& rendezvous,
                                                 int rank, int size) {
  ReportingStore reporting(*store, rendezvous.where, rank, size);
  reporting.set_timeout(rendezvous.timeout);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  // A pair waits five times its timeout for its first connection (Gloo's rule): with the
  // rendezvous timeout there, a peer that died while the ranks connected held a survivor 25 s
  // against a 5 s bound. The pairs are made with a fifth of it; the context gets it all back.
  context->setTimeout(std::max(rendezvous.timeout / 5, std::chrono::milliseconds(1)));
  try {
    std::shared_ptr<gloo::transport::Device> device = rendezvous.device;  // Gloo takes it by non-const reference
    context->connectFullMesh(reporting, device);
  } catch (const std::exception& error) {
    const std::string message = error.what();
    // Close this rank's pairs now rather than at unwinding: a peer still connecting to it fails
    // at once, and asks the store below while the store is still there.
    context.reset();
    // The store's waits name who never arrived; a pair's failure names an address. Which rank
    // is it? Every rank that fails here says so in the store: the ones that say nothing within
    // a moment are the ones that died (or hang) while the ranks connected.
    const std::optional<std::vector<bool>> said =
        size > 1 ? connect_failure_census(store, "", rendezvous, rank, size) : std::nullopt;
    const int peer = reporting.rank_of_address(message);
    // A pair's peer that said it failed too is a survivor (it failed on the dead rank first and
    // closed its pairs): the dead are the silent ones.
    const bool peer_failed_too = peer >= 0 && said && (*said)[static_cast<std::size_t>(peer)];
    std::string who;
    if (peer >= 0 && peer != rank && !peer_failed_too) {
      who = " (that is the pair with rank " + std::to_string(peer) + ", which did not connect: it died or hangs)";
    } else if (message.find("not arrived yet") == std::string::npos && message.find("not published yet") == std::string::npos &&
               size > 1) {
      who = silent_ranks(said, rank, size, rendezvous.where);
    }
    detail::throw_error("gloo rendezvous of rank ", rank, " of ", size, " failed (within ", rendezvous.timeout.count(),
                        " ms): ", message, who);
  }
  context->setTimeout(rendezvous.timeout);
  return context;
}

std::optional<std::vector<bool>> store_markers(std::shared_ptr<gloo::rendezvous::Store> store, std::vector<std::string> keys,
                                               int me, std::chrono::milliseconds grace, std::chrono::milliseconds slack) {
  using Clock = std::chrono::steady_clock;
  if (!store) return std::nullopt;
  auto result = std::make_shared<std::promise<std::vector<bool>>>();
  std::future<std::vector<bool>> answer = result->get_future();
  std::thread([store, keys, me, grace, result] {
    try {
      store->set(keys[static_cast<std::size_t>(me)], {'1'});
      const auto deadline = Clock::now() + grace;
      std::vector<bool> present(keys.size(), false);
      present[static_cast<std::size_t>(me)] = true;
      for (std::size_t k = 0; k < keys.size(); ++k) {
        if (present[k]) continue;
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        try {
          store->wait({keys[k]}, std::max(left, std::chrono::milliseconds(1)));
          present[k] = true;
        } catch (const std::exception&) {
        }
      }
      result->set_value(std::move(present));
    } catch (...) {
      result->set_exception(std::current_exception());
    }
  }).detach();
  if (answer.wait_for(grace + slack) != std::future_status::ready) return std::nullopt;
  try {
    return answer.get();
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::optional<std::vector<bool>> connect_failure_census(std::shared_ptr<gloo::rendezvous::Store> store,
                                                        const std::string& prefix, const Rendezvous& rendezvous, int rank,
                                                        int size) {
  constexpr std::chrono::milliseconds kGrace(500);
  std::vector<std::string> failed;
  for (int r = 0; r < size; ++r) failed.push_back(prefix + "gradsync/connect-failed/" + std::to_string(r));
  const std::optional<std::vector<bool>> said = store_markers(store, failed, rank, kGrace, kGrace);
  if (!said) return said;
  // Every rank says it has read; the rank that serves the store waits for those who said they
  // failed to have read too, before its exit takes the store away. Without that wait a slower
  // survivor, whose pair with rank 0 broke when rank 0 left, found no store to ask and blamed
  // rank 0 for the rank that died (the corner of the kill -9 schedule). Bounded: a reader reads
  // for at most its own grace after it said it failed.
  std::vector<std::string> read;
  int me = 0;
  for (int r = 0; r < size; ++r) {
    if (!(*said)[static_cast<std::size_t>(r)]) continue;
    if (r == rank) me = static_cast<int>(read.size());
    read.push_back(prefix + "gradsync/connect-read/" + std::to_string(r));
  }
  const bool serves_store = rendezvous.keepalive != nullptr;
  store_markers(store, read, me, serves_store ? kGrace + std::chrono::milliseconds(100) : std::chrono::milliseconds(0),
                kGrace);
  return said;
}

std::string silent_ranks(const std::optional<std::vector<bool>>& said, int me, int size, const std::string& where) {
  if (!said) {
    return " (" + where + " does not answer either: whoever serves it has gone, rank 0 for a launcher's TCP store)";
  }
  std::string ranks;
  int count = 0;
  for (int r = 0; r < size; ++r) {
    if (r == me || (*said)[static_cast<std::size_t>(r)]) continue;
    if (++count <= 8) ranks += (count > 1 ? ", " : "") + std::to_string(r);
  }
  if (count == 0) return " (every other rank failed to connect too)";
  if (count > 8) ranks += " and " + std::to_string(count - 8) + " more";
  return std::string(" (rank") + (count > 1 ? "s " : " ") + ranks + " said nothing: died or hung while the ranks " +
         "connected; the others failed to connect as this one did)";
}

bool gloo_available() { return true; }

namespace {

// A rank's communicator once the store exists: meet, then hand the backend to the engine.
std::unique_ptr<Communicator> meet(Rendezvous rendezvous, int rank, int size, const CommOptions& options,
                                   bool barrier_after = false) {
  auto context = connect_full_mesh(rendezvous.store, rendezvous, rank, size);
  auto backend = make_gloo_backend(std::move(context), std::move(rendezvous), "");
  if (barrier_after) {
    // Everyone has read what it needed from the store once all ranks are connected; the
    // barrier lets rank 0 know that before its server may go away.
    backend->set_timeout(resolve_timeout(options.timeout));
    try {
      backend->barrier();
    } catch (const std::exception& error) {  // raw Gloo words: the backend says which peer they mean
      detail::throw_error("gloo rendezvous of rank ", rank, " of ", size, " failed at its closing barrier: ",
                          backend->explain(error.what()));
    }
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
  Rendezvous rendezvous = rendezvous_through(std::make_shared<OwningPrefixStore>(prefix, store), std::move(where), options);
  return meet(std::move(rendezvous), rank, size, options);
}

}  // namespace gradsync::comm
