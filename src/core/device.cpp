#include "gradsync/core/device.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdlib>

#include <sys/mman.h>
#include <unistd.h>
#include <cstring>

#include "gradsync/config.h"
#include "gradsync/core/error.h"
#include "gradsync/core/stream.h"
#include "device_memory.h"

#if GRADSYNC_WITH_CUDA
#include "cuda_check.h"
#endif

namespace gradsync {

Device Device::parse(std::string_view text) {
  if (text == "cpu") return cpu();
  if (text == "cuda") return cuda(0);
  if (text.starts_with("cuda:")) {
    const std::string_view digits = text.substr(5);
    int index = -1;
    const auto [end, status] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (status == std::errc() && end == digits.data() + digits.size() && index >= 0) return cuda(index);
  }
  detail::throw_error("cannot parse device '", text, "': expected cpu, cuda or cuda:N");
}

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }

bool cuda_compiled() { return GRADSYNC_WITH_CUDA != 0; }

namespace {
// Host buffers are 256-byte aligned (vector loads and cache lines never straddle the start of
// a buffer, and it is what cudaMalloc guarantees on the device side). Large ones (arenas, optimizer state, buckets) are aligned
// to 2 MiB and marked for transparent huge pages: a pass over hundreds of MiB then takes a
// TLB miss per 2 MiB instead of per 4 KiB (bench_optimizers: a few percent of the step).
void* host_allocate(std::size_t nbytes) {
  constexpr std::size_t kHugePage = std::size_t{2} << 20;
  const std::size_t alignment = nbytes >= 2 * kHugePage ? kHugePage : 256;
  const std::size_t rounded = std::max<std::size_t>(alignment, (nbytes + alignment - 1) / alignment * alignment);
  void* data = std::aligned_alloc(alignment, rounded);
  GRADSYNC_CHECK(data != nullptr, "out of host memory allocating ", nbytes, " bytes");
#if defined(MADV_HUGEPAGE)
  if (alignment == kHugePage) madvise(data, rounded, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
  return data;
}
}  // namespace

namespace detail {

void* host_map_zeros(std::size_t nbytes) {
  // Every mapping starts on a page, so the element alignment the arenas need (256 bytes)
  // follows. Large ones start on a 2 MiB boundary and are marked for transparent huge pages,
  // as host_allocate's: pages given back and written again each step then fault once per 2 MiB
  // instead of once per 4 KiB (with 4 KiB faults, ZeRO stage 2's step took 1.5x stage 0's).
  constexpr std::size_t kHugePage = std::size_t{2} << 20;
  const bool huge = nbytes >= 2 * kHugePage;
  const std::size_t length = std::max<std::size_t>(nbytes, 1) + (huge ? kHugePage : 0);
  void* mapped = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  GRADSYNC_CHECK(mapped != MAP_FAILED, "mapping ", nbytes, " bytes of paged host memory failed: ", std::strerror(errno));
  if (!huge) return mapped;
  // Keep the 2 MiB-aligned part: unmap the slack before and after it.
  const auto start = reinterpret_cast<std::uintptr_t>(mapped);
  const std::uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const std::uintptr_t end = aligned + (nbytes + page - 1) / page * page;
  if (aligned > start) munmap(mapped, aligned - start);
  if (start + length > end) munmap(reinterpret_cast<void*>(end), start + length - end);
#if defined(MADV_HUGEPAGE)
  madvise(reinterpret_cast<void*>(aligned), end - aligned, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
  return reinterpret_cast<void*>(aligned);
}

void host_unmap(void* data, std::size_t nbytes) noexcept { munmap(data, std::max<std::size_t>(nbytes, 1)); }

void host_release_zero(void* data, std::size_t nbytes) {
  static const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t end = begin + nbytes;
  const std::uintptr_t inner_begin = (begin + page - 1) / page * page;
  const std::uintptr_t inner_end = end / page * page;
  if (inner_begin >= inner_end) {  // no whole page inside
    std::memset(data, 0, nbytes);
    return;
  }
  std::memset(data, 0, inner_begin - begin);
  std::memset(reinterpret_cast<void*>(inner_end), 0, end - inner_end);
  GRADSYNC_CHECK(madvise(reinterpret_cast<void*>(inner_begin), inner_end - inner_begin, MADV_DONTNEED) == 0,
                 "giving back ", inner_end - inner_begin, " bytes of paged host memory failed: ", std::strerror(errno));
}

void host_small_pages_around(void* data, std::size_t nbytes, std::size_t at) noexcept {
#if defined(MADV_NOHUGEPAGE)
  constexpr std::uintptr_t kHugePage = std::uintptr_t{2} << 20;
  static const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t point = begin + at;
  if (at == 0 || at >= nbytes || point % kHugePage == 0) return;  // no window is cut there
  // The window, kept inside the buffer's pages (all of them mapped).
  const std::uintptr_t low = std::max(point / kHugePage * kHugePage, begin / page * page);
  const std::uintptr_t high = std::min(low / kHugePage * kHugePage + kHugePage, (begin + nbytes + page - 1) / page * page);
  madvise(reinterpret_cast<void*>(low), high - low, MADV_NOHUGEPAGE);  // advice only: failure is harmless
#else
  (void)data, (void)nbytes, (void)at;
#endif
}

}  // namespace detail

#if GRADSYNC_WITH_CUDA

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return count;
}

std::string cuda_unavailable_reason() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();
    return std::string("no usable CUDA device: ") + cudaGetErrorString(status);
  }
  if (count == 0) return "no CUDA device is visible";
  return "";
}

