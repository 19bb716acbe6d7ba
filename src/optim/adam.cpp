#include "gradsync/optim/adam.h"

#include <cmath>

#include "../kernels/optimizer_kernels.h"
#include "gradsync/config.h"
#include "group_helpers.h"

namespace gradsync::optim {

namespace {

void validate(const Adam::Options& options, std::size_t group, const char* name) {
  GRADSYNC_CHECK(options.lr >= 0.0, name, " group ", group, ": invalid learning rate: ", options.lr);
  GRADSYNC_CHECK(options.eps >= 0.0, name, " group ", group, ": invalid epsilon value: ", options.eps);
  GRADSYNC_CHECK(options.beta1 >= 0.0 && options.beta1 < 1.0, name, " group ", group,
                 ": invalid beta parameter at index 0: ", options.beta1);
  GRADSYNC_CHECK(options.beta2 >= 0.0 && options.beta2 < 1.0, name, " group ", group,
                 ": invalid beta parameter at index 1: ", options.beta2);
  GRADSYNC_CHECK(options.weight_decay >= 0.0, name, " group ", group, ": invalid weight_decay value: ",
                 options.weight_decay);
}

// The hyperparameters under torch.optim's names.
constexpr std::array kFields{internal::number("lr", &Adam::Options::lr),
                             internal::number("beta1", &Adam::Options::beta1),
                             internal::number("beta2", &Adam::Options::beta2),
                             internal::number("eps", &Adam::Options::eps),
                             internal::number("weight_decay", &Adam::Options::weight_decay),
                             internal::flag("amsgrad", &Adam::Options::amsgrad),
                             internal::flag("maximize", &Adam::Options::maximize)};

constexpr std::size_t kExpAvg = 0;
constexpr std::size_t kExpAvgSq = 1;
constexpr std::size_t kMaxExpAvgSq = 2;

}  // namespace

Adam::Adam(ParameterRegistry& registry, const Options& options, MasterWeights master_weights)
    : Adam(registry, std::vector<Group>{{trainable_parameters(registry), options}}, false, master_weights) {}

Adam::Adam(ParameterRegistry& registry, std::vector<Group> groups, MasterWeights master_weights)
    : Adam(registry, std::move(groups), false, master_weights) {}

Adam::Adam(ParameterRegistry& registry, std::vector<Group> groups, bool decoupled, MasterWeights master_weights)
    : Optimizer(registry, internal::members(groups), {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, master_weights),
      decoupled_(decoupled) {
  for (std::size_t group = 0; group < groups.size(); ++group) {
    validate(groups[group].options, group, name());
    options_.push_back(groups[group].options);
  }
}

AdamW::AdamW(ParameterRegistry& registry) : AdamW(registry, Options{}) {}

AdamW::AdamW(ParameterRegistry& registry, const Options& options, MasterWeights master_weights)
    : AdamW(registry, static_cast<Adam::Options>(options), master_weights) {}

AdamW::AdamW(ParameterRegistry& registry, const Adam::Options& options, MasterWeights master_weights)
    : Adam(registry, std::vector<Group>{{trainable_parameters(registry), options}}, true, master_weights) {}

AdamW::AdamW(ParameterRegistry& registry, std::vector<Group> groups, MasterWeights master_weights)
    : Adam(registry, std::move(groups), true, master_weights) {}

const Adam::Options& Adam::options(std::size_t group) const {
  group_parameters(group);  // range check with a clear message
  return options_[group];
}

void Adam::set_options(std::size_t group, const Options& options) {
  group_parameters(group);
  validate(options, group, name());
  options_[group] = options;
}

Hyperparameters Adam::hyperparameters(std::size_t group) const {
  return internal::to_hyperparameters(options(group), kFields);
}

void Adam::set_hyperparameters(std::size_t group, const Hyperparameters& values) {
  set_options(group, internal::with_hyperparameters(options(group), values, kFields));
}

std::uint32_t Adam::buffers_used(std::size_t group) const {
  return (1u << kExpAvg) | (1u << kExpAvgSq) | (options_[group].amsgrad ? (1u << kMaxExpAvgSq) : 0u);
}

void Adam::update_arena(const ArenaSlice& slice, std::span<const Segment> segments) {
  const Arena& parameters = registry().arenas()[slice.arena];
  std::vector<kernels::AdamSegment> runs;
  bool needs_max = false;
  for (const Segment& segment : segments) {
    const Options& o = options_[segment.group];
    needs_max |= o.amsgrad;
    // The scalars exactly as torch.optim computes them in Python (double precision).
    const double step = static_cast<double>(segment.step);
    const double bias_correction1 = 1.0 - std::pow(o.beta1, step);
    const double bias_correction2 = 1.0 - std::pow(o.beta2, step);
    runs.push_back({segment.begin, segment.count, o.beta1, o.beta2, o.eps, o.weight_decay,
                    1.0 - o.lr * o.weight_decay, o.lr / bias_correction1, std::sqrt(bias_correction2), o.amsgrad,
                    o.maximize, decoupled_, segment.grad_unscale, segment.grad_clip});
  }
  void* exp_avg = state_data(slice, kExpAvg);
  void* exp_avg_sq = state_data(slice, kExpAvgSq);
  void* max_exp_avg_sq = needs_max ? state_data(slice, kMaxExpAvgSq) : nullptr;
  if (parameters.device.is_cpu()) {
    kernels::cpu::adam_update(slice.buffers, exp_avg, exp_avg_sq, max_exp_avg_sq, runs);
  } else {
#if GRADSYNC_WITH_CUDA
    kernels::cuda::adam_update(parameters.device, slice.buffers, exp_avg, exp_avg_sq, max_exp_avg_sq, runs);
#else
    detail::throw_error(name(), ": parameters on ", parameters.device.str(), " but gradsync was built without CUDA");
#endif
  }
}

}  // namespace gradsync::optim
