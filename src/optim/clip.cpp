// Clipping by global norm (gradsync/optim/clip.h).
#include "gradsync/optim/clip.h"

#include <cmath>
#include <sstream>

#include "gradsync/kernels/ops.h"

namespace gradsync::optim {

namespace {

void require_norm_type(double norm_type) {
  GRADSYNC_CHECK(norm_type == 2.0 || norm_type == kInfinityNorm, "clip_grad_norm: norm_type ", norm_type,
                 " is not supported (2 or infinity)");
}

// PyTorch's message, plus what PyTorch cannot say: which parameters hold the inf or NaN.
[[noreturn]] void throw_nonfinite(double norm_type, double total, const GradientStatistics& statistics) {
  std::ostringstream names;
  for (std::size_t k = 0; k < statistics.nonfinite_parameters.size(); ++k) {
    names << (k ? ", " : "") << "'" << statistics.nonfinite_parameters[k] << "'";
  }
  detail::throw_error("clip_grad_norm: the total norm of order ", norm_type, " of the gradients is ", total,
                      ", so it cannot be clipped: ", statistics.nonfinite, " gradient element",
                      statistics.nonfinite == 1 ? " is" : "s are", " inf or NaN, in ", names.str(),
                      ". To scale the gradients by the non-finite norm anyway, set error_if_nonfinite to false");
}

// torch.clamp(max_norm / (total + 1e-6), max=1.0): NaN stays NaN.
double coefficient(double max_norm, double total) {
  const double coef = max_norm / (total + 1e-6);
  return std::isnan(coef) ? coef : std::min(coef, 1.0);
}

}  // namespace

double total_norm(const GradientStatistics& statistics, double norm_type) {
  require_norm_type(norm_type);
  // An inf or NaN element makes the sum of squares inf or NaN too, so it says which.
  if (norm_type == 2.0 || !statistics.finite()) {
    const double root = std::sqrt(statistics.sum_of_squares);
    return norm_type == 2.0 || std::isnan(root) ? root : std::numeric_limits<double>::infinity();
  }
  return statistics.max_abs;
}

double clip_grad_norm(Optimizer& optimizer, double max_norm, double norm_type, bool error_if_nonfinite) {
  require_norm_type(norm_type);
  GRADSYNC_CHECK(max_norm >= 0.0, "clip_grad_norm: max_norm ", max_norm, " is negative");
  const GradientStatistics& statistics = optimizer.gradient_statistics();
  const double total = total_norm(statistics, norm_type);
  if (error_if_nonfinite && !std::isfinite(total)) throw_nonfinite(norm_type, total, statistics);
  optimizer.defer_gradient_clip(coefficient(max_norm, total));
  return total;
}

double clip_grad_norm(std::span<Parameter* const> parameters, double max_norm, double norm_type,
                      bool error_if_nonfinite) {
  require_norm_type(norm_type);
  GRADSYNC_CHECK(max_norm >= 0.0, "clip_grad_norm: max_norm ", max_norm, " is negative");
  const GradientStatistics statistics = gradient_statistics(parameters);
  const double total = total_norm(statistics, norm_type);
  if (error_if_nonfinite && !std::isfinite(total)) throw_nonfinite(norm_type, total, statistics);
  const double coef = coefficient(max_norm, total);
  for (Parameter* parameter : parameters) {
    if (parameter->grad_defined()) ops::scale(parameter->grad_for_overwrite(), coef);
  }
  return total;
}

}  // namespace gradsync::optim
