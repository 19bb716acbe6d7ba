// Internal: allocation and copies of raw memory on any device. The only place in core that
// talks to the CUDA runtime; without CUDA compiled in, asking for CUDA memory is an error
// that says so.
#pragma once

#include <cstddef>

#include "gradsync/core/device.h"

namespace gradsync::detail {

void* device_allocate(std::size_t nbytes, Device device);
void device_free(void* data, Device device) noexcept;
void device_memset_zero(void* data, std::size_t nbytes, Device device);
// Copies nbytes between any two devices (host<->device, device<->device, host<->host).
void device_copy(void* destination, Device destination_device, const void* source, Device source_device,
                 std::size_t nbytes);

}  // namespace gradsync::detail
