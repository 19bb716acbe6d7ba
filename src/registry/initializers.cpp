// Counter-based parameter initialization (gradsync/registry/initializers.h).
#include "gradsync/registry/initializers.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "core/hashing.h"
#include "core/parallel.h"
#include "gradsync/core/error.h"

namespace gradsync::init {

namespace {

using hashing::kGolden;
using hashing::mix;
using hashing::name_hash;

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
  // In chunks, so that filling a piece of hundreds of MiB costs a chunk of doubles, not the piece
  // in doubles; the drawn rules' chunks on the pool (each element depends on its index only), a
  // user's function on this thread (it need not be thread-safe).
  constexpr std::int64_t kChunk = std::int64_t{1} << 16;
  const std::int64_t n = target.numel();
  const auto fill_chunk = [&](std::int64_t chunk) {
    const std::int64_t begin = chunk * kChunk, end = std::min(n, begin + kChunk);
    std::vector<double> values(static_cast<std::size_t>(end - begin));
    for (std::size_t k = 0; k < values.size(); ++k) {
      const std::int64_t i = first + begin + static_cast<std::int64_t>(k);
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
    const Tensor computed = Tensor::from_vector(values, {end - begin}).to(target.dtype());
    target.view(static_cast<std::size_t>(begin), {end - begin}).copy_from(computed.to(target.device()));
  };
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  if (rule.kind == Rule::Kind::function || target.device().is_cuda()) {
    for (std::int64_t chunk = 0; chunk < chunks; ++chunk) fill_chunk(chunk);
  } else {
    parallel::for_each_task(chunks, fill_chunk);
  }
}

void initialize(Parameter& parameter, const Rule& rule, std::uint64_t seed) {
  Tensor value = parameter.value();
  fill(value, parameter.name(), 0, rule, seed);
}

}  // namespace gradsync::init
