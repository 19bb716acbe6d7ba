// Master weights (gradsync/optim/optimizer.h, docs/mixed_precision.md): the f32 copy of each
// 16-bit parameter that the optimizer steps and rounds into the model, kept as one more state
// buffer ("master"), laid out like the others.
#include <utility>
#include <vector>

#include "gradsync/kernels/ops.h"
#include "gradsync/optim/optimizer.h"
#include "state_arenas.h"

namespace gradsync::optim {

// Takes the master copy of every parameter about to step that has none yet: its first step,
// or the first after a load_state() whose file held no master copy.
void Optimizer::initialize_master_weights(std::size_t arena) {
  const std::uint32_t bit = 1u << master_buffer_;
  for (const std::size_t index : registry_.arenas()[arena].parameters) {
    Parameter& parameter = registry_[index];
    if (group_of_[index] == kNoGroup || !parameter.grad_defined() || (present_[index] & bit)) continue;
    Tensor& master = state_->get(arena, master_buffer_);
    const Tensor values = registry_.arenas()[arena].values;
    for (const internal::StateArenas::Piece& piece : state_->pieces(parameter)) {
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
    GRADSYNC_CHECK(info->shape == parameter.shape() && info->dtype && is_floating(*info->dtype),
                   "load_master_weights: '", parameter.name(), "' is ", info->dtype_label(), shape_str(info->shape), " in '",
                   file.path().string(), "', the parameter ", dtype_name(parameter.dtype()),
                   shape_str(parameter.shape()));
    entries.emplace_back(&parameter, info);
  }
  std::vector<Tensor> data;
  for (const auto& [parameter, info] : entries) data.push_back(file.read(info->name).to(DType::f32));
  for (std::size_t k = 0; k < entries.size(); ++k) {
    Parameter& parameter = *entries[k].first;
    Tensor master = state_->get(parameter.arena_index(), master_buffer_).view(parameter.arena_offset(), parameter.shape());
    master.copy_from(data[k]);
    ops::cast(master, parameter.value());  // the model is the master copy, rounded
    present_[parameter.index()] |= 1u << master_buffer_;
  }
  return entries.size();
}

}  // namespace gradsync::optim