namespace detail {

namespace {
// Makes `device` current for the lifetime of the guard and restores the previous one. It
// first checks that the device exists, so that a missing GPU or driver is reported as such,
// naming the device, rather than as whatever the first CUDA call happens to return.
class CurrentDeviceGuard {
 public:
  explicit CurrentDeviceGuard(Device device) : guard_(usable(device)) {}

 private:
  static int usable(Device device) {
    const int count = cuda_device_count();
    GRADSYNC_CHECK(device.index < count, "device ", device.str(), " is not usable: ",
                   count == 0 ? cuda_unavailable_reason() : std::to_string(count) + " CUDA device(s) visible");
    return device.index;
  }
  CudaDeviceGuard guard_;
};
}  // namespace

void* device_allocate(std::size_t nbytes, Device device) {
  if (device.is_cpu()) return host_allocate(nbytes);
  CurrentDeviceGuard guard(device);
  void* data = nullptr;
  const cudaError_t status = cudaMalloc(&data, nbytes == 0 ? 1 : nbytes);
  if (status != cudaSuccess) {
    cudaGetLastError();
    throw_error("cudaMalloc of ", nbytes, " bytes on ", device.str(), " failed: ", cudaGetErrorString(status));
  }
  return data;
}

void device_free(void* data, Device device) noexcept {
  if (device.is_cpu()) {
    std::free(data);
  } else {
    cudaFree(data);  // a failure here (driver shutting down) must not throw from a destructor
  }
}

void device_memset_zero(void* data, std::size_t nbytes, Device device) {
  if (device.is_cpu()) {
    std::memset(data, 0, nbytes);
    return;
  }
  CurrentDeviceGuard guard(device);
  // On the caller's current stream (gradsync/core/stream.h), in order with its kernels.
  GRADSYNC_CUDA_CHECK(cudaMemsetAsync(data, 0, nbytes, static_cast<cudaStream_t>(current_cuda_stream(device))));
}

void device_copy(void* destination, Device destination_device, const void* source, Device source_device,
                 std::size_t nbytes) {
  if (nbytes == 0) return;
  if (destination_device.is_cpu() && source_device.is_cpu()) {
    std::memcpy(destination, source, nbytes);
    return;
  }
  // Unified addressing lets cudaMemcpyDefault work out the direction from the pointers.
  const Device device = destination_device.is_cuda() ? destination_device : source_device;
  CurrentDeviceGuard guard(device);
  // A synchronous copy that sees everything queued on the caller's current stream: on the
  // legacy default stream cudaMemcpy does that by itself; on an engine's own stream the copy
  // is queued there and waited for.
  auto* stream = static_cast<cudaStream_t>(current_cuda_stream(device));
  if (stream == nullptr) {
    GRADSYNC_CUDA_CHECK(cudaMemcpy(destination, source, nbytes, cudaMemcpyDefault));
  } else {
    GRADSYNC_CUDA_CHECK(cudaMemcpyAsync(destination, source, nbytes, cudaMemcpyDefault, stream));
    GRADSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
}

}  // namespace detail

void synchronize(Device device) {
  if (device.is_cpu()) return;
  detail::CurrentDeviceGuard guard(device);
  GRADSYNC_CUDA_CHECK(cudaDeviceSynchronize());
}

#else  // built without CUDA

int cuda_device_count() { return 0; }

std::string cuda_unavailable_reason() { return "gradsync was built without CUDA (meson option -Dcuda)"; }

namespace detail {

namespace {
[[noreturn]] void no_cuda(Device device) {
  throw_error("device ", device.str(), " is not usable: gradsync was built without CUDA (reconfigure with -Dcuda=enabled)");
}
}  // namespace

void* device_allocate(std::size_t nbytes, Device device) {
  if (device.is_cuda()) no_cuda(device);
  return host_allocate(nbytes);
}

void device_free(void* data, Device) noexcept { std::free(data); }

void device_memset_zero(void* data, std::size_t nbytes, Device device) {
  if (device.is_cuda()) no_cuda(device);
  std::memset(data, 0, nbytes);
}

void device_copy(void* destination, Device destination_device, const void* source, Device source_device,
                 std::size_t nbytes) {
  if (destination_device.is_cuda()) no_cuda(destination_device);
  if (source_device.is_cuda()) no_cuda(source_device);
  if (nbytes != 0) std::memcpy(destination, source, nbytes);
}

}  // namespace detail

void synchronize(Device device) {
  if (device.is_cuda()) detail::no_cuda(device);
}

#endif

}  // namespace gradsync
