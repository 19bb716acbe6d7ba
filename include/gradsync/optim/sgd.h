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

// torch.optim.SGD, fused over arenas (the update above); shards under ZeRO.
class SGD : public Optimizer {
 public:
  // torch.optim.SGD's hyperparameters, under its names and defaults.
  struct Options {
    double lr = 1e-3;            // the learning rate
    double momentum = 0.0;       // 0: no momentum buffer
    double dampening = 0.0;      // scales the new gradient's share of the momentum
    double weight_decay = 0.0;   // L2: added to the gradient as weight_decay * param
    bool nesterov = false;       // Nesterov momentum (needs momentum > 0, dampening 0)
    bool maximize = false;       // ascend: the gradient's sign flipped
  };
  // One parameter group (PyTorch's param_groups entry).
  struct Group {
    std::vector<Parameter*> parameters;  // trainable, of the registry, in no other group
    Options options;                     // this group's hyperparameters
  };

  // Every trainable parameter of the registry, one group. MasterWeights::f32 is required for
  // f16/bf16 parameters (see optimizer.h).
  SGD(ParameterRegistry& registry, const Options& options, MasterWeights master_weights = MasterWeights::none);
  SGD(ParameterRegistry& registry, std::vector<Group> groups, MasterWeights master_weights = MasterWeights::none);

  const char* name() const override { return "SGD"; }
  bool supports_sharding() const override { return true; }
  const Options& options(std::size_t group) const;  // a group's hyperparameters
  // Replaces them, validated first (an invalid value is an error naming it; nothing changes).
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
