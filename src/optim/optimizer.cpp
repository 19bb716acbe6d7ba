#include "gradsync/optim/optimizer.h"
#include "gradsync/core/timeline.h"

#include "gradsync/kernels/ops.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace gradsync::optim {

namespace {
using json = nlohmann::json;
const std::string kStatePrefix = "optimizer.state.";
}  // namespace

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
  for (std::size_t arena = 0; arena < registry_.arenas().size(); ++arena) {
    const DType dtype = registry_.arenas()[arena].dtype;
    master_arena_[arena] = master_weights_ == MasterWeights::f32 && (dtype == DType::f16 || dtype == DType::bf16);
  }
  buffers_.assign(registry_.arenas().size(), std::vector<Tensor>(buffer_names_.size()));
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
  if (sharded_) return Tensor();  // pieces on several ranks: dist/zero.h gathers them
  for (std::size_t b = 0; b < buffer_names_.size(); ++b) {
    if (buffer_names_[b] != buffer) continue;
    const Tensor& arena = buffers_[parameter.arena_index()][b];
    if (!arena.defined() || !(present_[parameter.index()] & (1u << b))) return Tensor();
    return arena.view(parameter.arena_offset(), parameter.shape());
  }
  detail::throw_error(name(), " has no state buffer '", buffer, "'");
}

DType Optimizer::state_dtype(std::size_t arena) const {
  return has_master(arena) ? DType::f32 : registry_.arenas()[arena].dtype;
}

Tensor& Optimizer::state_buffer(std::size_t arena, std::size_t buffer) {
  Tensor& tensor = buffers_.at(arena).at(buffer);
  if (!tensor.defined()) {
    const Arena& values = registry_.arenas()[arena];
    tensor = Tensor::zeros({state_elements(arena)}, state_dtype(arena), values.device);
  }
  return tensor;
}

namespace {
void* shifted(void* base, DType dtype, std::int64_t elements) {
  return static_cast<char*>(base) + static_cast<std::ptrdiff_t>(elements) * static_cast<std::ptrdiff_t>(dtype_size(dtype));
}
}  // namespace

void* Optimizer::state_data(std::size_t arena, std::size_t buffer) {
  return shifted(state_buffer(arena, buffer).data(), state_dtype(arena), state_shift_);
}

Optimizer::ArenaBuffers Optimizer::arena_buffers(std::size_t arena) {
  const Arena& a = registry_.arenas()[arena];
  void* grads = shifted(const_cast<void*>(a.grads.data()), a.grad_dtype, shift_);
  void* values = shifted(const_cast<void*>(a.values.data()), a.dtype, shift_);
  if (has_master(arena)) return {DType::f32, state_data(arena, master_buffer_), a.grad_dtype, grads, a.dtype, values};
  return {a.dtype, values, a.grad_dtype, grads, a.dtype, nullptr};
}

// ---------------------------------------------------------------------------------------------
// Sharding

