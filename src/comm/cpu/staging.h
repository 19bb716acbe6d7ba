// Internal: device tensors on a CPU backend (docs/communication.md, "Device tensors on Gloo and
// MPI"): each one is staged through a pooled page-locked host buffer, as PyTorch's Gloo backend
// does.
//  1. At submission, on the caller's thread: the copies to the host are queued on a side
//     stream of the tensor's device, after the caller's current stream (so they see the
//     gradient its kernels wrote), and a fence is recorded. They run while earlier operations
//     are still on the wire.
//  2. On the communication thread: wait for that fence (bounded by the timeout), run the host
//     collective on the pinned buffers, queue the copies back on a second side stream (the
//     next operation's copy to the host goes the other way at the same time) and fence them.
//  3. Work::wait returns, and is_completed() says true, only once the copies back have landed.
// Host tensors pass through untouched (no Staging object at all); the collective's body never
// knows the difference.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/staging.h"
#include "gradsync/core/tensor.h"

namespace gradsync::comm {

// One operation's device tensors and their pinned stand-ins.
class Staging {
 public:
  using Clock = std::chrono::steady_clock;

  // The tensor the collective's body works on: a host view of a pinned buffer that is filled
  // from `tensor` (copy_in) and copied back to it (copy_out). `tensor` is on a CUDA device.
  Tensor add(const Tensor& tensor, bool copy_in, bool copy_out);

  Device device() const { return entries_.front().device.device(); }
  std::string first_tensor() const { return entries_.front().device.describe(); }

  // Step 1, on the caller's thread.
  void start(detail::StagingStream& to_host, detail::StagingStream& to_device);
  // Step 2, on the communication thread: before and after the wire.
  void before_wire(Clock::time_point deadline, const std::string& what) const;
  void after_wire();
  // Step 3.
  bool copies_done() const { return copied_out_ == nullptr || copied_out_->done(); }
  void wait_copies(Clock::time_point deadline, const std::string& what) const;

  // The pinned buffers go back to the pool only once no copy touches them (a Work dropped
  // unwaited, or an operation that never ran).
  ~Staging();

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

// The tensor a collective's body works on: `tensor` itself on the host (no staging object, no
// cost for host collectives), else its pinned host stand-in in `staging` (made on first use).
Tensor stage(std::shared_ptr<Staging>& staging, const Tensor& tensor, bool copy_in, bool copy_out);

// A communicator's side streams, two per device so that copies to the host and copies back
// overlap each other.
class StagingStreams {
 public:
  // Starts the copies to the host now, and returns `body` wrapped in the wait for them and the
  // copies back. `who` names the communicator in errors ("the gloo communicator of rank 1").
  std::function<void()> start(std::function<void()> body, const std::shared_ptr<Staging>& staging, std::string what,
                              const std::string& who, std::chrono::milliseconds timeout);

 private:
  struct Pair {
    std::unique_ptr<detail::StagingStream> to_host;
    std::unique_ptr<detail::StagingStream> to_device;
  };
  std::mutex mutex_;
  std::map<int, Pair> streams_;  // by device index
};

}  // namespace gradsync::comm
