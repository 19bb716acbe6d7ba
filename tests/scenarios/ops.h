// The element-wise and reduction checks, written once and run per device: the unit suite runs
// them on the CPU, the gpu suite on CUDA. Each op is compared with a naive double precision
// reference on seeded random data of awkward sizes (0, 1, odd, not a multiple of any vector
// width, large).
#pragma once

#include "gradsync/core/device.h"

namespace gradsync::testing {

void check_all_ops(Device device);

}  // namespace gradsync::testing