void Optimizer::shard(std::vector<std::vector<ElementRange>> ranges_per_arena,
                      std::function<void(GradientStatistics&)> combine) {
  GRADSYNC_CHECK(supports_sharding(), name(), ": this optimizer does not support sharding (its update_arena must use ",
                 "state_data() and arena_buffers(), which sharding shifts to the owned ranges)");
  GRADSYNC_CHECK(ranges_per_arena.size() == registry_.arenas().size(), name(), ": shard ranges for ",
                 ranges_per_arena.size(), " arenas, the registry has ", registry_.arenas().size());
  GRADSYNC_CHECK(!sharded_, name(), ": already sharded");
  shard_at_.assign(ranges_per_arena.size(), {});
  for (std::size_t arena = 0; arena < ranges_per_arena.size(); ++arena) {
    const std::int64_t size = registry_.arenas()[arena].values.numel();
    std::int64_t previous_end = 0, packed = 0;
    for (const ElementRange& range : ranges_per_arena[arena]) {
      GRADSYNC_CHECK(range.begin >= previous_end && range.begin < range.end && range.end <= size, name(),
                     ": shard range [", range.begin, ", ", range.end, ") of arena ", arena, " (", size,
                     " elements) is empty, out of order or out of bounds");
      shard_at_[arena].push_back(packed);
      packed += range.end - range.begin;
      previous_end = range.end;
    }
  }
  // State that exists already (a loaded checkpoint): keep the owned pieces only.
  for (std::size_t arena = 0; arena < buffers_.size(); ++arena) {
    for (Tensor& buffer : buffers_[arena]) {
      if (!buffer.defined()) continue;
      std::int64_t owned = 0;
      for (const ElementRange& range : ranges_per_arena[arena]) owned += range.end - range.begin;
      Tensor packed = Tensor::zeros({owned}, buffer.dtype(), buffer.device());
      std::int64_t at = 0;
      for (const ElementRange& range : ranges_per_arena[arena]) {
        Tensor target = packed.view(static_cast<std::size_t>(at), {range.end - range.begin});
        target.copy_from(buffer.view(static_cast<std::size_t>(range.begin), {range.end - range.begin}));
        at += range.end - range.begin;
      }
      buffer = packed;
    }
  }
  shard_ = std::move(ranges_per_arena);
  combine_statistics_ = std::move(combine);
  sharded_ = true;
  statistics_.reset();
}

const std::vector<Optimizer::ElementRange>& Optimizer::shard_ranges(std::size_t arena) const {
  GRADSYNC_CHECK(sharded_ && arena < shard_.size(), name(), ": not sharded, or no arena ", arena);
  return shard_[arena];
}

std::int64_t Optimizer::state_elements(std::size_t arena) const {
  if (!sharded_) return registry_.arenas()[arena].values.numel();
  std::int64_t total = 0;
  for (const ElementRange& range : shard_[arena]) total += range.end - range.begin;
  return total;
}

std::int64_t Optimizer::state_bytes() const {
  std::int64_t total = 0;
  for (const auto& buffers : buffers_) {
    for (const Tensor& buffer : buffers) total += buffer.defined() ? static_cast<std::int64_t>(buffer.nbytes()) : 0;
  }
  return total;
}

std::vector<Optimizer::OwnedPiece> Optimizer::owned_pieces(const Parameter& parameter) const {
  const auto begin = static_cast<std::int64_t>(parameter.arena_offset());
  const std::int64_t end = begin + parameter.numel();
  if (!sharded_) return {{begin, parameter.numel(), begin}};
  std::vector<OwnedPiece> pieces;
  const auto& ranges = shard_[parameter.arena_index()];
  for (std::size_t r = 0; r < ranges.size(); ++r) {
    const std::int64_t lo = std::max(begin, ranges[r].begin), hi = std::min(end, ranges[r].end);
    if (lo < hi) pieces.push_back({lo, hi - lo, shard_at_[parameter.arena_index()][r] + (lo - ranges[r].begin)});
  }
  return pieces;
}

void Optimizer::require_unsharded(const char* what) const {
  GRADSYNC_CHECK(!sharded_, name(), "::", what, ": this optimizer is sharded (ZeRO): its state is spread over the ",
                 "ranks; use the checkpoint functions of gradsync/dist/zero.h");
}

// ---------------------------------------------------------------------------------------------
// Master weights

// Takes the master copy of every parameter about to step that has none yet: its first step,
// or the first after a load_state() whose file held no master copy.
void Optimizer::initialize_master_weights(std::size_t arena) {
  const std::uint32_t bit = 1u << master_buffer_;
  for (const std::size_t index : registry_.arenas()[arena].parameters) {
    Parameter& parameter = registry_[index];
    if (group_of_[index] == kNoGroup || !parameter.grad_defined() || (present_[index] & bit)) continue;
    Tensor& master = state_buffer(arena, master_buffer_);
    const Tensor values = registry_.arenas()[arena].values;
    for (const OwnedPiece& piece : owned_pieces(parameter)) {
      Tensor target = master.view(static_cast<std::size_t>(piece.state_offset), {piece.count});
      ops::cast(values.view(static_cast<std::size_t>(piece.begin), {piece.count}), target);  // widening is exact
    }
    present_[index] |= bit;
  }
}

