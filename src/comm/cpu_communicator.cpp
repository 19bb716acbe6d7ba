// The communicator over a CPU backend. The caller's thread validates and enqueues; one
// communication thread per communicator runs the operations in submission order (so every
// rank issues its collectives in the same order, and overlap with the caller is free), and
// completes the Work handles. A failure breaks the communicator: later operations fail at
// once with the first error instead of running out of step with the other ranks.
#include <atomic>
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
#include "gradsync/core/timeline.h"
#include "gradsync/kernels/ops.h"

namespace gradsync::comm {

std::chrono::milliseconds milliseconds_from_environment(const char* name, std::chrono::milliseconds fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr) return fallback;
  // A plain positive integer, nothing else: atoll would read "5s" as 5 ms and "" as 0.
  const std::string value(text);
  const bool digits = !value.empty() && value.size() <= 12 &&
                      std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; });
  GRADSYNC_CHECK(digits && std::stoll(value) > 0, name, " must be a positive whole number of milliseconds, got '", value,
                 "'");
  return std::chrono::milliseconds(std::stoll(value));
}

std::chrono::milliseconds resolve_timeout(std::chrono::milliseconds requested) {
  if (requested.count() > 0) return requested;
  return milliseconds_from_environment("GRADSYNC_TIMEOUT_MS", std::chrono::milliseconds(300000));
}

std::chrono::milliseconds resolve_rendezvous_timeout(std::chrono::milliseconds requested,
                                                     std::chrono::milliseconds operation_timeout) {
  if (requested.count() > 0) return requested;
  return milliseconds_from_environment("GRADSYNC_RENDEZVOUS_TIMEOUT_MS", resolve_timeout(operation_timeout));
}

namespace {

using Clock = std::chrono::steady_clock;

// Extra time a Work's own deadline allows beyond the backend's timeout, so that the backend's
// error (which says more: which step, which peer) is the one a caller usually sees.
constexpr std::chrono::milliseconds kWaitGrace{2000};

class Engine;

// The Work of a CPU operation: completed by the communication thread, or cancelled.
class CpuWork final : public Work, public std::enable_shared_from_this<CpuWork> {
 public:
  // A collective is described from its Descriptor, and only when somebody asks (an error, a
  // timeout, description()): formatting costs about a microsecond, a small collective a few.
  CpuWork(std::optional<Descriptor> descriptor, std::string description, std::chrono::milliseconds default_timeout,
          std::weak_ptr<Engine> engine)
      : descriptor_(std::move(descriptor)), description_(std::move(description)), default_timeout_(default_timeout),
        issued_(Clock::now()), engine_(std::move(engine)) {}

  bool is_completed() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }

  void wait(std::chrono::milliseconds timeout) override;

  const std::string& description() const override {
    std::call_once(described_, [&] {
      if (descriptor_) description_ = descriptor_->str();
    });
    return description_;
  }

  void complete(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (done_) return;
      done_ = true;
      error_ = std::move(error);
    }
    done_changed_.notify_all();
  }

  // Blocks until the communication thread has let go of the operation (it was aborted).
  bool wait_done_until(Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mutex_);
    return done_changed_.wait_until(lock, deadline, [&] { return done_; });
  }

 private:
  std::optional<Descriptor> descriptor_;
  mutable std::string description_;
  mutable std::once_flag described_;
  std::chrono::milliseconds default_timeout_;
  Clock::time_point issued_;
  std::weak_ptr<Engine> engine_;
  mutable std::mutex mutex_;
  std::condition_variable done_changed_;
  bool done_ = false;
  std::exception_ptr error_;
};

// Everything a CPU communicator's operations share with their Works: the backend, the queue,
// the communication thread and the broken state. Works hold it weakly: a Work that outlives its
// communicator is always completed (the destructor fails what it did not run).
class Engine final : public std::enable_shared_from_this<Engine> {
 public:
  Engine(std::unique_ptr<Backend> backend, const CommOptions& options)
      : backend_(std::move(backend)), options_(options), timeout_(resolve_timeout(options.timeout)) {
    const char* debug = std::getenv("GRADSYNC_DEBUG_COLLECTIVES");
    check_agreement_ = options.check_agreement || (debug != nullptr && std::string(debug) == "1");
    const char* verify = std::getenv("GRADSYNC_VERIFY_COLLECTIVES");
    verify_ = options.verify && !(verify != nullptr && std::string(verify) == "0");
    backend_->set_timeout(timeout_);
  }

  void start() {
    timeline::start_from_environment(backend_->rank());  // GRADSYNC_TIMELINE: now the rank is known
    worker_ = std::thread([self = shared_from_this()] { self->run(); });
  }

