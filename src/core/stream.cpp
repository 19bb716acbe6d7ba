// The calling thread's current CUDA stream per device (gradsync/core/stream.h). Plain
// bookkeeping: it needs no CUDA, so a build without CUDA accepts (and ignores) scopes too.
#include "gradsync/core/stream.h"

#include <array>

#include "gradsync/config.h"
#include "gradsync/core/error.h"

#if GRADSYNC_WITH_CUDA
#include "cuda_check.h"
#endif

namespace gradsync {

namespace {
constexpr int kMaxDevices = 64;
thread_local std::array<void*, kMaxDevices> current_streams{};

void*& slot(Device device) {
  GRADSYNC_CHECK(device.is_cuda(), "a CUDA stream belongs to a CUDA device, got ", device.str());
  GRADSYNC_CHECK(device.index >= 0 && device.index < kMaxDevices, "device ", device.str(), " is beyond the ",
                 kMaxDevices, " devices gradsync tracks streams for");
  return current_streams[static_cast<std::size_t>(device.index)];
}
}  // namespace

CudaStreamScope::CudaStreamScope(Device device, void* stream) : device_(device), previous_(slot(device)) {
  slot(device) = stream;
}

CudaStreamScope::~CudaStreamScope() { current_streams[static_cast<std::size_t>(device_.index)] = previous_; }

void* current_cuda_stream(Device device) {
  if (!device.is_cuda() || device.index < 0 || device.index >= kMaxDevices) return nullptr;
  return current_streams[static_cast<std::size_t>(device.index)];
}

#if GRADSYNC_WITH_CUDA

CudaStream::CudaStream(Device device) : device_(device) {
  GRADSYNC_CHECK(device.is_cuda() && device.index < cuda_device_count(), "CudaStream on ", device.str(),
                 ": not a usable CUDA device (", cuda_device_count() == 0 ? cuda_unavailable_reason() : "no such device",
                 ")");
  detail::CudaDeviceGuard current(device.index);
  cudaStream_t stream = nullptr;
  GRADSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_ = stream;
}

CudaStream::~CudaStream() {
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

void CudaStream::synchronize() const { GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_))); }

#else

CudaStream::CudaStream(Device device) : device_(device) {
  detail::throw_error("CudaStream on ", device.str(), ": gradsync was built without CUDA (reconfigure with -Dcuda=enabled)");
}
CudaStream::~CudaStream() = default;
void CudaStream::synchronize() const {}

#endif

}  // namespace gradsync
