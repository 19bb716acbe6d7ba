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
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "backend.h"
#include "collective.h"
#include "core/environment.h"
#include "core/staging.h"
#include "gradsync/core/timeline.h"
#include "gradsync/kernels/ops.h"

namespace gradsync::comm {

std::chrono::milliseconds resolve_timeout(std::chrono::milliseconds requested) {
  if (requested.count() > 0) return requested;
  return environment::timeout().value_or(std::chrono::milliseconds(300000));
}

std::chrono::milliseconds resolve_rendezvous_timeout(std::chrono::milliseconds requested,
                                                     std::chrono::milliseconds operation_timeout) {
  if (requested.count() > 0) return requested;
  return environment::rendezvous_timeout().value_or(resolve_timeout(operation_timeout));
}

namespace {

using Clock = std::chrono::steady_clock;

// Extra time a Work's own deadline allows beyond the backend's timeout, so that the backend's
// error (which says more: which step, which peer) is the one a caller usually sees.
constexpr std::chrono::milliseconds kWaitGrace{2000};

class Engine;

// Device tensors on a CPU backend (docs/communication.md, "Device tensors on Gloo and MPI"):
// each one is staged through a pooled page-locked host buffer, as PyTorch's Gloo backend does.
//  1. At submission, on the caller's thread: the copies to the host are queued on a side
//     stream of the tensor's device, after the caller's current stream (so they see the
//     gradient its kernels wrote), and a fence is recorded. They run while earlier operations
//     are still on the wire.
//  2. On the communication thread: wait for that fence (bounded by the timeout), run the host
//     collective on the pinned buffers, queue the copies back on a second side stream (the
//     next operation's copy to the host goes the other way at the same time) and fence them.
//  3. Work::wait returns, and is_completed() says true, only once the copies back have landed.
// Host tensors pass through untouched; the collective's body never knows the difference.
class Staging {
 public:
  // The tensor the collective's body works on: `tensor` itself on the host, else a host view
  // of a pinned buffer that is filled from it (copy_in) and copied back to it (copy_out).
  Tensor add(const Tensor& tensor, bool copy_in, bool copy_out) {
    if (tensor.device().is_cpu()) return tensor;
    GRADSYNC_CHECK(entries_.empty() || tensor.device() == entries_.front().device.device(),
                   "one collective's tensors must be on one device: ", entries_.front().device.describe(), " and ",
                   tensor.describe());
    Entry entry{tensor, Tensor(), detail::lease_pinned(tensor.nbytes()), copy_in, copy_out};
    entry.host = Tensor::wrap(entry.buffer.data(), tensor.shape(), tensor.dtype());
    entries_.push_back(std::move(entry));
    return entries_.back().host;
  }

  Device device() const { return entries_.front().device.device(); }
  std::string first_tensor() const { return entries_.front().device.describe(); }

  // Step 1, on the caller's thread.
  void start(detail::StagingStream& to_host, detail::StagingStream& to_device) {
    to_device_ = &to_device;
    // Both directions wait for the caller's work so far: the copies up read what its kernels
    // wrote, and the copies back must not land before its kernels are done with the tensor
    // (an output zero-filled on the caller's stream, say, would overwrite the result).
    to_host.order_after_current_stream();
    to_device.order_after_current_stream();
    for (const Entry& entry : entries_) {
      if (entry.in) to_host.copy_async(entry.host.data(), entry.device.data(), entry.device.nbytes());
    }
    copied_in_ = to_host.record();
  }

  // Step 2, on the communication thread: before and after the wire.
  void before_wire(Clock::time_point deadline, const std::string& what) const {
    copied_in_->wait(deadline, what + ": the copy of its device tensors to the host");
  }
  void after_wire() {
    for (const Entry& entry : entries_) {
      if (entry.out) to_device_->copy_async(entry.device.data(), entry.host.data(), entry.device.nbytes());
    }
    copied_out_ = to_device_->record();
  }

