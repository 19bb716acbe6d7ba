// Dynamic loss scaling (gradsync/optim/grad_scaler.h).
#include "gradsync/optim/grad_scaler.h"

#include <charconv>
#include <cmath>

#include "gradsync/comm/communicator.h"

namespace gradsync::optim {

GradScaler::GradScaler(GradScalerOptions options, comm::Communicator* communicator)
    : options_(options), communicator_(communicator), scale_(static_cast<float>(options.init_scale)) {
  // torch.amp.GradScaler's checks.
  GRADSYNC_CHECK(std::isfinite(options.init_scale) && options.init_scale > 0.0, "GradScaler: init_scale ",
                 options.init_scale, " must be a positive finite number");
  GRADSYNC_CHECK(options.growth_factor > 1.0, "GradScaler: growth_factor ", options.growth_factor,
                 " should be > 1");
  GRADSYNC_CHECK(options.backoff_factor < 1.0 && options.backoff_factor > 0.0, "GradScaler: backoff_factor ",
                 options.backoff_factor, " should be in (0, 1)");
  GRADSYNC_CHECK(options.growth_interval > 0, "GradScaler: growth_interval ", options.growth_interval,
                 " should be a positive integer");
}

double GradScaler::scale() const { return options_.enabled ? static_cast<double>(scale_) : 1.0; }

GradScaler::PerOptimizer& GradScaler::track(Optimizer& optimizer) { return optimizers_[&optimizer]; }

void GradScaler::unscale(Optimizer& optimizer) {
  if (!options_.enabled) return;
  PerOptimizer& state = track(optimizer);
  GRADSYNC_CHECK(state.stage != Stage::unscaled, "GradScaler: unscale() has already been called on this ",
                 optimizer.name(), " optimizer since the last update()");
  GRADSYNC_CHECK(state.stage != Stage::stepped, "GradScaler: unscale() is being called after step()");
  if (!warned_bf16_) {
    for (std::size_t group = 0; group < optimizer.group_count(); ++group) {
      for (const Parameter* parameter : optimizer.group_parameters(group)) {
        if (parameter->grad_dtype() == DType::bf16 && !warned_bf16_) {
          warned_bf16_ = true;
          warn("GradScaler: parameter '" + parameter->name() + "' has bf16 gradients. bf16 has f32's exponent range, "
               "so its gradients do not underflow and loss scaling only risks skipped steps; it works, but it is "
               "not needed (said once)");
        }
      }
    }
  }
  // torch: inv_scale = scale.double().reciprocal().float()
  optimizer.defer_gradient_unscale(static_cast<double>(static_cast<float>(1.0 / static_cast<double>(scale_))));
  state.stage = Stage::unscaled;
}

bool GradScaler::step(Optimizer& optimizer) {
  return step(optimizer, [&] { optimizer.step(); });
}

bool GradScaler::step(Optimizer& optimizer, const std::function<void()>& step) {
  if (!options_.enabled) {
    step();
    return true;
  }
  PerOptimizer& state = track(optimizer);
  GRADSYNC_CHECK(state.stage != Stage::stepped, "GradScaler: step() has already been called since the last update()");
  if (state.stage == Stage::ready) unscale(optimizer);
  // The statistics pass clip_grad_norm made, if it ran since unscale(); else one pass now.
  float found = optimizer.gradient_statistics().finite() ? 0.0f : 1.0f;
  if (communicator_ != nullptr && communicator_->size() > 1) {
    Tensor flag = Tensor::from_vector(std::vector<float>{found}, {1});
    communicator_->allreduce_host(flag, comm::ReduceOp::max);
    found = flag.data_as<float>()[0];
  }
  state.found_inf = found != 0.0f;
  state.stage = Stage::stepped;
  if (state.found_inf) {
    optimizer.discard_gradient_factors();  // the skipped step's factors must not reach the next one
    return false;
  }
  step();
  return true;
}

bool GradScaler::found_inf() const {
  for (const auto& [optimizer, state] : optimizers_) {
    if (state.found_inf) return true;
  }
  return false;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  bool any_stepped = false;
  for (const auto& [optimizer, state] : optimizers_) any_stepped |= state.stage == Stage::stepped;
  GRADSYNC_CHECK(any_stepped, "GradScaler: update() without a step() since the last update() (no inf checks were "
                 "recorded)");
  // torch._amp_update_scale_: float scale, double factors, the product stored as float; a
  // growth that would overflow to inf is not applied.
  if (found_inf()) {
    scale_ = static_cast<float>(static_cast<double>(scale_) * options_.backoff_factor);
    growth_tracker_ = 0;
  } else if (growth_tracker_ + 1 == options_.growth_interval) {
    const float grown = static_cast<float>(static_cast<double>(scale_) * options_.growth_factor);
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  } else {
    ++growth_tracker_;
  }
  optimizers_.clear();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled) return;
  GRADSYNC_CHECK(std::isfinite(new_scale) && new_scale > 0.0, "GradScaler: update(", new_scale,
                 "): the new scale must be a positive finite number");
  scale_ = static_cast<float>(new_scale);
  optimizers_.clear();
}

namespace {

std::string exact(double value) {
  char text[64];
  const auto end = std::to_chars(text, text + sizeof text, value).ptr;  // shortest exact form
  return std::string(text, end);
}

double number(const io::Metadata& metadata, const std::string& key) {
  const auto found = metadata.find(key);
  GRADSYNC_CHECK(found != metadata.end(), "GradScaler state: no '", key, "' in the metadata");
  double value = 0.0;
  const auto [end, error] = std::from_chars(found->second.data(), found->second.data() + found->second.size(), value);
  GRADSYNC_CHECK(error == std::errc() && end == found->second.data() + found->second.size(), "GradScaler state: '",
                 key, "' is '", found->second, "', not a number");
  return value;
}

}  // namespace

io::Metadata GradScaler::state_metadata() const {
  return {{"grad_scaler.scale", exact(scale_)},
          {"grad_scaler.growth_tracker", std::to_string(growth_tracker_)},
          {"grad_scaler.growth_factor", exact(options_.growth_factor)},
          {"grad_scaler.backoff_factor", exact(options_.backoff_factor)},
          {"grad_scaler.growth_interval", std::to_string(options_.growth_interval)},
          {"grad_scaler.enabled", options_.enabled ? "1" : "0"}};
}

void GradScaler::load_state(const io::Metadata& metadata) {
  // Read everything before changing anything.
  GradScalerOptions options = options_;
  const double scale = number(metadata, "grad_scaler.scale");
  const double tracker = number(metadata, "grad_scaler.growth_tracker");
  options.growth_factor = number(metadata, "grad_scaler.growth_factor");
  options.backoff_factor = number(metadata, "grad_scaler.backoff_factor");
  const double interval = number(metadata, "grad_scaler.growth_interval");
  options.enabled = number(metadata, "grad_scaler.enabled") != 0.0;
  GRADSYNC_CHECK(std::isfinite(scale) && scale > 0.0 && tracker >= 0.0 && tracker == std::trunc(tracker) &&
                     interval >= 1.0 && interval == std::trunc(interval),
                 "GradScaler state: scale ", scale, ", growth tracker ", tracker, ", growth interval ", interval,
                 " are not a valid state");
  options.growth_interval = static_cast<std::int64_t>(interval);
  options.init_scale = scale;
  GradScaler check(options);  // validates the factors with the constructor's messages
  options_ = options;
  scale_ = static_cast<float>(scale);
  growth_tracker_ = static_cast<std::int64_t>(tracker);
  optimizers_.clear();
}

}  // namespace gradsync::optim
