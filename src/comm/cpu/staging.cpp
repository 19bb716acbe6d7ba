// Device tensors on a CPU backend (staging.h).
#include "staging.h"

#include "gradsync/core/device.h"
#include "gradsync/core/error.h"

namespace gradsync::comm {

Tensor Staging::add(const Tensor& tensor, bool copy_in, bool copy_out) {
  GRADSYNC_CHECK(entries_.empty() || tensor.device() == entries_.front().device.device(),
                 "one collective's tensors must be on one device: ", entries_.front().device.describe(), " and ",
                 tensor.describe());
  Entry entry{tensor, Tensor(), detail::lease_pinned(tensor.nbytes()), copy_in, copy_out};
  entry.host = Tensor::wrap(entry.buffer.data(), tensor.shape(), tensor.dtype());
  entries_.push_back(std::move(entry));
  return entries_.back().host;
}

void Staging::start(detail::StagingStream& to_host, detail::StagingStream& to_device) {
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

void Staging::before_wire(Clock::time_point deadline, const std::string& what) const {
  copied_in_->wait(deadline, what + ": the copy of its device tensors to the host");
}

void Staging::after_wire() {
  for (const Entry& entry : entries_) {
    if (entry.out) to_device_->copy_async(entry.device.data(), entry.host.data(), entry.device.nbytes());
  }
  copied_out_ = to_device_->record();
}

void Staging::wait_copies(Clock::time_point deadline, const std::string& what) const {
  if (copied_out_ != nullptr) copied_out_->wait(deadline, what + ": the copy of its result back to the device");
}

Staging::~Staging() {
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

Tensor stage(std::shared_ptr<Staging>& staging, const Tensor& tensor, bool copy_in, bool copy_out) {
  if (tensor.device().is_cpu()) return tensor;
  if (staging == nullptr) staging = std::make_shared<Staging>();
  return staging->add(tensor, copy_in, copy_out);
}

std::function<void()> StagingStreams::start(std::function<void()> body, const std::shared_ptr<Staging>& staging,
                                            std::string what, const std::string& who, std::chrono::milliseconds timeout) {
  const int devices = cuda_device_count();
  GRADSYNC_CHECK(staging->device().index < devices, what, " on ", who, ": ", staging->first_tensor(), " is not usable: ",
                 devices == 0 ? cuda_unavailable_reason() : std::to_string(devices) + " CUDA device(s) visible");
  Pair* pair = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pair = &streams_[staging->device().index];
    if (pair->to_host == nullptr) {
      pair->to_host = std::make_unique<detail::StagingStream>(staging->device());
      pair->to_device = std::make_unique<detail::StagingStream>(staging->device());
    }
  }
  staging->start(*pair->to_host, *pair->to_device);
  return [body = std::move(body), staging, timeout, what = std::move(what)] {
    staging->before_wire(Staging::Clock::now() + timeout, what);
    body();
    staging->after_wire();
  };
}

}  // namespace gradsync::comm
