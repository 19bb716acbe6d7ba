// The communicator over a CPU backend. The caller's thread validates and enqueues; one
// communication thread per communicator runs the operations in submission order (so every
// rank issues its collectives in the same order, and overlap with the caller is free), and
// completes the Work handles. A failure breaks the communicator: later operations fail at
// once with the first error instead of running out of step with the other ranks.
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "backend.h"
#include "gradsync/kernels/ops.h"

namespace gradsync::comm {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::min: return "min";
    case ReduceOp::max: return "max";
    case ReduceOp::prod: return "prod";
  }
  return "?";
}

std::chrono::milliseconds resolve_timeout(std::chrono::milliseconds requested) {
  if (requested.count() > 0) return requested;
  if (const char* text = std::getenv("GRADSYNC_TIMEOUT_MS")) {
    const long long value = std::atoll(text);
    GRADSYNC_CHECK(value > 0, "GRADSYNC_TIMEOUT_MS must be a positive number of milliseconds, got '", text, "'");
    return std::chrono::milliseconds(value);
  }
  return std::chrono::milliseconds(300000);
}

namespace {

// The Work of a CPU operation: completed by the communication thread.
class CpuWork final : public Work {
 public:
  CpuWork(std::string description, std::chrono::milliseconds default_timeout)
      : description_(std::move(description)), default_timeout_(default_timeout) {}

  bool is_completed() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }

  void wait(std::chrono::milliseconds timeout) override {
    const auto limit = timeout.count() > 0 ? timeout : default_timeout_;
    std::unique_lock<std::mutex> lock(mutex_);
    if (!done_changed_.wait_for(lock, limit, [&] { return done_; })) {
      detail::throw_error(description_, " did not complete within ", limit.count(),
                          " ms: a peer may have skipped it, be stuck, or have died");
    }
    if (error_) std::rethrow_exception(error_);
  }

  const std::string& description() const override { return description_; }

  void complete(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
      error_ = std::move(error);
    }
    done_changed_.notify_all();
  }

 private:
  std::string description_;
  std::chrono::milliseconds default_timeout_;
  mutable std::mutex mutex_;
  std::condition_variable done_changed_;
  bool done_ = false;
  std::exception_ptr error_;
};

enum class OpKind : std::int64_t { allreduce = 1, broadcast, allgather, allgatherv, reduce_scatter, coalesced, barrier };

const char* op_kind_name(std::int64_t kind) {
  switch (static_cast<OpKind>(kind)) {
    case OpKind::allreduce: return "allreduce";
    case OpKind::broadcast: return "broadcast";
    case OpKind::allgather: return "allgather";
    case OpKind::allgatherv: return "allgatherv";
    case OpKind::reduce_scatter: return "reduce_scatter";
    case OpKind::coalesced: return "allreduce_coalesced";
    case OpKind::barrier: return "barrier";
  }
  return "?";
}

// What a rank believes the current collective is; compared across ranks in debug mode.
struct Descriptor {
  std::int64_t seq = 0;
  std::int64_t kind = 0;
  std::int64_t dtype = 0;
  std::int64_t count = 0;
  std::int64_t root = -1;
  std::int64_t op = -1;

  std::string str() const {
    std::ostringstream text;
    text << op_kind_name(kind) << " #" << seq;
    if (op >= 0) text << " (" << reduce_op_name(static_cast<ReduceOp>(op)) << ")";
    if (root >= 0) text << " root " << root;
    text << ", " << dtype_name(static_cast<DType>(dtype)) << " x " << count;
    return text.str();
  }
  bool operator==(const Descriptor&) const = default;
};
static_assert(sizeof(Descriptor) == 6 * sizeof(std::int64_t));

class CpuCommunicator final : public Communicator {
 public:
  CpuCommunicator(std::unique_ptr<Backend> backend, const CommOptions& options)
      : backend_(std::move(backend)), timeout_(resolve_timeout(options.timeout)) {
    const char* debug = std::getenv("GRADSYNC_DEBUG_COLLECTIVES");
    check_agreement_ = options.check_agreement || (debug != nullptr && std::string(debug) == "1");
    backend_->set_timeout(timeout_);
    worker_ = std::thread([this] { run(); });
  }

