// The rendezvous store (src/comm/store/tcp_store.h) against hostile peers on loopback: strangers
// without the job's token, malformed and oversized requests, floods of garbage, slow and
// silent connections. Rank 0's memory and descriptors stay bounded, no exception leaves its
// loop, and the job's own clients (a real Gloo rendezvous included) carry on.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/gloo/rendezvous.h"
#include "comm/store/protocol.h"
#include "comm/store/tcp_store.h"
#include "comm/store/torch_store.h"
#include "gradsync/comm/gloo/gloo.h"
#include "test_util.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using comm::TcpStore;

// The process's open descriptors and resident memory (the server runs in this process).
int open_descriptors() {
  int count = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++count;
  return count;
}

std::int64_t resident_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return 0;
}

// A port nobody listens on now (the kernel's pick, released at once).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  ::inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
  ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
  socklen_t length = sizeof address;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  ::close(fd);
  return ntohs(address.sin_port);
}

// A raw TCP connection to the server, for sending what no client of ours would.
int raw_connection(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<std::uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

void send_all(int fd, const std::string& bytes) {
  std::size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t put = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (put <= 0) return;  // the server may close first: that is the point
    sent += static_cast<std::size_t>(put);
  }
}

// True once the server has closed the connection (a read sees the end), within `limit`.
bool closed_by_server(int fd, std::chrono::milliseconds limit) {
  timeval timeout{};
  timeout.tv_sec = static_cast<time_t>(limit.count() / 1000);
  timeout.tv_usec = static_cast<suseconds_t>((limit.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  char byte;
  for (;;) {
    const ssize_t got = ::recv(fd, &byte, 1, 0);
    if (got == 0) return true;
    if (got < 0) return errno == ECONNRESET;
  }
}

template <typename Predicate>
bool eventually(Predicate predicate, std::chrono::milliseconds limit = 5000ms) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (predicate()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return predicate();
}

struct Server {
  std::shared_ptr<comm::TcpStoreServer> server;
  int port;
  explicit Server(comm::TcpStoreServerOptions options = {}) {
    if (options.token.empty()) options.token = "the-job-token";
    server = comm::start_tcp_store_server(options);
    port = comm::tcp_store_server_port(*server);
  }
  comm::TcpStoreServerCounters counters() const { return comm::tcp_store_server_counters(*server); }
  // A client of the job (the right token), checked to work.
  void expect_clients_work(const std::string& key) const {
    TcpStore client("127.0.0.1", port, false, 5000ms, "the-job-token");
    client.set(key, {'o', 'k'});
    EXPECT_EQ(client.get(key), (std::vector<char>{'o', 'k'}));
  }
};

TEST(Store, AStrangerWithoutTheTokenIsRefused) {
  Server server;
  EXPECT_GRADSYNC_ERROR(TcpStore("127.0.0.1", server.port, false, 2000ms, "a-guess"), "refused this rank's token");
  // Nothing before the hello is served: a plain get is malformed.
  const int fd = raw_connection(server.port);
  send_all(fd, comm::store::encode_request(comm::store::kGet, "0"));
  EXPECT_TRUE(closed_by_server(fd, 2000ms));
  ::close(fd);
  EXPECT_TRUE(eventually([&] { return server.counters().refused_token == 1 && server.counters().malformed == 1; }));
  server.expect_clients_work("after strangers");
}

// A client holding the token cannot fill rank 0's memory: what the store holds is bounded
// (GRADSYNC_STORE_MAX_MB) for everyone, so sets past it are refused, naming the knob, while
// replacing a value and reading go on. (It used to store 1.5 GB from one client.)
TEST(Store, AClientWithTheTokenCannotFillTheStore) {
  comm::TcpStoreServerOptions options;
  options.max_stored_bytes = std::size_t{8} << 20;
  Server server(options);
  TcpStore client("127.0.0.1", server.port, false, 5000ms, "the-job-token");
  const std::vector<char> mebibyte(std::size_t{1} << 20, 'x');
  const std::int64_t before = resident_kib();
  int stored = 0;
  try {
    for (; stored < 1000; ++stored) client.set("fill/" + std::to_string(stored), mebibyte);
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("refused: the store holds all it may (GRADSYNC_STORE_MAX_MB"),
              std::string::npos)
        << error.what();
  }
  EXPECT_EQ(stored, 7);  // 7 MiB and their keys fit in 8 MiB; the 8th does not
  EXPECT_LT(resident_kib() - before, 64 * 1024);
  EXPECT_EQ(server.counters().refused_full_store, 1);
  EXPECT_LE(server.counters().stored_bytes, std::int64_t{8} << 20);
  client.set("fill/0", {'s', 'm', 'a', 'l', 'l'});  // a replacement frees what it replaces
  client.set("after", mebibyte);
  EXPECT_EQ(client.get("fill/1").size(), mebibyte.size());
  server.expect_clients_work("after a fill");
}

// A delete frees what the key held (the bound counts it no more); a missing key says so; a delete
// carrying a value is malformed.
TEST(Store, ADeleteFreesTheKey) {
  Server server;
  TcpStore client("127.0.0.1", server.port, false, 5000ms, "the-job-token");
  const std::int64_t empty = server.counters().stored_bytes;
  client.set("gone/soon", std::vector<char>(1000, 'x'));
  EXPECT_GT(server.counters().stored_bytes, empty + 1000);
  EXPECT_TRUE(client.erase("gone/soon"));
  std::vector<char> value;
  EXPECT_FALSE(client.try_get("gone/soon", value));
  EXPECT_FALSE(client.erase("gone/soon"));
  EXPECT_EQ(server.counters().stored_bytes, empty);
  const auto parsed = comm::store::parse_request(comm::store::encode_request(comm::store::kDelete, "k", "v"), true);
  EXPECT_EQ(parsed.status, comm::store::Parsed::malformed);
  EXPECT_EQ(parsed.error, "a delete carrying a value");
  server.expect_clients_work("after deletes");
}

TEST(Store, TheBoundComesFromTheEnvironment) {
  const testing::ScopedVariable limit("GRADSYNC_STORE_MAX_MB", "2");
  TcpStore store("127.0.0.1", free_port(), true, 5000ms, "t");
  const std::vector<char> mebibyte(std::size_t{1} << 20, 'x');
  store.set("a", mebibyte);
  EXPECT_GRADSYNC_ERROR(store.set("b", mebibyte), "GRADSYNC_STORE_MAX_MB");
  const testing::ScopedVariable wrong("GRADSYNC_STORE_MAX_MB", "0");
  EXPECT_GRADSYNC_ERROR(TcpStore("127.0.0.1", free_port(), true, 2000ms, "t"),
                        "GRADSYNC_STORE_MAX_MB must be a whole number");
}

// GRADSYNC_STORE_BIND names where rank 0 listens: an address that is not this machine's is an
// error naming it, never a quiet fallback to every interface (which widened the exposure).
TEST(Store, AForeignBindAddressIsAnError) {
  const testing::ScopedVariable bind("GRADSYNC_STORE_BIND", "192.0.2.1");  // TEST-NET-1: nobody's address
  EXPECT_GRADSYNC_ERROR(TcpStore("127.0.0.1", free_port(), true, 2000ms, "t"),
                        "cannot listen on GRADSYNC_STORE_BIND=192.0.2.1");
}

// The token: set but empty is an error; derived (no GRADSYNC_STORE_TOKEN) on an address beyond
// this machine is warned about, since whoever reaches the port can compute it.
TEST(Store, ATokenThatIsNoSecretIsSaidSo) {
  {
    const testing::ScopedVariable empty("GRADSYNC_STORE_TOKEN", "");
    EXPECT_GRADSYNC_ERROR(comm::store_token("127.0.0.1", 29500, 2), "GRADSYNC_STORE_TOKEN is set but empty");
  }
  std::vector<std::string> warnings;
  const WarningHandler previous = set_warning_handler([&](const std::string& text) { warnings.push_back(text); });
  {
    comm::TcpStoreServerOptions options;
    options.bind_host = "127.0.0.1";
    options.secret_token = false;
    Server loopback(options);  // only this machine reaches it: nothing to say
    options.bind_host = "*";
    Server everywhere(options);
  }
  set_warning_handler(previous);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("set GRADSYNC_STORE_TOKEN to a secret shared by the ranks"), std::string::npos) << warnings[0];
}

