// The low-rank kernels on a CUDA device (low_rank.h). The products go to cuBLAS. The
// orthonormalizations work on tall, thin matrices (a gradient's rows by a rank of 1 to a few
// dozen), which are far too small to fill a GPU and too thin for a library's blocked QR to pay
// off: one block of threads per matrix walks its columns, each thread owning the same rows
// throughout, so that the only communication between threads is the block-wide sums (in
// double, whatever the matrix's dtype). The matrices of one call are independent launches on
// the caller's stream; their failure flags come back in one copy at the end.
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <limits>
#include <vector>

#include "../../core/cuda_check.h"
#include "../../core/device_memory.h"
#include "../low_rank.h"
#include "blas.h"
#include "device_scope.h"

namespace gradsync::kernels::cuda {

namespace {

constexpr int kThreads = 256;

// The sum of every thread's `value`, returned to every thread of the block.
__device__ double block_sum(double value) {
  __shared__ double partial[kThreads];
  partial[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  const double sum = partial[0];
  __syncthreads();  // every thread has read it before the next call overwrites it
  return sum;
}

// The rows a thread owns: threadIdx.x, + kThreads, ... (the same in every phase).
#define OWNED_ROWS(r, rows) for (long long r = threadIdx.x; r < (rows); r += kThreads)

// torch's _orthogonalize_gram_schmidt (as src/kernels/cpu/low_rank.cpp). Sets *failed on an
// all-zero column with epsilon 0; every thread sees the same norm, so all return together.
template <typename T>
__global__ void gram_schmidt_kernel(T* a, long long rows, long long cols, double epsilon, int* failed) {
  for (long long i = 0; i < cols; ++i) {
    double squares = 0;
    OWNED_ROWS(r, rows) {
      const double v = a[r * cols + i];
      squares += v * v;
    }
    const T norm = static_cast<T>(sqrt(block_sum(squares)));
    if (!(norm + epsilon > 0)) {
      if (threadIdx.x == 0) *failed = 1;
      return;
    }
    const T divisor = norm + static_cast<T>(epsilon);
    OWNED_ROWS(r, rows) a[r * cols + i] /= divisor;
    for (long long j = i + 1; j < cols; ++j) {
      double dot = 0;
      OWNED_ROWS(r, rows) dot += static_cast<double>(a[r * cols + i]) * static_cast<double>(a[r * cols + j]);
      const T projection = static_cast<T>(block_sum(dot));
      OWNED_ROWS(r, rows) a[r * cols + j] -= projection * a[r * cols + i];
    }
  }
}

// The thin Q of a Householder QR, as LAPACK's geqr2 + org2r (and Eigen's HouseholderQR):
// column k's reflection I - tau v v^T (v[k] = 1) maps a[k:, k] onto beta e_k with beta of the
// opposite sign to a[k, k]; v's tail is kept below the diagonal. Q = H_0 ... H_{n-1} I[:, :n]
// is then built from the last reflection to the first in `q` (rows x cols) and copied over a.
// `tau` holds cols scalars.
template <typename T>
__global__ void householder_kernel(T* a, long long rows, long long cols, T* q, T* tau) {
  for (long long k = 0; k < cols; ++k) {
    double tail = 0;
    OWNED_ROWS(r, rows) {
      if (r > k) {
        const double v = a[r * cols + k];
        tail += v * v;
      }
    }
    tail = block_sum(tail);
    const double alpha = a[k * cols + k];
    __syncthreads();  // all have read a[k, k] before its owner overwrites it
    double t = 0;
    double beta = alpha;
    double tail_scale = 1;
    if (tail > static_cast<double>(std::numeric_limits<T>::min())) {  // otherwise H = I (Eigen's test)
      const double norm = sqrt(alpha * alpha + tail);
      beta = alpha >= 0 ? -norm : norm;
      t = (beta - alpha) / beta;
      tail_scale = 1 / (alpha - beta);
    }
    OWNED_ROWS(r, rows) {
      if (r > k) a[r * cols + k] = static_cast<T>(a[r * cols + k] * tail_scale);
      if (r == k) a[r * cols + k] = static_cast<T>(beta);
    }
    if (threadIdx.x == 0) tau[k] = static_cast<T>(t);
    for (long long j = k + 1; j < cols; ++j) {  // the trailing columns: a[k:, j] -= t v (v^T a[k:, j])
      double w = 0;
      OWNED_ROWS(r, rows) {
        if (r >= k) w += (r == k ? 1.0 : static_cast<double>(a[r * cols + k])) * static_cast<double>(a[r * cols + j]);
      }
      const double tw = static_cast<T>(t) * block_sum(w);
      OWNED_ROWS(r, rows) {
        if (r >= k) a[r * cols + j] = static_cast<T>(a[r * cols + j] - tw * (r == k ? 1.0 : static_cast<double>(a[r * cols + k])));
      }
    }
  }
  OWNED_ROWS(r, rows) {
    for (long long c = 0; c < cols; ++c) q[r * cols + c] = r == c ? T(1) : T(0);
  }
  __syncthreads();  // tau, written by thread 0, is read by all below
  for (long long k = cols - 1; k >= 0; --k) {
    const double t = tau[k];
    for (long long j = k; j < cols; ++j) {  // columns before k are still zero from row k on
      double w = 0;
      OWNED_ROWS(r, rows) {
        if (r >= k) w += (r == k ? 1.0 : static_cast<double>(a[r * cols + k])) * static_cast<double>(q[r * cols + j]);
      }
      const double tw = t * block_sum(w);
      OWNED_ROWS(r, rows) {
        if (r >= k) q[r * cols + j] = static_cast<T>(q[r * cols + j] - tw * (r == k ? 1.0 : static_cast<double>(a[r * cols + k])));
      }
    }
  }
  OWNED_ROWS(r, rows) {
    for (long long c = 0; c < cols; ++c) a[r * cols + c] = q[r * cols + c];
  }
}

#undef OWNED_ROWS

int as_int(std::int64_t value, const char* what) {
  GRADSYNC_CHECK(value <= INT_MAX, "matmul on CUDA: ", what, " = ", value, " exceeds cuBLAS's int range");
  return static_cast<int>(value);
}

template <typename T>
void launch_orthonormalize(cudaStream_t stream, const std::vector<MatrixRef>& matrices, double epsilon, int* failed,
                           T* scratch) {
  for (std::size_t i = 0; i < matrices.size(); ++i) {
    T* a = static_cast<T*>(matrices[i].data);
    const long long rows = matrices[i].rows;
    const long long cols = matrices[i].cols;
    if (rows == 0 || cols == 0) continue;
    if (cols > 2) {
      householder_kernel<T><<<1, kThreads, 0, stream>>>(a, rows, cols, scratch, scratch + rows * cols);
      scratch += rows * cols + cols;
    } else {
      gram_schmidt_kernel<T><<<1, kThreads, 0, stream>>>(a, rows, cols, epsilon, failed + i);
    }
    GRADSYNC_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

void matmul(Device device, DType dtype, bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k,
            const void* a, const void* b, void* out) {
  if (m == 0 || n == 0) return;
  DeviceScope scope(device);
  cublasHandle_t handle = cublas_handle(device.index, scope.stream());
  const cublasOperation_t op_a = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  // out = op(a) op(b) (row-major, m x n)  <=>  out^T = op(b)^T op(a)^T (column-major n x m):
  // b's memory is op(b)^T as it stands unless b is transposed, and likewise a.
  const int ld_a = as_int(transpose_a ? m : k, "a's row length");
  const int ld_b = as_int(transpose_b ? k : n, "b's row length");
  if (dtype == DType::f32) {
    gemm<float>(handle, op_b, op_a, as_int(n, "n"), as_int(m, "m"), as_int(k, "k"), 1.0f, static_cast<const float*>(b), ld_b,
                static_cast<const float*>(a), ld_a, 0.0f, static_cast<float*>(out), as_int(n, "n"));
  } else {
    gemm<double>(handle, op_b, op_a, as_int(n, "n"), as_int(m, "m"), as_int(k, "k"), 1.0, static_cast<const double*>(b),
                 ld_b, static_cast<const double*>(a), ld_a, 0.0, static_cast<double*>(out), as_int(n, "n"));
  }
}

std::int64_t orthonormalize_columns(Device device, DType dtype, const std::vector<MatrixRef>& matrices, double epsilon) {
  DeviceScope scope(device);
  const std::size_t element = dtype == DType::f32 ? sizeof(float) : sizeof(double);
  std::size_t scratch_elements = 0;  // each Householder matrix's Q and tau
  for (const MatrixRef& matrix : matrices) {
    if (matrix.cols > 2) scratch_elements += static_cast<std::size_t>(matrix.rows * matrix.cols + matrix.cols);
  }
  // One allocation: a failure flag per matrix, then the scratch (256-byte aligned). Freed at
  // the end, after the wait for the flags, so no kernel still uses it.
  const std::size_t flag_bytes = matrices.size() * sizeof(int);
  const std::size_t scratch_at = (flag_bytes + 255) / 256 * 256;
  struct Memory {
    void* data;
    Device device;
    ~Memory() { detail::device_free(data, device); }
  } memory{detail::device_allocate(scratch_at + scratch_elements * element, device), device};
  int* flags = static_cast<int*>(memory.data);
  void* scratch = static_cast<char*>(memory.data) + scratch_at;
  GRADSYNC_CUDA_CHECK(cudaMemsetAsync(flags, 0, flag_bytes, scope.stream()));
  if (dtype == DType::f32) {
    launch_orthonormalize<float>(scope.stream(), matrices, epsilon, flags, static_cast<float*>(scratch));
  } else {
    launch_orthonormalize<double>(scope.stream(), matrices, epsilon, flags, static_cast<double*>(scratch));
  }
  std::vector<int> failed(matrices.size());
  GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(failed.data(), flags, flag_bytes, cudaMemcpyDeviceToHost, scope.stream()));
  GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(scope.stream()));
  for (std::size_t i = 0; i < failed.size(); ++i) {
    if (failed[i] != 0) return static_cast<std::int64_t>(i);
  }
  return -1;
}

}  // namespace gradsync::kernels::cuda
