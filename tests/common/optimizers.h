// The one way tests make an optimizer: by kind ("sgd", "adam", "adamw") and torch.optim's
// hyperparameter names, through the library's own factory (gradsync/optim/factory.h). The
// settings the multi-rank scenarios train with are named here once.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "gradsync/optim/factory.h"

namespace gradsync::testing {

// The settings the data-parallel and join scenarios train with: SGD with momentum, Adam.
optim::Hyperparameters training_settings(const std::string& kind);
// ZeRO's scenarios: weight decay, Nesterov momentum, AMSGrad for AdamW, so that every state
// buffer is sharded.
optim::Hyperparameters zero_settings(const std::string& kind);

// `settings` over torch.optim's defaults; every trainable parameter, one group.
std::unique_ptr<optim::Optimizer> make_test_optimizer(const std::string& kind, ParameterRegistry& registry,
                                                      const optim::Hyperparameters& settings,
                                                      optim::MasterWeights master = optim::MasterWeights::none);
// Several groups (the fixtures' cases).
std::unique_ptr<optim::Optimizer> make_test_optimizer(const std::string& kind, ParameterRegistry& registry,
                                                      std::vector<optim::GroupSettings> groups,
                                                      optim::MasterWeights master = optim::MasterWeights::none);

}  // namespace gradsync::testing