// 13 bytes with a huge length prefix used to end rank 0 (std::length_error in a handler).
TEST(Store, AHugeLengthPrefixClosesOnlyThatConnection) {
  Server server;
  for (const std::string& bytes : {std::string("H\xff\xff\xff\xff\x00\x00\x00\x00" "abcd", 13),
                                   std::string("H\x10\x00\x00\x00\xff\xff\xff\x7f", 9)}) {
    const int fd = raw_connection(server.port);
    send_all(fd, bytes);
    EXPECT_TRUE(closed_by_server(fd, 2000ms));
    ::close(fd);
  }
  // And from a client that did present the token: a 1 GiB value is refused at its header.
  TcpStore client("127.0.0.1", server.port, false, 2000ms, "the-job-token");
  const int fd = raw_connection(server.port);
  send_all(fd, comm::store::encode_request(comm::store::kHello, comm::store::kHelloKey, "the-job-token"));
  char ack = 0;
  ASSERT_EQ(::recv(fd, &ack, 1, MSG_WAITALL), 1);
  send_all(fd, std::string("S\x01\x00\x00\x00\x00\x00\x00\x40", 9));  // key 1 byte, value 1 GiB
  EXPECT_TRUE(closed_by_server(fd, 2000ms));
  ::close(fd);
  EXPECT_TRUE(eventually([&] { return server.counters().malformed == 3; }));
  server.expect_clients_work("after huge prefixes");
}

