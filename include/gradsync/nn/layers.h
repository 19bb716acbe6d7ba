// gradsync/nn/layers.h - just enough layers to train real models without autograd: Linear,
// ReLU and a Sequential container, each with a hand-written backward.
//
// A model is built in two steps, because parameters can only be written once the registry has
// laid out its arenas:
//
//   ParameterRegistry registry;
//   auto model = std::make_shared<nn::Sequential>(registry);
//   model->add<nn::Linear>("fc1", 64, 32);
//   model->add<nn::ReLU>();
//   model->add<nn::Linear>("fc2", 32, 10);
//   model->initialize(/*seed=*/1);          // finalizes the registry, then initializes weights
//
// Tensors are [batch, features], row-major, f32 or f64, on the CPU (Eigen) or a CUDA device
// (cuBLAS). Parameters may also be f16/bf16 (mixed precision): such a layer computes in f32. backward() accumulates into the parameter gradients and marks each ready at once,
// last layer first, so a data-parallel wrapper starts reducing while earlier layers compute.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gradsync/nn/module.h"

namespace gradsync::nn {

// y = x W^T + b, W [out, in], b [out], registered as "<name>.weight" and "<name>.bias".
class Linear final : public Module {
 public:
  // f16/bf16 parameters compute in f32 (inputs and outputs f32); their gradients are kept in
  // `grad_dtype` (default: the parameter's dtype; f32 accumulates 16-bit models' gradients in f32).
  Linear(ParameterRegistry& registry, const std::string& name, std::int64_t in_features, std::int64_t out_features,
         DType dtype = DType::f32, Device device = Device::cpu(), std::optional<DType> grad_dtype = std::nullopt);
  ParameterRegistry& registry() override { return registry_; }
  Tensor forward(const Tensor& input) override;
  Tensor backward(const Tensor& grad_output) override;
  // PyTorch's default: weight and bias uniform in +-1/sqrt(in_features) (kaiming_uniform with
  // a = sqrt(5)), from a generator seeded with `seed`.
  void initialize(std::uint64_t seed);

  Parameter& weight() { return *weight_; }  // [out_features, in_features]
  Parameter& bias() { return *bias_; }      // [out_features]

 private:
  ParameterRegistry& registry_;
  Parameter* weight_;
  Parameter* bias_;
  std::int64_t in_;
  std::int64_t out_;
  Tensor input_;  // kept by forward for backward
};

// max(x, 0); its backward passes the gradient where the input was positive.
class ReLU final : public Module {
 public:
  explicit ReLU(ParameterRegistry& registry) : registry_(registry) {}  // no parameters
  ParameterRegistry& registry() override { return registry_; }
  Tensor forward(const Tensor& input) override;
  Tensor backward(const Tensor& grad_output) override;

 private:
  ParameterRegistry& registry_;
  Tensor output_;
};

// Layers run in order; the backward runs them in reverse.
class Sequential final : public Module {
 public:
  explicit Sequential(ParameterRegistry& registry) : registry_(registry) {}  // empty: add() layers
  ParameterRegistry& registry() override { return registry_; }

  // Adds a layer constructed with (registry, args...).
  template <typename Layer, typename... Args>
  Layer& add(Args&&... args) {
    auto layer = std::make_unique<Layer>(registry_, std::forward<Args>(args)...);
    Layer& reference = *layer;
    layers_.push_back(std::move(layer));
    return reference;
  }
  // Finalizes the registry and initializes every Linear, layer i with seed + i.
  void initialize(std::uint64_t seed);

  Tensor forward(const Tensor& input) override;
  Tensor backward(const Tensor& grad_output) override;  // layers in reverse
  std::size_t size() const { return layers_.size(); }        // the number of layers
  Module& operator[](std::size_t i) { return *layers_[i]; }  // layer i

 private:
  ParameterRegistry& registry_;
  std::vector<std::unique_ptr<Module>> layers_;
};

}  // namespace gradsync::nn
