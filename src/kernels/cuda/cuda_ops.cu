// CUDA kernels behind gradsync::ops.
//
// Element-wise kernels are grid-stride loops over the same load()/store()/convert() helpers
// the CPU uses (src/core/element.h), so arithmetic rounds identically on both devices. They
// are bandwidth-bound; a grid of a few waves of 256-thread blocks saturates HBM without
// launch tuning. Reductions accumulate in double per thread, reduce within a block through
// shared memory, and finish on the host over at most kMaxReductionBlocks partial sums.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "../../core/cuda_check.h"
#include "../../core/staging.h"
#include "device_scope.h"
#include "../../core/element.h"
#include "../kernels.h"

namespace gradsync::kernels::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 65535;
constexpr int kMaxReductionBlocks = 1024;

int blocks_for(std::int64_t n, int max_blocks = kMaxBlocks) {
  const std::int64_t needed = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::clamp<std::int64_t>(needed, 1, max_blocks));
}


void check_launch(const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) detail::throw_error("CUDA kernel ", kernel, " failed to launch: ", cudaGetErrorString(status));
}

#define GRID_STRIDE_LOOP(i, n) \
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<std::int64_t>(blockDim.x) * gridDim.x)

template <typename T>
__global__ void fill_kernel(T* x, std::int64_t n, T value) {
  GRID_STRIDE_LOOP(i, n) x[i] = value;
}

template <typename T>
__global__ void scale_kernel(T* x, std::int64_t n, compute_t<T> alpha) {
  GRID_STRIDE_LOOP(i, n) x[i] = store<T>(load(x[i]) * alpha);
}

template <typename T>
__global__ void axpy_kernel(compute_t<T> alpha, const T* x, T* y, std::int64_t n) {
  GRID_STRIDE_LOOP(i, n) y[i] = store<T>(load(y[i]) + alpha * load(x[i]));
}

template <typename T>
__global__ void add_kernel(const T* a, const T* b, T* out, std::int64_t n) {
  GRID_STRIDE_LOOP(i, n) out[i] = store<T>(load(a[i]) + load(b[i]));
}

