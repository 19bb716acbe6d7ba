#include "gradsync/registry/parameter_registry.h"
#include "gradsync/core/timeline.h"

#include <algorithm>
#include <utility>

#include "gradsync/kernels/ops.h"

namespace gradsync {

// ---------------------------------------------------------------------------------------------
// Parameter

Parameter::Parameter(std::string name, Shape shape, DType dtype, DType grad_dtype, Device device, bool requires_grad,
                     std::size_t index)
    : name_(std::move(name)), shape_(std::move(shape)), numel_(shape_numel(shape_)), dtype_(dtype),
      grad_dtype_(grad_dtype), device_(device), requires_grad_(requires_grad), index_(index) {}

void Parameter::require_finalized(const char* what) const {
  GRADSYNC_CHECK(value_.defined(), what, " of parameter '", name_,
                 "': the registry is not finalized yet (call ParameterRegistry::finalize())");
}

void Parameter::require_trainable(const char* what) const {
  require_finalized(what);
  GRADSYNC_CHECK(requires_grad_, what, " of parameter '", name_, "': it is frozen (requires_grad is false)");
}

Tensor& Parameter::value() {
  require_finalized("value()");
  GRADSYNC_CHECK(released_ == nullptr, "parameter '", name_, "': its value is not on this rank: ", *released_);
  return value_;
}

const Tensor& Parameter::value() const {
  require_finalized("value()");
  GRADSYNC_CHECK(released_ == nullptr, "parameter '", name_, "': its value is not on this rank: ", *released_);
  return value_;
}

const Tensor& Parameter::grad() const {
  require_finalized("grad()");
  return grad_;
}

void Parameter::set_grad(const Tensor& gradient) {
  require_trainable("set_grad");
  GRADSYNC_CHECK(gradient.defined() && gradient.numel() == numel_ && gradient.dtype() == grad_dtype_,
                 "set_grad of parameter '", name_, "': gradient ", gradient.describe(), " does not match ",
                 dtype_name(grad_dtype_), shape_str(shape_));
  grad_.copy_from(gradient);
  grad_defined_ = true;
  grad_reduced_piece_ = false;
}

void Parameter::accumulate_grad(const Tensor& gradient) {
  require_trainable("accumulate_grad");
  GRADSYNC_CHECK(gradient.defined() && gradient.numel() == numel_ && gradient.dtype() == grad_dtype_,
                 "accumulate_grad of parameter '", name_, "': gradient ", gradient.describe(), " does not match ",
                 dtype_name(grad_dtype_), shape_str(shape_));
  if (!grad_defined_) {
    grad_.copy_from(gradient);
    grad_defined_ = true;
    return;
  }
  // The addition runs where the gradient buffer lives; a gradient from elsewhere is copied over.
  ops::axpy(1.0, gradient.to(device_), grad_);
}

Tensor& Parameter::grad_for_overwrite() {
  require_trainable("grad_for_overwrite");
  grad_defined_ = true;
  grad_reduced_piece_ = false;
  return grad_;
}

Tensor& Parameter::grad_for_accumulate() {
  require_trainable("grad_for_accumulate");
  if (!grad_defined_) ops::fill(grad_, 0.0);
  grad_defined_ = true;
  return grad_;
}

void Parameter::zero_grad(bool set_to_undefined) {
  require_finalized("zero_grad");
  grad_reduced_piece_ = false;
  if (set_to_undefined || !requires_grad_) {
    grad_defined_ = false;
    return;
  }
  ops::fill(grad_, 0.0);
  grad_defined_ = true;
}

void Parameter::mark_grad_defined() {
  require_trainable("mark_grad_defined");
  grad_defined_ = true;
}

// ---------------------------------------------------------------------------------------------
// ParameterRegistry

Parameter& ParameterRegistry::add(const std::string& name, const Shape& shape, DType dtype, Device device,
                                  bool requires_grad, std::optional<DType> grad_dtype) {
  GRADSYNC_CHECK(!name.empty(), "cannot register a parameter with an empty name (shape ", shape_str(shape), ")");
  GRADSYNC_CHECK(!finalized_, "cannot register parameter '", name, "': the registry is already finalized");
  GRADSYNC_CHECK(!contains(name), "duplicate parameter name '", name, "'");
  for (const std::int64_t extent : shape) {
    GRADSYNC_CHECK(extent > 0, "parameter '", name, "' has shape ", shape_str(shape),
                   ": every dimension must be positive");
  }
  const DType gradient_dtype = grad_dtype.value_or(dtype);
  if (gradient_dtype != dtype) {
    GRADSYNC_CHECK(is_floating(dtype) && is_floating(gradient_dtype) && (dtype == DType::f16 || dtype == DType::bf16),
                   "parameter '", name, "': a ", dtype_name(gradient_dtype), " gradient for a ", dtype_name(dtype),
                   " parameter; only a f16/bf16 parameter may keep its gradient in another floating dtype");
  }
  parameters_.push_back(std::unique_ptr<Parameter>(
      new Parameter(name, shape, dtype, gradient_dtype, device, requires_grad, parameters_.size())));
  return *parameters_.back();
}

void ParameterRegistry::finalize() {
  if (finalized_) return;
  GRADSYNC_CHECK(!parameters_.empty(), "cannot finalize an empty parameter registry");

  // Group parameters by (device, dtype, gradient dtype) in order of first appearance, laying
  // each group out in registration order with offsets aligned for both buffers.
  std::vector<std::size_t> arena_numel;
  for (const auto& parameter : parameters_) {
    auto match = std::find_if(arenas_.begin(), arenas_.end(), [&](const Arena& arena) {
      return arena.device == parameter->device_ && arena.dtype == parameter->dtype_ &&
             arena.grad_dtype == parameter->grad_dtype_;
    });
    if (match == arenas_.end()) {
      arenas_.push_back(Arena{parameter->device_, parameter->dtype_, parameter->grad_dtype_, {}, {}, {}});
      arena_numel.push_back(0);
      match = arenas_.end() - 1;
    }
    const std::size_t arena_index = static_cast<std::size_t>(match - arenas_.begin());
    const std::size_t alignment =
        kArenaAlignmentBytes / std::min(dtype_size(parameter->dtype_), dtype_size(parameter->grad_dtype_));
    const std::size_t offset = (arena_numel[arena_index] + alignment - 1) / alignment * alignment;
    parameter->arena_index_ = arena_index;
    parameter->arena_offset_ = offset;
    arena_numel[arena_index] = offset + static_cast<std::size_t>(parameter->numel_);
    match->parameters.push_back(parameter->index_);
  }

  for (std::size_t index = 0; index < arenas_.size(); ++index) {
    Arena& arena = arenas_[index];
    const auto numel = static_cast<std::int64_t>(arena_numel[index]);
    // Paged: a page costs memory once written, and ZeRO gives back the pages of the pieces
    // other ranks own: stage 2 a reduced bucket's gradients (Reducer, reduce_scatter), stage 3
    // a released unit's values (ZeroOptimizer).
    arena.values = Tensor::zeros_paged({numel}, arena.dtype, arena.device);
    arena.grads = Tensor::zeros_paged({numel}, arena.grad_dtype, arena.device);
    for (const std::size_t parameter_index : arena.parameters) {
      Parameter& parameter = *parameters_[parameter_index];
      parameter.value_ = arena.values.view(parameter.arena_offset_, parameter.shape_);
      parameter.grad_ = arena.grads.view(parameter.arena_offset_, parameter.shape_);
    }
  }
  finalized_ = true;
}

Parameter& ParameterRegistry::operator[](std::size_t index) {
  GRADSYNC_CHECK(index < parameters_.size(), "parameter index ", index, " out of range (", parameters_.size(),
                 " registered)");
  return *parameters_[index];
}

const Parameter& ParameterRegistry::operator[](std::size_t index) const {
  return const_cast<ParameterRegistry&>(*this)[index];
}

Parameter* ParameterRegistry::find(std::string_view name) {
  // Linear search: registries hold hundreds of parameters, names are looked up at set-up
  // and checkpoint time, never per element.
  for (const auto& parameter : parameters_) {
    if (parameter->name_ == name) return parameter.get();
  }
  return nullptr;
}

const Parameter* ParameterRegistry::find(std::string_view name) const {
  return const_cast<ParameterRegistry&>(*this).find(name);
}

Parameter& ParameterRegistry::at(std::string_view name) {
  Parameter* parameter = find(name);
  GRADSYNC_CHECK(parameter != nullptr, "no parameter named '", name, "' is registered");
  return *parameter;
}

const Parameter& ParameterRegistry::at(std::string_view name) const { return const_cast<ParameterRegistry&>(*this).at(name); }

ParameterRegistry::Iterator ParameterRegistry::begin() const { return Iterator(parameters_.data()); }
ParameterRegistry::Iterator ParameterRegistry::end() const { return Iterator(parameters_.data() + parameters_.size()); }

void ParameterRegistry::require_finalized(const char* what) const {
  GRADSYNC_CHECK(finalized_, what, ": the parameter registry is not finalized yet (call finalize())");
}

const std::vector<Arena>& ParameterRegistry::arenas() const {
  require_finalized("arenas()");
  return arenas_;
}

void ParameterRegistry::zero_grad(bool set_to_undefined) {
  require_finalized("zero_grad");
  if (!set_to_undefined) {
    // One fill per arena instead of one per parameter; padding is zero already.
    for (Arena& arena : arenas_) ops::fill(arena.grads, 0.0);
  }
  for (const auto& parameter : parameters_) parameter->grad_defined_ = !set_to_undefined && parameter->requires_grad_;
}

std::int64_t ParameterRegistry::total_numel() const {
  std::int64_t total = 0;
  for (const auto& parameter : parameters_) total += parameter->numel_;
  return total;
}

void ParameterRegistry::mark_ready(Parameter& parameter) {
  GRADSYNC_CHECK(parameter.index_ < parameters_.size() && parameters_[parameter.index_].get() == &parameter,
                 "mark_ready: parameter '", parameter.name_, "' belongs to another registry");
  parameter.require_trainable("mark_ready");
  GRADSYNC_CHECK(parameter.grad_defined_, "mark_ready of parameter '", parameter.name_,
                 "': its gradient is undefined (write it with set_grad/grad_for_* first)");
  // A sharded parameter's gradient is computed from its gathered value (ZeRO stage 3).
  GRADSYNC_CHECK(parameter.released_ == nullptr, "mark_ready of parameter '", parameter.name_,
                 "': its value is not on this rank, so its gradient cannot have been computed: ", *parameter.released_);
  if (timeline::enabled()) timeline::instant("ready", "ready " + parameter.name_);
  // Index loop over a vector that listeners may change: one may subscribe another (appended,
  // heard in this very call too, since the loop reads the size afresh) or
  // unsubscribe (its slot is emptied now and compacted once the outermost call returns).
  ++notify_depth_;
  struct DepthGuard {
    ParameterRegistry& registry;
    ~DepthGuard() {
      if (--registry.notify_depth_ == 0) {
        std::erase_if(registry.listeners_, [](const ListenerSlot& slot) { return !slot.listener; });
      }
    }
  } guard{*this};
  for (std::size_t slot = 0; slot < listeners_.size(); ++slot) {
    if (listeners_[slot].listener) {
      ReadyListener listener = listeners_[slot].listener;  // copy: the vector may grow
      listener(parameter);
    }
  }
}

ParameterRegistry::Subscription ParameterRegistry::on_ready(ReadyListener listener) {
  GRADSYNC_CHECK(static_cast<bool>(listener), "on_ready: empty listener");
  const std::uint64_t id = next_listener_id_++;
  listeners_.push_back(ListenerSlot{id, std::move(listener)});
  return Subscription(this, id);
}

void ParameterRegistry::unsubscribe(std::uint64_t id) {
  for (ListenerSlot& slot : listeners_) {
    if (slot.id == id) slot.listener = nullptr;
  }
  if (notify_depth_ == 0) std::erase_if(listeners_, [](const ListenerSlot& slot) { return !slot.listener; });
}

ParameterRegistry::Subscription::Subscription(Subscription&& other) noexcept
    : registry_(std::exchange(other.registry_, nullptr)), id_(other.id_) {}

ParameterRegistry::Subscription& ParameterRegistry::Subscription::operator=(Subscription&& other) noexcept {
  if (this != &other) {
    reset();
    registry_ = std::exchange(other.registry_, nullptr);
    id_ = other.id_;
  }
  return *this;
}

ParameterRegistry::Subscription::~Subscription() { reset(); }

void ParameterRegistry::Subscription::reset() {
  if (registry_ != nullptr) registry_->unsubscribe(id_);
  registry_ = nullptr;
}

}  // namespace gradsync
