// The tests' optimizer factory (optimizers.h).
#include "optimizers.h"

#include "gradsync/core/error.h"

namespace gradsync::testing {

optim::Hyperparameters training_settings(const std::string& kind) {
  if (kind == "sgd") return {{"lr", 0.05}, {"momentum", 0.9}};
  if (kind == "adam") return {{"lr", 0.01}};
  detail::throw_error("training_settings: no settings for '", kind, "'");
}

optim::Hyperparameters zero_settings(const std::string& kind) {
  if (kind == "sgd") return {{"lr", 0.1}, {"momentum", 0.9}, {"weight_decay", 0.01}, {"nesterov", 1}};
  if (kind == "adam") return {{"lr", 0.01}, {"weight_decay", 0.1}};
  if (kind == "adamw") return {{"lr", 0.01}, {"weight_decay", 0.1}, {"amsgrad", 1}};
  detail::throw_error("zero_settings: no settings for '", kind, "'");
}

std::unique_ptr<optim::Optimizer> make_test_optimizer(const std::string& kind, ParameterRegistry& registry,
                                                      const optim::Hyperparameters& settings,
                                                      optim::MasterWeights master) {
  return optim::make_optimizer(kind, registry, settings, master);
}

std::unique_ptr<optim::Optimizer> make_test_optimizer(const std::string& kind, ParameterRegistry& registry,
                                                      std::vector<optim::GroupSettings> groups,
                                                      optim::MasterWeights master) {
  return optim::make_optimizer(kind, registry, std::move(groups), master);
}

}  // namespace gradsync::testing
