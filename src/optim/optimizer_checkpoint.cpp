// Optimizer checkpoints (gradsync/optim/optimizer.h, docs/checkpoints.md): the state tensors
// ("optimizer.state.<param>.<buffer>") and the metadata (type, groups with hyperparameters,
// step counts), written as safetensors; and load_state, which checks everything against this
// optimizer first (one error listing every difference, the optimizer unchanged) and only then
// commits. A sharded optimizer takes its pieces of each tensor, whatever world size saved it.
#include <algorithm>
#include <bit>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gradsync/optim/optimizer.h"
#include "state_arenas.h"

namespace gradsync::optim {

namespace {
using json = nlohmann::json;
const std::string kStatePrefix = "optimizer.state.";
}  // namespace

// What load_state found, checked: the hyperparameters, steps and presence to restore, the
// tensors to read, and every difference from this optimizer.
struct Optimizer::LoadPlan {
  std::vector<Hyperparameters> hyperparameters;  // per group
  std::vector<std::int64_t> steps;               // per registry index
  std::vector<std::uint32_t> present_elsewhere;  // per registry index: state in a sharded set's other files
  struct Staged {
    const Parameter* parameter;
    std::size_t buffer;
    std::string key;
  };
  std::vector<Staged> staged;
  std::vector<std::string> differences;

  template <typename... Parts>
  void differ(Parts&&... parts) {
    std::ostringstream line;
    (line << ... << parts);
    differences.push_back(line.str());
  }
};

// ---------------------------------------------------------------------------------------------
// Saving

std::vector<io::NamedTensor> Optimizer::state_tensors() const {
  require_unsharded("state_tensors");
  return state_tensors_of(state_->all());
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

// ---------------------------------------------------------------------------------------------
// Loading: check, then commit

void Optimizer::load_state(const std::filesystem::path& path) { load_state(io::SafetensorsReader(path)); }

void Optimizer::load_state(const io::SafetensorsReader& file) {
  load_state_from("optimizer state '" + file.path().string() + "'", file.metadata(), file.tensors(),
                  [&](const std::string& name) { return file.read(name); });
}

namespace {
std::vector<io::TensorInfo> infos_of(const std::vector<io::NamedTensor>& tensors) {
  std::vector<io::TensorInfo> infos;
  for (const io::NamedTensor& tensor : tensors) {
    infos.push_back({tensor.name, tensor.tensor.dtype(), tensor.tensor.shape(), 0, 0,
                     dtype_safetensors_name(tensor.tensor.dtype())});
  }
  return infos;
}
}  // namespace

void Optimizer::load_state(const std::vector<io::NamedTensor>& tensors, const io::Metadata& metadata,
                           const std::string& origin) {
  std::map<std::string, const Tensor*> by_name;
  for (const io::NamedTensor& tensor : tensors) by_name[tensor.name] = &tensor.tensor;
  load_state_from(origin, metadata, infos_of(tensors), [&](const std::string& name) { return *by_name.at(name); });
}

void Optimizer::check_state(const std::vector<io::NamedTensor>& tensors, const io::Metadata& metadata,
                            const std::string& origin) const {
  plan_load(origin, metadata, infos_of(tensors));
}

void Optimizer::load_state_from(const std::string& where, const io::Metadata& metadata,
                                const std::vector<io::TensorInfo>& tensors,
                                const std::function<Tensor(const std::string&)>& read) {
  const LoadPlan plan = plan_load(where, metadata, tensors);
  std::vector<Tensor> data;
  for (const LoadPlan::Staged& entry : plan.staged) data.push_back(read(entry.key));
  commit(where, plan, data);
}

Optimizer::LoadPlan Optimizer::plan_load(const std::string& where, const io::Metadata& metadata,
                                         const std::vector<io::TensorInfo>& tensors) const {
  for (const char* key : {"optimizer.type", "optimizer.groups", "optimizer.steps"}) {
    GRADSYNC_CHECK(metadata.contains(key), where, " has no '", key, "' metadata: it is not an optimizer state");
  }
  LoadPlan plan;
  if (metadata.at("optimizer.type") != name()) {
    plan.differ("saved by a ", metadata.at("optimizer.type"), " optimizer, loading into ", name());
  }
  check_groups(where, metadata, plan);
  check_steps(where, metadata, plan);
  check_tensors(tensors, plan);
  if (!plan.differences.empty()) {
    std::ostringstream message;
    message << where << " does not match this " << name() << " optimizer (" << plan.differences.size()
            << (plan.differences.size() == 1 ? " difference" : " differences") << "):";
    for (const std::string& line : plan.differences) message << "\n  - " << line;
    throw Error(message.str());
  }
  return plan;
}

// Groups: the same members in the same order, and hyperparameters to restore.
void Optimizer::check_groups(const std::string& where, const io::Metadata& metadata, LoadPlan& plan) const {
  const json groups = json::parse(metadata.at("optimizer.groups"), nullptr, false);
  GRADSYNC_CHECK(groups.is_array(), where, ": malformed optimizer.groups");
  if (groups.size() != groups_.size()) {
    plan.differ(groups.size(), " parameter groups saved, ", groups_.size(), " in this optimizer");
    return;
  }
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
      plan.differ("group ", group, " holds [", json(saved_names).dump(), "] in the file, [", json(names).dump(), "] here");
    }
    Hyperparameters values;
    for (auto item = entry["hyperparameters"].begin(); item != entry["hyperparameters"].end(); ++item) {
      GRADSYNC_CHECK(item.value().is_number(), where, ": hyperparameter '", item.key(), "' of group ", group,
                     " is not a number");
      values[item.key()] = item.value().get<double>();
    }
    plan.hyperparameters.push_back(values);
  }
}

