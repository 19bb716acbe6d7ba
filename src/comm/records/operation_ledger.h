// Internal: the operations a device communicator (NCCL) has queued on the GPU, and what became
// of each one when the communicator aborted. No CUDA here: completion is a callback (a CUDA
// event query in NCCL), so the logic is unit-tested on any machine (tests/unit/test_staging.cpp).
//
// Why a ledger: aborting an NCCL communicator (after a timeout or an asynchronous error) ends
// its kernels, and the CUDA events behind them then complete as if the operations had. A Work
// that only polled its event would report success for data that was never reduced. So when the
// communicator fails, under one lock and before the abort, every tracked operation gets its
// verdict: complete now means it succeeded; anything else is lost, for good. A Work whose
// verdict is "lost" fails naming the original failure, whatever its event says afterwards.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace gradsync::comm {

class OperationLedger {
 public:
  enum class Verdict { pending, succeeded, lost };

  class Operation {
   public:
    const std::string& description() const { return description_; }

   private:
    friend class OperationLedger;
    Operation(std::string description, std::function<bool()> completed)
        : description_(std::move(description)), completed_(std::move(completed)) {}
    std::string description_;
    std::function<bool()> completed_;
    Verdict verdict_ = Verdict::pending;  // guarded by the ledger's mutex
  };

  // `abort` runs once, on the first failure, under the lock (NCCL: ncclCommAbort).
  OperationLedger(std::string backend, std::function<void()> abort)
      : backend_(std::move(backend)), abort_(std::move(abort)) {}

  // A newly queued operation; `completed` says whether the device has finished it.
  std::shared_ptr<Operation> track(std::string description, std::function<bool()> completed);

  // The operation's state now: succeeded once the device finished it before any failure;
  // lost if the communicator failed first (whether or not its event fired since).
  Verdict poll(Operation& operation);
  // True once poll() says anything but pending (what Work::is_completed reports).
  bool settled(Operation& operation) { return poll(operation) != Verdict::pending; }

  // Waits for the operation: returns once it succeeded; throws naming the original failure if
  // it is lost; after `limit`, fails the communicator (which aborts it) and throws. `probe`
  // runs on every poll and may call fail() (NCCL's asynchronous error state).
  void wait(Operation& operation, std::chrono::milliseconds limit, const std::function<void()>& probe);

  // The first failure breaks the communicator: every tracked operation gets its verdict, then
  // the abort action runs (once, under the lock, so nothing enqueues meanwhile). Always throws
  // an Error with `message`; later calls keep the first reason.
  [[noreturn]] void fail(const std::string& message);

  // Throws (naming the first failure) once the communicator is broken.
  void require_usable(const std::string& what);
  std::string broken_reason();

  // Held while a caller hands an operation to the device, so that an abort on another thread
  // waits until the hand-over is done (NCCL forbids using a communicator while aborting it).
  std::recursive_mutex& mutex() { return mutex_; }

 private:
  std::string backend_;
  std::function<void()> abort_;
  std::recursive_mutex mutex_;
  std::string broken_;
  std::vector<std::weak_ptr<Operation>> in_flight_;
};

}  // namespace gradsync::comm
