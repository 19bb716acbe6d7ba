// gradsync/comm/communicator.h - the one interface every layer above talks to.
//
// A Communicator connects `size()` ranks. Every operation has an async form returning a Work
// handle, and a blocking form (async + wait). Operations run off the caller's thread: on a
// communication thread per communicator for the CPU backends (MPI, Gloo), in submission
// order, so a wait on a later operation never reorders anything.
//
// Never hang, always say why:
//  * every wait has a timeout: CommOptions::timeout (default 5 minutes, or the environment
//    variable GRADSYNC_TIMEOUT_MS), or a per-call value given to Work::wait. The backends
//    apply the same bound inside their own blocking calls. An expiry raises an Error naming the
//    operation, its sequence number, dtype, count and rank;
//  * after any failure the communicator is broken: later operations fail at once with the
//    first error, instead of running out of step with the other ranks;
//  * a wait that expires breaks the communicator and cancels the operation (a queued one
//    never runs; a running one is aborted and waited for), so no late completion can land in a
//    buffer the caller has moved on from (docs/communication.md, "Failure semantics");
//  * the CPU backends check before every collective, always, that all ranks run the same one
//    (one 16-byte allreduce of a fingerprint of the descriptor below; CommOptions::verify);
//    a mismatch is an Error on every rank, never a third-party abort. Debug mode
//    (CommOptions::check_agreement, or GRADSYNC_DEBUG_COLLECTIVES=1) exchanges the whole
//    descriptor (sequence number, operation, dtype, element count, root) and names the first
//    disagreeing rank with both views (the cheap check does that too once it sees a mismatch).
//
// One order per communicator: collectives match by the order each rank issues them. Anything
// that issues collectives from rank-local events (the Reducer launches buckets when the
// engine says "ready") takes its own communicator from duplicate(), so its order can never
// interleave differently with other users' on different ranks.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/core/tensor.h"

namespace gradsync::comm {

// How a collective combines the ranks' elements (avg: the sum divided by size(), floating only).
enum class ReduceOp { sum, avg, min, max, prod };
const char* reduce_op_name(ReduceOp op);  // "sum", "avg", ... (for messages)

// What a communicator is made with (connect(), the backends' constructors).
struct CommOptions {
  std::chrono::milliseconds timeout{0};  // 0: GRADSYNC_TIMEOUT_MS, else 300000
  // How long ranks wait for each other to arrive at the rendezvous (a slow scheduler may start
  // them minutes apart): 0: GRADSYNC_RENDEZVOUS_TIMEOUT_MS, else `timeout`. While waiting, a
  // rank reports every 10 s (GRADSYNC_RENDEZVOUS_REPORT_MS) which ranks have not arrived.
  std::chrono::milliseconds rendezvous_timeout{0};
  bool check_agreement = false;  // also on when GRADSYNC_DEBUG_COLLECTIVES=1
  bool verify = true;            // the cheap always-on check; off when GRADSYNC_VERIFY_COLLECTIVES=0
  // Reproducible reductions (also on when GRADSYNC_REPRODUCIBLE=1): every element of every
  // allreduce, reduce-scatter and coalesced allreduce is combined in ascending rank order,
  // ((x0 + x1) + x2) + ..., so the bits depend only on the inputs: not on the bucket size, the
  // algorithm or the backend (Gloo, MPI; NCCL refuses it). The same bytes on the wire as the
  // ring; docs/communication.md has the algorithms and their cost. Duplicates inherit it.
  bool reproducible = false;
  // Hierarchical allreduce, for ranks on several nodes (docs/communication.md): the ranks of a
  // node reduce-scatter among themselves, each carries its slice to its peers on the other
  // nodes (an allreduce across nodes per local rank, so every rank's link is used), and the
  // node allgathers the result. Only the inter-node phase crosses the slow link, with 1/L of the
  // buffer per rank for L ranks per node. It needs the same number of ranks, more than one, on
  // every node; otherwise the flat algorithm runs. Reproducible mode overrides it.
  //  automatic: GRADSYNC_HIERARCHICAL (unset: from GRADSYNC_HIERARCHICAL_MIN_KB up); always; never.
  enum class Hierarchy { automatic, always, never };
  Hierarchy hierarchical = Hierarchy::automatic;  // whether allreduces take the two-level path
  // The node this rank runs on: ranks with the same name share one. Empty: GRADSYNC_NODE, else
  // torchrun's GROUP_RANK, else the host name.
  std::string node{};
  // Gloo: allreduces that an expired wait can abort at once. Gloo's own allreduce cannot be
  // woken from another thread (its waits end only by its timeout); with this set, allreduces run
  // gradsync's ring (src/comm/algorithms/) over Gloo's point-to-point buffers, whose waits abort
  // (the same bytes on the wire; other bits than Gloo's algorithm, the same on every rank). For
  // communicators whose peers may hang, where giving an operation up must not wait for its
  // timeout: fault tolerance's across replica groups. Duplicates inherit it. MPI and NCCL ignore
  // it (NCCL aborts anyway).
  bool interruptible = false;
};

// The node this process runs on, as the hierarchical allreduce and HSDP's shard groups name it:
// `configured` (CommOptions::node), else GRADSYNC_NODE, else torchrun's GROUP_RANK, else the host
// name. Ranks with the same name share a node.
std::string node_name(const std::string& configured = "");

// Bytes this node's network interfaces (every one but the loopback) have sent since boot, from
// /sys/class/net/*/statistics/tx_bytes (0 where it cannot be read): what the node put on its
// links, so the difference over a step is the step's traffic off the node (on
// scripts/simulate_nodes.sh's nodes, exactly the link to the others).
std::int64_t node_bytes_sent();

// The timeout an operation gets when none is given: CommOptions, the environment, the default.
std::chrono::milliseconds resolve_timeout(std::chrono::milliseconds requested);
// The rendezvous timeout: `requested`, GRADSYNC_RENDEZVOUS_TIMEOUT_MS, else `operation_timeout`.
std::chrono::milliseconds resolve_rendezvous_timeout(std::chrono::milliseconds requested,
                                                     std::chrono::milliseconds operation_timeout);

// "The calling thread will wait for the next operation it issues, right away." The blocking
// forms of Communicator set it around their call; a CPU communicator whose queue is empty then
// runs that operation on the calling thread instead of handing it to its communication thread
// and sleeping until woken (two thread hand-offs: most of the time of a small collective).
// The order of operations, their checks and their timeouts are unchanged. Scoped, per thread,
// consumed by the first submission.
class CallerWaits {
 public:
  CallerWaits();
  ~CallerWaits();
  CallerWaits(const CallerWaits&) = delete;
  CallerWaits& operator=(const CallerWaits&) = delete;
  // True once per scope: for the first operation the thread submits inside it.
  static bool take();

