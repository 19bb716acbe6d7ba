// A reduce hook run off the caller's thread (off_thread.h).
#include "off_thread.h"

#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace gradsync::dist {

namespace {

// One bucket's reduction as the Reducer waits for it: completed by the hook's thread.
class HookWork final : public comm::Work {
 public:
  explicit HookWork(std::string description) : description_(std::move(description)) {}
  bool is_completed() const override {
    const std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  // The hook's collectives have the communicator's timeout: the wait is bounded by them.
  void wait(std::chrono::milliseconds) override {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  const std::string& description() const override { return description_; }
  void complete(std::exception_ptr error) {
    const std::lock_guard<std::mutex> lock(mutex_);
    error_ = std::move(error);
    done_ = true;
    changed_.notify_all();
  }

 private:
  std::string description_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  bool done_ = false;
  std::exception_ptr error_;
};

// The hook's thread and its queue of buckets.
class HookThread {
 public:
  HookThread(ReduceHook hook, std::unique_ptr<comm::Communicator> comm)
      : hook_(std::move(hook)), comm_(std::move(comm)), thread_([this] { run(); }) {}
  // Runs what is queued first (each bucket writes into a buffer its Reducer waits on), then ends.
  ~HookThread() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      changed_.notify_all();
    }
    thread_.join();
  }
  HookThread(const HookThread&) = delete;
  HookThread& operator=(const HookThread&) = delete;

  comm::WorkHandle submit(Tensor& flat, const BucketInfo& info) {
    auto work = std::make_shared<HookWork>("reduce hook of bucket " + std::to_string(info.index) + " (off the caller's thread)");
    const std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back({&flat, info, work});
    changed_.notify_all();
    return work;
  }

 private:
  struct Task {
    Tensor* flat;     // the caller's: it stays until the bucket's Work completes (the Reducer waits)
    BucketInfo info;  // a copy: the caller's may be a temporary
    std::shared_ptr<HookWork> work;
  };

  void run() {
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopped, nothing left
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr error;
      try {
        const comm::WorkHandle inner = hook_(*comm_, *task.flat, task.info);
        GRADSYNC_CHECK(inner != nullptr, "the reduce hook returned no Work for bucket ", task.info.index);
        inner->wait();
      } catch (...) {
        error = std::current_exception();
      }
      task.work->complete(error);
    }
  }

  ReduceHook hook_;
  std::unique_ptr<comm::Communicator> comm_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Task> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: it starts once the rest is there
};

}  // namespace

ReduceHook off_thread(ReduceHook hook) {
  // Shared by the copies of the returned function (a ReduceHook is copyable); made at the first
  // host bucket.
  auto thread = std::make_shared<std::unique_ptr<HookThread>>();
  return [hook = std::move(hook), thread](comm::Communicator& comm, Tensor& flat, const BucketInfo& info) -> comm::WorkHandle {
    if (!flat.device().is_cpu() || comm.size() == 1) return hook(comm, flat, info);
    if (*thread == nullptr) *thread = std::make_unique<HookThread>(hook, comm.duplicate());
    return (*thread)->submit(flat, info);
  };
}

}  // namespace gradsync::dist