// Step counts, and the presence of state held in the other files of a sharded set.
void Optimizer::check_steps(const std::string& where, const io::Metadata& metadata, LoadPlan& plan) const {
  const json steps = json::parse(metadata.at("optimizer.steps"), nullptr, false);
  GRADSYNC_CHECK(steps.is_object(), where, ": malformed optimizer.steps");
  plan.steps.assign(registry_.size(), 0);
  for (auto item = steps.begin(); item != steps.end(); ++item) {
    const Parameter* parameter = registry_.find(item.key());
    if (parameter == nullptr || group_of_[parameter->index()] == kNoGroup) {
      plan.differ("step count for '", item.key(), "', which this optimizer does not hold");
    } else if (!item.value().is_number_unsigned()) {
      plan.differ("step count for '", item.key(), "' is not a non-negative integer");
    } else {
      plan.steps[parameter->index()] = item.value().get<std::int64_t>();
    }
  }
  plan.present_elsewhere.assign(registry_.size(), 0u);
  if (!metadata.contains("optimizer.present_elsewhere")) return;
  const json elsewhere = json::parse(metadata.at("optimizer.present_elsewhere"), nullptr, false);
  GRADSYNC_CHECK(elsewhere.is_object(), where, ": malformed optimizer.present_elsewhere");
  for (auto item = elsewhere.begin(); item != elsewhere.end(); ++item) {
    const Parameter* parameter = registry_.find(item.key());
    if (parameter == nullptr || group_of_[parameter->index()] == kNoGroup) {
      plan.differ("state presence for '", item.key(), "', which this optimizer does not hold");
    } else if (!item.value().is_number_unsigned() || item.value().get<std::uint64_t>() >> buffer_names_.size()) {
      plan.differ("state presence for '", item.key(), "' is not a set of ", buffer_names_.size(), " buffers");
    } else {
      plan.present_elsewhere[parameter->index()] = item.value().get<std::uint32_t>();
    }
  }
}