template <typename T>
__global__ void dot_kernel(const T* a, const T* b, std::int64_t n, double* partial_sums) {
  __shared__ double block_sums[kThreads];
  double sum = 0.0;
  GRID_STRIDE_LOOP(i, n) sum += static_cast<double>(load(a[i])) * static_cast<double>(load(b[i]));
  block_sums[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) block_sums[threadIdx.x] += block_sums[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial_sums[blockIdx.x] = block_sums[0];
}

// norm_statistics: the CPU's rule (src/kernels/cpu/cpu_ops.cpp) per thread, then a block
// reduction of the three partials.
struct NormPartial {
  double sum;
  double max_abs;
  long long nonfinite;
};

template <typename T>
__global__ void norm_statistics_kernel(const T* x, std::int64_t n, compute_t<T> factor, NormPartial* partials) {
  using C = compute_t<T>;
  __shared__ double sums[kThreads];
  __shared__ double maxima[kThreads];
  __shared__ long long bad[kThreads];
  double sum = 0.0, largest = 0.0;
  long long nonfinite = 0;
  GRID_STRIDE_LOOP(i, n) {
    const C v = load(x[i]) * factor;
    const double magnitude = fabs(static_cast<double>(v));
    const bool finite = magnitude <= (sizeof(C) == 4 ? 3.4028234663852886e38 : 1.7976931348623157e308);  // FLT_MAX, DBL_MAX
    sum += static_cast<double>(v) * static_cast<double>(v);
    largest = finite && magnitude > largest ? magnitude : largest;
    nonfinite += finite ? 0 : 1;
  }
  sums[threadIdx.x] = sum;
  maxima[threadIdx.x] = largest;
  bad[threadIdx.x] = nonfinite;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      sums[threadIdx.x] += sums[threadIdx.x + stride];
      maxima[threadIdx.x] = fmax(maxima[threadIdx.x], maxima[threadIdx.x + stride]);
      bad[threadIdx.x] += bad[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = NormPartial{sums[0], maxima[0], bad[0]};
}

#undef GRID_STRIDE_LOOP

}  // namespace

void fill(Device device, void* x, DType dtype, std::int64_t n, double value) {
  if (n == 0) return;
  DeviceScope scope(device);
  visit_dtype(dtype, [&]<typename T>(T) {
    fill_kernel<T><<<blocks_for(n), kThreads, 0, scope.stream()>>>(static_cast<T*>(x), n, convert<T>(value));
  });
  check_launch("fill");
}

void scale(Device device, void* x, DType dtype, std::int64_t n, double alpha) {
  if (n == 0) return;
  DeviceScope scope(device);
  visit_dtype(dtype, [&]<typename T>(T) {
    scale_kernel<T><<<blocks_for(n), kThreads, 0, scope.stream()>>>(static_cast<T*>(x), n, static_cast<compute_t<T>>(alpha));
  });
  check_launch("scale");
}

void axpy(Device device, double alpha, const void* x, void* y, DType dtype, std::int64_t n) {
  if (n == 0) return;
  DeviceScope scope(device);
  visit_dtype(dtype, [&]<typename T>(T) {
    axpy_kernel<T><<<blocks_for(n), kThreads, 0, scope.stream()>>>(static_cast<compute_t<T>>(alpha), static_cast<const T*>(x),
                                                static_cast<T*>(y), n);
  });
  check_launch("axpy");
}

void add(Device device, const void* a, const void* b, void* out, DType dtype, std::int64_t n) {
  if (n == 0) return;
  DeviceScope scope(device);
  visit_dtype(dtype, [&]<typename T>(T) {
    add_kernel<T><<<blocks_for(n), kThreads, 0, scope.stream()>>>(static_cast<const T*>(a), static_cast<const T*>(b),
                                               static_cast<T*>(out), n);
  });
  check_launch("add");
}

// The partial sums of a reduction: written by the kernel into pooled device memory, copied
// into pooled page-locked memory on the caller's stream, read once that stream is done.
// (Pooled: a cudaMalloc/cudaFree pair per call would cost more than the reduction, and
// cudaFree synchronises the whole device.)
template <typename Partial>
class Partials {
 public:
  Partials(Device device, int blocks)
      : count_(static_cast<std::size_t>(blocks)),
        device_(detail::lease_device(sizeof(Partial) * count_, device)),
        host_(detail::lease_pinned(sizeof(Partial) * count_)) {}
  Partial* device() const { return static_cast<Partial*>(device_.data()); }
  // After the kernel: checks its launch, copies back, waits for the stream.
  const Partial* read(cudaStream_t stream) {
    GRADSYNC_CUDA_CHECK(cudaGetLastError());
    GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(host_.data(), device_.data(), sizeof(Partial) * count_, cudaMemcpyDeviceToHost, stream));
    GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
    return static_cast<const Partial*>(host_.data());
  }
  std::size_t size() const { return count_; }

 private:
  std::size_t count_;
  detail::PooledBuffer device_;
  detail::PooledBuffer host_;
};

double dot(Device device, const void* a, const void* b, DType dtype, std::int64_t n) {
  if (n == 0) return 0.0;
  DeviceScope scope(device);
  const int blocks = blocks_for(n, kMaxReductionBlocks);
  Partials<double> partials(device, blocks);
  visit_dtype(dtype, [&]<typename T>(T) {
    dot_kernel<T><<<blocks, kThreads, 0, scope.stream()>>>(static_cast<const T*>(a), static_cast<const T*>(b), n,
                                                           partials.device());
  });
  const double* host_sums = partials.read(scope.stream());
  double sum = 0.0;
  for (std::size_t i = 0; i < partials.size(); ++i) sum += host_sums[i];
  return sum;
}

double squared_norm(Device device, const void* x, DType dtype, std::int64_t n) { return dot(device, x, x, dtype, n); }

ops::NormStatistics norm_statistics(Device device, const void* x, DType dtype, std::int64_t n, double factor) {
  ops::NormStatistics result;
  if (n == 0) return result;
  DeviceScope scope(device);
  const int blocks = blocks_for(n, kMaxReductionBlocks);
  Partials<NormPartial> partials(device, blocks);
  visit_dtype(dtype, [&]<typename T>(T) {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      norm_statistics_kernel<T><<<blocks, kThreads, 0, scope.stream()>>>(static_cast<const T*>(x), n,
                                                                         static_cast<compute_t<T>>(factor), partials.device());
    }
  });
  const NormPartial* first = partials.read(scope.stream());
  const std::vector<NormPartial> host(first, first + partials.size());
  for (const NormPartial& partial : host) {
    result.sum_of_squares += partial.sum;
    result.max_abs = std::max(result.max_abs, partial.max_abs);
    result.nonfinite += partial.nonfinite;
  }
  return result;
}

}  // namespace gradsync::kernels::cuda
