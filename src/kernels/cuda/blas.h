// Internal (CUDA sources only): cuBLAS for gradsync's products. One handle per device and
// thread, created on first use and queued on the caller's stream for each call, and gemm for
// f32 and f64 with its status checked. gradsync's [rows, cols] buffers are row-major; cuBLAS
// reads column-major, so a row-major X is a column-major X^T: callers write each product
// transposed (C = A B  <=>  C^T = B^T A^T) and say so beside the call.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "gradsync/core/error.h"

namespace gradsync::kernels::cuda {

inline void check_cublas(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) detail::throw_error("cuBLAS call ", call, " failed: ", cublasGetStatusString(status));
}

inline cublasHandle_t cublas_handle(int device, cudaStream_t stream) {
  static thread_local cublasHandle_t handles[64] = {};
  GRADSYNC_CHECK(device >= 0 && device < 64, "cuBLAS: device index ", device, " is out of range");
  if (handles[device] == nullptr) check_cublas(cublasCreate(&handles[device]), "cublasCreate");
  check_cublas(cublasSetStream(handles[device], stream), "cublasSetStream");
  return handles[device];
}

// Column-major C = alpha op(A) op(B) + beta C, C m x n, the inner dimension k.
template <typename T>
void gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, T alpha, const T* a, int lda,
          const T* b, int ldb, T beta, T* c, int ldc) {
  if constexpr (sizeof(T) == 4) {
    check_cublas(cublasSgemm(h, ta, tb, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc), "cublasSgemm");
  } else {
    check_cublas(cublasDgemm(h, ta, tb, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc), "cublasDgemm");
  }
}

}  // namespace gradsync::kernels::cuda
