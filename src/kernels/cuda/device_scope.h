// Internal: makes a CUDA device current for a scope and restores the previous one, and names
// the stream gradsync's kernels launch on there: the calling thread's current stream
// (gradsync/core/stream.h), which is the legacy default stream unless the engine set its own.
#pragma once

#include <cuda_runtime.h>

#include "../../core/cuda_check.h"
#include "gradsync/core/device.h"
#include "gradsync/core/stream.h"

namespace gradsync::kernels::cuda {

class DeviceScope {
 public:
  explicit DeviceScope(Device device) : stream_(static_cast<cudaStream_t>(current_cuda_stream(device))) {
    GRADSYNC_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device.index) GRADSYNC_CUDA_CHECK(cudaSetDevice(device.index));
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

  // nullptr (stream 0) is the legacy default stream.
  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t stream_;
  int previous_ = 0;
};

}  // namespace gradsync::kernels::cuda
