// The progress engine of a CPU communicator (engine.h).
#include "engine.h"

#include <atomic>
#include <sstream>

#include "core/environment.h"
#include "gradsync/core/timeline.h"

namespace gradsync::comm {

namespace {
// Extra time a Work's own deadline allows beyond the backend's timeout, so that the backend's
// error (which says more: which step, which peer) is the one a caller usually sees.
constexpr std::chrono::milliseconds kWaitGrace{2000};
}  // namespace

CpuWork::CpuWork(std::optional<Descriptor> descriptor, std::string description,
                 std::chrono::milliseconds default_timeout, std::weak_ptr<Engine> engine)
    : descriptor_(std::move(descriptor)), description_(std::move(description)), default_timeout_(default_timeout),
      issued_(Clock::now()), engine_(std::move(engine)) {}

bool CpuWork::is_completed() const {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_) return false;
    if (error_) return true;  // completed, with an error that wait() rethrows
  }
  return staging_ == nullptr || staging_->copies_done();
}

const std::string& CpuWork::description() const {
  std::call_once(described_, [&] {
    if (descriptor_) description_ = descriptor_->str();
  });
  return description_;
}

void CpuWork::complete(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    done_ = true;
    error_ = std::move(error);
  }
  done_changed_.notify_all();
}

bool CpuWork::wait_done_until(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  return done_changed_.wait_until(lock, deadline, [&] { return done_; });
}

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
  std::string record;
  if (auto engine = engine_.lock()) record = engine->expire(shared_from_this(), message.str(), issued_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_ || error_) throw Error(message.str() + record);
  }
  // It finished after all, just before it could be cancelled.
  if (staging_ != nullptr) staging_->wait_copies(Clock::now() + default_timeout_, description());
}

Engine::Engine(std::unique_ptr<Backend> backend, const CommOptions& options, const std::string& name)
    : backend_(std::move(backend)), options_(options), timeout_(resolve_timeout(options.timeout)) {
  recorder_ = FlightRecorder::create(name, backend_->rank(), backend_->size(), backend_->name());
  check_agreement_ = options.check_agreement || environment::debug_collectives();
  verify_ = options.verify && environment::verify_collectives();
  reproducible_ = options.reproducible || environment::reproducible();
  if (environment::reproducible_chain()) ordered_algorithm_ = algorithms::OrderedAlgorithm::chain;
  backend_->set_timeout(timeout_);
}

void Engine::start() {
  timeline::start_from_environment(backend_->rank());  // GRADSYNC_TIMELINE: now the rank is known
  worker_ = std::thread([self = shared_from_this()] { self->run(); });
}

void Engine::stop() {
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

std::string Engine::broken_reason() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return broken_;
}

WorkHandle Engine::submit_collective(Descriptor descriptor, std::function<void()> body, std::shared_ptr<Staging> staging) {
  std::optional<Task> inline_task;
  WorkHandle work;
  {
    std::lock_guard<std::mutex> lock(submit_mutex_);
    descriptor.seq = collective_sequence_++;
    work = submit(std::string(), {.collective = descriptor}, descriptor, std::move(body), inline_task, std::move(staging));
  }
  if (inline_task) run_inline(*inline_task);
  return work;
}

WorkHandle Engine::submit_p2p(const char* op, const Tensor& tensor, int peer, int tag, std::function<void()> body,
                              std::shared_ptr<Staging> staging) {
  std::optional<Task> inline_task;
  WorkHandle work;
  {
    std::lock_guard<std::mutex> lock(submit_mutex_);
    const Descriptor what{p2p_sequence_, 0, static_cast<std::int64_t>(tensor.dtype()), tensor.numel(), -1, -1};
    work = submit(describe_p2p(op, p2p_sequence_++, tensor, peer, tag), {.collective = what, .p2p = op, .peer = peer, .tag = tag},
                  std::nullopt, std::move(body), inline_task, std::move(staging));
  }
  if (inline_task) run_inline(*inline_task);
  return work;
}

