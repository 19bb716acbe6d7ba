// gradsync/optim/factory.h - an optimizer chosen by name and configured by torch.optim's
// hyperparameter names: what a config file or a command line gives.
//
//   auto optimizer = optim::make_optimizer("adamw", registry, {{"lr", 3e-4}, {"weight_decay", 0.1}});
//
// Names: "sgd", "adam", "adamw" (any case). Hyperparameters not given keep torch.optim's
// defaults (AdamW's weight_decay is 0.01); booleans (nesterov, amsgrad, maximize) are 0 or 1.
// An unknown optimizer or hyperparameter name is an error listing the valid ones.
#pragma once

#include <memory>
#include <string_view>
#include <vector>

#include "gradsync/optim/optimizer.h"

namespace gradsync::optim {

struct GroupSettings {
  std::vector<Parameter*> parameters;
  Hyperparameters hyperparameters;
};

std::unique_ptr<Optimizer> make_optimizer(std::string_view name, ParameterRegistry& registry,
                                          std::vector<GroupSettings> groups,
                                          MasterWeights master_weights = MasterWeights::none);
// Every trainable parameter of the registry, one group.
std::unique_ptr<Optimizer> make_optimizer(std::string_view name, ParameterRegistry& registry,
                                          const Hyperparameters& hyperparameters = {},
                                          MasterWeights master_weights = MasterWeights::none);

}  // namespace gradsync::optim
