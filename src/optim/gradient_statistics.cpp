// Gradient factors and statistics (gradsync/optim/optimizer.h): the loss scaler's unscale and
// the clipping coefficient the next step applies inside its fused pass, and the one pass over
// the gradients that clipping and the GradScaler's finite check share.
#include <algorithm>
#include <cmath>

#include "gradsync/kernels/ops.h"
#include "gradsync/optim/optimizer.h"
#include "state_arenas.h"

namespace gradsync::optim {

void Optimizer::defer_gradient_unscale(double factor) {
  GRADSYNC_CHECK(std::isfinite(factor) && factor > 0.0, name(), ": gradient unscale factor ", factor,
                 " is not a positive finite number");
  grad_unscale_ = factor;
  statistics_.reset();
}

void Optimizer::defer_gradient_clip(double factor) {
  // NaN is allowed: clipping by a NaN norm makes NaN gradients in PyTorch too.
  GRADSYNC_CHECK(!(factor < 0.0), name(), ": gradient clip factor ", factor, " is negative");
  grad_clip_ *= factor;
}

void Optimizer::discard_gradient_factors() {
  grad_unscale_ = 1.0;
  grad_clip_ = 1.0;
  statistics_.reset();
}

GradientStatistics gradient_statistics(std::span<Parameter* const> parameters, double factor) {
  GradientStatistics total;
  for (const Parameter* parameter : parameters) {
    GRADSYNC_CHECK(parameter != nullptr, "gradient_statistics: a null parameter");
    if (!parameter->grad_defined()) continue;
    const ops::NormStatistics one = ops::norm_statistics(parameter->grad(), factor);
    total.sum_of_squares += one.sum_of_squares;
    total.max_abs = std::max(total.max_abs, one.max_abs);
    total.nonfinite += one.nonfinite;
    if (one.nonfinite > 0) total.nonfinite_parameters.push_back(parameter->name());
  }
  return total;
}

const GradientStatistics& Optimizer::gradient_statistics() {
  if (!statistics_) {
    std::vector<Parameter*> all;
    for (const auto& group : groups_) all.insert(all.end(), group.begin(), group.end());
    if (!state_->sharded()) {
      statistics_ = optim::gradient_statistics(all, grad_unscale_);
    } else {
      // The owned elements only: the reduced gradient lives there (ZeRO stage 2 reduces
      // nothing else), and the ranks' statistics together cover every element once.
      GradientStatistics total;
      for (const Parameter* parameter : all) {
        if (!parameter->grad_defined()) continue;
        const Tensor& grads = registry_.arenas()[parameter->arena_index()].grads;
        std::int64_t nonfinite = 0;
        for (const internal::StateArenas::Piece& piece : state_->pieces(*parameter)) {
          const ops::NormStatistics one =
              ops::norm_statistics(grads.view(static_cast<std::size_t>(piece.begin), {piece.count}), grad_unscale_);
          total.sum_of_squares += one.sum_of_squares;
          total.max_abs = std::max(total.max_abs, one.max_abs);
          nonfinite += one.nonfinite;
        }
        total.nonfinite += nonfinite;
        if (nonfinite > 0) total.nonfinite_parameters.push_back(parameter->name());
      }
      if (combine_statistics_) combine_statistics_(total);
      statistics_ = total;
    }
  }
  return *statistics_;
}

}  // namespace gradsync::optim
