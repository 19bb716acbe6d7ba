// PyTorch's and numpy's Mersenne Twister draws (torch_random.h).
#include "torch_random.h"

#include <cmath>
#include <numbers>

#include "gradsync/core/error.h"

namespace gradsync::dist::random {

Mt19937::Mt19937(std::uint32_t seed) {
  state_[0] = seed;
  for (std::uint32_t j = 1; j < state_.size(); ++j) {
    state_[j] = 1812433253u * (state_[j - 1] ^ (state_[j - 1] >> 30)) + j;
  }
}

void Mt19937::twist() {
  constexpr std::size_t n = 624, m = 397;
  constexpr std::uint32_t matrix_a = 0x9908b0dfu, upper = 0x80000000u, lower = 0x7fffffffu;
  for (std::size_t j = 0; j < n; ++j) {
    const std::uint32_t y = (state_[j] & upper) | (state_[(j + 1) % n] & lower);
    state_[j] = state_[(j + m) % n] ^ (y >> 1) ^ ((y & 1u) ? matrix_a : 0u);
  }
  position_ = 0;
}

std::uint32_t Mt19937::next32() {
  if (position_ >= state_.size()) twist();
  std::uint32_t y = state_[position_++];
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= y >> 18;
  return y;
}

std::uint64_t Mt19937::next64() {
  const std::uint64_t high = next32();
  return (high << 32) | next32();
}

std::vector<std::int64_t> Mt19937::save() const {
  std::vector<std::int64_t> saved(state_.begin(), state_.end());
  saved.push_back(static_cast<std::int64_t>(position_));
  return saved;
}

void Mt19937::load(const std::vector<std::int64_t>& saved) {
  GRADSYNC_CHECK(saved.size() == state_.size() + 1 && saved.back() >= 0 &&
                     saved.back() <= static_cast<std::int64_t>(state_.size()),
                 "Mt19937::load: a saved state has 625 entries with a position in [0, 624], got ", saved.size(),
                 " entries");
  for (std::size_t j = 0; j < state_.size(); ++j) state_[j] = static_cast<std::uint32_t>(saved[j]);
  position_ = static_cast<std::size_t>(saved.back());
}

std::int64_t numpy_randint(Mt19937& engine, std::int64_t high) {
  GRADSYNC_CHECK(high > 0 && high <= (std::int64_t{1} << 32), "numpy_randint: high ", high, " is outside (0, 2^32]");
  const auto range = static_cast<std::uint32_t>(high - 1);
  std::uint32_t mask = range;
  for (int shift = 1; shift <= 16; shift *= 2) mask |= mask >> shift;
  for (;;) {
    const std::uint32_t value = engine.next32() & mask;
    if (value <= range) return value;
  }
}

// 24 bits for a float, 53 for a double: torch's uniform_real_distribution on [0, 1).
namespace {
double uniform(Mt19937& engine, float*) { return static_cast<float>(engine.next32() & ((1u << 24) - 1)) * (1.0f / (1u << 24)); }
double uniform(Mt19937& engine, double*) {
  return static_cast<double>(engine.next64() & ((std::uint64_t{1} << 53) - 1)) * (1.0 / static_cast<double>(std::uint64_t{1} << 53));
}
}  // namespace

// normal_fill: every element a uniform, then Box-Muller on each block of 16 in the element type;
// a partial last block is redrawn as the last 16 elements.
template <typename T>
void TorchNormal::fill_blocks(T* data, std::size_t n) {
  const auto block = [&](T* b) {
    for (int j = 0; j < 8; ++j) {
      const T u1 = 1 - b[j];
      const T u2 = b[j + 8];
      const T radius = std::sqrt(-2 * std::log(u1));
      const T theta = static_cast<T>(2.0 * std::numbers::pi * static_cast<double>(u2));  // in double, as torch
      b[j] = radius * std::cos(theta);
      b[j + 8] = radius * std::sin(theta);
    }
  };
  for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<T>(uniform(engine_, static_cast<T*>(nullptr)));
  for (std::size_t i = 0; i + 16 <= n; i += 16) block(data + i);
  if (n % 16 != 0) {
    T* tail = data + n - 16;
    for (std::size_t i = 0; i < 16; ++i) tail[i] = static_cast<T>(uniform(engine_, static_cast<T*>(nullptr)));
    block(tail);
  }
}

// at::normal_distribution<double>: two 53-bit uniforms give two normals; the second waits in
// the generator for the next element (of this call or the next).
template <typename T>
void TorchNormal::fill_pairs(T* data, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if (has_cached_) {
      data[i] = static_cast<T>(cached_);
      has_cached_ = false;
      continue;
    }
    const double u1 = uniform(engine_, static_cast<double*>(nullptr));
    const double u2 = uniform(engine_, static_cast<double*>(nullptr));
    const double radius = std::sqrt(-2.0 * std::log1p(-u2));
    const double theta = 2.0 * std::numbers::pi * u1;
    cached_ = radius * std::sin(theta);
    has_cached_ = true;
    data[i] = static_cast<T>(radius * std::cos(theta));
  }
}

void TorchNormal::fill(float* data, std::size_t n) { n >= 16 ? fill_blocks(data, n) : fill_pairs(data, n); }
void TorchNormal::fill(double* data, std::size_t n) { n >= 16 ? fill_blocks(data, n) : fill_pairs(data, n); }

}  // namespace gradsync::dist::random
