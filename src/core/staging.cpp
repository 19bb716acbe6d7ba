// The staging pool and the staging streams (staging.h).
#include "staging.h"

#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "device_memory.h"
#include "environment.h"
#include "gradsync/config.h"
#include "gradsync/core/error.h"
#include "gradsync/core/stream.h"

#if GRADSYNC_WITH_CUDA
#include "cuda_check.h"
#endif

namespace gradsync::detail {

namespace {

constexpr std::size_t kSmallestClass = 4096;

// Size classes are powers of two from 4 KiB: a lease wastes less than half its buffer, and a
// training loop that stages the same buckets every step hits the same few classes.
std::size_t class_size(std::size_t nbytes) {
  std::size_t size = kSmallestClass;
  while (size < nbytes) size <<= 1;
  return size;
}

bool host_buffers_page_locked() {
  static const bool page_locked = cuda_device_count() > 0;
  return page_locked;
}

void* allocate(std::size_t nbytes, Device device) {
#if GRADSYNC_WITH_CUDA
  if (device.is_cpu() && host_buffers_page_locked()) {
    void* data = nullptr;
    const cudaError_t status = cudaHostAlloc(&data, nbytes, cudaHostAllocPortable);
    if (status != cudaSuccess) {
      cudaGetLastError();
      throw_error("cudaHostAlloc of ", nbytes, " bytes of page-locked staging memory failed: ",
                  cudaGetErrorString(status));
    }
    return data;
  }
#endif
  return device_allocate(nbytes, device);
}

void release(void* data, Device device) noexcept {
#if GRADSYNC_WITH_CUDA
  if (device.is_cpu() && host_buffers_page_locked()) {
    cudaFreeHost(data);  // never throws from a destructor; a failure at shutdown is harmless
    return;
  }
#endif
  device_free(data, device);
}

class Pool {
 public:
  std::pair<void*, std::size_t> take(std::size_t nbytes, Device device) {
    const std::size_t size = class_size(nbytes);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& free = free_[{key(device), size}];
      if (!free.empty()) {
        void* data = free.back();
        free.pop_back();
        stats_.cached_bytes -= size;
        stats_.leased_bytes += size;
        ++stats_.reuses;
        return {data, size};
      }
    }
    void* data = allocate(size, device);  // outside the lock: cudaHostAlloc can take milliseconds
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.leased_bytes += size;
    ++stats_.allocations;
    return {data, size};
  }

  void give_back(void* data, std::size_t size, Device device) noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stats_.leased_bytes -= size;
      if (stats_.cached_bytes + size <= staging_pool_limit()) {
        free_[{key(device), size}].push_back(data);
        stats_.cached_bytes += size;
        return;
      }
    }
    release(data, device);
  }

  void trim() {
    std::map<std::pair<int, std::size_t>, std::vector<void*>> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      dropped.swap(free_);
      stats_.cached_bytes = 0;
    }
    for (auto& [where, buffers] : dropped) {
      for (void* data : buffers) release(data, where.first < 0 ? Device::cpu() : Device::cuda(where.first));
    }
  }

  StagingPoolStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    StagingPoolStats copy = stats_;
    copy.page_locked = host_buffers_page_locked();
    return copy;
  }

 private:
  static int key(Device device) { return device.is_cpu() ? -1 : device.index; }

  std::mutex mutex_;
  std::map<std::pair<int, std::size_t>, std::vector<void*>> free_;  // (device or -1, class) -> buffers
  StagingPoolStats stats_;
};

// Never destroyed: leases may come back from other static destructors, and freeing device
// memory after the CUDA runtime has shut down is an error. The buffers stay reachable.
Pool& pool() {
  static Pool* instance = new Pool();
  return *instance;
}

}  // namespace

PooledBuffer::PooledBuffer(PooledBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), capacity_(std::exchange(other.capacity_, 0)), device_(other.device_) {}

PooledBuffer& PooledBuffer::operator=(PooledBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) pool().give_back(data_, capacity_, device_);
    data_ = std::exchange(other.data_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
    device_ = other.device_;
  }
  return *this;
}

PooledBuffer::~PooledBuffer() {
  if (data_ != nullptr) pool().give_back(data_, capacity_, device_);
}