  // The communicator goes away: nothing queued runs (each fails, naming why), the operation in
  // flight is aborted, and the thread ends. Bounded by the backend's timeout at worst.
  void stop() {
    std::deque<Task> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      if (broken_.empty()) broken_ = "the communicator was destroyed";
      dropped.swap(queue_);
      if (running_) backend_->abort();
    }
    queue_changed_.notify_all();
    for (Task& task : dropped) task.work->complete(broken_error(task.work->description()));
    if (worker_.joinable()) worker_.join();
  }

  Backend& backend() { return *backend_; }
  const Backend& backend() const { return *backend_; }
  const CommOptions& options() const { return options_; }

  std::string broken_reason() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return broken_;
  }

  WorkHandle submit_collective(Descriptor descriptor, std::function<void()> body) {
    std::optional<Task> inline_task;
    WorkHandle work;
    {
      std::lock_guard<std::mutex> lock(submit_mutex_);
      descriptor.seq = collective_sequence_++;
      work = submit(std::string(), descriptor, std::move(body), inline_task);
    }
    if (inline_task) run_inline(*inline_task);
    return work;
  }

  WorkHandle submit_p2p(const char* op, const Tensor& tensor, int peer, int tag, std::function<void()> body) {
    std::optional<Task> inline_task;
    WorkHandle work;
    {
      std::lock_guard<std::mutex> lock(submit_mutex_);
      work = submit(describe_p2p(op, p2p_sequence_++, tensor, peer, tag), std::nullopt, std::move(body), inline_task);
    }
    if (inline_task) run_inline(*inline_task);
    return work;
  }

  // A wait expired (called by the Work): break the communicator so that nothing later runs out
  // of step, and make sure the operation no longer touches its buffers: a queued one is
  // dropped, a running one is aborted and waited for (bounded by the backend's own timeout:
  // Gloo's own collectives cannot be interrupted). An operation running ahead of a queued one
  // is aborted too: the communicator is broken, it has no future.
  void expire(const std::shared_ptr<CpuWork>& work, const std::string& message, Clock::time_point issued) {
    bool queued = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (broken_.empty()) broken_ = message;
      for (auto it = queue_.begin(); it != queue_.end(); ++it) {
        if (it->work == work) {
          queue_.erase(it);
          queued = true;
          break;
        }
      }
      // Broken now: whatever runs gives up too, this operation or one ahead of it.
      if (running_ != nullptr) backend_->abort();
    }
    if (queued) {
      work->complete(std::make_exception_ptr(Error(message)));
      return;
    }
    work->wait_done_until(issued + timeout_ + 2 * kWaitGrace);
  }

 private:
  struct Task {
    std::shared_ptr<CpuWork> work;
    std::optional<Descriptor> descriptor;  // collectives only
    std::function<void()> body;
  };

  std::exception_ptr broken_error(const std::string& description) const {
    return std::make_exception_ptr(Error(description + ": the " + backend_->name() +
                                         " communicator is broken by an earlier failure: " + broken_));
  }

  // Queues an operation for the communication thread, or, when the caller is about to wait for
  // it (CallerWaits) and nothing is queued or running, hands it back in `inline_task` to run on
  // the calling thread: it then counts as running, so anything submitted meanwhile queues
  // behind it and the communication thread waits for it.
  WorkHandle submit(std::string description, std::optional<Descriptor> descriptor, std::function<void()> body,
                    std::optional<Task>& inline_task) {
    auto work = std::make_shared<CpuWork>(descriptor, std::move(description), timeout_ + kWaitGrace, weak_from_this());
    const bool caller_waits = CallerWaits::take();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!broken_.empty()) {
        detail::throw_error(work->description(), ": the ", backend_->name(),
                            " communicator is broken by an earlier failure: ", broken_);
      }
      if (caller_waits && queue_.empty() && running_ == nullptr) {
        running_ = work.get();
        inline_task = Task{work, descriptor, std::move(body)};
        return work;
      }
      queue_.push_back({work, descriptor, std::move(body)});
    }
    queue_changed_.notify_one();
    return work;
  }

  void run_inline(Task& task) {
    ThreadRankScope label(backend_->rank());
    execute(task);
  }

  // The communication thread: runs the queue in order; the first failure breaks everything after.
  void run() {
    ThreadRankScope label(backend_->rank());
    // One track per communicator (a Reducer's duplicate has its own), numbered in creation
    // order; named once the timeline records (it may start after this thread did).
    static std::atomic<int> communicators{0};
    const std::string track = "communication " + std::to_string(++communicators) + " (" + backend_->name() + ")";
    bool named = false;
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        // One operation at a time: also none while a caller runs one itself (submit).
        queue_changed_.wait(lock, [&] { return stopping_ || (!queue_.empty() && running_ == nullptr); });
        if (queue_.empty()) return;  // stopping, and nothing left
        task = std::move(queue_.front());
        queue_.pop_front();
        if (!broken_.empty()) {
          lock.unlock();
          task.work->complete(broken_error(task.work->description()));
          continue;
        }
        running_ = task.work.get();
      }
      if (!named && timeline::enabled()) {
        timeline::name_thread(track);
        named = true;
      }
      execute(task);
    }
  }

  // Runs one operation that is marked running, completes its Work and lets the next one run.
  void execute(Task& task) {
    std::exception_ptr failure;
    try {
      // On the timeline: the operation on the wire, on whichever thread runs it.
      timeline::Span wire("wire", [&] { return task.work->description(); }, 0);
      if (task.descriptor) verify(*task.descriptor);
      task.body();
    } catch (const std::exception& error) {
      const Error wrapped(task.work->description() + " failed: " + backend_->explain(error.what()));
      failure = std::make_exception_ptr(wrapped);
      std::lock_guard<std::mutex> lock(mutex_);
      if (broken_.empty()) broken_ = wrapped.what();
    }
    bool queued = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      running_ = nullptr;
      queued = !queue_.empty();
    }
    if (queued) queue_changed_.notify_one();  // an operation queued behind this one
    task.work->complete(failure);
  }

  // Before every collective: do all ranks run the same one? The cheap form is one allreduce
  // (max) of {f, -f} for this rank's fingerprint f: the ranks agree exactly when max(f) ==
  // -max(-f) == min(f). It always matches on the wire whatever the ranks disagree about, so a
  // mismatch becomes an error on every rank before a payload of the wrong size can reach Gloo
  // or MPI (where it would abort the process). On a mismatch, or in debug mode, every rank
  // exchanges the whole descriptor to name who differs and how.
  void verify(const Descriptor& mine) {
    if (size_one()) return;
    if (!check_agreement_) {
      if (!verify_) return;
      std::int64_t words[2] = {mine.fingerprint(), -mine.fingerprint()};
      backend_->allreduce(words, 2, DType::i64, ReduceOp::max);
      if (words[0] == -words[1]) return;
    }
    std::vector<Descriptor> all(static_cast<std::size_t>(backend_->size()));
    backend_->allgather(&mine, all.data(), kDescriptorWords, DType::i64);
    require_agreement(mine, all, backend_->rank());
    detail::throw_error("collective mismatch: the ranks' fingerprints of ", mine.str(), " differ");
  }

  bool size_one() const { return backend_->size() == 1; }

  std::unique_ptr<Backend> backend_;
  CommOptions options_;
  std::chrono::milliseconds timeout_;
  bool check_agreement_ = false;
  bool verify_ = true;

  std::mutex submit_mutex_;  // sequence numbers are assigned in submission order
  std::int64_t collective_sequence_ = 0;
  std::int64_t p2p_sequence_ = 0;

  mutable std::mutex mutex_;  // guards the queue, stopping_, running_ and broken_
  std::condition_variable queue_changed_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  const CpuWork* running_ = nullptr;
  std::string broken_;
  std::thread worker_;
};