// 200 connections of 4 KiB of random bytes each used to grow rank 0 past 23 GB.
TEST(Store, AFloodOfGarbageStaysBounded) {
  Server server;
  const int descriptors = open_descriptors();
  const std::int64_t before = resident_kib();
  std::mt19937 random(11);
  for (int wave = 0; wave < 10; ++wave) {
    std::vector<int> fds;
    for (int k = 0; k < 20; ++k) {
      std::string garbage(4096, '\0');
      for (char& c : garbage) c = static_cast<char>(random());
      garbage[0] = 'H';  // past the first check: the lengths are what is refused
      const int fd = raw_connection(server.port);
      if (fd < 0) continue;
      send_all(fd, garbage);
      fds.push_back(fd);
    }
    for (const int fd : fds) ::close(fd);
    server.expect_clients_work("during the flood " + std::to_string(wave));
  }
  EXPECT_TRUE(eventually([&] { return server.counters().open == 0; }));
  EXPECT_LE(open_descriptors(), descriptors + 2) << "the server's connections are all closed again";
  EXPECT_LT(resident_kib() - before, 64 * 1024) << "KiB grown during the flood";
}

// A request begun and never finished, connections that never present the token, and more
// connections than the caps allow: all dropped, the job's clients unaffected.
TEST(Store, SlowSilentAndSurplusConnectionsAreDropped) {
  Server server({.max_connections = 48, .max_unauthenticated = 16, .handshake_timeout = 300ms,
                 .stall_timeout = 300ms});
  const int descriptors = open_descriptors();
  // Silent: never a byte. Surplus: beyond 16 yet to authenticate, refused at once.
  std::vector<int> silent;
  for (int k = 0; k < 40; ++k) silent.push_back(raw_connection(server.port));
  EXPECT_TRUE(eventually([&] { return server.counters().refused_full >= 24; }));
  for (const int fd : silent) {
    if (fd >= 0) {
      EXPECT_TRUE(closed_by_server(fd, 3000ms));
    }
  }
  // Half-open: a valid hello header, then nothing.
  const int stalled = raw_connection(server.port);
  const std::string hello = comm::store::encode_request(comm::store::kHello, comm::store::kHelloKey, "the-job-token");
  send_all(stalled, hello.substr(0, 12));
  EXPECT_TRUE(closed_by_server(stalled, 3000ms));
  ::close(stalled);
  for (const int fd : silent) {
    if (fd >= 0) ::close(fd);
  }
  EXPECT_TRUE(eventually([&] { return server.counters().open == 0; }));
  EXPECT_LE(open_descriptors(), descriptors + 2);
  EXPECT_GE(server.counters().timed_out, 17);
  server.expect_clients_work("after the silent ones");
}

