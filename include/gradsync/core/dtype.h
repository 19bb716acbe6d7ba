// gradsync/core/dtype.h - element types.
//
// The six element types a training runtime meets: full and double precision floats, the two
// 16-bit floats used for compression and mixed precision, and two integer types (step
// counters, indices of sparse gradients). Names follow safetensors ("F32", "BF16", ...).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace gradsync {

// The element types gradsync computes with: floats of 32, 64 and 16 bits (IEEE half and
// bfloat16), and 32- and 64-bit integers (indices, labels, counts).
enum class DType : std::uint8_t { f32, f64, f16, bf16, i32, i64 };

// Bytes per element.
std::size_t dtype_size(DType dtype);
// Lower-case name as used in messages: "f32", "bf16", ...
const char* dtype_name(DType dtype);
// The safetensors header spelling: "F32", "BF16", ...
const char* dtype_safetensors_name(DType dtype);
// Parses a safetensors dtype string; throws gradsync::Error naming the string if unknown.
DType dtype_from_safetensors_name(std::string_view name);
bool is_floating(DType dtype);  // f32, f64, f16 or bf16

// Storage types for the 16-bit floats on the host. They are plain bit containers: arithmetic
// converts to float, computes, and rounds back (see core/half.h).
struct Half {
  std::uint16_t bits;  // IEEE 754 binary16: sign, 5 exponent bits, 10 mantissa bits
};
// The bfloat16 storage type (see Half).
struct BFloat16 {
  std::uint16_t bits;  // the upper half of an f32: sign, 8 exponent bits, 7 mantissa bits
};

}  // namespace gradsync
