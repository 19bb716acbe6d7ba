// Optimizers by name (gradsync/optim/factory.h).
#include "gradsync/optim/factory.h"

#include <algorithm>
#include <cctype>
#include <string>

#include "gradsync/optim/adam.h"
#include "gradsync/optim/sgd.h"

namespace gradsync::optim {

namespace {

// The groups with torch.optim's default options, before the settings are applied.
template <typename Kind>
std::vector<typename Kind::Group> default_groups(const std::vector<GroupSettings>& groups,
                                                 typename Kind::Options defaults) {
  std::vector<typename Kind::Group> result;
  for (const GroupSettings& group : groups) result.push_back({group.parameters, defaults});
  return result;
}

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(std::string_view name, ParameterRegistry& registry,
                                          std::vector<GroupSettings> groups, MasterWeights master_weights) {
  std::string kind(name);
  std::transform(kind.begin(), kind.end(), kind.begin(), [](unsigned char c) { return std::tolower(c); });
  std::unique_ptr<Optimizer> optimizer;
  if (kind == "sgd") {
    optimizer = std::make_unique<SGD>(registry, default_groups<SGD>(groups, SGD::Options{}), master_weights);
  } else if (kind == "adam") {
    optimizer = std::make_unique<Adam>(registry, default_groups<Adam>(groups, Adam::Options{}), master_weights);
  } else if (kind == "adamw") {
    optimizer = std::make_unique<AdamW>(registry, default_groups<Adam>(groups, AdamW::defaults()), master_weights);
  } else {
    detail::throw_error("make_optimizer: no optimizer '", name, "' (expected sgd, adam or adamw)");
  }
  for (std::size_t group = 0; group < groups.size(); ++group) {
    optimizer->update_hyperparameters(group, groups[group].hyperparameters);
  }
  return optimizer;
}

std::unique_ptr<Optimizer> make_optimizer(std::string_view name, ParameterRegistry& registry,
                                          const Hyperparameters& hyperparameters, MasterWeights master_weights) {
  return make_optimizer(name, registry, {{trainable_parameters(registry), hyperparameters}}, master_weights);
}

}  // namespace gradsync::optim
