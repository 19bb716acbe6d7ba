#include "gradsync/optim/sgd.h"

#include "../kernels/optimizer_kernels.h"
#include "group_helpers.h"
#include "gradsync/config.h"

namespace gradsync::optim {

namespace {

void validate(const SGD::Options& options, std::size_t group) {
  GRADSYNC_CHECK(options.lr >= 0.0, "SGD group ", group, ": invalid learning rate: ", options.lr);
  GRADSYNC_CHECK(options.momentum >= 0.0, "SGD group ", group, ": invalid momentum value: ", options.momentum);
  GRADSYNC_CHECK(options.weight_decay >= 0.0, "SGD group ", group, ": invalid weight_decay value: ",
                 options.weight_decay);
  GRADSYNC_CHECK(!options.nesterov || (options.momentum > 0.0 && options.dampening == 0.0), "SGD group ", group,
                 ": Nesterov momentum requires a momentum and zero dampening");
}

// The hyperparameters under torch.optim's names.
constexpr std::array kFields{internal::number("lr", &SGD::Options::lr),
                             internal::number("momentum", &SGD::Options::momentum),
                             internal::number("dampening", &SGD::Options::dampening),
                             internal::number("weight_decay", &SGD::Options::weight_decay),
                             internal::flag("nesterov", &SGD::Options::nesterov),
                             internal::flag("maximize", &SGD::Options::maximize)};

constexpr std::size_t kMomentumBuffer = 0;

}  // namespace

SGD::SGD(ParameterRegistry& registry, const Options& options, MasterWeights master_weights)
    : SGD(registry, std::vector<Group>{{trainable_parameters(registry), options}}, master_weights) {}

SGD::SGD(ParameterRegistry& registry, std::vector<Group> groups, MasterWeights master_weights)
    : Optimizer(registry, internal::members(groups), {"momentum_buffer"}, master_weights) {
  for (std::size_t group = 0; group < groups.size(); ++group) {
    validate(groups[group].options, group);
    options_.push_back(groups[group].options);
  }
}

const SGD::Options& SGD::options(std::size_t group) const {
  group_parameters(group);  // range check with a clear message
  return options_[group];
}

void SGD::set_options(std::size_t group, const Options& options) {
  group_parameters(group);
  validate(options, group);
  options_[group] = options;
}

Hyperparameters SGD::hyperparameters(std::size_t group) const {
  return internal::to_hyperparameters(options(group), kFields);
}

void SGD::set_hyperparameters(std::size_t group, const Hyperparameters& values) {
  set_options(group, internal::with_hyperparameters(options(group), values, kFields));
}

std::uint32_t SGD::buffers_used(std::size_t group) const {
  return options_[group].momentum != 0.0 ? (1u << kMomentumBuffer) : 0u;
}

void SGD::update_arena(const ArenaSlice& slice, std::span<const Segment> segments) {
  const Arena& parameters = registry().arenas()[slice.arena];
  std::vector<kernels::SgdSegment> runs;
  bool needs_momentum = false;
  for (const Segment& segment : segments) {
    const Options& o = options_[segment.group];
    needs_momentum |= o.momentum != 0.0;
    runs.push_back({segment.begin, segment.count, o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov,
                    o.maximize, /*first_step=*/!(segment.present & (1u << kMomentumBuffer)), segment.grad_unscale,
                    segment.grad_clip});
  }
  void* momentum = needs_momentum ? state_data(slice, kMomentumBuffer) : nullptr;
  if (parameters.device.is_cpu()) {
    kernels::cpu::sgd_update(slice.buffers, momentum, runs);
  } else {
#if GRADSYNC_WITH_CUDA
    kernels::cuda::sgd_update(parameters.device, slice.buffers, momentum, runs);
#else
    detail::throw_error("SGD: parameters on ", parameters.device.str(), " but gradsync was built without CUDA");
#endif
  }
}

}  // namespace gradsync::optim
