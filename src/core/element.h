// Internal: element access, shared by the dtype conversions of core (convert.h) and by the CPU
// and CUDA kernels and reduce functions above it.
//
// Each storage type has a compute type: f16 and bf16 compute in float (as PyTorch does on
// CPU), f32 in float, f64 in double, integers in int64. load() widens a stored element to
// its compute type, store() rounds a computed value back, and convert() is the one
// conversion rule behind every cast:
//  * to f16/bf16: through float first (PyTorch's rule, see core/half.h);
//  * floating to integer: truncate toward zero, saturating at the integer's range, NaN -> 0
//    (C++ leaves this undefined; PyTorch inherits that, we define it);
//  * everything else: the C++ conversion, which rounds to nearest even.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

#include "gradsync/core/dtype.h"
#include "gradsync/core/half.h"

namespace gradsync {

template <typename T>
struct ComputeTypeOf {
  using type = T;
};
template <> struct ComputeTypeOf<Half> { using type = float; };
template <> struct ComputeTypeOf<BFloat16> { using type = float; };
template <> struct ComputeTypeOf<std::int32_t> { using type = std::int64_t; };

template <typename T>
using compute_t = typename ComputeTypeOf<T>::type;

template <typename T>
constexpr bool is_half_v = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

template <typename T>
GRADSYNC_HOST_DEVICE inline compute_t<T> load(T value) {
  if constexpr (std::is_same_v<T, Half>) {
    return half_bits_to_float(value.bits);
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return bf16_bits_to_float(value.bits);
  } else {
    return static_cast<compute_t<T>>(value);
  }
}

template <typename To, typename From>
GRADSYNC_HOST_DEVICE inline To convert(From value) {
  if constexpr (is_half_v<From>) {
    return convert<To>(load(value));
  } else if constexpr (std::is_same_v<To, Half>) {
    return Half{float_to_half_bits(static_cast<float>(value))};
  } else if constexpr (std::is_same_v<To, BFloat16>) {
    return BFloat16{float_to_bf16_bits(static_cast<float>(value))};
  } else if constexpr (std::is_integral_v<To> && std::is_floating_point_v<From>) {
    if (!(value == value)) return To{0};  // NaN
    // The limits as From: max() of int64 is not representable in double, so compare with
    // the power of two just above it and saturate.
    const From upper = static_cast<From>(std::numeric_limits<To>::max()) + From{1};
    const From lower = static_cast<From>(std::numeric_limits<To>::min());
    if (value >= upper) return std::numeric_limits<To>::max();
    if (value <= lower) return std::numeric_limits<To>::min();
    return static_cast<To>(value);
  } else {
    return static_cast<To>(value);
  }
}

template <typename T>
GRADSYNC_HOST_DEVICE inline T store(compute_t<T> value) {
  return convert<T>(value);
}

// Calls fn(T{}) with T the storage type of dtype: float, double, Half, BFloat16, int32, int64.
template <typename Fn>
decltype(auto) visit_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::f32: return fn(float{});
    case DType::f64: return fn(double{});
    case DType::f16: return fn(Half{});
    case DType::bf16: return fn(BFloat16{});
    case DType::i32: return fn(std::int32_t{});
    case DType::i64: return fn(std::int64_t{});
  }
  return fn(float{});  // unreachable: every enumerator is handled above
}

}  // namespace gradsync
