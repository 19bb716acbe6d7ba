// Internal: makes a CUDA device current for a scope and restores the previous one.
#pragma once

#include <cuda_runtime.h>

#include "../../core/cuda_check.h"
#include "gradsync/core/device.h"

namespace gradsync::kernels::cuda {

class DeviceScope {
 public:
  explicit DeviceScope(Device device) {
    GRADSYNC_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device.index) GRADSYNC_CUDA_CHECK(cudaSetDevice(device.index));
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace gradsync::kernels::cuda