 private:
  bool previous_;
};

// An operation in flight (PyTorch's Work): what every *_async call returns.
class Work {
 public:
  virtual ~Work() = default;
  virtual bool is_completed() const = 0;  // done, successfully or not (never blocks)
  // Waits for completion; rethrows the operation's error. timeout 0 means the communicator's.
  // The deadline counts from when the operation was issued. When it passes, the communicator
  // is broken and the operation cancelled; wait() returns (by throwing) only once nothing will
  // touch the operation's buffers any more.
  virtual void wait(std::chrono::milliseconds timeout = std::chrono::milliseconds{0}) = 0;
  virtual const std::string& description() const = 0;  // "allreduce #12 (sum, f32 x 1000)"
};

using WorkHandle = std::shared_ptr<Work>;  // shared: the caller and the communicator both hold it

// "Wait, keep the first error, carry on", NCCL's cleanup idiom, in one place. After a failure
// every operation still in flight must be waited for (each wait is bounded by its timeout and
// fails at once on a broken communicator), so that none writes into a buffer its owner is about
// to reuse or free; but the error worth reporting is the first, not its consequences:
//
//   FirstError errors;
//   errors.run([&] { reducer.wait(); });   // may throw: kept
//   errors.wait(status_work);               // waited for whatever happened above
//   errors.rethrow();                       // the first error, if any
class FirstError {
 public:
  // Runs `step`; keeps what it throws when nothing was thrown before, drops it otherwise.
  template <typename Step>
  void run(Step&& step) noexcept {
    try {
      step();
    } catch (...) {
      if (!first_) first_ = std::current_exception();
    }
  }
  // Waits for `work` (nothing when it is null) and lets go of it.
  void wait(WorkHandle& work) noexcept {
    run([&] {
      if (!work) return;
      const WorkHandle waited = std::move(work);
      work.reset();
      waited->wait();
    });
  }
  bool failed() const { return first_ != nullptr; }           // an error was kept
  const std::exception_ptr& error() const { return first_; }  // the first error (null: none)
  // Throws the first error, if any.
  void rethrow() const {
    if (first_) std::rethrow_exception(first_);
  }

 private:
  std::exception_ptr first_;
};

// A group of ranks and their collectives (MPI's communicator, PyTorch's ProcessGroup): the
// interface dist and every layer above it use, whatever the backend. Operations are matched by
// the order each rank issues them; each has a timeout (CommOptions) and fails, never hangs.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // this rank, in [0, size())
  virtual int size() const = 0;  // the number of ranks
  virtual const char* backend() const = 0;  // "gloo", "mpi", "nccl"
  virtual Device device_type() const = 0;   // Device::cpu() for MPI/Gloo, cuda:N for NCCL

