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

// Paged host memory (Storage's paged kind): an anonymous private mapping, zero, its pages
// committed when first written. host_release_zero zeroes [data, data + nbytes): the whole
// pages inside are given back (MADV_DONTNEED: they read as zeros afterwards), the partial
// pages at the ends are written with zeros.
void* host_map_zeros(std::size_t nbytes);
void host_unmap(void* data, std::size_t nbytes) noexcept;
void host_release_zero(void* data, std::size_t nbytes);
// Paged memory is marked for 2 MiB transparent huge pages, and the first write into a 2 MiB
// window commits all of it. Where one owner's piece ends inside a window (ZeRO stage 3's pieces
// of a unit's values), that would commit the neighbour's part too, up to twice the piece; this
// asks for 4 KiB pages in the window around byte `at` of [data, data + nbytes) (advice only).
void host_small_pages_around(void* data, std::size_t nbytes, std::size_t at) noexcept;
// Copies nbytes between any two devices (host<->device, device<->device, host<->host).
void device_copy(void* destination, Device destination_device, const void* source, Device source_device,
                 std::size_t nbytes);

}  // namespace gradsync::detail
