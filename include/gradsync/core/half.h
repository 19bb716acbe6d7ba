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

GRADSYNC_HOST_DEVICE inline std::uint32_t float_bits(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

GRADSYNC_HOST_DEVICE inline float bits_float(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// f32 -> bf16: keep the top 16 bits, rounding the dropped 16 to nearest even.
GRADSYNC_HOST_DEVICE inline std::uint16_t float_to_bf16_bits(float value) {
  const std::uint32_t bits = float_bits(value);
  // Adding 0x7FFF plus the lowest kept bit rounds half-way cases towards an even result.
  const std::uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  // NaN becomes the canonical quiet NaN, as c10 does. A select, not a branch, so that
  // loops over arrays vectorize.
  const bool is_nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<std::uint16_t>(is_nan ? 0x7FC0u : rounded);
}

GRADSYNC_HOST_DEVICE inline float bf16_bits_to_float(std::uint16_t bits) {
  return bits_float(static_cast<std::uint32_t>(bits) << 16);
}

// f32 -> f16 (1 sign, 5 exponent, 10 mantissa bits).
GRADSYNC_HOST_DEVICE inline std::uint16_t float_to_half_bits(float value) {
  const std::uint32_t bits = float_bits(value);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  const std::uint32_t magnitude = bits & 0x7FFFFFFFu;

  if (magnitude >= 0x7F800000u) {  // inf stays inf; NaN becomes the canonical quiet NaN
    return static_cast<std::uint16_t>(sign | (magnitude > 0x7F800000u ? 0x7E00u : 0x7C00u));
  }
  if (magnitude >= 0x477FF000u) {  // rounds to a value >= 65520: overflow to infinity
    return static_cast<std::uint16_t>(sign | 0x7C00u);
  }
  if (magnitude < 0x38800000u) {  // below the smallest normal f16 (2^-14): subnormal or zero
    // Let the FPU do the rounding: adding 0.5 aligns the f16 subnormal grid (spacing 2^-24)
    // with the f32 mantissa's last bit, and the addition rounds to nearest even.
    const float shifted = bits_float(magnitude) + 0.5f;
    return static_cast<std::uint16_t>(sign | (float_bits(shifted) - 0x3F000000u));
  }
  // Normal range: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits.
  const std::uint32_t odd = (magnitude >> 13) & 1u;
  const std::uint32_t rebased = magnitude - (static_cast<std::uint32_t>(127 - 15) << 23) + 0xFFFu + odd;
  return static_cast<std::uint16_t>(sign | (rebased >> 13));
}

GRADSYNC_HOST_DEVICE inline float half_bits_to_float(std::uint16_t half) {
  const std::uint32_t sign = static_cast<std::uint32_t>(half & 0x8000u) << 16;
  const std::uint32_t exponent = (half >> 10) & 0x1Fu;
  const std::uint32_t mantissa = half & 0x03FFu;
  if (exponent == 0x1Fu) {  // inf, or a NaN made quiet (as the F16C instruction does)
    const std::uint32_t quiet = mantissa != 0 ? 0x00400000u : 0u;
    return bits_float(sign | 0x7F800000u | quiet | (mantissa << 13));
  }
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in f32
    const float value = static_cast<float>(mantissa) * bits_float(0x33800000u);  // 2^-24
    return bits_float(sign | float_bits(value));
  }
  return bits_float(sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13));
}

}  // namespace gradsync