// The server drops idle connections; the job's clients reconnect by themselves.
TEST(Store, ClientsReconnectAfterTheServerDropsThemIdle) {
  Server server({.idle_timeout = 200ms});
  TcpStore client("127.0.0.1", server.port, false, 2000ms, "the-job-token");
  client.set("a", {'1'});
  std::this_thread::sleep_for(600ms);
  EXPECT_EQ(client.get("a"), std::vector<char>{'1'});
  client.set("b", {'2'});
  EXPECT_EQ(client.get("b"), std::vector<char>{'2'});
}

// Rank 0 dies while another rank waits in the store (a duplicate() meeting, a late rendezvous):
// the waiting client fails promptly, naming the store, instead of waiting out its timeout; so
// do its later requests.
TEST(Store, AClientFailsPromptlyWhenTheServerDies) {
  auto server = std::make_unique<Server>();
  TcpStore client("127.0.0.1", server->port, false, 30000ms, "the-job-token");
  client.set("here", {'1'});
  std::string message;
  const auto start = std::chrono::steady_clock::now();
  std::thread waiter([&] {
    try {
      client.wait({"never-set"});
    } catch (const Error& error) {
      message = error.what();
    }
  });
  std::this_thread::sleep_for(200ms);
  server.reset();  // the server goes, as with its process: every connection closes
  waiter.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 10.0) << "the client waited for its timeout: " << message;
  EXPECT_NE(message.find("tcp store at 127.0.0.1:"), std::string::npos) << message;
  EXPECT_GRADSYNC_ERROR(client.get("here"), "tcp store at 127.0.0.1:");
}

// A rank waiting at the rendezvous for a rank that will never come, when the store itself goes:
// it fails at once naming the store, not after the rendezvous timeout.
TEST(Store, ARendezvousFailsAtOnceWhenTheStoreGoes) {
  const testing::ScopedVariable token("GRADSYNC_STORE_TOKEN", "a-test-token");
  auto server = std::make_unique<Server>(comm::TcpStoreServerOptions{.token = comm::store_token("", 0, 2)});
  std::string message;
  const auto start = std::chrono::steady_clock::now();
  std::thread rank1([&, port = server->port] {
    try {
      comm::gloo_tcp_store("127.0.0.1", port, 1, 2, {.timeout = 30000ms});
    } catch (const Error& error) {
      message = error.what();
    }
  });
  std::this_thread::sleep_for(300ms);
  server.reset();
  rank1.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 10.0) << "it waited for the rendezvous timeout: " << message;
  EXPECT_NE(message.find("is gone"), std::string::npos) << message;
}

// The rendezvous timeout bounds the whole rendezvous. Gloo's full mesh waits for each peer's key
// in turn: with rank 1 arriving late and rank 2 never, a timeout per wait let rank 0 wait for
// rank 1 and then a whole timeout more for rank 2 (N - 1 timeouts for N ranks: 25 s for a 5 s
// bound was seen across replica groups). Now it ends one timeout after it began.
TEST(Store, TheRendezvousTimeoutBoundsTheWholeRendezvous) {
  Server server;
  std::vector<double> seconds(2, 0.0);
  std::vector<std::string> messages(2);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      if (rank == 1) std::this_thread::sleep_for(900ms);  // late, but within rank 0's bound
      const auto start = std::chrono::steady_clock::now();
      try {
        auto store = std::make_shared<TcpStore>("127.0.0.1", server.port, false, 5000ms, "the-job-token");
        comm::gloo_prefixed_communicator(store, "late", "the test store", rank, 3, {.rendezvous_timeout = 1000ms});
      } catch (const Error& error) {
        messages[static_cast<std::size_t>(rank)] = error.what();
      }
      seconds[static_cast<std::size_t>(rank)] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  }
  for (std::thread& rank : ranks) rank.join();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(messages[static_cast<std::size_t>(rank)].find("rank(s) 2 (not arrived yet)"), std::string::npos)
        << messages[static_cast<std::size_t>(rank)];
    EXPECT_LT(seconds[static_cast<std::size_t>(rank)], 1.6) << "rank " << rank << ": " << messages[static_cast<std::size_t>(rank)];
  }
}

