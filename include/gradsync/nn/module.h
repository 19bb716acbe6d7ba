// gradsync/nn/module.h - the minimal Module: parameters in a registry, a forward, and a
// hand-written backward that writes parameter gradients and signals each one ready as soon as
// it is complete (last layer first, so reductions start while earlier layers still compute).
// No autograd: each layer keeps what its backward needs from its forward.
#pragma once

#include "gradsync/registry/parameter_registry.h"

namespace gradsync::nn {

// A layer or a model with a hand-written backward (above).
class Module {
 public:
  virtual ~Module() = default;
  // Where this module's parameters live (shared by the layers of one model).
  virtual ParameterRegistry& registry() = 0;
  // input [batch, features] -> output [batch, features'].
  virtual Tensor forward(const Tensor& input) = 0;
  // dLoss/dOutput -> dLoss/dInput. Accumulates into the parameters' gradients (so microbatches
  // add up) and marks each parameter ready when its gradient is complete.
  virtual Tensor backward(const Tensor& grad_output) = 0;

  bool has_trainable_parameters();  // its registry holds a parameter that requires a gradient
};

}  // namespace gradsync::nn
