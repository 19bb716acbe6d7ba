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

// One parameter group as torch.optim takes it: its parameters and their hyperparameters.
struct GroupSettings {
  std::vector<Parameter*> parameters;  // trainable, of the registry, in no other group
  Hyperparameters hyperparameters;     // by torch.optim's names; the others keep their defaults
};

// The optimizer `name` ("sgd", "adam", "adamw", any case) over these groups; an unknown name or
// hyperparameter is an error naming it and listing the valid ones.
std::unique_ptr<Optimizer> make_optimizer(std::string_view name, ParameterRegistry& registry,
                                          std::vector<GroupSettings> groups,
                                          MasterWeights master_weights = MasterWeights::none);
// Every trainable parameter of the registry, one group.
std::unique_ptr<Optimizer> make_optimizer(std::string_view name, ParameterRegistry& registry,
                                          const Hyperparameters& hyperparameters = {},
                                          MasterWeights master_weights = MasterWeights::none);

}  // namespace gradsync::optim
