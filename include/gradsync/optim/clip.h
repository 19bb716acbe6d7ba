// gradsync/optim/clip.h - clipping gradients by their global norm, with
// torch.nn.utils.clip_grad_norm_'s semantics.
//
//   total = || (||g_1||, ||g_2||, ...) ||      over the parameters with a defined gradient
//   coef  = min(max_norm / (total + 1e-6), 1)
//   g_i  *= coef                                 (always, also when coef is 1)
//
// norm_type is 2 (the Euclidean norm of all gradients as one vector) or infinity (the largest
// magnitude). The total is accumulated in double, so it is at least as accurate as PyTorch's
// f32 value (and differs from it by f32 rounding). With error_if_nonfinite, an inf or NaN
// total is an error naming the parameters whose gradients hold inf or NaN; otherwise such a
// total clips every gradient to NaN or zero, as PyTorch does.
//
// The Optimizer overload clips what that optimizer will step: the gradients as its pending
// GradScaler unscale leaves them, and it does not rewrite them but hands the coefficient to
// the next step()'s fused pass (the same product, rounded the same way, without a second pass
// over the gradients). Call it after the gradients are complete and synchronized: after
// DataParallel's backward, or through DistributedOptimizer::clip_grad_norm. Every rank then
// computes the same total from the same reduced gradients.
#pragma once

#include <limits>
#include <span>

#include "gradsync/optim/optimizer.h"

namespace gradsync::optim {

inline constexpr double kInfinityNorm = std::numeric_limits<double>::infinity();  // norm_type: the max norm

// Returns the total norm (of the unscaled gradients).
double clip_grad_norm(Optimizer& optimizer, double max_norm, double norm_type = 2.0, bool error_if_nonfinite = false);

// The same over explicit parameters, scaling their gradients in place (in their own dtype).
double clip_grad_norm(std::span<Parameter* const> parameters, double max_norm, double norm_type = 2.0,
                      bool error_if_nonfinite = false);

// The total norm alone, from statistics (what both overloads compute before clipping).
double total_norm(const GradientStatistics& statistics, double norm_type);

}  // namespace gradsync::optim
