// ShardedSequential (gradsync/nn/sharded_sequential.h): an nn::Sequential under ZeRO stage 3.
#include "gradsync/nn/sharded_sequential.h"

namespace gradsync::nn {

ShardedSequential::ShardedSequential(std::shared_ptr<Sequential> layers) : layers_(std::move(layers)) {
  GRADSYNC_CHECK(layers_ != nullptr, "ShardedSequential: no layers");
  for (std::size_t i = 0; i < layers_->size(); ++i) {
    auto* linear = dynamic_cast<Linear*>(&(*layers_)[i]);  // nn's one layer with parameters
    unit_of_layer_.push_back(linear != nullptr ? static_cast<int>(units_.size()) : -1);
    if (linear != nullptr) units_.push_back({&linear->weight(), &linear->bias()});
  }
  GRADSYNC_CHECK(!units_.empty(), "ShardedSequential: no layer has parameters, so there is nothing to shard");
}

void ShardedSequential::gather_all() {
  GRADSYNC_CHECK(zero_ != nullptr, "ShardedSequential: attach the ZeroOptimizer first");
  for (std::size_t unit = 0; unit < units_.size(); ++unit) zero_->gather(unit);
}

Tensor ShardedSequential::forward(const Tensor& input) {
  Tensor x = input;
  for (std::size_t i = 0; i < layers_->size(); ++i) {
    gather(i);
    x = (*layers_)[i].forward(x);
    if (i + 1 < layers_->size()) release(i);  // the last stays: the backward starts with it
  }
  return x;
}

Tensor ShardedSequential::backward(const Tensor& grad_output) {
  Tensor g = grad_output;
  for (std::size_t i = layers_->size(); i-- > 0;) {
    gather(i);
    g = (*layers_)[i].backward(g);
    release(i);
  }
  return g;
}

void ShardedSequential::gather(std::size_t layer) {
  GRADSYNC_CHECK(zero_ != nullptr, "ShardedSequential: attach the ZeroOptimizer (stage 3) before the first forward");
  if (unit_of_layer_[layer] >= 0) zero_->gather(static_cast<std::size_t>(unit_of_layer_[layer]));
}

void ShardedSequential::release(std::size_t layer) {
  if (unit_of_layer_[layer] >= 0) zero_->release(static_cast<std::size_t>(unit_of_layer_[layer]));
}

}  // namespace gradsync::nn
