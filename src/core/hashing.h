// Internal: the two small hashes that counter-based code shares (init::fill's streams, the
// piece checksums of io/checksum.h): SplitMix64's finalizer and FNV-1a over a name.
#pragma once

#include <cstdint>
#include <string_view>

namespace gradsync::hashing {

// 2^64 / golden ratio: consecutive counters times it land far apart.
inline constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// SplitMix64's finalizer: a bijection of 64-bit words whose outputs on consecutive counters
// pass BigCrush (Steele, Lea and Flood, 2014).
inline std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// FNV-1a (64-bit) of a name: what keys a parameter's stream or checksum.
inline std::uint64_t name_hash(std::string_view name) {
  std::uint64_t hash = 1469598103934665603ull;
  for (const unsigned char c : name) hash = (hash ^ c) * 1099511628211ull;
  return hash;
}

}  // namespace gradsync::hashing