std::string Engine::expire(const std::shared_ptr<CpuWork>& work, const std::string& message, Clock::time_point issued) {
  recorder_->failed(work->record(), message, /*timed_out=*/true);
  const std::string record = recorder_->on_failure(message);
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
    work->complete(std::make_exception_ptr(Error(message + record)));
    return record;
  }
  work->wait_done_until(issued + timeout_ + 2 * kWaitGrace);
  return record;
}

std::exception_ptr Engine::broken_error(const std::string& description) const {
  return std::make_exception_ptr(Error(description + ": the " + backend_->name() +
                                       " communicator is broken by an earlier failure: " + broken_));
}

// Queues an operation for the communication thread, or, when the caller is about to wait for
// it (CallerWaits) and nothing is queued or running, hands it back in `inline_task` to run on
// the calling thread: it then counts as running, so anything submitted meanwhile queues
// behind it and the communication thread waits for it.
WorkHandle Engine::submit(std::string description, const FlightRecorder::Operation& record,
                          std::optional<Descriptor> descriptor, std::function<void()> body,
                          std::optional<Task>& inline_task, std::shared_ptr<Staging> staging) {
  auto work = std::make_shared<CpuWork>(descriptor, std::move(description), timeout_ + kWaitGrace, weak_from_this());
  work->set_staging(std::move(staging));
  work->set_record(recorder_->issued(record));
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

void Engine::run_inline(Task& task) {
  ThreadRankScope label(backend_->world_rank(backend_->rank()));
  execute(task);
}

// The communication thread: runs the queue in order; the first failure breaks everything after.
void Engine::run() {
  ThreadRankScope label(backend_->world_rank(backend_->rank()));
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
void Engine::execute(Task& task) {
  std::exception_ptr failure;
  try {
    // On the timeline: the operation on the wire, on whichever thread runs it.
    timeline::Span wire("wire", [&] { return task.work->description(); }, 0);
    recorder_->started(task.work->record());
    if (task.descriptor) verify(*task.descriptor);
    task.body();
    recorder_->completed(task.work->record());
  } catch (const std::exception& error) {
    const std::string message = task.work->description() + " failed: " + backend_->explain(error.what());
    recorder_->failed(task.work->record(), message, /*timed_out=*/false);
    // The first failure dumps this rank's flight record (when asked to), and says where.
    const Error wrapped(message + recorder_->on_failure(message));
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
void Engine::verify(const Descriptor& mine) {
  if (backend_->size() == 1) return;
  if (!check_agreement_) {
    if (!verify_) return;
    // A rank in reproducible mode reduces with other messages than one that is not: the mode
    // is part of what must agree (flipping the top bit of 62 keeps -f from overflowing).
    const std::int64_t fingerprint = mine.fingerprint() ^ (reproducible_ ? (std::int64_t{1} << 61) : 0);
    std::int64_t words[2] = {fingerprint, -fingerprint};
    backend_->allreduce(words, 2, DType::i64, ReduceOp::max);
    if (words[0] == -words[1]) return;
  }
  std::vector<Descriptor> all(static_cast<std::size_t>(backend_->size()));
  backend_->allgather(&mine, all.data(), kDescriptorWords, DType::i64);
  require_agreement(mine, all, backend_->rank());
  // The descriptors agree. Without debug mode the fingerprints differed all the same: only the
  // mode can be left. In debug mode nothing has compared the modes yet.
  if (check_agreement_) {
    std::int64_t modes[2] = {reproducible_ ? 1 : 0, reproducible_ ? -1 : 0};
    backend_->allreduce(modes, 2, DType::i64, ReduceOp::max);
    if (modes[0] == -modes[1]) return;
  }
  detail::throw_error("collective mismatch: every rank runs ", mine.str(),
                      ", but not every rank is in reproducible mode (this rank ", backend_->rank(),
                      reproducible_ ? " is" : " is not",
                      "): set CommOptions::reproducible or GRADSYNC_REPRODUCIBLE the same on every rank");
}

}  // namespace gradsync::comm