  // A new communicator over the same ranks with its own order of operations and its own
  // progress (MPI_Comm_idup, a new Gloo context, ncclCommSplit). Collective: every rank calls
  // it at the same point of this communicator's sequence. Used by every Reducer.
  virtual std::unique_ptr<Communicator> duplicate() = 0;
  // Sub-communicators (MPI_Comm_split, PyTorch's new_group / split_group): the ranks that pass
  // the same `color` form a new communicator, ordered by `key` (ties by their rank here); a rank
  // that passes kNoColor gets nullptr. Collective over this communicator, like duplicate(); the
  // new one has its own order of operations and progress, so work on it and on this one (or on
  // another split) may be in flight at once. Gloo (a new context through the store), MPI
  // (MPI_Comm_split) and NCCL (ncclCommSplit). Messages of a group name a peer by its group rank
  // and its world rank.
  static constexpr int kNoColor = -1;  // split(): this rank joins no new communicator
  virtual std::unique_ptr<Communicator> split(int color, int key);  // (above)
  // The first failure that broke this communicator, or empty while it is usable.
  virtual std::string broken_reason() const = 0;

  // Collectives. Tensors must stay alive and untouched until the work completes.
  // Allreduce in place; avg divides the sum by size() (floating dtypes only).
  virtual WorkHandle allreduce_async(Tensor& tensor, ReduceOp op) = 0;
  // Broadcast: root's tensor to everyone, in place.
  virtual WorkHandle broadcast_async(Tensor& tensor, int root) = 0;
  // Allgather: output holds size() * input.numel(), rank r's input at r * input.numel().
  virtual WorkHandle allgather_async(const Tensor& input, Tensor& output) = 0;
  // Allgather of different sizes: output holds sum(counts); counts[r] = elements rank r gives.
  virtual WorkHandle allgatherv_async(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts) = 0;
  // Reduce-scatter: input holds size() * output.numel(); rank r receives reduced chunk r.
  virtual WorkHandle reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) = 0;
  // Several tensors (one dtype) allreduced through one flat buffer.
  virtual WorkHandle allreduce_coalesced_async(std::vector<Tensor> tensors, ReduceOp op) = 0;
  virtual WorkHandle barrier_async() = 0;  // completes once every rank has issued it
  // Point to point (Adasum's building block). Matched by (peer, tag) in order.
  virtual WorkHandle send_async(const Tensor& tensor, int peer, int tag = 0) = 0;
  // Receives into `tensor` the message `peer` sent with `tag` (same dtype and size).
  virtual WorkHandle recv_async(Tensor& tensor, int peer, int tag = 0) = 0;

  // Blocking forms. Each marks the caller as waiting (CallerWaits), so that a CPU communicator
  // with nothing queued may run the operation on the calling thread.
  void allreduce(Tensor& tensor, ReduceOp op) {
    CallerWaits waiting;
    allreduce_async(tensor, op)->wait();
  }
  void allreduce(const Tensor& input, Tensor& output, ReduceOp op);  // out of place
  // Blocking broadcast_async.
  void broadcast(Tensor& tensor, int root) {
    CallerWaits waiting;
    broadcast_async(tensor, root)->wait();
  }
  // Blocking allgather_async.
  void allgather(const Tensor& input, Tensor& output) {
    CallerWaits waiting;
    allgather_async(input, output)->wait();
  }
  // Blocking allgatherv_async.
  void allgatherv(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts) {
    CallerWaits waiting;
    allgatherv_async(input, output, counts)->wait();
  }
  // Blocking reduce_scatter_async.
  void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) {
    CallerWaits waiting;
    reduce_scatter_async(input, output, op)->wait();
  }
  // Blocking allreduce_coalesced_async.
  void allreduce_coalesced(std::vector<Tensor> tensors, ReduceOp op) {
    CallerWaits waiting;
    allreduce_coalesced_async(std::move(tensors), op)->wait();
  }
  // Blocking barrier_async: returns once every rank has arrived.
  void barrier() {
    CallerWaits waiting;
    barrier_async()->wait();
  }
  void send(const Tensor& tensor, int peer, int tag = 0) { send_async(tensor, peer, tag)->wait(); }  // blocking
  void recv(Tensor& tensor, int peer, int tag = 0) { recv_async(tensor, peer, tag)->wait(); }  // blocking

  // Control-plane forms for small host tensors (counts, flags, descriptions, timings) on any
  // backend: a device communicator (NCCL) stages them through device memory, a CPU one runs
  // them as they are. The forms above stay strict: a tensor on the wrong device is an error.
  WorkHandle allreduce_host_async(Tensor& host, ReduceOp op);
  // Blocking allreduce_host_async.
  void allreduce_host(Tensor& host, ReduceOp op) {
    CallerWaits waiting;
    allreduce_host_async(host, op)->wait();
  }
  void broadcast_host(Tensor& host, int root);                // blocking, host tensors
  void allgather_host(const Tensor& input, Tensor& output);  // blocking, host tensors
  // Blocking, host tensors.
  void allgatherv_host(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts);
};

}  // namespace gradsync::comm
