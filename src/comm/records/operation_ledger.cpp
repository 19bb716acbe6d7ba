// The operation ledger of a device communicator (operation_ledger.h).
#include "operation_ledger.h"

#include <algorithm>
#include <thread>

#include "gradsync/core/error.h"

namespace gradsync::comm {

std::shared_ptr<OperationLedger::Operation> OperationLedger::track(std::string description,
                                                                   std::function<bool()> completed) {
  std::shared_ptr<Operation> operation(new Operation(std::move(description), std::move(completed)));
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  // Forget the operations nobody holds any more, so the list stays as long as what is in flight.
  std::erase_if(in_flight_, [](const std::weak_ptr<Operation>& entry) { return entry.expired(); });
  if (!broken_.empty()) operation->verdict_ = Verdict::lost;
  in_flight_.push_back(operation);
  return operation;
}

OperationLedger::Verdict OperationLedger::poll(Operation& operation) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  // Decided under the lock that fail() decides under: a completion seen here happened before
  // any abort, or fail() has already marked the operation lost.
  if (operation.verdict_ == Verdict::pending && operation.completed_()) operation.verdict_ = Verdict::succeeded;
  return operation.verdict_;
}

void OperationLedger::wait(Operation& operation, std::chrono::milliseconds limit, const std::function<void()>& probe) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    switch (poll(operation)) {
      case Verdict::succeeded: return;
      case Verdict::lost:
        detail::throw_error(operation.description(), " was lost: the ", backend_,
                            " communicator was aborted before it completed, by an earlier failure: ", broken_reason());
      case Verdict::pending: break;
    }
    if (probe) probe();
    const auto elapsed = std::chrono::steady_clock::now() - start;
    if (elapsed > limit) {
      fail(operation.description() + " did not complete within " + std::to_string(limit.count()) +
               " ms: a peer may have skipped it, be stuck, or have died");
    }
    if (elapsed > std::chrono::seconds(1)) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    } else {
      std::this_thread::yield();
    }
  }
}

void OperationLedger::fail(const std::string& message) {
  {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (broken_.empty()) {
      broken_ = message;
      for (const std::weak_ptr<Operation>& entry : in_flight_) {
        if (auto operation = entry.lock(); operation && operation->verdict_ == Verdict::pending) {
          bool completed = false;
          try {
            completed = operation->completed_();
          } catch (...) {
            // A device that cannot even say: the operation is lost, and the abort must still run.
          }
          operation->verdict_ = completed ? Verdict::succeeded : Verdict::lost;
        }
      }
      in_flight_.clear();
      if (abort_) abort_();
    }
  }
  detail::throw_error(backend_, ": ", message);
}

void OperationLedger::require_usable(const std::string& what) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!broken_.empty()) detail::throw_error(what, ": the ", backend_, " communicator is broken by an earlier failure: ", broken_);
}

std::string OperationLedger::broken_reason() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  return broken_;
}

}  // namespace gradsync::comm
