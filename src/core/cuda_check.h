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
