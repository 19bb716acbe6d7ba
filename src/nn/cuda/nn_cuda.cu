// The nn layers on a CUDA device: Linear through cuBLAS, the rest as small kernels. Everything
// runs on the default stream, where gradsync's kernels run and after which the NCCL
// communicator orders its work. Row-major [rows, cols] buffers are column-major [cols, rows]
// to cuBLAS, so each product below is written transposed (the comments give the row-major
// meaning and the column-major call).
#include <cuda_runtime.h>

#include "../../core/cuda_check.h"
#include "../../kernels/cuda/blas.h"
#include "../../kernels/cuda/device_scope.h"
#include "../nn_kernels.h"

namespace gradsync::nn::cuda {

namespace {

using kernels::cuda::cublas_handle;
using kernels::cuda::gemm;

template <typename T>
__global__ void add_bias(T* y, const T* b, long long rows, long long cols) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i < rows * cols) y[i] += b[i % cols];
}

template <typename T>
__global__ void accumulate_column_sums(const T* gy, T* gb, long long rows, long long cols) {
  const long long j = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (j >= cols) return;
  T sum = 0;
  for (long long i = 0; i < rows; ++i) sum += gy[i * cols + j];
  gb[j] += sum;
}

template <typename T>
__global__ void relu(const T* x, T* y, long long n) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = x[i] > T(0) ? x[i] : T(0);
}

template <typename T>
__global__ void relu_grad(const T* y, const T* gy, T* gx, long long n) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i < n) gx[i] = y[i] > T(0) ? gy[i] : T(0);
}

// Callers return early on empty inputs: a launch of zero blocks is a CUDA error.
unsigned blocks(long long n) { return static_cast<unsigned>((n + 255) / 256); }

}  // namespace

void linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) {
  kernels::cuda::DeviceScope scope(x.device());
  const int batch = static_cast<int>(x.shape()[0]), in = static_cast<int>(w.shape()[1]), out = static_cast<int>(w.shape()[0]);
  if (batch == 0 || out == 0) return;  // nothing to write
  with_float(x.dtype(), [&]<typename T>(T) {
    // y[B,out] = x[B,in] W[out,in]^T   <=>   y^T = W x^T: gemm(T, N, out, B, in)
    gemm<T>(cublas_handle(x.device().index, scope.stream()), CUBLAS_OP_T, CUBLAS_OP_N, out, batch, in, T(1), w.data_as<T>(), in, x.data_as<T>(), in,
            T(0), y.data_as<T>(), out);
    add_bias<T><<<blocks(static_cast<long long>(batch) * out), 256, 0, scope.stream()>>>(y.data_as<T>(), b.data_as<T>(), batch, out);
  });
  GRADSYNC_CUDA_CHECK(cudaGetLastError());
}

void linear_backward(const Tensor& x, const Tensor& w, const Tensor& gy, Tensor& gw, Tensor& gb, Tensor& gx) {
  kernels::cuda::DeviceScope scope(x.device());
  const int batch = static_cast<int>(x.shape()[0]), in = static_cast<int>(w.shape()[1]), out = static_cast<int>(w.shape()[0]);
  if (batch == 0) return;  // an empty batch adds nothing to gw and gb, and gx is empty
  with_float(x.dtype(), [&]<typename T>(T) {
    cublasHandle_t h = cublas_handle(x.device().index, scope.stream());
    // gw[out,in] += gy^T x   <=>   gw^T += x^T gy: gemm(N, T, in, out, B), beta 1
    gemm<T>(h, CUBLAS_OP_N, CUBLAS_OP_T, in, out, batch, T(1), x.data_as<T>(), in, gy.data_as<T>(), out, T(1),
            gw.data_as<T>(), in);
    // gx[B,in] = gy W   <=>   gx^T = W^T gy^T: gemm(N, N, in, B, out)
    gemm<T>(h, CUBLAS_OP_N, CUBLAS_OP_N, in, batch, out, T(1), w.data_as<T>(), in, gy.data_as<T>(), out, T(0),
            gx.data_as<T>(), in);
    if (out > 0) accumulate_column_sums<T><<<blocks(out), 256, 0, scope.stream()>>>(gy.data_as<T>(), gb.data_as<T>(), batch, out);
  });
  GRADSYNC_CUDA_CHECK(cudaGetLastError());
}

void relu_forward(const Tensor& x, Tensor& y) {
  if (x.numel() == 0) return;
  kernels::cuda::DeviceScope scope(x.device());
  with_float(x.dtype(), [&]<typename T>(T) { relu<T><<<blocks(x.numel()), 256, 0, scope.stream()>>>(x.data_as<T>(), y.data_as<T>(), x.numel()); });
  GRADSYNC_CUDA_CHECK(cudaGetLastError());
}

void relu_backward(const Tensor& y, const Tensor& gy, Tensor& gx) {
  if (y.numel() == 0) return;
  kernels::cuda::DeviceScope scope(y.device());
  with_float(y.dtype(), [&]<typename T>(T) {
    relu_grad<T><<<blocks(y.numel()), 256, 0, scope.stream()>>>(y.data_as<T>(), gy.data_as<T>(), gx.data_as<T>(), y.numel());
  });
  GRADSYNC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gradsync::nn::cuda