void CpuWork::wait(std::chrono::milliseconds timeout) {
  const auto limit = timeout.count() > 0 ? timeout : default_timeout_;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (done_changed_.wait_until(lock, issued_ + limit, [&] { return done_; })) {
      if (error_) std::rethrow_exception(error_);
      return;
    }
  }
  std::ostringstream message;
  message << description() << " did not complete within " << limit.count()
          << " ms of being issued: a peer may have skipped it, be stuck, or have died";
  if (auto engine = engine_.lock()) engine->expire(shared_from_this(), message.str(), issued_);
  std::lock_guard<std::mutex> lock(mutex_);
  if (done_ && !error_) return;  // it finished after all, just before it could be cancelled
  throw Error(message.str());
}

class CpuCommunicator final : public Communicator {
 public:
  CpuCommunicator(std::unique_ptr<Backend> backend, const CommOptions& options)
      : engine_(std::make_shared<Engine>(std::move(backend), options)) {
    engine_->start();
  }

  ~CpuCommunicator() override { engine_->stop(); }

  int rank() const override { return engine_->backend().rank(); }
  int size() const override { return engine_->backend().size(); }
  const char* backend() const override { return engine_->backend().name(); }
  Device device_type() const override { return Device::cpu(); }
  std::string broken_reason() const override { return engine_->broken_reason(); }

