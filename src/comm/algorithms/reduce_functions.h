// Internal: element-wise reductions c[i] = a[i] op b[i] for every dtype, for backends whose
// library lacks one (Gloo for everything, MPI for f16/bf16). 16-bit floats are combined in f32
// and rounded once per combination.
#pragma once

#include <cstddef>

#include "gradsync/comm/communicator.h"

namespace gradsync::comm {

using ReduceFunction = void (*)(void* c, const void* a, const void* b, std::size_t n);

// op is sum, min, max or prod.
ReduceFunction reduce_function(DType dtype, ReduceOp op);

}  // namespace gradsync::comm
