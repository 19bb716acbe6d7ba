// Element conversions on a GPU (core/convert.h): a grid-stride loop over element.h's convert(),
// the rule the CPU uses, so a value rounds the same on both devices.
#include <cuda_runtime.h>

#include <algorithm>

#include "../convert.h"
#include "../cuda_check.h"
#include "../element.h"
#include "gradsync/core/stream.h"

namespace gradsync::detail::cuda {

namespace {

constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 65535;

template <typename S, typename D>
__global__ void convert_kernel(const S* source, D* destination, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(blockDim.x) * gridDim.x) {
    destination[i] = gradsync::convert<D>(source[i]);
  }
}

}  // namespace

void convert_elements(Device device, const void* source, DType source_dtype, void* destination,
                      DType destination_dtype, std::int64_t n) {
  CudaDeviceGuard guard(device.index);
  const auto stream = static_cast<cudaStream_t>(current_cuda_stream(device));
  const int blocks = static_cast<int>(std::clamp<std::int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
  visit_dtype(source_dtype, [&]<typename S>(S) {
    visit_dtype(destination_dtype, [&]<typename D>(D) {
      convert_kernel<S, D><<<blocks, kThreads, 0, stream>>>(static_cast<const S*>(source), static_cast<D*>(destination), n);
    });
  });
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) throw_error("CUDA kernel convert failed to launch: ", cudaGetErrorString(status));
}

}  // namespace gradsync::detail::cuda