// A real rendezvous of three ranks while a stranger floods the port with garbage.
TEST(Store, ARendezvousCompletesDuringAFlood) {
  const int port = 20000 + static_cast<int>(::getpid() % 20000);
  std::atomic<bool> done{false};
  std::thread flood([&] {
    std::mt19937 random(5);
    while (!done) {
      const int fd = raw_connection(port);
      if (fd >= 0) {
        std::string garbage(512, '\0');
        for (char& c : garbage) c = static_cast<char>(random());
        send_all(fd, garbage);
        ::close(fd);
      }
      std::this_thread::sleep_for(1ms);
    }
  });
  std::vector<std::thread> ranks;
  std::atomic<int> sums{0};
  for (int rank = 0; rank < 3; ++rank) {
    ranks.emplace_back([&, rank] {
      auto comm = comm::gloo_tcp_store("127.0.0.1", port, rank, 3, {.timeout = 20000ms});
      Tensor t = Tensor::from_vector(std::vector<float>{1.0f}, {1});
      comm->allreduce(t, comm::ReduceOp::sum);
      if (t.to_double_vector()[0] == 3.0) ++sums;
    });
  }
  for (std::thread& rank : ranks) rank.join();
  done = true;
  flood.join();
  EXPECT_EQ(sums.load(), 3);
}

// The parser on random bytes and on mutations of valid requests: it never reads past its
// buffer, never accepts what is over the caps, and round-trips what clients send. (The same
// parser runs under libFuzzer in the checks suite: tests/fuzz/store_parser_fuzz.cpp.)
TEST(StoreProtocol, RandomAndMutatedRequests) {
  using comm::store::Parsed;
  std::mt19937 random(1234);
  const std::vector<std::string> seeds{
      comm::store::encode_request(comm::store::kHello, comm::store::kHelloKey, "token"),
      comm::store::encode_request(comm::store::kSet, "rank/3", std::string(300, 'x')),
      comm::store::encode_request(comm::store::kGet, "dup0/1"),
      comm::store::encode_request(comm::store::kDelete, "ft/q3/reduce/p0/0")};
  for (const std::string& seed : seeds) {
    const Parsed parsed = comm::store::parse_request(seed, /*authenticated=*/true);
    ASSERT_EQ(parsed.status, Parsed::complete);
    EXPECT_EQ(parsed.consumed, seed.size());
    EXPECT_EQ(comm::store::encode_request(parsed.request.op, parsed.request.key, parsed.request.value), seed);
  }
  const auto deadline = std::chrono::steady_clock::now() + 1500ms;
  std::int64_t runs = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    std::string input;
    if (random() % 2) {
      input.resize(random() % 64);
      for (char& c : input) c = static_cast<char>(random());
    } else {
      input = seeds[random() % seeds.size()];
      for (int flips = 1 + static_cast<int>(random() % 4); flips > 0; --flips) {
        input[random() % input.size()] = static_cast<char>(random());
      }
      input.resize(random() % (input.size() + 1));
    }
    for (const bool authenticated : {false, true}) {
      const Parsed parsed = comm::store::parse_request(input, authenticated);
      if (parsed.status == Parsed::complete) {
        ASSERT_LE(parsed.consumed, input.size());
        ASSERT_LE(parsed.request.key.size(), comm::store::kMaxKeyBytes);
        ASSERT_LE(parsed.request.value.size(), comm::store::kMaxValueBytes);
        ASSERT_TRUE(authenticated || parsed.request.op == comm::store::kHello);
      } else if (parsed.status == Parsed::malformed) {
        ASSERT_FALSE(parsed.error.empty());
      }
    }
    ++runs;
  }
  EXPECT_GT(runs, 1000);
}

// ---- The client of PyTorch's TCPStore against servers that answer wrong ----------------------
// (Against torch's real servers and torchrun: tests/multirank/torch_store.sh.)