  // Step 3.
  bool copies_done() const { return copied_out_ == nullptr || copied_out_->done(); }
  void wait_copies(Clock::time_point deadline, const std::string& what) const {
    if (copied_out_ != nullptr) copied_out_->wait(deadline, what + ": the copy of its result back to the device");
  }

  // The pinned buffers go back to the pool only once no copy touches them (a Work dropped
  // unwaited, or an operation that never ran).
  ~Staging() {
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    for (const auto& fence : {copied_in_, copied_out_}) {
      try {
        if (fence != nullptr) fence->wait(deadline, "staging");
      } catch (const std::exception&) {
        // The device failed; the buffers are leaked rather than reused while a copy may run.
        for (Entry& entry : entries_) static_cast<void>(new detail::PooledBuffer(std::move(entry.buffer)));
        return;
      }
    }
  }

 private:
  struct Entry {
    Tensor device;  // the caller's tensor
    Tensor host;    // a view of `buffer`
    detail::PooledBuffer buffer;
    bool in;
    bool out;
  };
  std::vector<Entry> entries_;
  detail::StagingStream* to_device_ = nullptr;
  std::shared_ptr<detail::CopyFence> copied_in_;
  std::shared_ptr<detail::CopyFence> copied_out_;
};

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
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!done_) return false;
      if (error_) return true;  // completed, with an error that wait() rethrows
    }
    return staging_ == nullptr || staging_->copies_done();
  }

  void wait(std::chrono::milliseconds timeout) override;

  // Set before the Work is queued, for an operation on device tensors.
  void set_staging(std::shared_ptr<Staging> staging) { staging_ = std::move(staging); }

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
  std::shared_ptr<Staging> staging_;
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
    check_agreement_ = options.check_agreement || environment::debug_collectives();
    verify_ = options.verify && environment::verify_collectives();
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

  std::chrono::milliseconds timeout() const { return timeout_; }

  WorkHandle submit_collective(Descriptor descriptor, std::function<void()> body, std::shared_ptr<Staging> staging) {
    std::optional<Task> inline_task;
    WorkHandle work;
    {
      std::lock_guard<std::mutex> lock(submit_mutex_);
      descriptor.seq = collective_sequence_++;
      work = submit(std::string(), descriptor, std::move(body), inline_task, std::move(staging));
    }
    if (inline_task) run_inline(*inline_task);
    return work;
  }

  WorkHandle submit_p2p(const char* op, const Tensor& tensor, int peer, int tag, std::function<void()> body,
                        std::shared_ptr<Staging> staging) {
    std::optional<Task> inline_task;
    WorkHandle work;
    {
      std::lock_guard<std::mutex> lock(submit_mutex_);
      work = submit(describe_p2p(op, p2p_sequence_++, tensor, peer, tag), std::nullopt, std::move(body), inline_task,
                    std::move(staging));
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
                    std::optional<Task>& inline_task, std::shared_ptr<Staging> staging) {
    auto work = std::make_shared<CpuWork>(descriptor, std::move(description), timeout_ + kWaitGrace, weak_from_this());
    work->set_staging(std::move(staging));
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
      lock.unlock();
      // The copies back are local work, with their own bound: the wire may have used most of `limit`.
      if (staging_ != nullptr) staging_->wait_copies(Clock::now() + default_timeout_, description());
      return;
    }
  }
  std::ostringstream message;
  message << description() << " did not complete within " << limit.count()
          << " ms of being issued: a peer may have skipped it, be stuck, or have died";
  if (auto engine = engine_.lock()) engine->expire(shared_from_this(), message.str(), issued_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_ || error_) throw Error(message.str());
  }
  // It finished after all, just before it could be cancelled.
  if (staging_ != nullptr) staging_->wait_copies(Clock::now() + default_timeout_, description());
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
    submit(Descriptor::of(OpKind::duplicate, DType::i64, 0), [&backend, child] { *child = backend.duplicate(); }, nullptr)
        ->wait();
    return std::make_unique<CpuCommunicator>(std::move(*child), engine_->options());
  }

  // Every collective below works on host tensors; `staging` swaps each device tensor for a
  // pinned host view (Staging, above), so the same bodies serve CUDA tensors.
  WorkHandle allreduce_async(Tensor& tensor, ReduceOp op) override {
    require_device(*this, "allreduce", tensor);
    require_reducible("allreduce", op, tensor);
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    Tensor target = stage(staging, tensor, true, true);
    return submit(Descriptor::of(OpKind::allreduce, tensor.dtype(), tensor.numel(), -1, static_cast<std::int64_t>(op)),
                  [this, target, op]() mutable { reduce_in_place(target, op); }, std::move(staging));
  }

  WorkHandle broadcast_async(Tensor& tensor, int root) override {
    require_device(*this, "broadcast", tensor);
    require_rank(*this, "broadcast", root, "root");
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    // Only the root's values travel; the others' are overwritten.
    Tensor target = stage(staging, tensor, rank() == root, rank() != root);
    Backend& backend = engine_->backend();
    return submit(Descriptor::of(OpKind::broadcast, tensor.dtype(), tensor.numel(), root),
                  [&backend, target, root] { backend.broadcast(target.data(), target.numel(), target.dtype(), root); },
                  std::move(staging));
  }

  WorkHandle allgather_async(const Tensor& input, Tensor& output) override {
    require_allgather(*this, input, output);
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    Tensor in = stage(staging, input, true, false);
    Tensor out = stage(staging, output, false, true);
    Backend& backend = engine_->backend();
    return submit(Descriptor::of(OpKind::allgather, input.dtype(), input.numel()),
                  [&backend, in, out] { backend.allgather(in.data(), out.data(), in.numel(), in.dtype()); },
                  std::move(staging));
  }

  WorkHandle allgatherv_async(const Tensor& input, Tensor& output, const std::vector<std::int64_t>& counts) override {
    const std::int64_t total = require_allgatherv(*this, input, output, counts);
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    Tensor in = stage(staging, input, true, false);
    Tensor out = stage(staging, output, false, true);
    Backend& backend = engine_->backend();
    return submit(Descriptor::of(OpKind::allgatherv, input.dtype(), total),
                  [&backend, in, out, counts] { backend.allgatherv(in.data(), out.data(), counts, in.dtype()); },
                  std::move(staging));
  }

  WorkHandle reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) override {
    require_reduce_scatter(*this, input, output, op);
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    Tensor in = stage(staging, input, true, false);
    Tensor out = stage(staging, output, false, true);
    return submit(Descriptor::of(OpKind::reduce_scatter, input.dtype(), input.numel(), -1, static_cast<std::int64_t>(op)),
                  [this, in, out, op]() mutable {
                    engine_->backend().reduce_scatter(in.data(), out.data(), out.numel(), in.dtype(), backend_op(op));
                    finish_average(out, op);
                  },
                  std::move(staging));
  }

  WorkHandle allreduce_coalesced_async(std::vector<Tensor> tensors, ReduceOp op) override {
    const std::int64_t total = require_coalesced(*this, tensors, op);
    const DType dtype = tensors[0].dtype();
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    std::vector<Tensor> targets;
    for (const Tensor& tensor : tensors) targets.push_back(stage(staging, tensor, true, true));
    return submit(Descriptor::of(OpKind::coalesced, dtype, total, -1, static_cast<std::int64_t>(op)),
                  [this, targets, total, dtype, op]() mutable {
                    // One flat buffer: one collective instead of one per tensor.
                    Tensor flat = Tensor::empty({total}, dtype);
                    std::int64_t offset = 0;
                    for (const Tensor& tensor : targets) {
                      flat.view(static_cast<std::size_t>(offset), {tensor.numel()}).copy_from(tensor.flatten());
                      offset += tensor.numel();
                    }
                    reduce_in_place(flat, op);
                    offset = 0;
                    for (Tensor& tensor : targets) {
                      tensor.flatten().copy_from(flat.view(static_cast<std::size_t>(offset), {tensor.numel()}));
                      offset += tensor.numel();
                    }
                  },
                  std::move(staging));
  }

  WorkHandle barrier_async() override {
    Backend& backend = engine_->backend();
    return submit(Descriptor::of(OpKind::barrier, DType::f32, 0), [&backend] { backend.barrier(); }, nullptr);
  }

  WorkHandle send_async(const Tensor& tensor, int peer, int tag) override {
    require_device(*this, "send", tensor);
    require_peer(*this, "send", peer);
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    Tensor source = stage(staging, tensor, true, false);
    Backend& backend = engine_->backend();
    return submit_p2p("send", tensor, peer, tag,
                      [&backend, source, peer, tag] { backend.send(source.data(), source.nbytes(), peer, tag); },
                      std::move(staging));
  }

  WorkHandle recv_async(Tensor& tensor, int peer, int tag) override {
    require_device(*this, "recv", tensor);
    require_peer(*this, "recv", peer);
    std::shared_ptr<Staging> staging;  // made only for a device tensor
    Tensor target = stage(staging, tensor, false, true);
    Backend& backend = engine_->backend();
    return submit_p2p("recv", tensor, peer, tag,
                      [&backend, target, peer, tag] { backend.recv(target.data(), target.nbytes(), peer, tag); },
                      std::move(staging));
  }

 private:
  // The tensor a collective's body works on: `tensor` itself on the host (no staging object, no
  // cost for host collectives), else its pinned host stand-in.
  static Tensor stage(std::shared_ptr<Staging>& staging, const Tensor& tensor, bool copy_in, bool copy_out) {
    if (tensor.device().is_cpu()) return tensor;
    if (staging == nullptr) staging = std::make_shared<Staging>();
    return staging->add(tensor, copy_in, copy_out);
  }

  WorkHandle submit(const Descriptor& descriptor, std::function<void()> body, std::shared_ptr<Staging> staging) {
    if (staging == nullptr) return engine_->submit_collective(descriptor, std::move(body), nullptr);
    return engine_->submit_collective(descriptor, staged(std::move(body), staging, op_kind_name(descriptor.kind)), staging);
  }

  WorkHandle submit_p2p(const char* op, const Tensor& tensor, int peer, int tag, std::function<void()> body,
                        std::shared_ptr<Staging> staging) {
    if (staging == nullptr) return engine_->submit_p2p(op, tensor, peer, tag, std::move(body), nullptr);
    return engine_->submit_p2p(op, tensor, peer, tag, staged(std::move(body), staging, op), staging);
  }

  // Starts the copies to the host now and wraps `body` in the wait for them and the copies back.
  std::function<void()> staged(std::function<void()> body, const std::shared_ptr<Staging>& staging, std::string what) {
    const int devices = cuda_device_count();
    GRADSYNC_CHECK(staging->device().index < devices, what, " on the ", engine_->backend().name(), " communicator of rank ",
                   rank(), ": ", staging->first_tensor(), " is not usable: ",
                   devices == 0 ? cuda_unavailable_reason() : std::to_string(devices) + " CUDA device(s) visible");
    StagingStreams& streams = streams_for(staging->device());
    staging->start(*streams.to_host, *streams.to_device);
    const auto timeout = engine_->timeout();
    return [body = std::move(body), staging, timeout, what = std::move(what)] {
      staging->before_wire(Clock::now() + timeout, what);
      body();
      staging->after_wire();
    };
  }

  // Two side streams per device: copies to the host and copies back overlap each other.
  struct StagingStreams {
    std::unique_ptr<detail::StagingStream> to_host;
    std::unique_ptr<detail::StagingStream> to_device;
  };
  StagingStreams& streams_for(Device device) {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    StagingStreams& streams = streams_[device.index];
    if (streams.to_host == nullptr) {
      streams.to_host = std::make_unique<detail::StagingStream>(device);
      streams.to_device = std::make_unique<detail::StagingStream>(device);
    }
    return streams;
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

  // Declared before engine_ so that they outlive it: the destructor stops the engine (its
  // thread queues copies on them) before any member goes.
  std::mutex streams_mutex_;
  std::map<int, StagingStreams> streams_;
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