PooledBuffer lease_pinned(std::size_t nbytes) {
  const auto [data, capacity] = pool().take(nbytes, Device::cpu());
  return PooledBuffer(data, capacity, Device::cpu());
}

PooledBuffer lease_device(std::size_t nbytes, Device device) {
  GRADSYNC_CHECK(device.is_cuda(), "lease_device: expected a CUDA device, got ", device.str());
  const auto [data, capacity] = pool().take(nbytes, device);
  return PooledBuffer(data, capacity, device);
}

StagingPoolStats staging_pool_stats() { return pool().stats(); }

std::size_t staging_pool_limit() {
  static const std::size_t limit = environment::staging_pool_bytes();
  return limit;
}

void trim_staging_pool() { pool().trim(); }

// ---- Staging streams --------------------------------------------------------------------

#if GRADSYNC_WITH_CUDA

namespace {

// An event on one device; queried with that device current (the polling thread may be any:
// the communication thread, a Work's waiter, a destructor).
class EventFence final : public CopyFence {
 public:
  explicit EventFence(int device) : device_(device) {
    CudaDeviceGuard guard(device_);
    GRADSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~EventFence() override { cudaEventDestroy(event_); }
  cudaEvent_t event() const { return event_; }

  bool done() const override {
    CudaDeviceGuard guard(device_);
    return cudaEventQuery(event_) == cudaSuccess;
  }

  void wait(std::chrono::steady_clock::time_point deadline, const std::string& what) const override {
    CudaDeviceGuard guard(device_);
    for (int polls = 0;; ++polls) {
      const cudaError_t status = cudaEventQuery(event_);
      if (status == cudaSuccess) return;
      if (status != cudaErrorNotReady) {
        throw_error(what, ": CUDA reported ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ")");
      }
      if (std::chrono::steady_clock::now() > deadline) {
        throw_error(what, " did not finish in time: the device is stuck behind earlier work");
      }
      // Copies take microseconds to milliseconds: spin briefly, then stop burning a core.
      if (polls < 1000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
};

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

}  // namespace

StagingStream::StagingStream(Device device) : device_(device) {
  GRADSYNC_CHECK(device.is_cuda(), "StagingStream: expected a CUDA device, got ", device.str());
  GRADSYNC_CHECK(device.index < cuda_device_count(), "device ", device.str(), " is not usable: ",
                 cuda_device_count() == 0 ? cuda_unavailable_reason() : "no such device");
  CudaDeviceGuard guard(device.index);
  cudaStream_t stream = nullptr;
  GRADSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_ = stream;
}

StagingStream::~StagingStream() {
  cudaStreamSynchronize(as_stream(stream_));  // nothing queued may outlive its buffers' owners
  cudaStreamDestroy(as_stream(stream_));
}

void StagingStream::order_after_current_stream() {
  CudaDeviceGuard guard(device_.index);
  EventFence caller(device_.index);
  void* current = current_cuda_stream(device_);
  GRADSYNC_CUDA_CHECK(cudaEventRecord(caller.event(), current != nullptr ? as_stream(current) : cudaStreamLegacy));
  GRADSYNC_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream_), caller.event(), 0));
  // Destroying the event now is allowed: the wait holds on to the recorded work.
}

void StagingStream::copy_async(void* destination, const void* source, std::size_t nbytes) {
  if (nbytes == 0) return;
  CudaDeviceGuard guard(device_.index);
  GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(destination, source, nbytes, cudaMemcpyDefault, as_stream(stream_)));
}

std::shared_ptr<CopyFence> StagingStream::record() {
  CudaDeviceGuard guard(device_.index);
  auto fence = std::make_shared<EventFence>(device_.index);
  GRADSYNC_CUDA_CHECK(cudaEventRecord(fence->event(), as_stream(stream_)));
  return fence;
}

#else  // built without CUDA: no device tensor can exist, so no stream is ever asked for

StagingStream::StagingStream(Device device) : device_(device) {
  throw_error("StagingStream on ", device.str(), ": gradsync was built without CUDA (reconfigure with -Dcuda=enabled)");
}
StagingStream::~StagingStream() = default;
void StagingStream::order_after_current_stream() {}
void StagingStream::copy_async(void*, const void*, std::size_t) {}
std::shared_ptr<CopyFence> StagingStream::record() { return nullptr; }

#endif

}  // namespace gradsync::detail
