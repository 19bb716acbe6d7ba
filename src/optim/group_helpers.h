// Internal: small helpers the concrete optimizers share.
#pragma once

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

// Copies values[key] into field when present (booleans: non-zero is true).
inline void assign(const Hyperparameters& values, const char* key, double& field) {
  if (const auto found = values.find(key); found != values.end()) field = found->second;
}
inline void assign(const Hyperparameters& values, const char* key, bool& field) {
  if (const auto found = values.find(key); found != values.end()) field = found->second != 0.0;
}

}  // namespace gradsync::optim::internal