// A one-connection server on loopback that plays `script` with the client: it reads what the
// client sends and answers with whatever `script` returns for the bytes received so far.
class ScriptedServer {
 public:
  // `reply(request_bytes_so_far)`: the bytes to send now ("" to keep reading), or nullopt to
  // close the connection.
  using Script = std::function<std::optional<std::string>(const std::string&)>;
  explicit ScriptedServer(Script script) : script_(std::move(script)) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    ::inet_pton(AF_INET, "127.0.0.1", &address.sin_addr);
    ::bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof address);
    ::listen(listener_, 4);
    socklen_t length = sizeof address;
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length);
    port = ntohs(address.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~ScriptedServer() {
    stop_ = true;
    ::shutdown(listener_, SHUT_RDWR);
    ::close(listener_);
    thread_.join();
  }
  int port = 0;

 private:
  void serve() {
    const int fd = ::accept(listener_, nullptr, nullptr);
    if (fd < 0) return;
    timeval tick{0, 20000};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tick, sizeof tick);
    std::string received;
    while (!stop_) {
      char buffer[4096];
      const ssize_t got = ::recv(fd, buffer, sizeof buffer, 0);
      if (got == 0) break;
      if (got > 0) received.append(buffer, static_cast<std::size_t>(got));
      const std::optional<std::string> reply = script_(received);
      if (!reply) break;
      send_all(fd, *reply);
    }
    ::close(fd);
  }
  Script script_;
  int listener_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The validate (5 bytes) and ping (5 bytes) every connection opens with; the ping's nonce is
// its last 4 bytes, which a real server echoes.
constexpr std::size_t kOpening = 10;
std::string echo_ping(const std::string& received) { return received.substr(6, 4); }

TEST(TorchStoreClient, HostileRepliesAreErrorsNamingTheStore) {
  const auto limit = 1500ms;
  const std::vector<std::pair<std::string, ScriptedServer::Script>> cases = {
      {"closes at once", [](const std::string&) -> std::optional<std::string> { return std::nullopt; }},
      {"a changed nonce",
       [](const std::string& in) -> std::optional<std::string> {
         return in.size() >= kOpening ? std::optional<std::string>("\x01\x02\x03\x04") : "";
       }},
      {"a short ping reply then silence",
       [sent = false](const std::string& in) mutable -> std::optional<std::string> {
         if (in.size() < kOpening || sent) return "";
         sent = true;
         return echo_ping(in).substr(0, 2);
       }},
  };
  for (const auto& [what, script] : cases) {
    ScriptedServer server(script);
    const auto start = std::chrono::steady_clock::now();
    SCOPED_TRACE(what);
    EXPECT_GRADSYNC_ERROR(comm::TorchStore("127.0.0.1", server.port, limit, "/p/"), "torch store at 127.0.0.1:");
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << what;
  }

  // After a good opening, replies to get that lie about their length, stall, or are not the
  // protocol's: each an error naming the store and the request.
  const auto after_opening = [](std::function<std::optional<std::string>(const std::string&)> then) {
    // `then` sees each request's bytes once (the client writes a request in one piece).
    return [then, seen = std::size_t{0}](const std::string& in) mutable -> std::optional<std::string> {
      if (seen == 0) {
        if (in.size() < kOpening) return "";
        seen = kOpening;
        return echo_ping(in);
      }
      const std::string fresh = in.substr(seen);
      seen = in.size();
      return then(fresh);
    };
  };
  const std::vector<std::tuple<std::string, ScriptedServer::Script, std::string>> requests = {
      {"a wait answered 7", after_opening([](const std::string& in) -> std::optional<std::string> {
         return in.empty() ? "" : std::string("\x07");
       }),
       "not the protocol's"},
      {"a value of 2^62 bytes", after_opening([](const std::string& in) -> std::optional<std::string> {
         if (in.empty()) return "";
         if (in[0] == 6) return std::string(1, '\0');  // the wait: the key is there
         std::string huge(8, '\0');
         huge[7] = 0x40;
         return huge;
       }),
       "claims"},
      {"a value cut short", after_opening([](const std::string& in) -> std::optional<std::string> {
         if (in.empty()) return "";
         if (in[0] == 6) return std::string(1, '\0');
         return std::optional<std::string>();  // closes before any length
       }),
       "no complete reply"},
  };
  for (const auto& [what, script, fragment] : requests) {
    ScriptedServer server(script);
    comm::TorchStore client("127.0.0.1", server.port, limit, "/p/");
    const auto start = std::chrono::steady_clock::now();
    SCOPED_TRACE(what);
    EXPECT_GRADSYNC_ERROR(client.get("key"), "torch store at 127.0.0.1:", fragment);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << what;
  }
}

