// gradsync/core/half.h - conversions between f32/f64 and the 16-bit floats.
//
// Round-to-nearest-even, bit for bit as IEEE 754 and PyTorch do it, including infinities,
// NaN, subnormals and overflow to infinity. Two details that matter for
// matching PyTorch exactly:
//  * f64 -> f16/bf16 goes through f32 first, because PyTorch's c10::Half and c10::BFloat16
//    are constructed from float. This double rounding differs from a direct conversion in
//    rare ties (1 + 2^-11 + 2^-40 becomes 1.0, not 1 + 2^-10); we match PyTorch.
//  * NaN payloads are not information a gradient carries, and PyTorch itself is not
//    consistent about them (its vectorized f32->bf16 path writes 0xFFFF, its scalar path
//    0x7FC0). We follow PyTorch's scalar c10 conversions: f32->f16 gives sign|0x7E00,
//    f32->bf16 gives 0x7FC0, and 16-bit NaNs widen to quiet f32 NaNs keeping their payload.
// The functions are inline (and host+device under nvcc) so that loops over arrays of them
// vectorize and the GPU rounds exactly as the CPU does.
#pragma once

#include <cstdint>
#include <cstring>

// The same functions compile for the GPU, so that casts are bit-identical on both devices.
#if defined(__CUDACC__)
#define GRADSYNC_HOST_DEVICE __host__ __device__
#else
#define GRADSYNC_HOST_DEVICE
#endif

namespace gradsync {

// An f32's bits, as an integer (memcpy: the one well-defined type pun).
GRADSYNC_HOST_DEVICE inline std::uint32_t float_bits(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

// The f32 whose bits these are.
GRADSYNC_HOST_DEVICE inline float bits_float(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// condition ? a : b with arithmetic instead of a branch: compilers keep a ternary on integers as
// a jump often enough to stop a loop from vectorizing; this form they cannot.
GRADSYNC_HOST_DEVICE inline std::uint32_t select_bits(bool condition, std::uint32_t a, std::uint32_t b) {
  return b ^ ((a ^ b) & (0u - static_cast<std::uint32_t>(condition)));
}

// f32 -> bf16: keep the top 16 bits, rounding the dropped 16 to nearest even.
GRADSYNC_HOST_DEVICE inline std::uint16_t float_to_bf16_bits(float value) {
  const std::uint32_t bits = float_bits(value);
  // Adding 0x7FFF plus the lowest kept bit rounds half-way cases towards an even result.
  const std::uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  // NaN becomes the canonical quiet NaN, as c10 does.
  const bool is_nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<std::uint16_t>(select_bits(is_nan, 0x7FC0u, rounded));
}

// bf16 -> f32: exact (the bf16 bits are the f32's upper half).
GRADSYNC_HOST_DEVICE inline float bf16_bits_to_float(std::uint16_t bits) {
  return bits_float(static_cast<std::uint32_t>(bits) << 16);
}

// f32 -> f16 (1 sign, 5 exponent, 10 mantissa bits). Every case is computed and the right one
// selected, without branches, so that loops over arrays vectorize.
GRADSYNC_HOST_DEVICE inline std::uint16_t float_to_half_bits(float value) {
  const std::uint32_t bits = float_bits(value);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  const std::uint32_t magnitude = bits & 0x7FFFFFFFu;
  // Normal range: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to
  // nearest even. (Wraps around for small magnitudes, which select the subnormal result.)
  const std::uint32_t odd = (magnitude >> 13) & 1u;
  const std::uint32_t normal = (magnitude - (static_cast<std::uint32_t>(127 - 15) << 23) + 0xFFFu + odd) >> 13;
  // Below the smallest normal f16 (2^-14): subnormal or zero. Adding 0.5 aligns the f16
  // subnormal grid (spacing 2^-24) with the f32 mantissa's last bit, and the FPU's addition
  // rounds to nearest even.
  const std::uint32_t subnormal = float_bits(bits_float(magnitude) + 0.5f) - 0x3F000000u;
  std::uint32_t result = select_bits(magnitude < 0x38800000u, subnormal, normal);
  result = select_bits(magnitude >= 0x477FF000u, 0x7C00u, result);  // rounds to >= 65520: overflow to infinity
  result = select_bits(magnitude > 0x7F800000u, 0x7E00u, result);   // NaN: the canonical quiet NaN
  return static_cast<std::uint16_t>(sign | result);
}

// f16 -> f32, exact; branch-free like the other direction.
GRADSYNC_HOST_DEVICE inline float half_bits_to_float(std::uint16_t half) {
  const std::uint32_t sign = static_cast<std::uint32_t>(half & 0x8000u) << 16;
  const std::uint32_t exponent = (half >> 10) & 0x1Fu;
  const std::uint32_t mantissa = half & 0x03FFu;
  const std::uint32_t normal = ((exponent + (127 - 15)) << 23) | (mantissa << 13);
  // inf, or a NaN made quiet (as the F16C instruction does)
  const std::uint32_t special = 0x7F800000u | select_bits(mantissa != 0, 0x00400000u, 0u) | (mantissa << 13);
  // zero or subnormal: mantissa * 2^-24, exact in f32
  const std::uint32_t tiny = float_bits(static_cast<float>(mantissa) * bits_float(0x33800000u));
  const std::uint32_t magnitude = select_bits(exponent == 0x1Fu, special, select_bits(exponent == 0, tiny, normal));
  return bits_float(sign | magnitude);
}

}  // namespace gradsync