Tensor Optimizer::master_weight(const Parameter& parameter) const {
  require_optimized(parameter, "master_weight");
  if (!has_master(parameter.arena_index())) return Tensor();
  return state(parameter, "master");
}

std::size_t Optimizer::load_master_weights(const io::SafetensorsReader& file) {
  require_unsharded("load_master_weights");
  // Check everything first, so that a bad file changes nothing.
  std::vector<std::pair<Parameter*, const io::TensorInfo*>> entries;
  for (Parameter& parameter : registry_) {
    if (group_of_[parameter.index()] == kNoGroup || !has_master(parameter.arena_index())) continue;
    const io::TensorInfo* info = file.find(parameter.name());
    if (info == nullptr) continue;
    GRADSYNC_CHECK(info->shape == parameter.shape() && is_floating(info->dtype), "load_master_weights: '",
                   parameter.name(), "' is ", dtype_name(info->dtype), shape_str(info->shape), " in '",
                   file.path().string(), "', the parameter ", dtype_name(parameter.dtype()),
                   shape_str(parameter.shape()));
    entries.emplace_back(&parameter, info);
  }
  std::vector<Tensor> data;
  for (const auto& [parameter, info] : entries) data.push_back(file.read(info->name).to(DType::f32));
  for (std::size_t k = 0; k < entries.size(); ++k) {
    Parameter& parameter = *entries[k].first;
    Tensor master =
        state_buffer(parameter.arena_index(), master_buffer_).view(parameter.arena_offset(), parameter.shape());
    master.copy_from(data[k]);
    ops::cast(master, parameter.value());  // the model is the master copy, rounded
    present_[parameter.index()] |= 1u << master_buffer_;
  }
  return entries.size();
}

