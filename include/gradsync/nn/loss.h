// gradsync/nn/loss.h - losses with their gradients, for hand-written backward passes.
//
// Each returns the mean loss over the batch and dLoss/dInput multiplied by `grad_scale`
// (default 1/batch, the gradient of the mean). Data-parallel training with microbatches
// passes 1/(samples per rank per step) so that accumulating microbatches and averaging over
// ranks gives the gradient of the mean over the global batch.
#pragma once

#include <cstdint>
#include <optional>

#include "gradsync/core/tensor.h"

namespace gradsync::nn {

// A loss, its gradient with respect to the input, and (classification) the correct count.
struct LossResult {
  double loss = 0;           // mean over the batch
  Tensor grad;               // same shape as the input
  std::int64_t correct = 0;  // classification only: argmax == label
};

// logits [batch, classes], labels i64 [batch] (on the host).
LossResult softmax_cross_entropy(const Tensor& logits, const Tensor& labels, std::optional<double> grad_scale = {});
// Mean over every element of (output - target)^2, as torch.nn.MSELoss.
LossResult mse_loss(const Tensor& output, const Tensor& target, std::optional<double> grad_scale = {});

// argmax per row == label, counted (for evaluation without a gradient).
std::int64_t count_correct(const Tensor& logits, const Tensor& labels);

}  // namespace gradsync::nn
