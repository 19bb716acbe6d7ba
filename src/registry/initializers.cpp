// Counter-based parameter initialization (gradsync/registry/initializers.h).
#include "gradsync/registry/initializers.h"

#include <cmath>
#include <numbers>
#include <vector>

#include "gradsync/core/error.h"

namespace gradsync::init {

namespace {

constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// SplitMix64's finalizer: a bijection of 64-bit words whose outputs on consecutive counters
// pass BigCrush (Steele, Lea and Flood, 2014).
std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::uint64_t name_hash(const std::string& name) {
  std::uint64_t hash = 1469598103934665603ull;  // FNV-1a
  for (const unsigned char c : name) hash = (hash ^ c) * 1099511628211ull;
  return hash;
}

// A double in [0, 1) from a word's top 53 bits; (0, 1] when `open_at_zero`, for the logarithm.
double unit(std::uint64_t word, bool open_at_zero = false) {
  const double value = static_cast<double>(word >> 11) * 0x1.0p-53;
  return open_at_zero ? 1.0 - value : value;
}

void check(const Rule& rule, const std::string& name) {
  switch (rule.kind) {
    case Rule::Kind::uniform:
      GRADSYNC_CHECK(std::isfinite(rule.a) && std::isfinite(rule.b) && rule.b > rule.a, "init: '", name,
                     "': a uniform rule needs finite low < high, got [", rule.a, ", ", rule.b, ")");
      break;
    case Rule::Kind::normal:
      GRADSYNC_CHECK(std::isfinite(rule.a) && std::isfinite(rule.b) && rule.b > 0, "init: '", name,
                     "': a normal rule needs a finite mean and a positive std, got mean ", rule.a, ", std ", rule.b);
      break;
    case Rule::Kind::function:
      GRADSYNC_CHECK(static_cast<bool>(rule.function), "init: '", name, "': a from_index rule without a function");
      break;
    case Rule::Kind::constant:
      break;
  }
}

}  // namespace

Rule zeros() { return constant(0.0); }
Rule ones() { return constant(1.0); }
Rule constant(double value) { return {Rule::Kind::constant, value, 0.0, {}}; }
Rule uniform(double low, double high) { return {Rule::Kind::uniform, low, high, {}}; }
Rule normal(double mean, double std) { return {Rule::Kind::normal, mean, std, {}}; }
Rule from_index(std::function<double(std::int64_t)> value) { return {Rule::Kind::function, 0.0, 0.0, std::move(value)}; }

void fill(Tensor& target, const std::string& name, std::int64_t first, const Rule& rule, std::uint64_t seed) {
  GRADSYNC_CHECK(target.defined() && is_floating(target.dtype()), "init: '", name, "': the target must be a floating ",
                 "tensor, got ", target.defined() ? target.describe() : std::string("an undefined tensor"));
  GRADSYNC_CHECK(first >= 0, "init: '", name, "': first element ", first, " is negative");
  check(rule, name);
  const std::uint64_t key = mix(seed ^ name_hash(name));
  const auto word = [key](std::int64_t i, int j) {
    return mix(key + (2 * static_cast<std::uint64_t>(i) + static_cast<std::uint64_t>(j)) * kGolden);
  };
  std::vector<double> values(static_cast<std::size_t>(target.numel()));
  for (std::size_t k = 0; k < values.size(); ++k) {
    const std::int64_t i = first + static_cast<std::int64_t>(k);
    switch (rule.kind) {
      case Rule::Kind::constant:
        values[k] = rule.a;
        break;
      case Rule::Kind::uniform:
        values[k] = rule.a + (rule.b - rule.a) * unit(word(i, 0));
        break;
      case Rule::Kind::normal: {
        // Box-Muller, the cosine branch: each element its own pair of words.
        const double radius = std::sqrt(-2.0 * std::log(unit(word(i, 0), /*open_at_zero=*/true)));
        values[k] = rule.a + rule.b * radius * std::cos(2.0 * std::numbers::pi * unit(word(i, 1)));
        break;
      }
      case Rule::Kind::function:
        values[k] = rule.function(i);
        break;
    }
  }
  // Computed in double, rounded once to the target's dtype (Tensor::to), on the target's device.
  const Tensor computed = Tensor::from_vector(values, {target.numel()}).to(target.dtype());
  target.copy_from(computed.to(target.device()));
}

void initialize(Parameter& parameter, const Rule& rule, std::uint64_t seed) {
  Tensor value = parameter.value();
  fill(value, parameter.name(), 0, rule, seed);
}

}  // namespace gradsync::init
