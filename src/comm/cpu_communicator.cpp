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
#include "collective.h"
#include "gradsync/kernels/ops.h"

namespace gradsync::comm {

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
    require_device(*this, "allreduce", tensor);
    require_reducible("allreduce", op, tensor);
    Tensor target = tensor;
    return submit_collective(Descriptor::of(OpKind::allreduce, tensor.dtype(), tensor.numel(), -1, static_cast<std::int64_t>(op)),
                             [this, target, op]() mutable { reduce_in_place(target, op); });
  }

  WorkHandle broadcast_async(Tensor& tensor, int root) override {
    require_device(*this, "broadcast", tensor);
    require_rank(*this, "broadcast", root, "root");
    Tensor target = tensor;
    return submit_collective(Descriptor::of(OpKind::broadcast, tensor.dtype(), tensor.numel(), root),
                             [this, target, root] { backend_->broadcast(target.data(), target.numel(), target.dtype(), root); });
  }

  WorkHandle allgather_async(const Tensor& input, Tensor& output) override {
    require_allgather(*this, input, output);
    Tensor in = input;
    Tensor out = output;
    return submit_collective(Descriptor::of(OpKind::allgather, input.dtype(), input.numel()),
                             [this, in, out] { backend_->allgather(in.data(), out.data(), in.numel(), in.dtype()); });
  }

  WorkHandle allgatherv_async(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts) override {
    const std::int64_t total = require_allgatherv(*this, input, output, counts);
    Tensor in = input;
    Tensor out = output;
    return submit_collective(Descriptor::of(OpKind::allgatherv, input.dtype(), total),
                             [this, in, out, counts] { backend_->allgatherv(in.data(), out.data(), counts, in.dtype()); });
  }

  WorkHandle reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) override {
    require_reduce_scatter(*this, input, output, op);
    Tensor in = input;
    Tensor out = output;
    return submit_collective(Descriptor::of(OpKind::reduce_scatter, input.dtype(), input.numel(), -1, static_cast<std::int64_t>(op)),
                             [this, in, out, op]() mutable {
                               backend_->reduce_scatter(in.data(), out.data(), out.numel(), in.dtype(), backend_op(op));
                               finish_average(out, op);
                             });
  }

  WorkHandle allreduce_coalesced_async(std::vector<Tensor> tensors, ReduceOp op) override {
    const std::int64_t total = require_coalesced(*this, tensors, op);
    const DType dtype = tensors[0].dtype();
    return submit_collective(Descriptor::of(OpKind::coalesced, dtype, total, -1, static_cast<std::int64_t>(op)),
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
    return submit_collective(Descriptor::of(OpKind::barrier, DType::f32, 0), [this] { backend_->barrier(); });
  }

  WorkHandle send_async(const Tensor& tensor, int peer, int tag) override {
    require_device(*this, "send", tensor);
    require_peer(*this, "send", peer);
    Tensor source = tensor;
    return submit(next_p2p("send", tensor, peer, tag), std::nullopt,
                  [this, source, peer, tag] { backend_->send(source.data(), source.nbytes(), peer, tag); });
  }

  WorkHandle recv_async(Tensor& tensor, int peer, int tag) override {
    require_device(*this, "recv", tensor);
    require_peer(*this, "recv", peer);
    Tensor target = tensor;
    return submit(next_p2p("recv", tensor, peer, tag), std::nullopt,
                  [this, target, peer, tag] { backend_->recv(target.data(), target.nbytes(), peer, tag); });
  }

 private:
  struct Task {
    std::shared_ptr<CpuWork> work;
    std::optional<Descriptor> descriptor;  // collectives only
    std::function<void()> body;
  };

  std::string next_p2p(const char* op, const Tensor& tensor, int peer, int tag) {
    std::lock_guard<std::mutex> lock(submit_mutex_);
    return describe_p2p(op, p2p_sequence_++, tensor, peer, tag);
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
    backend_->allgather(&mine, all.data(), kDescriptorWords, DType::i64);
    require_agreement(mine, all, rank());
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
