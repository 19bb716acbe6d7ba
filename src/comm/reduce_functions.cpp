#include "reduce_functions.h"

#include <algorithm>

#include "core/element.h"

namespace gradsync::comm {

namespace {

template <typename T, ReduceOp kOp>
void reduce(void* c, const void* a, const void* b, std::size_t n) {
  auto* out = static_cast<T*>(c);
  const auto* left = static_cast<const T*>(a);
  const auto* right = static_cast<const T*>(b);
  for (std::size_t i = 0; i < n; ++i) {
    const auto x = load(left[i]);
    const auto y = load(right[i]);
    if constexpr (kOp == ReduceOp::sum) out[i] = store<T>(x + y);
    if constexpr (kOp == ReduceOp::prod) out[i] = store<T>(x * y);
    if constexpr (kOp == ReduceOp::min) out[i] = store<T>(std::min(x, y));
    if constexpr (kOp == ReduceOp::max) out[i] = store<T>(std::max(x, y));
  }
}

}  // namespace

ReduceFunction reduce_function(DType dtype, ReduceOp op) {
  return visit_dtype(dtype, [&]<typename T>(T) -> ReduceFunction {
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
