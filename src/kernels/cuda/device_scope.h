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
  explicit DeviceScope(Device device)
      : guard_(device.index), stream_(static_cast<cudaStream_t>(current_cuda_stream(device))) {}

  // nullptr (stream 0) is the legacy default stream.
  cudaStream_t stream() const { return stream_; }

 private:
  detail::CudaDeviceGuard guard_;
  cudaStream_t stream_;
};

}  // namespace gradsync::kernels::cuda
