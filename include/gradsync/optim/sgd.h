// gradsync/optim/sgd.h - stochastic gradient descent with torch.optim.SGD's semantics.
//
//   d_p = maximize ? -grad : grad
//   d_p += weight_decay * param
//   buf = first step ? d_p : momentum * buf + (1 - dampening) * d_p      (if momentum != 0)
//   d_p = nesterov ? d_p + momentum * buf : buf
//   param -= lr * d_p
#pragma once

#include "gradsync/optim/optimizer.h"

namespace gradsync::optim {

class SGD : public Optimizer {
 public:
  struct Options {
    double lr = 1e-3;
    double momentum = 0.0;
    double dampening = 0.0;
    double weight_decay = 0.0;
    bool nesterov = false;
    bool maximize = false;
  };
  struct Group {
    std::vector<Parameter*> parameters;
    Options options;
  };

  // Every trainable parameter of the registry, one group. MasterWeights::f32 is required for
  // f16/bf16 parameters (see optimizer.h).
  SGD(ParameterRegistry& registry, const Options& options, MasterWeights master_weights = MasterWeights::none);
  SGD(ParameterRegistry& registry, std::vector<Group> groups, MasterWeights master_weights = MasterWeights::none);

  const char* name() const override { return "SGD"; }
  bool supports_sharding() const override { return true; }
  const Options& options(std::size_t group) const;
  void set_options(std::size_t group, const Options& options);
  Hyperparameters hyperparameters(std::size_t group) const override;

 protected:
  void set_hyperparameters(std::size_t group, const Hyperparameters& values) override;
  std::uint32_t buffers_used(std::size_t group) const override;
  void update_arena(const ArenaSlice& slice, std::span<const Segment> segments) override;

 private:
  std::vector<Options> options_;
};

}  // namespace gradsync::optim