  std::unique_ptr<Communicator> duplicate() override {
    // The new backend is made on the communication thread, in sequence with everything else.
    auto child = std::make_shared<std::unique_ptr<Backend>>();
    Backend& backend = engine_->backend();
    submit(Descriptor::of(OpKind::duplicate, DType::i64, 0), [&backend, child] { *child = backend.duplicate(); })->wait();
    return std::make_unique<CpuCommunicator>(std::move(*child), engine_->options());
  }

  WorkHandle allreduce_async(Tensor& tensor, ReduceOp op) override {
    require_device(*this, "allreduce", tensor);
    require_reducible("allreduce", op, tensor);
    Tensor target = tensor;
    return submit(Descriptor::of(OpKind::allreduce, tensor.dtype(), tensor.numel(), -1, static_cast<std::int64_t>(op)),
                  [this, target, op]() mutable { reduce_in_place(target, op); });
  }

  WorkHandle broadcast_async(Tensor& tensor, int root) override {
    require_device(*this, "broadcast", tensor);
    require_rank(*this, "broadcast", root, "root");
    Tensor target = tensor;
    Backend& backend = engine_->backend();
    return submit(Descriptor::of(OpKind::broadcast, tensor.dtype(), tensor.numel(), root),
                  [&backend, target, root] { backend.broadcast(target.data(), target.numel(), target.dtype(), root); });
  }

  WorkHandle allgather_async(const Tensor& input, Tensor& output) override {
    require_allgather(*this, input, output);
    Tensor in = input;
    Tensor out = output;
    Backend& backend = engine_->backend();
    return submit(Descriptor::of(OpKind::allgather, input.dtype(), input.numel()),
                  [&backend, in, out] { backend.allgather(in.data(), out.data(), in.numel(), in.dtype()); });
  }

  WorkHandle allgatherv_async(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts) override {
    const std::int64_t total = require_allgatherv(*this, input, output, counts);
    Tensor in = input;
    Tensor out = output;
    Backend& backend = engine_->backend();
    return submit(Descriptor::of(OpKind::allgatherv, input.dtype(), total),
                  [&backend, in, out, counts] { backend.allgatherv(in.data(), out.data(), counts, in.dtype()); });
  }

  WorkHandle reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) override {
    require_reduce_scatter(*this, input, output, op);
    Tensor in = input;
    Tensor out = output;
    return submit(Descriptor::of(OpKind::reduce_scatter, input.dtype(), input.numel(), -1, static_cast<std::int64_t>(op)),
                  [this, in, out, op]() mutable {
                    engine_->backend().reduce_scatter(in.data(), out.data(), out.numel(), in.dtype(), backend_op(op));
                    finish_average(out, op);
                  });
  }

  WorkHandle allreduce_coalesced_async(std::vector<Tensor> tensors, ReduceOp op) override {
    const std::int64_t total = require_coalesced(*this, tensors, op);
    const DType dtype = tensors[0].dtype();
    return submit(Descriptor::of(OpKind::coalesced, dtype, total, -1, static_cast<std::int64_t>(op)),
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
    Backend& backend = engine_->backend();
    return submit(Descriptor::of(OpKind::barrier, DType::f32, 0), [&backend] { backend.barrier(); });
  }

  WorkHandle send_async(const Tensor& tensor, int peer, int tag) override {
    require_device(*this, "send", tensor);
    require_peer(*this, "send", peer);
    Tensor source = tensor;
    Backend& backend = engine_->backend();
    return engine_->submit_p2p("send", tensor, peer, tag,
                               [&backend, source, peer, tag] { backend.send(source.data(), source.nbytes(), peer, tag); });
  }

  WorkHandle recv_async(Tensor& tensor, int peer, int tag) override {
    require_device(*this, "recv", tensor);
    require_peer(*this, "recv", peer);
    Tensor target = tensor;
    Backend& backend = engine_->backend();
    return engine_->submit_p2p("recv", tensor, peer, tag,
                               [&backend, target, peer, tag] { backend.recv(target.data(), target.nbytes(), peer, tag); });
  }

 private:
  WorkHandle submit(const Descriptor& descriptor, std::function<void()> body) {
    return engine_->submit_collective(descriptor, std::move(body));
  }

  // avg never reaches a backend: it is a sum, then a division by the world size.
  static ReduceOp backend_op(ReduceOp op) { return op == ReduceOp::avg ? ReduceOp::sum : op; }
  void finish_average(Tensor& result, ReduceOp op) {
    if (op == ReduceOp::avg) ops::scale(result, 1.0 / size());
  }

  void reduce_in_place(Tensor& tensor, ReduceOp op) {
    engine_->backend().allreduce(tensor.data(), tensor.numel(), tensor.dtype(), backend_op(op));
    finish_average(tensor, op);
  }

  std::shared_ptr<Engine> engine_;
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
