// Collective checks written once and run on any communicator: Gloo ranks-as-threads in the
// multirank suite, MPI processes under mpirun, NCCL in the gpu suite. Inputs are small integers
// chosen per (rank, element) so that sums, products, minima and maxima are exact in every dtype;
// averages are checked within one rounding of the dtype (f16 1e-3, bf16 8e-3 relative, f32
// 2e-7, f64 1e-15).
#pragma once

#include <optional>
#include <vector>

#include "gradsync/comm/communicator.h"
#include "test_util.h"

namespace gradsync::testing {

// Runs every operation on tensors of the communicator's device type (CPU, or its CUDA device),
// or on `on` (CUDA tensors on a CPU backend: staged through host memory).
void check_collectives(comm::Communicator& comm, const std::vector<std::int64_t>& sizes,
                       const std::vector<DType>& dtypes = all_dtypes(), std::optional<Device> on = std::nullopt);

}  // namespace gradsync::testing
