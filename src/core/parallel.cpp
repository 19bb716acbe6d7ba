// The thread pool (core/parallel.h, gradsync/core/threads.h).
//
// A fixed set of workers sleeps on a condition variable. A job is a count of tasks and a
// function; workers and the calling thread claim task indices from one atomic counter until
// none are left, and the caller waits until every claimed task has finished. One job runs at a
// time (a mutex serializes callers from several threads); tasks never call back into the pool.
#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <sched.h>

#include "environment.h"
#include "gradsync/core/error.h"
#include "gradsync/core/threads.h"

namespace gradsync {

namespace {

int cores_available() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

std::atomic<int> configured{0};  // 0: not set by set_num_threads

class Pool {
 public:
  static Pool& instance() {
    static Pool pool;
    return pool;
  }

  void run(std::int64_t count, int threads, const std::function<void(std::int64_t)>& task) {
    std::lock_guard<std::mutex> serial(serial_);
    ensure_workers(threads - 1);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = &task;
      count_ = count;
      next_.store(0);
      finished_ = 0;
      error_ = nullptr;
      participants_ = std::min<std::int64_t>(threads - 1, count - 1);
      active_workers_ = participants_;
      ++generation_;
    }
    wake_.notify_all();
    work();  // the caller claims tasks too
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return finished_ == count_ && active_workers_ == 0; });
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (std::thread& worker : workers_) worker.join();
  }

 private:
  void ensure_workers(int wanted) {
    while (static_cast<int>(workers_.size()) < wanted) {
      const std::size_t id = workers_.size();
      workers_.emplace_back([this, id] { worker_loop(id); });
    }
  }

  // Claims and runs tasks of the current job until none are left.
  void work() {
    for (;;) {
      const std::int64_t index = next_.fetch_add(1);
      if (index >= count_) return;
      try {
        (*task_)(index);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex_);
      if (++finished_ == count_) done_.notify_all();
    }
  }

  void worker_loop(std::size_t id) {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        // Only the job's first `participants_` workers join it: the rest stay asleep. The
        // caller waits for all of them, so none can still be in an earlier job.
        wake_.wait(lock, [&] {
          return stopping_ || (generation_ != seen && static_cast<std::int64_t>(id) < participants_);
        });
        if (stopping_) return;
        seen = generation_;
      }
      work();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--active_workers_ == 0) done_.notify_all();
    }
  }

  std::mutex serial_;  // one job at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  const std::function<void(std::int64_t)>* task_ = nullptr;
  std::int64_t count_ = 0;
  std::atomic<std::int64_t> next_{0};
  std::int64_t finished_ = 0;
  std::int64_t participants_ = 0;    // workers taking part in the current job
  std::int64_t active_workers_ = 0;  // participants that have not finished it yet
  std::uint64_t generation_ = 0;
  std::exception_ptr error_;
  bool stopping_ = false;
};

}  // namespace

int default_num_threads() {
  if (const int forced = environment::num_threads()) return forced;
  // The cores are shared by every rank of this machine.
  return std::max(1, cores_available() / std::max(1, environment::local_world_size()));
}

int num_threads() {
  const int set = configured.load();
  if (set > 0) return set;
  static const int fallback = default_num_threads();
  return fallback;
}

void set_num_threads(int n) {
  GRADSYNC_CHECK(n >= 1, "set_num_threads(", n, "): at least one thread");
  configured.store(n);
}

namespace parallel {

void for_each_task(std::int64_t count, const std::function<void(std::int64_t)>& task) {
  if (count <= 0) return;
  const int threads = static_cast<int>(std::min<std::int64_t>(num_threads(), count));
  if (threads <= 1) {
    for (std::int64_t i = 0; i < count; ++i) task(i);
    return;
  }
  Pool::instance().run(count, threads, task);
}

void parallel_for(std::int64_t n, std::int64_t grain, std::int64_t align,
                  const std::function<void(std::int64_t, std::int64_t)>& body) {
  if (n <= 0) return;
  const std::int64_t threads = num_threads();
  // One chunk per thread, each at least `grain`, boundaries on multiples of `align`.
  std::int64_t chunks = std::min<std::int64_t>(threads, std::max<std::int64_t>(1, n / std::max<std::int64_t>(grain, 1)));
  if (chunks <= 1) return body(0, n);
  std::int64_t size = (n + chunks - 1) / chunks;
  size = (size + align - 1) / align * align;
  chunks = (n + size - 1) / size;
  for_each_task(chunks, [&](std::int64_t c) { body(c * size, std::min(n, (c + 1) * size)); });
}

}  // namespace parallel
}  // namespace gradsync
