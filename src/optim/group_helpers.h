// Internal: small helpers the concrete optimizers share.
#pragma once

#include <array>
#include <vector>

#include "../kernels/optimizer_kernels.h"
#include "gradsync/optim/optimizer.h"

namespace gradsync::optim::internal {

// The parameter lists of a vector of {parameters, options} groups.
template <typename Group>
std::vector<std::vector<Parameter*>> members(const std::vector<Group>& groups) {
  std::vector<std::vector<Parameter*>> result;
  for (const Group& group : groups) result.push_back(group.parameters);
  return result;
}

// One hyperparameter of an optimizer's Options: the name checkpoints and messages use, and the
// member it lives in (a number, or a flag stored as 0/1). Each optimizer lists its fields once;
// hyperparameters() and set_hyperparameters() both read that list.
template <typename Options>
struct Field {
  const char* name;
  double Options::*number;
  bool Options::*flag;
};
template <typename Options>
constexpr Field<Options> number(const char* name, double Options::*member) {
  return {name, member, nullptr};
}
template <typename Options>
constexpr Field<Options> flag(const char* name, bool Options::*member) {
  return {name, nullptr, member};
}

// The named numbers of `options`.
template <typename Options, std::size_t N>
Hyperparameters to_hyperparameters(const Options& options, const std::array<Field<Options>, N>& fields) {
  Hyperparameters values;
  for (const Field<Options>& field : fields) {
    values[field.name] = field.number != nullptr ? options.*field.number : (options.*field.flag ? 1.0 : 0.0);
  }
  return values;
}

// `options` with every field that `values` names replaced (flags: non-zero is true).
template <typename Options, std::size_t N>
Options with_hyperparameters(Options options, const Hyperparameters& values, const std::array<Field<Options>, N>& fields) {
  for (const Field<Options>& field : fields) {
    const auto found = values.find(field.name);
    if (found == values.end()) continue;
    if (field.number != nullptr) {
      options.*field.number = found->second;
    } else {
      options.*field.flag = found->second != 0.0;
    }
  }
  return options;
}

}  // namespace gradsync::optim::internal
