#include "reduce_functions.h"

#include <algorithm>

#include "../kernels/element.h"

namespace gradsync::comm {

namespace {

template <typename T, ReduceOp kOp>
void reduce(void* c, const void* a, const void* b, std::size_t n) {
  auto* out = static_cast<T*>(c);
  const auto* left = static_cast<const T*>(a);
  const auto* right = static_cast<const T*>(b);
  for (std::size_t i = 0; i < n; ++i) {
    const auto x = kernels::load(left[i]);
    const auto y = kernels::load(right[i]);
    if constexpr (kOp == ReduceOp::sum) out[i] = kernels::store<T>(x + y);
    if constexpr (kOp == ReduceOp::prod) out[i] = kernels::store<T>(x * y);
    if constexpr (kOp == ReduceOp::min) out[i] = kernels::store<T>(std::min(x, y));
    if constexpr (kOp == ReduceOp::max) out[i] = kernels::store<T>(std::max(x, y));
  }
}

}  // namespace

ReduceFunction reduce_function(DType dtype, ReduceOp op) {
  return kernels::visit_dtype(dtype, [&]<typename T>(T) -> ReduceFunction {
    switch (op) {
      case ReduceOp::sum: return &reduce<T, ReduceOp::sum>;
      case ReduceOp::prod: return &reduce<T, ReduceOp::prod>;
      case ReduceOp::min: return &reduce<T, ReduceOp::min>;
      case ReduceOp::max: return &reduce<T, ReduceOp::max>;
      case ReduceOp::avg: break;
    }
    detail::throw_error("reduce_function: ", reduce_op_name(op), " has no element-wise form");
  });
}

}  // namespace gradsync::comm