// A server that trickles its reply, a byte every 1.5 s, cannot hold a rank past its timeout (the
// timeout bounds the whole reply, not each recv: a rank waited forever under the old client);
// one that claims a value of the cap (1 GiB) and sends a little costs the client what it sent.
TEST(TorchStoreClient, ATricklingOrLyingServerCannotHoldOrFillARank) {
  const auto limit = 2000ms;
  {
    ScriptedServer server([sent = std::size_t{0}, last = std::chrono::steady_clock::time_point{}](
                              const std::string& in) mutable -> std::optional<std::string> {
      if (in.size() < kOpening || sent == 4) return "";
      const auto now = std::chrono::steady_clock::now();
      if (sent > 0 && now - last < 1500ms) return "";
      last = now;
      return echo_ping(in).substr(sent++, 1);  // the ping's echo, one byte at a time
    });
    const auto start = std::chrono::steady_clock::now();
    EXPECT_GRADSYNC_ERROR(comm::TorchStore("127.0.0.1", server.port, limit, "/p/"), "no complete reply within 2000 ms");
    EXPECT_LT(std::chrono::steady_clock::now() - start, 3500ms);
  }
  {
    ScriptedServer server([seen = std::size_t{0}](const std::string& in) mutable -> std::optional<std::string> {
      if (seen == 0) {
        if (in.size() < kOpening) return "";
        seen = kOpening;
        return echo_ping(in);
      }
      if (in.size() == seen) return "";
      const char op = in[seen];
      seen = in.size();
      if (op == 6) return std::string(1, '\0');  // the wait: the key is there
      std::string reply(8, '\0');                // the get: a length of 1 GiB, then 4 KiB, then silence
      reply[3] = 0x40;
      return reply + std::string(4096, 'v');
    });
    comm::TorchStore client("127.0.0.1", server.port, limit, "/p/");
    const std::int64_t before = resident_kib();
    const auto start = std::chrono::steady_clock::now();
    EXPECT_GRADSYNC_ERROR(client.get("key"), "4096 of 1073741824 bytes of the value within 2000 ms");
    EXPECT_LT(std::chrono::steady_clock::now() - start, 3500ms);
    EXPECT_LT(resident_kib() - before, 64 * 1024);  // not the 1 GiB claimed
  }
}

// Random replies after the opening: every request ends in a value or an error, within the
// timeout, and never in a crash.
TEST(TorchStoreClient, RandomRepliesNeverCrashOrHang) {
  std::mt19937 random(1234);
  for (int round = 0; round < 40; ++round) {
    const std::uint32_t seed = random();
    ScriptedServer server([seed, opened = false, replied = std::size_t{0}](const std::string& in) mutable
                          -> std::optional<std::string> {
      if (!opened) {
        if (in.size() < kOpening) return "";
        opened = true;
        return echo_ping(in);
      }
      if (in.size() <= kOpening + replied) return "";
      replied = in.size() - kOpening;
      std::mt19937 bytes(seed + static_cast<std::uint32_t>(replied));
      if (bytes() % 5 == 0) return std::nullopt;  // hang up
      std::string reply(bytes() % 24, '\0');
      for (char& c : reply) c = static_cast<char>(bytes() % 4 == 0 ? bytes() : bytes() % 3);  // mostly small
      return reply;
    });
    comm::TorchStore client("127.0.0.1", server.port, 300ms, "/p/");
    const auto start = std::chrono::steady_clock::now();
    for (int request = 0; request < 4; ++request) {
      try {
        if (request % 2 == 0) {
          (void)client.get("k");
        } else {
          client.wait({"a", "b"}, 100ms);
        }
      } catch (const Error& error) {
        EXPECT_NE(std::string(error.what()).find("torch store at"), std::string::npos) << error.what();
        break;  // the connection is in an unknown state after an error: a real caller gives up too
      }
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << "round " << round;
  }
}

TEST(StoreProtocol, TokensCompareAlike) {
  EXPECT_TRUE(comm::store::same_token("abc", "abc"));
  EXPECT_FALSE(comm::store::same_token("abc", "abd"));
  EXPECT_FALSE(comm::store::same_token("abc", "abcd"));
  EXPECT_FALSE(comm::store::same_token("", "a"));
  EXPECT_EQ(comm::store_token("h", 1, 2), comm::store_token("h", 1, 2));
  EXPECT_NE(comm::store_token("h", 1, 2), comm::store_token("h", 1, 3));
  EXPECT_EQ(comm::store_token("h", 1, 2).size(), 32u);
}

}  // namespace
}  // namespace gradsync
