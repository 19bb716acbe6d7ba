// gradsync/optim/adam.h - Adam and AdamW with torch.optim.Adam / AdamW semantics.
//
//   g = maximize ? -grad : grad
//   AdamW: param *= 1 - lr * weight_decay          Adam: g += weight_decay * param
//   exp_avg    = beta1 * exp_avg    + (1 - beta1) * g
//   exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
//   v = amsgrad ? (max_exp_avg_sq = max(max_exp_avg_sq, exp_avg_sq)) : exp_avg_sq
//   param -= lr / (1 - beta1^t) * exp_avg / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// with t the parameter's own step count.
#pragma once

#include "gradsync/optim/optimizer.h"

namespace gradsync::optim {

// torch.optim.Adam, fused over arenas (the update above); shards under ZeRO.
class Adam : public Optimizer {
 public:
  // torch.optim.Adam's hyperparameters, under its names and defaults (betas as beta1, beta2).
  struct Options {
    double lr = 1e-3;           // the learning rate
    double beta1 = 0.9;         // decay of the first moment (exp_avg)
    double beta2 = 0.999;       // decay of the second moment (exp_avg_sq)
    double eps = 1e-8;          // added to the denominator
    double weight_decay = 0.0;  // Adam: L2 added to the gradient; AdamW: decoupled decay
    bool amsgrad = false;       // keep the maximum of the second moments (max_exp_avg_sq)
    bool maximize = false;      // ascend: the gradient's sign flipped
  };
  // One parameter group (PyTorch's param_groups entry).
  struct Group {
    std::vector<Parameter*> parameters;  // trainable, of the registry, in no other group
    Options options;                     // this group's hyperparameters
  };

  // MasterWeights::f32 is required for f16/bf16 parameters (see optimizer.h).
  Adam(ParameterRegistry& registry, const Options& options, MasterWeights master_weights = MasterWeights::none);
  Adam(ParameterRegistry& registry, std::vector<Group> groups, MasterWeights master_weights = MasterWeights::none);

  const char* name() const override { return decoupled_ ? "AdamW" : "Adam"; }
  bool supports_sharding() const override { return true; }
  const Options& options(std::size_t group) const;  // a group's hyperparameters
  // Replaces them, validated first (an invalid value is an error naming it; nothing changes).
  void set_options(std::size_t group, const Options& options);
  Hyperparameters hyperparameters(std::size_t group) const override;

 protected:
  // AdamW's constructor: weight decay decoupled from the gradient.
  Adam(ParameterRegistry& registry, std::vector<Group> groups, bool decoupled, MasterWeights master_weights);
  void set_hyperparameters(std::size_t group, const Hyperparameters& values) override;
  std::uint32_t buffers_used(std::size_t group) const override;
  void update_arena(const ArenaSlice& slice, std::span<const Segment> segments) override;

 private:
  std::vector<Options> options_;
  bool decoupled_;
};

// AdamW: Adam with decoupled weight decay (Loshchilov & Hutter); PyTorch's default
// weight_decay for AdamW is 0.01.
class AdamW : public Adam {
 public:
  // torch.optim.AdamW's hyperparameters: Adam's, with AdamW's own default weight decay of 0.01,
  // so that AdamW::Options{.lr = 3e-4} decays as torch.optim.AdamW(lr=3e-4) does (it was Adam's
  // Options, whose 0 then silently turned the decay off).
  struct Options {
    double lr = 1e-3;            // the learning rate
    double beta1 = 0.9;          // decay of the first moment
    double beta2 = 0.999;        // decay of the second moment
    double eps = 1e-8;           // added to the denominator
    double weight_decay = 1e-2;  // decoupled: param *= 1 - lr * weight_decay
    bool amsgrad = false;        // keep the maximum of the second moments
    bool maximize = false;       // ascend
    // The same values as Adam's options (a Group's, options(), set_options()).
    operator Adam::Options() const { return {lr, beta1, beta2, eps, weight_decay, amsgrad, maximize}; }
  };
  // AdamW's defaults as Adam's options (for a Group).
  static Adam::Options defaults() { return Options{}; }
  // Every trainable parameter of the registry, one group, torch.optim.AdamW's defaults.
  explicit AdamW(ParameterRegistry& registry);
  // Every trainable parameter of the registry, one group; MasterWeights::f32 for f16/bf16.
  AdamW(ParameterRegistry& registry, const Options& options, MasterWeights master_weights = MasterWeights::none);
  // The same, with every value given as Adam's options (AdamW::defaults(), options(g) of another).
  AdamW(ParameterRegistry& registry, const Adam::Options& options, MasterWeights master_weights = MasterWeights::none);
  AdamW(ParameterRegistry& registry, std::vector<Group> groups, MasterWeights master_weights = MasterWeights::none);
};

}  // namespace gradsync::optim
