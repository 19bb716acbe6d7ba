#include "reduce_functions.h"

#include <algorithm>

#include "core/element.h"
#include "core/isa.h"

namespace gradsync::comm {

namespace {

#define GRADSYNC_ISA_LOOPS "comm/algorithms/reduce_loops.inc"
#include "core/isa_variants.inc"

}  // namespace

ReduceFunction reduce_function(DType dtype, ReduceOp op) {
  return visit_dtype(dtype, [&]<typename T>(T) -> ReduceFunction {
    switch (op) {
      case ReduceOp::sum: return GRADSYNC_ISA_DISPATCH(reduce<T, ReduceOp::sum>);
      case ReduceOp::prod: return GRADSYNC_ISA_DISPATCH(reduce<T, ReduceOp::prod>);
      case ReduceOp::min: return GRADSYNC_ISA_DISPATCH(reduce<T, ReduceOp::min>);
      case ReduceOp::max: return GRADSYNC_ISA_DISPATCH(reduce<T, ReduceOp::max>);
      case ReduceOp::avg: break;
    }
    detail::throw_error("reduce_function: ", reduce_op_name(op), " has no element-wise form");
  });
}

}  // namespace gradsync::comm
