// Internal: the progress engine of a CPU communicator. The caller's thread validates and
// enqueues; one communication thread per communicator runs the operations in submission order
// (so every rank issues its collectives in the same order, and overlap with the caller is
// free), and completes the Work handles. A failure breaks the engine: later operations fail at
// once with the first error instead of running out of step with the other ranks. Before every
// collective the ranks check that they run the same one (verify()).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "comm/algorithms/ordered_reduce.h"
#include "backend.h"
#include "comm/collective.h"
#include "staging.h"
#include "comm/records/flight_recorder.h"

namespace gradsync::comm {

class Engine;
using Clock = std::chrono::steady_clock;

// The Work of a CPU operation: completed by the communication thread, or cancelled.
class CpuWork final : public Work, public std::enable_shared_from_this<CpuWork> {
 public:
  // A collective is described from its Descriptor, and only when somebody asks (an error, a
  // timeout, description()): formatting costs about a microsecond, a small collective a few.
  CpuWork(std::optional<Descriptor> descriptor, std::string description, std::chrono::milliseconds default_timeout,
          std::weak_ptr<Engine> engine);

  bool is_completed() const override;
  void wait(std::chrono::milliseconds timeout) override;
  const std::string& description() const override;

  // Set before the Work is queued, for an operation on device tensors.
  void set_staging(std::shared_ptr<Staging> staging) { staging_ = std::move(staging); }
  // Its entry in the engine's flight recorder.
  void set_record(std::int64_t record) { record_ = record; }
  std::int64_t record() const { return record_; }
  void complete(std::exception_ptr error);
  // Blocks until the communication thread has let go of the operation (it was aborted).
  bool wait_done_until(Clock::time_point deadline);

 private:
  std::optional<Descriptor> descriptor_;
  mutable std::string description_;
  mutable std::once_flag described_;
  std::chrono::milliseconds default_timeout_;
  Clock::time_point issued_;
  std::weak_ptr<Engine> engine_;
  std::shared_ptr<Staging> staging_;
  std::int64_t record_ = -1;
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
  // `name` tells this communicator's flight record from the others' (comm/records/flight_recorder.h): the
  // same on every rank, "" for a top-level communicator.
  Engine(std::unique_ptr<Backend> backend, const CommOptions& options, const std::string& name);

  void start();
  // The communicator goes away: nothing queued runs (each fails, naming why), the operation in
  // flight is aborted, and the thread ends. Bounded by the backend's timeout at worst.
  void stop();

  Backend& backend() { return *backend_; }
  const Backend& backend() const { return *backend_; }
  const CommOptions& options() const { return options_; }
  std::string broken_reason() const;
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Reproducible mode (CommOptions::reproducible or GRADSYNC_REPRODUCIBLE): the reductions add
  // in rank order (algorithms/ordered_reduce.h), with this algorithm.
  bool reproducible() const { return reproducible_; }
  algorithms::OrderedAlgorithm ordered_algorithm() const { return ordered_algorithm_; }
  FlightRecorder& recorder() { return *recorder_; }
  // The name of the next duplicate of this communicator (the same on every rank: duplicate() is
  // collective and numbered in order).
  std::string next_duplicate_name() { return recorder_->name() + "/" + std::to_string(++duplicates_); }
  // The name of a split's communicator: its color among this communicator's splits, numbered.
  std::string next_split_name(int color) {
    return recorder_->name() + "/split" + std::to_string(++splits_) + "." + std::to_string(color);
  }

  // Queue an operation (or run it on the calling thread: see submit()). Collectives get the next
  // collective sequence number; point-to-point operations are numbered on their own.
  WorkHandle submit_collective(Descriptor descriptor, std::function<void()> body, std::shared_ptr<Staging> staging);
  WorkHandle submit_p2p(const char* op, const Tensor& tensor, int peer, int tag, std::function<void()> body,
                        std::shared_ptr<Staging> staging);

  // A wait expired (called by the Work): break the communicator so that nothing later runs out
  // of step, and make sure the operation no longer touches its buffers: a queued one is
  // dropped, a running one is aborted and waited for (bounded by the backend's own timeout:
  // Gloo's own collectives cannot be interrupted). An operation running ahead of a queued one
  // is aborted too: the communicator is broken, it has no future. Returns what to add to the
  // error (where the flight record was dumped, if it was).
  std::string expire(const std::shared_ptr<CpuWork>& work, const std::string& message, Clock::time_point issued);

 private:
  struct Task {
    std::shared_ptr<CpuWork> work;
    std::optional<Descriptor> descriptor;  // collectives only
    std::function<void()> body;
  };

  std::exception_ptr broken_error(const std::string& description) const;
  WorkHandle submit(std::string description, const FlightRecorder::Operation& record,
                    std::optional<Descriptor> descriptor, std::function<void()> body, std::optional<Task>& inline_task,
                    std::shared_ptr<Staging> staging);
  void run_inline(Task& task);
  void run();
  void execute(Task& task);
  void verify(const Descriptor& mine);

  std::unique_ptr<Backend> backend_;
  CommOptions options_;
  std::shared_ptr<FlightRecorder> recorder_;
  int duplicates_ = 0;
  int splits_ = 0;
  std::chrono::milliseconds timeout_;
  bool check_agreement_ = false;
  bool verify_ = true;
  bool reproducible_ = false;
  algorithms::OrderedAlgorithm ordered_algorithm_ = algorithms::OrderedAlgorithm::owner;

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

}  // namespace gradsync::comm
