// gradsync/nn/sharded_sequential.h - ZeRO stage 3 for an nn::Sequential: its layers' parameters
// sharded over the ranks, each layer with parameters a unit that is gathered for the layer's
// forward and backward and released after them.
//
//   auto layers = std::make_shared<nn::Sequential>(registry);  ... add layers, initialize ...
//   auto sharded = std::make_shared<nn::ShardedSequential>(layers);
//   dist::DataParallelOptions options{.shard_gradients = true};
//   options.units = sharded->units();
//   nn::DistributedDataParallel model(sharded, comm, options);
//   dist::ZeroOptimizer zero(adam, model.data_parallel(), {.stage = 3});
//   sharded->attach(zero);
//   ... model.forward(x), loss, model.backward(g), zero.step(), zero.zero_grad() ...
//
// An engine without autograd has no hooks for gradsync to gather by, so this module says when
// it needs what: forward gathers each unit, runs its layer and releases it (FSDP's
// reshard_after_forward), except the last, which the backward uses at once; backward gathers
// each unit again, runs its layer's backward (which writes the gradients and marks them ready:
// the unit is reduce-scattered as soon as it is complete) and releases it. The first step's
// order of gathers is replayed as prefetches from then on (ZeroOptions::auto_prefetch).
#pragma once

#include <memory>
#include <vector>

#include "gradsync/dist/zero/zero.h"
#include "gradsync/nn/layers.h"

namespace gradsync::nn {

// An nn::Sequential under ZeRO stage 3: each layer with parameters is a unit, gathered around
// its forward and its backward and released after (the loop above).
class ShardedSequential final : public Module {
 public:
  explicit ShardedSequential(std::shared_ptr<Sequential> layers);  // over an initialized Sequential
  // One unit per layer with parameters, in layer order: DataParallelOptions::units.
  const std::vector<std::vector<Parameter*>>& units() const { return units_; }
  // The stage-3 ZeroOptimizer over the DataParallel made with units(); before the first forward.
  void attach(dist::ZeroOptimizer& zero) { zero_ = &zero; }
  // Every unit gathered (collective): before reading the whole model, to save or compare it.
  void gather_all();

  ParameterRegistry& registry() override { return layers_->registry(); }
  Tensor forward(const Tensor& input) override;
  Tensor backward(const Tensor& grad_output) override;

 private:
  void gather(std::size_t layer);
  void release(std::size_t layer);

  std::shared_ptr<Sequential> layers_;
  std::vector<std::vector<Parameter*>> units_;
  std::vector<int> unit_of_layer_;  // -1: a layer without parameters
  dist::ZeroOptimizer* zero_ = nullptr;
};

}  // namespace gradsync::nn