  ~CpuCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    queue_changed_.notify_all();
    worker_.join();  // bounded: a backend call in flight gives up after the timeout
  }

  int rank() const override { return backend_->rank(); }
  int size() const override { return backend_->size(); }
  const char* backend() const override { return backend_->name(); }
  Device device_type() const override { return Device::cpu(); }

  WorkHandle allreduce_async(Tensor& tensor, ReduceOp op) override {
    require_host("allreduce", tensor);
    GRADSYNC_CHECK(op != ReduceOp::avg || is_floating(tensor.dtype()), "allreduce: avg of ", tensor.describe(),
                   " is not defined for integers (use sum)");
    Tensor target = tensor;
    return submit_collective({0, static_cast<std::int64_t>(OpKind::allreduce), static_cast<std::int64_t>(tensor.dtype()),
                              tensor.numel(), -1, static_cast<std::int64_t>(op)},
                             [this, target, op]() mutable { reduce_in_place(target, op); });
  }

  WorkHandle broadcast_async(Tensor& tensor, int root) override {
    require_host("broadcast", tensor);
    require_rank("broadcast", root, "root");
    Tensor target = tensor;
    return submit_collective({0, static_cast<std::int64_t>(OpKind::broadcast), static_cast<std::int64_t>(tensor.dtype()),
                              tensor.numel(), root, -1},
                             [this, target, root] { backend_->broadcast(target.data(), target.numel(), target.dtype(), root); });
  }

  WorkHandle allgather_async(const Tensor& input, Tensor& output) override {
    require_host("allgather", input);
    require_host("allgather", output);
    GRADSYNC_CHECK(input.dtype() == output.dtype() && output.numel() == input.numel() * size(), "allgather: output ",
                   output.describe(), " must hold ", size(), " x ", input.describe());
    Tensor in = input;
    Tensor out = output;
    return submit_collective({0, static_cast<std::int64_t>(OpKind::allgather), static_cast<std::int64_t>(input.dtype()),
                              input.numel(), -1, -1},
                             [this, in, out] { backend_->allgather(in.data(), out.data(), in.numel(), in.dtype()); });
  }

  WorkHandle allgatherv_async(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts) override {
    require_host("allgatherv", input);
    require_host("allgatherv", output);
    GRADSYNC_CHECK(static_cast<int>(counts.size()) == size(), "allgatherv: ", counts.size(), " counts for ", size(),
                   " ranks");
    GRADSYNC_CHECK(counts[static_cast<std::size_t>(rank())] == input.numel(), "allgatherv: counts[", rank(), "] = ",
                   counts[static_cast<std::size_t>(rank())], " but this rank's input is ", input.describe());
    std::int64_t total = 0;
    for (const std::int64_t count : counts) {
      GRADSYNC_CHECK(count >= 0, "allgatherv: negative count ", count);
      total += count;
    }
    GRADSYNC_CHECK(input.dtype() == output.dtype() && output.numel() == total, "allgatherv: output ",
                   output.describe(), " must hold ", total, " elements of ", dtype_name(input.dtype()));
    Tensor in = input;
    Tensor out = output;
    return submit_collective({0, static_cast<std::int64_t>(OpKind::allgatherv), static_cast<std::int64_t>(input.dtype()),
                              total, -1, -1},
                             [this, in, out, counts] { backend_->allgatherv(in.data(), out.data(), counts, in.dtype()); });
  }

  WorkHandle reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) override {
    require_host("reduce_scatter", input);
    require_host("reduce_scatter", output);
    GRADSYNC_CHECK(input.dtype() == output.dtype() && input.numel() == output.numel() * size(), "reduce_scatter: input ",
                   input.describe(), " must hold ", size(), " x ", output.describe());
    GRADSYNC_CHECK(op != ReduceOp::avg || is_floating(input.dtype()), "reduce_scatter: avg of ", input.describe(),
                   " is not defined for integers (use sum)");
    Tensor in = input;
    Tensor out = output;
    return submit_collective({0, static_cast<std::int64_t>(OpKind::reduce_scatter),
                              static_cast<std::int64_t>(input.dtype()), input.numel(), -1, static_cast<std::int64_t>(op)},
                             [this, in, out, op]() mutable {
                               backend_->reduce_scatter(in.data(), out.data(), out.numel(), in.dtype(), backend_op(op));
                               finish_average(out, op);
                             });
  }

  WorkHandle allreduce_coalesced_async(std::vector<Tensor> tensors, ReduceOp op) override {
    GRADSYNC_CHECK(!tensors.empty(), "allreduce_coalesced: no tensors");
    std::int64_t total = 0;
    for (const Tensor& tensor : tensors) {
      require_host("allreduce_coalesced", tensor);
      GRADSYNC_CHECK(tensor.dtype() == tensors[0].dtype(), "allreduce_coalesced: mixed dtypes ",
                     tensors[0].describe(), " and ", tensor.describe());
      total += tensor.numel();
    }
    GRADSYNC_CHECK(op != ReduceOp::avg || is_floating(tensors[0].dtype()), "allreduce_coalesced: avg of integers");
    const DType dtype = tensors[0].dtype();
    return submit_collective({0, static_cast<std::int64_t>(OpKind::coalesced), static_cast<std::int64_t>(dtype), total, -1,
                              static_cast<std::int64_t>(op)},
                             [this, tensors, total, dtype, op]() mutable {
                               // One flat buffer: one collective instead of one per tensor.
                               Tensor flat = Tensor::empty({total}, dtype);
                               std::int64_t offset = 0;
                               for (const Tensor& tensor : tensors) {
                                 flat.view(static_cast<std::size_t>(offset), {tensor.numel()}).copy_from(tensor.flatten());
                                 offset += tensor.numel();
                               }
                               reduce_in_place(flat, op);
                               offset = 0;
                               for (Tensor& tensor : tensors) {
                                 tensor.flatten().copy_from(flat.view(static_cast<std::size_t>(offset), {tensor.numel()}));
                                 offset += tensor.numel();
                               }
                             });
  }

  WorkHandle barrier_async() override {
    return submit_collective({0, static_cast<std::int64_t>(OpKind::barrier), 0, 0, -1, -1}, [this] { backend_->barrier(); });
  }

  WorkHandle send_async(const Tensor& tensor, int peer, int tag) override {
    require_host("send", tensor);
    require_peer("send", peer);
    Tensor source = tensor;
    return submit(describe_p2p("send", tensor, peer, tag), std::nullopt,
                  [this, source, peer, tag] { backend_->send(source.data(), source.nbytes(), peer, tag); });
  }

  WorkHandle recv_async(Tensor& tensor, int peer, int tag) override {
    require_host("recv", tensor);
    require_peer("recv", peer);
    Tensor target = tensor;
    return submit(describe_p2p("recv", tensor, peer, tag), std::nullopt,
                  [this, target, peer, tag] { backend_->recv(target.data(), target.nbytes(), peer, tag); });
  }

 private:
  struct Task {
    std::shared_ptr<CpuWork> work;
    std::optional<Descriptor> descriptor;  // collectives only
    std::function<void()> body;
  };

  void require_host(const char* op, const Tensor& tensor) const {
    GRADSYNC_CHECK(tensor.defined(), op, ": empty tensor handle");
    GRADSYNC_CHECK(tensor.device().is_cpu(), op, ": the ", backend(), " communicator handles CPU tensors, got ",
                   tensor.describe(), " (CUDA tensors go through the NCCL backend)");
  }

  void require_rank(const char* op, int value, const char* what) const {
    GRADSYNC_CHECK(value >= 0 && value < size(), op, ": ", what, " ", value, " is not a rank of this ", size(),
                   "-rank communicator");
  }

  void require_peer(const char* op, int peer) const {
    require_rank(op, peer, "peer");
    GRADSYNC_CHECK(peer != rank(), op, ": rank ", rank(), " cannot exchange with itself");
  }

  std::string describe_p2p(const char* op, const Tensor& tensor, int peer, int tag) {
    std::lock_guard<std::mutex> lock(submit_mutex_);
    std::ostringstream text;
    text << op << " p2p#" << p2p_sequence_++ << " (" << (std::string(op) == "send" ? "to" : "from") << " rank " << peer
         << ", tag " << tag << ", " << dtype_name(tensor.dtype()) << " x " << tensor.numel() << ")";
    return text.str();
  }

  // avg never reaches a backend: it is a sum, then a division by the world size.
  static ReduceOp backend_op(ReduceOp op) { return op == ReduceOp::avg ? ReduceOp::sum : op; }
  void finish_average(Tensor& result, ReduceOp op) {
    if (op == ReduceOp::avg) ops::scale(result, 1.0 / size());
  }

  void reduce_in_place(Tensor& tensor, ReduceOp op) {
    backend_->allreduce(tensor.data(), tensor.numel(), tensor.dtype(), backend_op(op));
    finish_average(tensor, op);
  }

  WorkHandle submit_collective(Descriptor descriptor, std::function<void()> body) {
    std::lock_guard<std::mutex> lock(submit_mutex_);
    descriptor.seq = collective_sequence_++;
    return submit(descriptor.str(), descriptor, std::move(body));
  }

  WorkHandle submit(std::string description, std::optional<Descriptor> descriptor, std::function<void()> body) {
    auto work = std::make_shared<CpuWork>(description, timeout_ + std::chrono::seconds(2));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!broken_.empty()) {
        detail::throw_error(description, ": the ", backend(), " communicator is broken by an earlier failure: ", broken_);
      }
      queue_.push_back({work, descriptor, std::move(body)});
    }
    queue_changed_.notify_one();
    return work;
  }

  // The communication thread.
  void run() {
    ThreadRankScope label(backend_->rank());
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        queue_changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and nothing left
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      std::string broken;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        broken = broken_;
      }
      if (!broken.empty()) {
        task.work->complete(std::make_exception_ptr(Error(task.work->description() + ": the " + backend() +
                                                          " communicator is broken by an earlier failure: " + broken)));
        continue;
      }
      try {
        if (task.descriptor && check_agreement_) check_agreement(*task.descriptor);
        task.body();
        task.work->complete(nullptr);
      } catch (const std::exception& error) {
        const std::string message = error.what();
        const Error wrapped(task.work->description() + " failed: " + message);
        {
          std::lock_guard<std::mutex> lock(mutex_);
          broken_ = wrapped.what();
        }
        task.work->complete(std::make_exception_ptr(wrapped));
      }
    }
  }

  // Debug mode: every rank shares what it is about to run; any difference is an error that
  // names the first disagreeing rank and both views.
  void check_agreement(const Descriptor& mine) {
    std::vector<Descriptor> all(static_cast<std::size_t>(size()));
    backend_->allgather(&mine, all.data(), 6, DType::i64);
    for (int other = 0; other < size(); ++other) {
      const Descriptor& theirs = all[static_cast<std::size_t>(other)];
      if (!(theirs == mine)) {
        detail::throw_error("collective mismatch: this rank (", rank(), ") runs ", mine.str(), ", rank ", other,
                            " runs ", theirs.str());
      }
    }
  }

  std::unique_ptr<Backend> backend_;
  std::chrono::milliseconds timeout_;
  bool check_agreement_ = false;

  std::mutex submit_mutex_;  // sequence numbers are assigned in submission order
  std::int64_t collective_sequence_ = 0;
  std::int64_t p2p_sequence_ = 0;

  std::mutex mutex_;  // guards the queue, stopping_ and broken_
  std::condition_variable queue_changed_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::string broken_;
  std::thread worker_;
};

}  // namespace

std::unique_ptr<Communicator> make_cpu_communicator(std::unique_ptr<Backend> backend, const CommOptions& options) {
  return std::make_unique<CpuCommunicator>(std::move(backend), options);
}

void Communicator::allreduce(const Tensor& input, Tensor& output, ReduceOp op) {
  output.copy_from(input);
  allreduce(output, op);
}

}  // namespace gradsync::comm
