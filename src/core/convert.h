// Internal: converting elements between dtypes, on any device. The one implementation behind
// Tensor::to(DType) and ops::cast, and so the one place that decides how a value rounds when
// it changes type: element.h's convert() rule, vectorized for the common f32 <-> f16/bf16 pairs
// on the CPU (bit for bit the scalar rule) and run as a grid-stride loop on a GPU.
//
// It lives in core, below the kernels, because a Tensor converts itself: core needs it, and
// nothing in core may reach up into kernels (docs/architecture.md).
#pragma once

#include <cstdint>

#include "gradsync/core/device.h"
#include "gradsync/core/dtype.h"

namespace gradsync::detail {

// n elements from `source` (source_dtype) into `destination` (destination_dtype), both on
// `device`. CPU: on all cores, returns when done. CUDA: ordered on the calling thread's current
// stream of that device (core/stream.h).
void convert_elements(const void* source, DType source_dtype, void* destination, DType destination_dtype,
                      std::int64_t n, Device device);

namespace cuda {
void convert_elements(Device device, const void* source, DType source_dtype, void* destination,
                      DType destination_dtype, std::int64_t n);
}  // namespace cuda

}  // namespace gradsync::detail