// State tensors: a known buffer of an optimized parameter with recorded steps, in its shape and
// state dtype. Other tensors in the file (model weights, say) are not the optimizer's.
void Optimizer::check_tensors(const std::vector<io::TensorInfo>& tensors, LoadPlan& plan) const {
  for (const io::TensorInfo& info : tensors) {
    if (!info.name.starts_with(kStatePrefix)) continue;
    const std::string rest = info.name.substr(kStatePrefix.size());
    const std::size_t dot = rest.rfind('.');
    const std::string parameter_name = dot == std::string::npos ? rest : rest.substr(0, dot);
    const std::string buffer_name = dot == std::string::npos ? "" : rest.substr(dot + 1);
    const auto buffer = std::find(buffer_names_.begin(), buffer_names_.end(), buffer_name);
    const Parameter* parameter = registry_.find(parameter_name);
    if (buffer == buffer_names_.end()) {
      plan.differ("'", info.name, "': ", name(), " has no state buffer '", buffer_name, "'");
    } else if (parameter == nullptr || group_of_[parameter->index()] == kNoGroup) {
      plan.differ("'", info.name, "': no optimized parameter '", parameter_name, "'");
    } else if (info.shape != parameter->shape() || info.dtype != state_dtype(parameter->arena_index())) {
      const DType expected = state_dtype(parameter->arena_index());
      plan.differ("'", info.name, "' is ", info.dtype_label(), shape_str(info.shape), " in the file, the parameter ",
                  dtype_name(parameter->dtype()), shape_str(parameter->shape()),
                  expected != parameter->dtype() ? std::string(" with ") + dtype_name(expected) + " state" : std::string());
    } else if (plan.steps[parameter->index()] == 0) {
      plan.differ("'", info.name, "' holds state for a parameter with no recorded steps");
    } else {
      plan.staged.push_back({parameter, static_cast<std::size_t>(buffer - buffer_names_.begin()), info.name});
    }
  }
  // A buffer the step counts say exists (a parameter stepped under hyperparameters that use it)
  // must be in the file or held elsewhere: missing, it would silently restart from zero (a
  // momentum reset). Only where the file's hyperparameters are this optimizer's: under others,
  // which buffers exist is theirs to say.
  std::vector<std::uint32_t> found(registry_.size(), 0u);
  for (const LoadPlan::Staged& staged : plan.staged) found[staged.parameter->index()] |= 1u << staged.buffer;
  for (std::size_t group = 0; group < groups_.size() && group < plan.hyperparameters.size(); ++group) {
    if (plan.hyperparameters[group] != hyperparameters(group)) continue;
    for (const Parameter* parameter : groups_[group]) {
      const std::size_t i = parameter->index();
      const std::uint32_t missing = buffers_used(group) & ~(found[i] | plan.present_elsewhere[i]);
      if (plan.steps[i] == 0 || missing == 0) continue;
      plan.differ("'", parameter->name(), "' has ", plan.steps[i], " recorded step(s) but no '",
                  buffer_names_[static_cast<std::size_t>(std::countr_zero(missing))],
                  "' buffer (it would restart from zero)");
    }
  }
}

// Hyperparameters first (they validate, and are rolled back if any is invalid), then steps,
// presence and buffers.
void Optimizer::commit(const std::string& where, const LoadPlan& plan, const std::vector<Tensor>& data) {
  std::vector<Hyperparameters> previous;
  for (std::size_t group = 0; group < groups_.size(); ++group) previous.push_back(hyperparameters(group));
  try {
    for (std::size_t group = 0; group < groups_.size(); ++group) set_hyperparameters(group, plan.hyperparameters[group]);
  } catch (const Error& error) {
    for (std::size_t group = 0; group < groups_.size(); ++group) set_hyperparameters(group, previous[group]);
    detail::throw_error(where, ": ", error.what());
  }
  steps_ = plan.steps;
  present_ = plan.present_elsewhere;
  state_->zero();
  for (std::size_t k = 0; k < plan.staged.size(); ++k) {
    const Parameter& parameter = *plan.staged[k].parameter;
    Tensor& arena = state_->get(parameter.arena_index(), plan.staged[k].buffer);
    // Sharded: only this rank's pieces of the parameter (whatever world size saved the file).
    const Tensor flat = data[k].flatten();
    for (const internal::StateArenas::Piece& piece : state_->pieces(parameter)) {
      Tensor target = arena.view(static_cast<std::size_t>(piece.state_offset), {piece.count});
      target.copy_from(flat.view(static_cast<std::size_t>(piece.begin - static_cast<std::int64_t>(parameter.arena_offset())),
                                 {piece.count}));
    }
    present_[parameter.index()] |= 1u << plan.staged[k].buffer;
  }
}

}  // namespace gradsync::optim