// ---------------------------------------------------------------------------------------------
// Gradient factors and statistics

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
    if (!sharded_) {
      statistics_ = optim::gradient_statistics(all, grad_unscale_);
    } else {
      // The owned elements only: the reduced gradient lives there (ZeRO stage 2 reduces
      // nothing else), and the ranks' statistics together cover every element once.
      GradientStatistics total;
      for (const Parameter* parameter : all) {
        if (!parameter->grad_defined()) continue;
        const Tensor& grads = registry_.arenas()[parameter->arena_index()].grads;
        std::int64_t nonfinite = 0;
        for (const OwnedPiece& piece : owned_pieces(*parameter)) {
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

// ---------------------------------------------------------------------------------------------
// The step: segments per arena, one fused update each.

void Optimizer::step() {
  timeline::Span span("step", "optimizer step");
  const auto& arenas = registry_.arenas();
  std::vector<Segment> segments;
  for (std::size_t arena = 0; arena < arenas.size(); ++arena) {
    segments.clear();
    if (has_master(arena)) initialize_master_weights(arena);
    bool previous_included = false;  // was the previous parameter in arena order updated?
    for (const std::size_t index : arenas[arena].parameters) {
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
    if (segments.empty()) continue;
    if (!sharded_) {
      update_arena(arena, segments);
    } else {
      // Each owned range on its own: the segments clipped to it, relative to its start, with
      // the buffers shifted there (arena_buffers, state_data).
      std::vector<Segment> local;
      for (std::size_t k = 0; k < shard_[arena].size(); ++k) {
        const ElementRange& range = shard_[arena][k];
        local.clear();
        for (const Segment& segment : segments) {
          const std::int64_t lo = std::max(segment.begin, range.begin);
          const std::int64_t hi = std::min(segment.begin + segment.count, range.end);
          if (lo >= hi) continue;
          Segment piece = segment;
          piece.begin = lo - range.begin;
          piece.count = hi - lo;
          local.push_back(piece);
        }
        if (local.empty()) continue;
        shift_ = range.begin;
        state_shift_ = shard_at_[arena][k];
        try {
          update_arena(arena, local);
        } catch (...) {
          shift_ = state_shift_ = 0;
          throw;
        }
        shift_ = state_shift_ = 0;
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

// ---------------------------------------------------------------------------------------------
// Checkpoints

std::vector<io::NamedTensor> Optimizer::state_tensors() const {
  require_unsharded("state_tensors");
  return state_tensors_of(buffers_);
}

std::vector<io::NamedTensor> Optimizer::state_tensors_of(const std::vector<std::vector<Tensor>>& full) const {
  GRADSYNC_CHECK(full.size() == registry_.arenas().size(), name(), "::state_tensors_of: buffers for ", full.size(),
                 " arenas, the registry has ", registry_.arenas().size());
  std::vector<io::NamedTensor> tensors;
  for (const Parameter& parameter : registry_) {
    if (group_of_[parameter.index()] == kNoGroup) continue;
    for (std::size_t b = 0; b < buffer_names_.size(); ++b) {
      const Tensor& arena = full[parameter.arena_index()].at(b);
      if (!arena.defined() || !(present_[parameter.index()] & (1u << b))) continue;
      tensors.push_back({kStatePrefix + parameter.name() + "." + buffer_names_[b],
                         arena.view(parameter.arena_offset(), parameter.shape())});
    }
  }
  return tensors;
}

Tensor Optimizer::shard_state(std::size_t arena, std::size_t buffer) const { return buffers_.at(arena).at(buffer); }

std::uint32_t Optimizer::state_presence(const Parameter& parameter) const {
  require_optimized(parameter, "state_presence");
  return present_[parameter.index()];
}

io::Metadata Optimizer::state_metadata() const {
  json groups = json::array();
  for (std::size_t group = 0; group < groups_.size(); ++group) {
    json names = json::array();
    for (const Parameter* parameter : groups_[group]) names.push_back(parameter->name());
    groups.push_back({{"params", names}, {"hyperparameters", hyperparameters(group)}});
  }
  json steps = json::object();
  for (const Parameter& parameter : registry_) {
    if (group_of_[parameter.index()] != kNoGroup && steps_[parameter.index()] > 0) {
      steps[parameter.name()] = steps_[parameter.index()];
    }
  }
  return {{"optimizer.type", name()}, {"optimizer.groups", groups.dump()}, {"optimizer.steps", steps.dump()}};
}

void Optimizer::save_state(const std::filesystem::path& path) const {
  io::save_safetensors(path, state_tensors(), state_metadata());
}

void Optimizer::load_state(const std::filesystem::path& path) { load_state(io::SafetensorsReader(path)); }

void Optimizer::load_state(const io::SafetensorsReader& file) {
  load_state_from("optimizer state '" + file.path().string() + "'", file.metadata(), file.tensors(),
                  [&](const std::string& name) { return file.read(name); });
}

void Optimizer::load_state(const std::vector<io::NamedTensor>& tensors, const io::Metadata& metadata,
                           const std::string& origin) {
  std::vector<io::TensorInfo> infos;
  std::map<std::string, const Tensor*> by_name;
  for (const io::NamedTensor& tensor : tensors) {
    infos.push_back({tensor.name, tensor.tensor.dtype(), tensor.tensor.shape(), 0, 0});
    by_name[tensor.name] = &tensor.tensor;
  }
  load_state_from(origin, metadata, infos, [&](const std::string& name) { return *by_name.at(name); });
}

void Optimizer::load_state_from(const std::string& where, const io::Metadata& metadata,
                                const std::vector<io::TensorInfo>& tensors,
                                const std::function<Tensor(const std::string&)>& read) {
  std::vector<std::string> differences;
  const auto differ = [&](auto&&... parts) {
    std::ostringstream line;
    (line << ... << parts);
    differences.push_back(line.str());
  };
  for (const char* key : {"optimizer.type", "optimizer.groups", "optimizer.steps"}) {
    GRADSYNC_CHECK(metadata.contains(key), where, " has no '", key, "' metadata: it is not an optimizer state");
  }
  if (metadata.at("optimizer.type") != name()) {
    differ("saved by a ", metadata.at("optimizer.type"), " optimizer, loading into ", name());
  }

  // Groups: the same members in the same order, and hyperparameters to restore.
  const json groups = json::parse(metadata.at("optimizer.groups"), nullptr, false);
  const json steps = json::parse(metadata.at("optimizer.steps"), nullptr, false);
  GRADSYNC_CHECK(groups.is_array() && steps.is_object(), where, ": malformed optimizer.groups or optimizer.steps");
  std::vector<Hyperparameters> saved_hyperparameters;
  if (groups.size() != groups_.size()) {
    differ(groups.size(), " parameter groups saved, ", groups_.size(), " in this optimizer");
  } else {
    for (std::size_t group = 0; group < groups_.size(); ++group) {
      const json& entry = groups[group];
      GRADSYNC_CHECK(entry.is_object() && entry.contains("params") && entry["params"].is_array() &&
                         entry.contains("hyperparameters") && entry["hyperparameters"].is_object(),
                     where, ": malformed group ", group);
      std::vector<std::string> saved_names;
      for (const json& item : entry["params"]) saved_names.push_back(item.is_string() ? item.get<std::string>() : "?");
      std::vector<std::string> names;
      for (const Parameter* parameter : groups_[group]) names.push_back(parameter->name());
      if (saved_names != names) {
        differ("group ", group, " holds [", json(saved_names).dump(), "] in the file, [", json(names).dump(), "] here");
      }
      Hyperparameters values;
      for (auto item = entry["hyperparameters"].begin(); item != entry["hyperparameters"].end(); ++item) {
        GRADSYNC_CHECK(item.value().is_number(), where, ": hyperparameter '", item.key(), "' of group ", group,
                       " is not a number");
        values[item.key()] = item.value().get<double>();
      }
      saved_hyperparameters.push_back(values);
    }
  }

  // Step counts and state tensors, checked against the parameters.
  std::vector<std::int64_t> new_steps(registry_.size(), 0);
  for (auto item = steps.begin(); item != steps.end(); ++item) {
    const Parameter* parameter = registry_.find(item.key());
    if (parameter == nullptr || group_of_[parameter->index()] == kNoGroup) {
      differ("step count for '", item.key(), "', which this optimizer does not hold");
    } else if (!item.value().is_number_unsigned()) {
      differ("step count for '", item.key(), "' is not a non-negative integer");
    } else {
      new_steps[parameter->index()] = item.value().get<std::int64_t>();
    }
  }
  // Presence of state held in the other files of a sharded set.
  std::vector<std::uint32_t> present_elsewhere(registry_.size(), 0u);
  if (metadata.contains("optimizer.present_elsewhere")) {
    const json elsewhere = json::parse(metadata.at("optimizer.present_elsewhere"), nullptr, false);
    GRADSYNC_CHECK(elsewhere.is_object(), where, ": malformed optimizer.present_elsewhere");
    for (auto item = elsewhere.begin(); item != elsewhere.end(); ++item) {
      const Parameter* parameter = registry_.find(item.key());
      if (parameter == nullptr || group_of_[parameter->index()] == kNoGroup) {
        differ("state presence for '", item.key(), "', which this optimizer does not hold");
      } else if (!item.value().is_number_unsigned() || item.value().get<std::uint64_t>() >> buffer_names_.size()) {
        differ("state presence for '", item.key(), "' is not a set of ", buffer_names_.size(), " buffers");
      } else {
        present_elsewhere[parameter->index()] = item.value().get<std::uint32_t>();
      }
    }
  }
  struct Staged {
    const Parameter* parameter;
    std::size_t buffer;
    std::string key;
  };
  std::vector<Staged> staged;
  for (const io::TensorInfo& info : tensors) {
    if (!info.name.starts_with(kStatePrefix)) continue;  // e.g. model weights in the same file
    const std::string rest = info.name.substr(kStatePrefix.size());
    const std::size_t dot = rest.rfind('.');
    const std::string parameter_name = dot == std::string::npos ? rest : rest.substr(0, dot);
    const std::string buffer_name = dot == std::string::npos ? "" : rest.substr(dot + 1);
    const auto buffer = std::find(buffer_names_.begin(), buffer_names_.end(), buffer_name);
    const Parameter* parameter = registry_.find(parameter_name);
    if (buffer == buffer_names_.end()) {
      differ("'", info.name, "': ", name(), " has no state buffer '", buffer_name, "'");
    } else if (parameter == nullptr || group_of_[parameter->index()] == kNoGroup) {
      differ("'", info.name, "': no optimized parameter '", parameter_name, "'");
    } else if (info.shape != parameter->shape() || info.dtype != state_dtype(parameter->arena_index())) {
      const DType expected = state_dtype(parameter->arena_index());
      differ("'", info.name, "' is ", dtype_name(info.dtype), shape_str(info.shape), " in the file, the parameter ",
             dtype_name(parameter->dtype()), shape_str(parameter->shape()),
             expected != parameter->dtype() ? std::string(" with ") + dtype_name(expected) + " state" : std::string());
    } else if (new_steps[parameter->index()] == 0) {
      differ("'", info.name, "' holds state for a parameter with no recorded steps");
    } else {
      staged.push_back({parameter, static_cast<std::size_t>(buffer - buffer_names_.begin()), info.name});
    }
  }
  if (!differences.empty()) {
    std::ostringstream message;
    message << where << " does not match this " << name() << " optimizer (" << differences.size()
            << (differences.size() == 1 ? " difference" : " differences") << "):";
    for (const std::string& line : differences) message << "\n  - " << line;
    throw Error(message.str());
  }

  // Stage the data, then commit: hyperparameters first (they validate, and are rolled back
  // if any is invalid), then steps, presence and buffers.
  std::vector<Tensor> data;
  for (const Staged& entry : staged) data.push_back(read(entry.key));
  std::vector<Hyperparameters> previous;
  for (std::size_t group = 0; group < groups_.size(); ++group) previous.push_back(hyperparameters(group));
  try {
    for (std::size_t group = 0; group < groups_.size(); ++group) set_hyperparameters(group, saved_hyperparameters[group]);
  } catch (const Error& error) {
    for (std::size_t group = 0; group < groups_.size(); ++group) set_hyperparameters(group, previous[group]);
    detail::throw_error(where, ": ", error.what());
  }
  steps_ = new_steps;
  present_ = present_elsewhere;
  for (std::size_t arena = 0; arena < buffers_.size(); ++arena) {
    for (Tensor& buffer : buffers_[arena]) {
      if (buffer.defined()) ops::fill(buffer, 0.0);
    }
  }
  for (std::size_t k = 0; k < staged.size(); ++k) {
    const Parameter& parameter = *staged[k].parameter;
    Tensor& arena = state_buffer(parameter.arena_index(), staged[k].buffer);
    // Sharded: only this rank's pieces of the parameter (whatever world size saved the file).
    const Tensor flat = data[k].flatten();
    for (const OwnedPiece& piece : owned_pieces(parameter)) {
      Tensor target = arena.view(static_cast<std::size_t>(piece.state_offset), {piece.count});
      target.copy_from(flat.view(static_cast<std::size_t>(piece.begin - static_cast<std::int64_t>(parameter.arena_offset())),
                                 {piece.count}));
    }
    present_[parameter.index()] |= 1u << staged[k].buffer;
  }
}

}  // namespace gradsync::optim
