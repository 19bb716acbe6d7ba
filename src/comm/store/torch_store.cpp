// A client of PyTorch's TCPStore (torch_store.h).
#include "torch_store.h"

#include <unistd.h>

#include <cstring>
#include <thread>

#include "gradsync/core/error.h"
#include "socket_io.h"

namespace gradsync::comm {

namespace {

using Clock = std::chrono::steady_clock;

enum Query : std::uint8_t {
  kValidate = 0,
  kSet = 1,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kWait = 6,
  kCancelWait = 12,
  kPing = 13,
};
constexpr std::uint32_t kMagic = 0x3C85F7CE;
constexpr std::uint8_t kStopWaiting = 0, kWaitCanceled = 1;  // WAIT's replies
constexpr std::uint8_t kReady = 0, kNotReady = 1;            // CHECK's

// A request under construction: little-endian numbers, length-prefixed strings.
class Request {
 public:
  explicit Request(Query query) { bytes_.push_back(static_cast<char>(query)); }
  template <typename Number>
  Request& number(Number value) {
    char raw[sizeof(Number)];
    std::memcpy(raw, &value, sizeof raw);  // x86-64 and arm64: little-endian, as torch sends
    bytes_.append(raw, sizeof raw);
    return *this;
  }
  Request& text(std::string_view value) {
    number<std::uint64_t>(value.size());
    bytes_.append(value);
    return *this;
  }
  Request& keys(const std::vector<std::string>& keys, const std::string& prefix) {
    number<std::uint64_t>(keys.size());
    for (const std::string& key : keys) text(prefix + key);
    return *this;
  }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

std::string joined(const std::vector<std::string>& keys) {
  std::string text;
  for (const std::string& key : keys) text += (text.empty() ? "'" : ", '") + key + "'";
  return text;
}

}  // namespace

TorchStore::TorchStore(const std::string& host, int port, std::chrono::milliseconds timeout, std::string prefix)
    : endpoint_(host + ":" + std::to_string(port)), prefix_(std::move(prefix)), timeout_(timeout) {
  GRADSYNC_CHECK(port > 0 && port < 65536, "torch store: MASTER_PORT ", port, " is not a TCP port");
  const auto deadline = Clock::now() + timeout;
  std::string error = "no attempt";
  bool refused = false;
  while ((socket_ = connect_tcp(host, port, timeout, error, refused)) < 0) {
    GRADSYNC_CHECK(Clock::now() < deadline, "torch store: cannot reach the PyTorch TCPStore at ", endpoint_,
                   " (MASTER_ADDR:MASTER_PORT) within ", timeout.count(), " ms: ", error);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // VALIDATE with the magic number, then a PING whose nonce must come back: a server that does
  // not echo it is not a TCPStore (another service on the port, or a gradsync store).
  const auto nonce = static_cast<std::uint32_t>(::getpid()) ^ 0x5a5a1234u;
  send(Request(kValidate).number(kMagic).bytes() + Request(kPing).number(nonce).bytes(), "validate");
  std::uint32_t echo = 0;
  receive(&echo, sizeof echo, "ping");
  if (echo != nonce) fail("the ping's nonce came back changed: is this a PyTorch TCPStore?");
}

TorchStore::~TorchStore() {
  if (socket_ >= 0) ::close(socket_);
}

void TorchStore::fail(const std::string& why) {
  detail::throw_error("torch store at ", endpoint_, ": ", why);
}

void TorchStore::send(const std::string& request, const char* what) {
  if (!write_exact(socket_, request.data(), request.size())) {
    throw StoreGone("torch store at " + endpoint_ + ": " + what +
                    ": the connection is closed (the store's agent has ended or died)");
  }
}

void TorchStore::receive(void* data, std::size_t bytes, const char* what, Clock::time_point deadline) {
  if (deadline == Clock::time_point::min()) deadline = Clock::now() + timeout_;
  if (!read_exact(socket_, data, bytes, deadline)) {
    throw StoreGone("torch store at " + endpoint_ + ": " + what + ": no complete reply within " +
                    std::to_string(timeout_.count()) + " ms (the connection closed, or the store stopped answering)");
  }
}

void TorchStore::set(const std::string& key, const std::vector<char>& data) {
  std::lock_guard<std::mutex> lock(mutex_);
  send(Request(kSet).text(prefix_ + key).text(std::string_view(data.data(), data.size())).bytes(), "set");
}

void TorchStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  send(Request(kWait).keys(keys, prefix_).bytes(), "wait");
  std::uint8_t reply = 0;
  if (readable_within(socket_, timeout)) {
    receive(&reply, 1, "wait");
    if (reply != kStopWaiting) fail("wait for " + joined(keys) + ": reply " + std::to_string(reply) + " is not the protocol's");
    return;
  }
  // Give up: cancel, then read what is owed. If the keys arrived meanwhile, the server answered
  // STOP_WAITING before it saw the cancel, and the wait succeeded after all.
  send(Request(kCancelWait).bytes(), "cancel wait");
  receive(&reply, 1, "cancel wait");
  bool arrived = false;
  if (reply == kStopWaiting) {
    arrived = true;
    receive(&reply, 1, "cancel wait");
  }
  if (reply != kWaitCanceled) fail("cancel wait: reply " + std::to_string(reply) + " is not the protocol's");
  if (!arrived) {
    detail::throw_error("torch store at ", endpoint_, ": ", joined(keys), " did not appear within ", timeout.count(),
                        " ms (has every rank started?)");
  }
}

std::vector<char> TorchStore::get(const std::string& key) {
  wait({key}, timeout_);
  std::lock_guard<std::mutex> lock(mutex_);
  send(Request(kGet).text(prefix_ + key).bytes(), "get");
  const auto deadline = Clock::now() + timeout_;  // the whole reply, length and value
  std::uint64_t length = 0;
  receive(&length, sizeof length, "get", deadline);
  if (length > kMaxValueBytes) {
    fail("get('" + key + "'): the reply claims " + std::to_string(length) + " bytes, over the " +
         std::to_string(kMaxValueBytes) + " a value may have: is this a PyTorch TCPStore?");
  }
  std::vector<char> value;  // grows as the bytes arrive: a claimed length allocates nothing
  if (!read_value(socket_, value, static_cast<std::size_t>(length), deadline)) {
    throw StoreGone("torch store at " + endpoint_ + ": get('" + key + "'): " + std::to_string(value.size()) + " of " +
                    std::to_string(length) + " bytes of the value within " + std::to_string(timeout_.count()) +
                    " ms (the connection closed, or the store stopped answering)");
  }
  return value;
}

std::int64_t TorchStore::add(const std::string& key, std::int64_t delta) {
  std::lock_guard<std::mutex> lock(mutex_);
  send(Request(kAdd).text(prefix_ + key).number(delta).bytes(), "add");
  std::int64_t sum = 0;
  receive(&sum, sizeof sum, "add");
  return sum;
}

bool TorchStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  send(Request(kCheck).keys(keys, prefix_).bytes(), "check");
  std::uint8_t reply = 0;
  receive(&reply, 1, "check");
  if (reply != kReady && reply != kNotReady) fail("check: reply " + std::to_string(reply) + " is not the protocol's");
  return reply == kReady;
}

}  // namespace gradsync::comm
