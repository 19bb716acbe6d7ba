// The Gloo backend: Gloo's collectives over its TCP transport, with our reduce functions
// (every dtype, f16/bf16 combined in f32), and every call bounded by the timeout.
#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/unbound_buffer.h>

#include <cstring>
#include <future>
#include <mutex>
#include <optional>
#include <thread>

#include "comm/algorithms/ring_allreduce.h"
#include "comm/algorithms/ring_reduce_scatter.h"
#include "comm/cpu/backend.h"
#include "peers.h"
#include "rendezvous.h"
#include "comm/algorithms/reduce_functions.h"

namespace gradsync::comm {

namespace {

// Point-to-point messages use their own slot range, far from the collectives' tags; so do the
// rings we build from point-to-point buffers.
constexpr std::uint64_t kP2PSlotBase = std::uint64_t{1} << 40;
constexpr std::uint64_t kRingSlotBase = std::uint64_t{1} << 48;

class GlooBackend final : public Backend {
 public:
  GlooBackend(std::shared_ptr<gloo::Context> context, Rendezvous rendezvous, std::string prefix)
      : context_(std::move(context)), rendezvous_(std::move(rendezvous)), prefix_(std::move(prefix)) {
    try {
      peers_.learn(*context_, *this);
    } catch (const std::exception& error) {
      // Still connecting (the directory is what names peers later): a peer that died now is
      // named as connect_full_mesh names one, by the ranks that said nothing.
      // Its pairs closed first, so that a peer still exchanging with it fails now and asks too.
      const int me = context_->rank, count = context_->size;
      context_.reset();
      const std::optional<std::vector<bool>> said = connect_failure_census(rendezvous_.store, prefix_, rendezvous_, me, count);
      detail::throw_error("gloo rendezvous of rank ", me, " of ", count, " failed as the ranks exchanged their ",
                          "addresses: ", error.what(), silent_ranks(said, me, count, rendezvous_.where));
    }
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
    if (rendezvous_.interruptible) {  // CommOptions::interruptible: our ring, whose waits abort()
      algorithms::ring_allreduce(begin_algorithm(), static_cast<std::byte*>(data), count, dtype, op);
      return;
    }
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

  // Gloo has no option-style reduce-scatter: the ring of src/comm/algorithms/, over Gloo's
  // point-to-point buffers in their own slot range.
  void reduce_scatter(const void* input, void* output, std::int64_t count, DType dtype, ReduceOp op) override {
    algorithms::ring_reduce_scatter(begin_algorithm(), static_cast<const std::byte*>(input),
                                    static_cast<std::byte*>(output), count, dtype, op);
  }

  algorithms::Transport& begin_algorithm() override {
    transport_.next_operation();
    return transport_;
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
    await(*buffer, /*receive=*/false, "gloo send to " + rank_name(peer));
  }

  void recv(void* data, std::size_t nbytes, int peer, int tag) override {
    auto buffer = context_->createUnboundBuffer(data, nbytes);
    buffer->recv(peer, kP2PSlotBase + static_cast<std::uint64_t>(tag));
    await(*buffer, /*receive=*/true, "gloo recv from " + rank_name(peer));
  }

  // A new context over the same store under a fresh prefix: every rank duplicates in the same
  // sequence, so the n-th duplicate of this context meets under the same name everywhere.
  std::unique_ptr<Backend> make_duplicate() override {
    const std::string prefix = prefix_ + "dup" + std::to_string(duplicates_++) + "/";
    auto context = connect_full_mesh(std::make_shared<OwningPrefixStore>(prefix, rendezvous_.store), rendezvous_, rank(), size());
    auto child = std::make_unique<GlooBackend>(std::move(context), rendezvous_, prefix);
    child->set_timeout(timeout_);
    return child;
  }

  // The group's own context, over the same store under a name that the n-th split of this
  // context and the color make: members meet at their places (collective.h's table); every rank
  // counts the split, member or not, so the next one meets under the same name everywhere.
  std::unique_ptr<Backend> make_split(int color, int, const SplitPlace& place) override {
    const std::string prefix = prefix_ + "split" + std::to_string(splits_++) + "." + std::to_string(color) + "/";
    if (color < 0) return nullptr;
    auto context =
        connect_full_mesh(std::make_shared<OwningPrefixStore>(prefix, rendezvous_.store), rendezvous_, place.rank, place.size);
    auto child = std::make_unique<GlooBackend>(std::move(context), rendezvous_, prefix);
    child->set_timeout(timeout_);
    return child;
  }

  // Our own point-to-point waits (send, recv, the reduce-scatter ring, the allreduce ring of an
  // interruptible communicator) are woken at once. Gloo's own algorithms (allreduce, broadcast, allgather) cannot be interrupted
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

  // Explaining a failure with what the other ranks said about theirs. Gloo names neither the
  // rank that died when several connections closed, nor the rank it waited for when it timed
  // out; each rank that fails records its failure in the rendezvous store (before it exits and
  // its connections close) and reads the others':
  //  * a lost connection: of several peers whose connections are closed, the ones that did not
  //    record "left after failing" are the ones that died;
  //  * a timeout: the ranks waiting in one collective time out at about the same moment, and the
  //    rank they wait for (stopped, or stuck elsewhere) does not: after a moment (a quarter of
  //    the timeout, at most 5 s) the peers that recorded no timeout are named.
  // Best effort, and bounded whatever the store does (store_markers).
  std::string explain(const std::string& message) const override {
    const bool timed_out = message.find("Timed out") != std::string::npos;
    const bool lost = PeerDirectory::lost_connection(message);
    if (!timed_out && !lost) return peers_.explain(message, *this);
    const std::string kind = timed_out ? "gradsync/timed-out/" : "gradsync/left-after-failing/";
    std::vector<std::string> keys;
    for (int r = 0; r < size(); ++r) keys.push_back(kind + std::to_string(world_rank(r)));
    const auto grace = timed_out ? std::min<std::chrono::milliseconds>(std::chrono::milliseconds(5000), timeout_ / 4)
                                 : std::chrono::milliseconds(0);
    const std::optional<std::vector<bool>> recorded =
        store_markers(rendezvous_.store, keys, rank(), grace, std::chrono::seconds(2));
    if (lost) {
      return peers_.explain(message, *this, recorded ? &*recorded : nullptr);
    }
    const std::string explained = peers_.explain(message, *this);
    // No store to ask: whoever served it is gone, the likeliest cause of the timeout too.
    if (!recorded) return explained + silent_ranks(std::nullopt, rank(), size(), rendezvous_.where);
    std::vector<int> silent;
    for (int peer = 0; peer < size(); ++peer) {
      if (peer != rank() && !(*recorded)[static_cast<std::size_t>(peer)]) silent.push_back(peer);
    }
    if (silent.empty()) return explained + " (every other rank timed out too)";
    std::string ranks;
    for (std::size_t i = 0; i < silent.size() && i < 8; ++i) ranks += (i > 0 ? ", " : "") + rank_name(silent[i]);
    if (silent.size() > 8) ranks += " and " + std::to_string(silent.size() - 8) + " more";
    return explained + " (" + ranks + " did not time out: stopped, stuck elsewhere or slower than the others, the " +
           "likeliest cause)";
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
    } catch (const std::exception& error) {
      {
        std::lock_guard<std::mutex> lock(abort_mutex_);
        waiting_ = nullptr;
      }
      // Gloo's own words ("Timed out waiting 15000ms for recv operation to complete") do not
      // say whom it waited for; `what` does. (A plain exception: the engine's error that wraps
      // it says the rank once.)
      throw std::runtime_error(what + ": " + error.what());
    }
    std::lock_guard<std::mutex> lock(abort_mutex_);
    waiting_ = nullptr;
    if (done) return;
    if (aborted_) detail::throw_error(what, " was aborted: the communicator broke while it was in flight");
    detail::throw_error(what, " did not complete within ", timeout_.count(), " ms");
  }

