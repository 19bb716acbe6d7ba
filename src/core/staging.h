// Internal: what moves device tensors through host memory and back, for the communicators
// whose wire is host memory (Gloo, MPI) and for the NCCL communicator's small host-side
// control collectives.
//
//  * Buffers come from a process-wide pool, by power-of-two size class: page-locked host
//    memory (cudaHostAlloc: the only host memory a copy engine reads and writes without an
//    extra bounce, and the only kind an asynchronous copy stays asynchronous with) and device
//    memory. Allocating either per operation would cost more than a small collective, and
//    cudaFree/cudaFreeHost synchronise the whole device. Without a CUDA device the "pinned"
//    pool hands out ordinary aligned host memory: the same bookkeeping, tested on any machine.
//  * A StagingStream queues copies on a side stream of one device, after the work the caller
//    queued on its current stream (gradsync/core/stream.h), and records fences on it; a fence
//    is waited for with a deadline, so a copy stuck behind a hung kernel is an error, not a hang.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "gradsync/core/device.h"

namespace gradsync::detail {

// A buffer leased from the pool; it goes back there when the lease is destroyed. The holder
// must make sure no copy still reads or writes it by then (wait for the copy's fence).
class PooledBuffer {
 public:
  PooledBuffer() = default;
  PooledBuffer(PooledBuffer&& other) noexcept;
  PooledBuffer& operator=(PooledBuffer&& other) noexcept;
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;
  ~PooledBuffer();

  void* data() const { return data_; }
  std::size_t capacity() const { return capacity_; }
  // Where the memory is: Device::cpu() for pinned host memory, cuda:N for device memory.
  Device device() const { return device_; }

 private:
  friend PooledBuffer lease_pinned(std::size_t nbytes);
  friend PooledBuffer lease_device(std::size_t nbytes, Device device);
  PooledBuffer(void* data, std::size_t capacity, Device device) : data_(data), capacity_(capacity), device_(device) {}
  void* data_ = nullptr;
  std::size_t capacity_ = 0;
  Device device_;
};

PooledBuffer lease_pinned(std::size_t nbytes);                 // page-locked host memory
PooledBuffer lease_device(std::size_t nbytes, Device device);  // memory on a CUDA device

struct StagingPoolStats {
  std::size_t allocations = 0;   // buffers allocated since the process started
  std::size_t reuses = 0;        // leases served from a cached buffer
  std::size_t cached_bytes = 0;  // free buffers the pool holds
  std::size_t leased_bytes = 0;  // buffers out on lease now
  bool page_locked = false;      // host buffers are cudaHostAlloc'd (a CUDA device is there)
};
StagingPoolStats staging_pool_stats();
// The most bytes of free buffers the pool keeps (GRADSYNC_STAGING_POOL_MB, default 4096 MiB);
// a buffer returned beyond that is freed.
std::size_t staging_pool_limit();
// Frees every cached buffer (leases out stay valid and are freed when they come back).
void trim_staging_pool();

// A point on a StagingStream: done once every copy queued before it has finished.
class CopyFence {
 public:
  virtual ~CopyFence() = default;
  virtual bool done() const = 0;
  // Waits until done; past `deadline` throws an Error saying `what` did not finish.
  virtual void wait(std::chrono::steady_clock::time_point deadline, const std::string& what) const = 0;
};

class StagingStream {
 public:
  explicit StagingStream(Device device);  // a CUDA device; an Error without CUDA
  ~StagingStream();
  StagingStream(const StagingStream&) = delete;
  StagingStream& operator=(const StagingStream&) = delete;

  Device device() const { return device_; }
  // Later copies wait for what the calling thread has queued on its current stream so far.
  void order_after_current_stream();
  // Queues a copy of nbytes (host<->device in either direction, by the pointers).
  void copy_async(void* destination, const void* source, std::size_t nbytes);
  // A fence after everything queued so far.
  std::shared_ptr<CopyFence> record();

 private:
  Device device_;
  void* stream_ = nullptr;  // cudaStream_t
};

}  // namespace gradsync::detail
