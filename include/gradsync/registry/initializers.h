// gradsync/registry/initializers.h - parameter initialization that does not need the whole model:
// every element's value is a function of (seed, the parameter's name, the element's index in the
// whole parameter), never of what was drawn before it. So a rank holding only its piece of a
// parameter (ZeRO stage 3, a sharded load) fills exactly the values the whole parameter would
// hold there, for any world size and any cut:
//
//   init::fill(piece, "blocks.3.mlp.fc.weight", /*first=*/begin, init::normal(0.0, 0.02), seed);
//   init::initialize(registry.at("ln_f.weight"), init::ones(), seed);   // the whole parameter
//
// The generator is counter-based: element i of a parameter draws the 64-bit word
// mix(key + (2i + j) x golden), j = 0, 1, with key = mix(seed ^ FNV-1a(name)) and mix SplitMix64's
// finalizer (a bijection that passes BigCrush on a counter). A uniform is the top 53 bits of the
// first word; a normal is Box-Muller's cosine branch over both words. Values are computed in
// double and rounded to the target's dtype (nearest even), on the host, then copied to the
// target's device. The streams are gradsync's own (not torch's): a model initialized here trains
// the same at every world size, not the same as one PyTorch initialized.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "gradsync/registry/parameter.h"

namespace gradsync::init {

// What each element gets.
struct Rule {
  // Which of the constructors below made it.
  enum class Kind { constant, uniform, normal, function };
  Kind kind = Kind::constant;  // what the rule draws
  double a = 0.0;  // constant: the value; uniform: the low bound; normal: the mean
  double b = 0.0;  // uniform: the high bound; normal: the standard deviation
  std::function<double(std::int64_t)> function{};  // function: the value of global element i
};

Rule zeros();                                 // 0 everywhere
Rule ones();                                  // 1 everywhere
Rule constant(double value);                  // `value` everywhere
Rule uniform(double low, double high);        // uniform in [low, high)
Rule normal(double mean, double std);         // normal with this mean and standard deviation
// A value of the element's index in the whole parameter (row-major), e.g. a positional table.
Rule from_index(std::function<double(std::int64_t)> value);

// Fills `target` (floating, any device) with elements [first, first + target.numel()) of the
// parameter `name` under `rule` and `seed`. Errors name the parameter: a non-floating target, a
// negative first element, an invalid rule (std <= 0 or negative, high <= low, no function).
void fill(Tensor& target, const std::string& name, std::int64_t first, const Rule& rule, std::uint64_t seed);
// The whole parameter's value (the registry finalized).
void initialize(Parameter& parameter, const Rule& rule, std::uint64_t seed);

}  // namespace gradsync::init