  std::shared_ptr<gloo::Context> context_;
  Rendezvous rendezvous_;
  std::string prefix_;
  int duplicates_ = 0;
  int splits_ = 0;
  std::mutex abort_mutex_;  // guards aborted_ and the buffer being waited for
  bool aborted_ = false;
  gloo::transport::UnboundBuffer* waiting_ = nullptr;
  bool waiting_receive_ = false;
  PeerDirectory peers_;  // which rank an address in Gloo's errors is
  std::chrono::milliseconds timeout_{300000};
  std::uint32_t tag_ = 0;

  // The algorithms' messages: an unbound buffer each, waited for by await() (so abort() wakes
  // it). Each algorithm call takes a fresh range of slots, far from the collectives' tags and
  // from send/recv's, and a message's slot is the range's start plus the algorithm's tag.
  class Message final : public algorithms::PendingMessage {
   public:
    Message(GlooBackend& backend, std::unique_ptr<gloo::transport::UnboundBuffer> buffer, bool receive)
        : backend_(backend), buffer_(std::move(buffer)), receive_(receive) {}
    void wait(const char* what) override { backend_.await(*buffer_, receive_, what); }

   private:
    GlooBackend& backend_;
    std::unique_ptr<gloo::transport::UnboundBuffer> buffer_;
    bool receive_;
  };
  class PointToPoint final : public algorithms::Transport {
   public:
    explicit PointToPoint(GlooBackend& backend) : backend_(backend) {}
    void next_operation() { slots_ = kRingSlotBase + (static_cast<std::uint64_t>(operations_++) << 16); }
    int rank() const override { return backend_.rank(); }
    int size() const override { return backend_.size(); }
    algorithms::Message send(const std::byte* data, std::size_t bytes, int peer, int tag) override {
      auto buffer = backend_.context_->createUnboundBuffer(const_cast<std::byte*>(data), bytes);
      buffer->send(peer, slots_ + static_cast<std::uint64_t>(tag));
      return std::make_unique<Message>(backend_, std::move(buffer), /*receive=*/false);
    }
    algorithms::Message receive(std::byte* data, std::size_t bytes, int peer, int tag) override {
      auto buffer = backend_.context_->createUnboundBuffer(data, bytes);
      buffer->recv(peer, slots_ + static_cast<std::uint64_t>(tag));
      return std::make_unique<Message>(backend_, std::move(buffer), /*receive=*/true);
    }

   private:
    GlooBackend& backend_;
    std::uint64_t slots_ = kRingSlotBase;
    std::uint32_t operations_ = 0;
  };
  PointToPoint transport_{*this};
};

}  // namespace

std::unique_ptr<Backend> make_gloo_backend(std::shared_ptr<gloo::Context> context, Rendezvous rendezvous,
                                           std::string prefix) {
  return std::make_unique<GlooBackend>(std::move(context), std::move(rendezvous), std::move(prefix));
}

}  // namespace gradsync::comm
