// The GPT of the gpt example: nanoGPT's model (its model.py), written out by hand, forward and
// backward, the way an engine without autograd holds it. This is the user's engine: gradsync
// only owns the parameters' memory (a ParameterRegistry, so the names are nanoGPT's state-dict
// names and a checkpoint loads in PyTorch) and is told, layer by layer from the last, which
// gradients are ready.
//
//   token and position embeddings -> N x [pre-LayerNorm causal self-attention, residual;
//   pre-LayerNorm MLP (GELU), residual] -> final LayerNorm -> logits through the token embedding
//   (the lm_head is tied to transformer.wte.weight: one tensor, two uses).
//
// Biases everywhere, no dropout. GELU with the tanh approximation (GPT-2, llm.c) by default, or
// the exact erf form (nanoGPT's nn.GELU()). f32 for training, f64 for the gradient check, bf16
// for mixed precision: bf16 parameters and gradients (what gradsync reduces and the optimizer
// reads, with f32 master weights there), f32 arithmetic on widened copies of the weights.
//
// On the host or on one CUDA device: the parameters, the activations and the arithmetic all
// live there. The forward and backward below are written once, as a sequence of operations
// (gpt_kernels.h) that each device does in its own way.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpt_kernels.h"
#include "gradsync/core/tensor.h"
#include "gradsync/dist/zero/zero.h"
#include "gradsync/registry/parameter_registry.h"

namespace gradsync::examples {

struct GptConfig {
  std::int64_t vocab = 65;
  std::int64_t block = 64;  // the longest sequence (positions)
  std::int64_t layers = 2;
  std::int64_t heads = 2;
  std::int64_t embd = 32;
  bool gelu_tanh = true;
};

class Gpt {
 public:
  // Registers every parameter under nanoGPT's name, in nanoGPT's order, in `dtype` (f32, f64 or
  // bf16), on `device` (the host, or a CUDA device: an error naming it without CUDA).
  Gpt(ParameterRegistry& registry, GptConfig config, DType dtype = DType::f32, Device device = Device::cpu());

  const GptConfig& config() const { return config_; }
  Device device() const { return device_; }
  std::int64_t parameter_count() const;

  // nanoGPT's initialisation: weights normal(0, 0.02), the residual projections (c_proj)
  // normal(0, 0.02 / sqrt(2 layers)), biases 0, LayerNorm weights 1; from `seed`.
  void initialize(std::uint64_t seed);

  // The mean cross-entropy of predicting targets[b, t] from tokens[b, <= t], B x T tokens
  // (T <= block). Keeps what the backward needs.
  double forward(const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& targets, std::int64_t batch,
                 std::int64_t length);
  // The last forward's predicted distribution (the softmax of the logits) at token `row` of the
  // B x T, for sampling. Kept with the activations: no copy of the logits on the training path.
  std::vector<double> probabilities(std::int64_t row) const;

  // The gradient of (loss x loss_scale) into every parameter's gradient, added to what is there
  // (microbatches accumulate); each parameter is marked ready as soon as its gradient is
  // complete, the last layer's first, the token embedding last.
  void backward(double loss_scale = 1.0);

  // ZeRO stage 3: the units, each a run of neighbours in registration order: the embeddings
  // (wte, which the head uses too, and wpe), each block, the final LayerNorm
  // (DataParallelOptions::units). Once `shard` is called, the forward gathers each unit before
  // its first use and releases each block after it; the embeddings and the final LayerNorm stay
  // gathered into the backward (FSDP's root: the head, first in the backward, uses both, and the
  // embeddings' gradient is complete only at its end). The backward gathers each block again
  // and releases every unit once its gradients are ready. f32 and f64 parameters only.
  // shard(nullptr) stops: every unit must be gathered then (the model used whole, by one rank).
  std::vector<std::vector<Parameter*>> units() const;
  void shard(dist::ZeroOptimizer* zero);

 private:
  struct Layer {
    Parameter *ln_1_w, *ln_1_b, *attn_w, *attn_b, *proj_w, *proj_b, *ln_2_w, *ln_2_b, *fc_w, *fc_b, *fc_proj_w,
        *fc_proj_b;
  };
  template <typename T>
  double forward_as(const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& targets);
  template <typename T>
  void backward_as(double loss_scale);
  template <typename T>
  const GptKernels<T>& kernels() const;
  template <typename T>
  T* values(Parameter* p);
  template <typename T>
  T* grads(Parameter* p);
  void ready(Parameter* p);
  void gather(std::size_t unit);   // stage 3: the unit's values here (nothing without shard())
  void release(std::size_t unit);  // stage 3: back to this rank's pieces

  ParameterRegistry& registry_;
  GptConfig config_;
  DType dtype_;
  Device device_;
  std::unique_ptr<GptKernels<float>> f32_kernels_;  // f32 and bf16 (its arithmetic is f32)
  std::unique_ptr<GptKernels<double>> f64_kernels_;
  Parameter* wte_;
  Parameter* wpe_;
  std::vector<Layer> layers_;
  Parameter* ln_f_w_;
  Parameter* ln_f_b_;
  dist::ZeroOptimizer* zero_ = nullptr;  // stage 3's, once sharded

  // The last forward's inputs and activations (in the model's dtype, on its device; gpt_model.cpp).
  std::int64_t batch_ = 0;
  std::int64_t length_ = 0;
  std::shared_ptr<void> saved_;
  std::shared_ptr<void> spare_;  // the activations of the last backward, for the next forward's reuse
  // bf16 only, on the model's device: each parameter's f32 values for this step and its f32
  // gradient of this backward; `sum` the bf16 gradient widened while this one is added into it.
  struct Compute {
    Tensor values;
    Tensor grads;
  };
  std::map<const Parameter*, Compute> compute_;
  Tensor sum_;
};

}  // namespace gradsync::examples
