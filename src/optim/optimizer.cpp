// The optimizer base (gradsync/optim/optimizer.h): parameter groups, per-parameter steps, and
// the step loop, which turns each arena into segments and hands them to the subclass's fused
// update. The state buffers live in state_arenas.cpp, master weights in master_weights.cpp,
// gradient factors and statistics in gradient_statistics.cpp, checkpoints in
// optimizer_checkpoint.cpp.
#include "gradsync/optim/optimizer.h"

#include <algorithm>

#include "gradsync/core/timeline.h"
#include "state_arenas.h"

namespace gradsync::optim {

std::vector<Parameter*> trainable_parameters(ParameterRegistry& registry) {
  std::vector<Parameter*> parameters;
  for (Parameter& parameter : registry) {
    if (parameter.requires_grad()) parameters.push_back(&parameter);
  }
  return parameters;
}

Optimizer::Optimizer(ParameterRegistry& registry, std::vector<std::vector<Parameter*>> groups,
                     std::vector<std::string> buffer_names, MasterWeights master_weights)
    : registry_(registry), groups_(std::move(groups)), buffer_names_(std::move(buffer_names)),
      master_weights_(master_weights) {
  GRADSYNC_CHECK(registry_.finalized(), "optimizer: the parameter registry must be finalized first");
  GRADSYNC_CHECK(!groups_.empty(), "optimizer got an empty parameter list");
  group_of_.assign(registry_.size(), kNoGroup);
  steps_.assign(registry_.size(), 0);
  present_.assign(registry_.size(), 0);
  // The master copy is one more state buffer: laid out like the others, saved and loaded with
  // them ("optimizer.state.<param>.master"), present once the parameter's first step took it.
  if (master_weights_ == MasterWeights::f32) {
    master_buffer_ = buffer_names_.size();
    buffer_names_.push_back("master");
  }
  GRADSYNC_CHECK(buffer_names_.size() <= 32, "optimizer: at most 32 state buffers");
  master_arena_.assign(registry_.arenas().size(), false);
  std::vector<DType> state_dtypes;
  for (std::size_t arena = 0; arena < registry_.arenas().size(); ++arena) {
    const DType dtype = registry_.arenas()[arena].dtype;
    master_arena_[arena] = master_weights_ == MasterWeights::f32 && (dtype == DType::f16 || dtype == DType::bf16);
    state_dtypes.push_back(master_arena_[arena] ? DType::f32 : dtype);
  }
  state_ = std::make_unique<internal::StateArenas>(registry_, buffer_names_.size(), std::move(state_dtypes));
  for (std::size_t group = 0; group < groups_.size(); ++group) {
    GRADSYNC_CHECK(!groups_[group].empty(), "optimizer: parameter group ", group, " is empty");
    for (Parameter* parameter : groups_[group]) {
      GRADSYNC_CHECK(parameter != nullptr, "optimizer: parameter group ", group, " holds a null parameter");
      const std::size_t index = parameter->index();
      GRADSYNC_CHECK(index < registry_.size() && &registry_[index] == parameter, "optimizer: parameter '",
                     parameter->name(), "' belongs to another registry");
      GRADSYNC_CHECK(parameter->requires_grad(), "optimizer: parameter '", parameter->name(),
                     "' is frozen (requires_grad is false) and cannot be optimized");
      const DType dtype = parameter->dtype();
      GRADSYNC_CHECK(dtype == DType::f32 || dtype == DType::f64 || dtype == DType::f16 || dtype == DType::bf16,
                     "optimizer: parameter '", parameter->name(), "' has dtype ", dtype_name(dtype),
                     "; optimizers update floating parameters");
      GRADSYNC_CHECK(dtype == DType::f32 || dtype == DType::f64 || master_weights_ == MasterWeights::f32,
                     "optimizer: parameter '", parameter->name(), "' is ", dtype_name(dtype),
                     ", and this optimizer keeps no master weights: updates of size lr * grad would vanish when "
                     "rounded to ", dtype == DType::bf16 ? 8 : 11, " significant bits. Construct the optimizer with "
                     "optim::MasterWeights::f32 to step an f32 master copy");
      GRADSYNC_CHECK(group_of_[index] == kNoGroup, "optimizer: parameter '", parameter->name(),
                     "' appears in more than one parameter group (groups ", group_of_[index], " and ", group, ")");
      group_of_[index] = group;
    }
  }
}

Optimizer::~Optimizer() = default;

const std::vector<Parameter*>& Optimizer::group_parameters(std::size_t group) const {
  GRADSYNC_CHECK(group < groups_.size(), "optimizer: group ", group, " out of range (", groups_.size(), " groups)");
  return groups_[group];
}

double Optimizer::lr(std::size_t group) const { return hyperparameters(group).at("lr"); }

void Optimizer::set_lr(std::size_t group, double lr) {
  Hyperparameters values = hyperparameters(group);
  values["lr"] = lr;
  set_hyperparameters(group, values);
}

void Optimizer::update_hyperparameters(std::size_t group, const Hyperparameters& values) {
  Hyperparameters updated = hyperparameters(group);
  for (const auto& [key, value] : values) {
    if (updated.count(key)) {
      updated[key] = value;
      continue;
    }
    std::string known;
    for (const auto& entry : updated) known += (known.empty() ? "" : ", ") + entry.first;
    detail::throw_error(name(), " group ", group, ": no hyperparameter '", key, "' (", name(), " has ", known, ")");
  }
  set_hyperparameters(group, updated);
}

void Optimizer::require_optimized(const Parameter& parameter, const char* what) const {
  GRADSYNC_CHECK(parameter.index() < registry_.size() && &registry_[parameter.index()] == &parameter &&
                     group_of_[parameter.index()] != kNoGroup,
                 what, ": parameter '", parameter.name(), "' is not optimized by this ", name(), " optimizer");
}

std::int64_t Optimizer::step_count(const Parameter& parameter) const {
  require_optimized(parameter, "step_count");
  return steps_[parameter.index()];
}

Tensor Optimizer::state(const Parameter& parameter, std::string_view buffer) const {
  require_optimized(parameter, "state");
  if (state_->sharded()) return Tensor();  // pieces on several ranks: dist/zero.h gathers them
  for (std::size_t b = 0; b < buffer_names_.size(); ++b) {
    if (buffer_names_[b] != buffer) continue;
    const Tensor& arena = state_->find(parameter.arena_index(), b);
    if (!arena.defined() || !(present_[parameter.index()] & (1u << b))) return Tensor();
    return arena.view(parameter.arena_offset(), parameter.shape());
  }
  detail::throw_error(name(), " has no state buffer '", buffer, "'");
}

DType Optimizer::state_dtype(std::size_t arena) const { return state_->dtype(arena); }

// ---------------------------------------------------------------------------------------------
// Sharding (ZeRO): which elements this optimizer holds state for and steps. The storage is
// state_arenas.cpp's; the step loop below walks the owned ranges.

void Optimizer::shard(std::vector<std::vector<ElementRange>> ranges_per_arena,
                      std::function<void(GradientStatistics&)> combine) {
  GRADSYNC_CHECK(supports_sharding(), name(), ": this optimizer does not support sharding (its update_arena must read ",
                 "and write through its slice and state_data(slice, b) only)");
  state_->shard(std::move(ranges_per_arena), name());
  combine_statistics_ = std::move(combine);
  statistics_.reset();
}

bool Optimizer::sharded() const { return state_->sharded(); }

const std::vector<Optimizer::ElementRange>& Optimizer::shard_ranges(std::size_t arena) const {
  GRADSYNC_CHECK(state_->sharded() && arena < registry_.arenas().size(), name(), ": not sharded, or no arena ", arena);
  return state_->ranges(arena);
}

std::int64_t Optimizer::state_elements(std::size_t arena) const { return state_->elements(arena); }
std::int64_t Optimizer::state_bytes() const { return state_->bytes(); }
Tensor Optimizer::shard_state(std::size_t arena, std::size_t buffer) const { return state_->find(arena, buffer); }

std::uint32_t Optimizer::state_presence(const Parameter& parameter) const {
  require_optimized(parameter, "state_presence");
  return present_[parameter.index()];
}

void Optimizer::require_unsharded(const char* what) const {
  GRADSYNC_CHECK(!state_->sharded(), name(), "::", what, ": this optimizer is sharded (ZeRO): its state is spread over ",
                 "the ranks; use the checkpoint functions of gradsync/dist/zero/zero.h");
}

// ---------------------------------------------------------------------------------------------
// The step: segments per arena, one fused update per arena (per owned range when sharded).

std::vector<Optimizer::Segment> Optimizer::segments_of(std::size_t arena) const {
  std::vector<Segment> segments;
  bool previous_included = false;  // was the previous parameter in arena order updated?
  for (const std::size_t index : registry_.arenas()[arena].parameters) {
    const Parameter& parameter = registry_[index];
    const std::size_t group = group_of_[index];
    if (group == kNoGroup || !parameter.grad_defined()) {
      previous_included = false;
      continue;
    }
    const Segment next{static_cast<std::int64_t>(parameter.arena_offset()), parameter.numel(), group,
                       steps_[index] + 1, present_[index], grad_unscale_, grad_clip_};
    // Neighbours with the same group, step and state merge into one run, padding included:
    // padding holds zeros in values, gradients and state, and every update maps zeros to zeros.
    if (previous_included && segments.back().group == group && segments.back().step == next.step &&
        segments.back().present == next.present) {
      segments.back().count = next.begin + next.count - segments.back().begin;
    } else {
      segments.push_back(next);
    }
    previous_included = true;
  }
  return segments;
}

Optimizer::ArenaSlice Optimizer::slice(std::size_t arena, std::int64_t begin, std::int64_t state_offset) {
  const Arena& a = registry_.arenas()[arena];
  const auto at = [begin](const void* base, DType dtype) {
    return static_cast<char*>(const_cast<void*>(base)) +
           static_cast<std::ptrdiff_t>(begin) * static_cast<std::ptrdiff_t>(dtype_size(dtype));
  };
  char* values = at(a.values.data(), a.dtype);
  const char* grads = at(a.grads.data(), a.grad_dtype);
  ArenaSlice result{arena, {a.dtype, values, a.grad_dtype, grads, a.dtype, nullptr}, state_offset};
  if (has_master(arena)) {
    // Mixed precision: the update steps the f32 master copy and writes the model's 16-bit values.
    result.buffers = {DType::f32, state_data(result, master_buffer_), a.grad_dtype, grads, a.dtype, values};
  }
  return result;
}

void* Optimizer::state_data(const ArenaSlice& slice, std::size_t buffer) {
  return static_cast<char*>(state_->get(slice.arena, buffer).data()) +
         static_cast<std::ptrdiff_t>(slice.state_offset) * static_cast<std::ptrdiff_t>(dtype_size(state_->dtype(slice.arena)));
}

void Optimizer::step() {
  timeline::Span span("step", "optimizer step");
  const auto& arenas = registry_.arenas();
  for (std::size_t arena = 0; arena < arenas.size(); ++arena) {
    if (has_master(arena)) initialize_master_weights(arena);
    const std::vector<Segment> segments = segments_of(arena);
    if (segments.empty()) continue;
    if (!state_->sharded()) {
      update_arena(slice(arena, 0, 0), segments);
    } else {
      // Each owned range on its own: the segments clipped to it, counted from its start.
      std::vector<Segment> local;
      const auto& ranges = state_->ranges(arena);
      for (std::size_t k = 0; k < ranges.size(); ++k) {
        local.clear();
        for (const Segment& segment : segments) {
          const std::int64_t lo = std::max(segment.begin, ranges[k].begin);
          const std::int64_t hi = std::min(segment.begin + segment.count, ranges[k].end);
          if (lo >= hi) continue;
          Segment piece = segment;
          piece.begin = lo - ranges[k].begin;
          piece.count = hi - lo;
          local.push_back(piece);
        }
        if (!local.empty()) update_arena(slice(arena, ranges[k].begin, state_->packed_offset(arena, k)), local);
      }
    }
    for (const std::size_t index : arenas[arena].parameters) {
      if (group_of_[index] == kNoGroup || !registry_[index].grad_defined()) continue;
      ++steps_[index];
      present_[index] |= buffers_used(group_of_[index]);
    }
  }
  discard_gradient_factors();
}

void Optimizer::zero_grad(bool set_to_undefined) {
  discard_gradient_factors();
  for (const auto& group : groups_) {
    for (Parameter* parameter : group) parameter->zero_grad(set_to_undefined);
  }
}

}  // namespace gradsync::optim
