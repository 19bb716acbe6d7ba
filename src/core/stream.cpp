// The calling thread's current CUDA stream per device (gradsync/core/stream.h). Plain
// bookkeeping: it needs no CUDA, so a build without CUDA accepts (and ignores) scopes too.
#include "gradsync/core/stream.h"

#include <array>

#include "gradsync/core/error.h"

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

}  // namespace gradsync
