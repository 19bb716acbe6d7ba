// The Gloo backend: Gloo's collectives over its TCP transport, with our reduce functions
// (every dtype, f16/bf16 combined in f32), and every call bounded by the timeout.
#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/transport/tcp/device.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "backend.h"
#include "gradsync/comm/gloo.h"
#include "reduce_functions.h"
#include "tcp_store.h"

namespace gradsync::comm {

namespace {

// Point-to-point messages use their own slot range, far from the collectives' tags; so do the
// rings we build from point-to-point buffers.
constexpr std::uint64_t kP2PSlotBase = std::uint64_t{1} << 40;
constexpr std::uint64_t kRingSlotBase = std::uint64_t{1} << 48;

class GlooBackend final : public Backend {
 public:
  explicit GlooBackend(std::shared_ptr<gloo::Context> context, std::shared_ptr<void> keepalive = nullptr)
      : context_(std::move(context)), keepalive_(std::move(keepalive)) {}

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
      GRADSYNC_CHECK(arriving->waitRecv(timeout_), "gloo reduce_scatter: step ", step, " receive from rank ", left,
                     " did not complete within ", timeout_.count(), " ms");
      std::byte* target = partial.data() + recv_chunk * chunk;
      reduce(target, target, incoming.data(), static_cast<std::size_t>(count));
      GRADSYNC_CHECK(whole->waitSend(timeout_), "gloo reduce_scatter: step ", step, " send to rank ", right,
                     " did not complete within ", timeout_.count(), " ms");
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
    GRADSYNC_CHECK(buffer->waitSend(timeout_), "gloo send to rank ", peer, " did not complete within ",
                   timeout_.count(), " ms");
  }

  void recv(void* data, std::size_t nbytes, int peer, int tag) override {
    auto buffer = context_->createUnboundBuffer(data, nbytes);
    buffer->recv(peer, kP2PSlotBase + static_cast<std::uint64_t>(tag));
    GRADSYNC_CHECK(buffer->waitRecv(timeout_), "gloo recv from rank ", peer, " did not complete within ",
                   timeout_.count(), " ms");
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

  std::shared_ptr<gloo::Context> context_;
  std::shared_ptr<void> keepalive_;  // rank 0 of a TCP rendezvous: the store server
  std::chrono::milliseconds timeout_{300000};
  std::uint32_t tag_ = 0;
  std::uint32_t ring_operations_ = 0;
};

// The address this rank listens on: GRADSYNC_GLOO_HOST (an address or host name other ranks
// can reach, for ranks on several machines), else loopback.
std::shared_ptr<gloo::transport::Device> loopback_device() {
  gloo::transport::tcp::attr attributes;
  const char* host = std::getenv("GRADSYNC_GLOO_HOST");
  attributes.hostname = host != nullptr ? host : "127.0.0.1";
  return gloo::transport::tcp::CreateDevice(attributes);
}

std::shared_ptr<gloo::Context> connect(gloo::rendezvous::Store& store, int rank, int size,
                                       std::chrono::milliseconds timeout,
                                       std::shared_ptr<gloo::transport::Device> device) {
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

void run_gloo_thread_group(int size, const std::function<void(Communicator&)>& body, const CommOptions& options) {
  GRADSYNC_CHECK(size >= 1, "run_gloo_thread_group: size must be positive, got ", size);
  gloo::rendezvous::HashStore store;
  auto device = loopback_device();
  const auto timeout = resolve_timeout(options.timeout);
  std::mutex errors_mutex;
  std::exception_ptr first_error;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      ThreadRankScope label(rank);
      try {
        auto communicator = make_cpu_communicator(
            std::make_unique<GlooBackend>(connect(store, rank, size, timeout, device)), options);
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
  gloo::rendezvous::FileStore store(folder.string());
  const auto timeout = resolve_timeout(options.timeout);
  return make_cpu_communicator(std::make_unique<GlooBackend>(connect(store, rank, size, timeout, loopback_device())),
                               options);
}

std::unique_ptr<Communicator> gloo_tcp_store(const std::string& host, int port, int rank, int size,
                                             const CommOptions& options) {
  GRADSYNC_CHECK(rank >= 0 && rank < size, "gloo_tcp_store: rank ", rank, " is outside a world of ", size);
  const auto timeout = resolve_timeout(options.timeout);
  if (size == 1) {  // nobody to meet: no server, no port
    gloo::rendezvous::HashStore store;
    return make_cpu_communicator(std::make_unique<GlooBackend>(connect(store, 0, 1, timeout, loopback_device())), options);
  }
  TcpStore store(host, port, /*serve=*/rank == 0, timeout);
  auto backend = std::make_unique<GlooBackend>(connect(store, rank, size, timeout, loopback_device()), store.server());
  // Everyone has read what it needed from the store once all ranks are connected; the
  // barrier lets rank 0 know that before its server may go away.
  backend->set_timeout(timeout);
  backend->barrier();
  return make_cpu_communicator(std::move(backend), options);
}

}  // namespace gradsync::comm
