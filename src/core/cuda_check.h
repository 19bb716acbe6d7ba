// Internal: every CUDA runtime call goes through GRADSYNC_CUDA_CHECK, which turns a failing
// status into a gradsync::Error naming the call, the CUDA error and the rank.
#pragma once

#include <cuda_runtime.h>

#include "gradsync/core/error.h"

#define GRADSYNC_CUDA_CHECK(call)                                                              \
  do {                                                                                          \
    const cudaError_t gradsync_status_ = (call);                                                \
    if (gradsync_status_ != cudaSuccess) {                                                      \
      ::gradsync::detail::throw_error("CUDA call ", #call, " failed: ", cudaGetErrorName(gradsync_status_), \
                                      " (", cudaGetErrorString(gradsync_status_), ")");         \
    }                                                                                           \
  } while (0)

namespace gradsync::detail {

// Makes a CUDA device current for a scope and gives the caller's back afterwards: every CUDA
// call on a device other than the current one goes through it.
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device) {
    GRADSYNC_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) GRADSYNC_CUDA_CHECK(cudaSetDevice(device));
    switched_ = previous_ != device;
  }
  ~CudaDeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace gradsync::detail
