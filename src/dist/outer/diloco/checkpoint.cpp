// DiLoCo's checkpoints (gradsync/dist/outer/diloco.h): the outer model, the outer SGD's state, the
// fragments in flight, and the options they were made with.
#include <string>
#include <vector>

#include "state.h"

namespace gradsync::dist {

namespace {

std::string number(double value) {
  char text[64];
  std::snprintf(text, sizeof text, "%.17g", value);
  return text;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> diloco_option_entries(const DiLoCoOptions& options) {
  return {{"diloco.sync_every", std::to_string(options.sync_every)},
          {"diloco.outer_lr", number(options.outer_lr)},
          {"diloco.outer_momentum", number(options.outer_momentum)},
          {"diloco.nesterov", options.nesterov ? "true" : "false"},
          {"diloco.warmup_steps", std::to_string(options.warmup_steps)},
          {"diloco.fragments", std::to_string(options.fragments)},
          {"diloco.delay", std::to_string(options.delay)},
          {"diloco.mixing", number(options.mixing)},
          {"diloco.compression", compression_name(options.compression)}};
}

std::vector<io::NamedTensor> DiLoCo::state_tensors() const {
  std::vector<io::NamedTensor> tensors = impl_->outer_sgd->state_tensors();
  for (Parameter* parameter : impl_->mirror) tensors.push_back({"diloco.outer." + parameter->name(), parameter->value()});
  // A fragment between its launch and its outer step: its averaged pseudo-gradients, landed now
  // (the same step on every rank; the outer step still waits for its own inner step).
  for (Impl::Fragment& fragment : impl_->fragments) {
    if (!fragment.pending) continue;
    impl_->land(fragment);
    for (const Impl::Wire& wire : fragment.wires) {
      for (const auto& [k, offset] : wire.members) {
        const Parameter& parameter = *impl_->trainable[k];
        Tensor pending = Tensor::empty(parameter.shape(), parameter.dtype(), Device::cpu());
        Impl::from_wire(wire, offset, pending);
        tensors.push_back({"diloco.pending." + parameter.name(), pending});
      }
    }
  }
  return tensors;
}

io::Metadata DiLoCo::state_metadata() const {
  io::Metadata metadata = impl_->outer_sgd->state_metadata();
  for (const auto& [key, value] : diloco_option_entries(impl_->options)) metadata[key] = value;
  metadata["diloco.world"] = std::to_string(impl_->comm.size());
  metadata["diloco.steps"] = std::to_string(impl_->steps);
  return metadata;
}

void DiLoCo::load_state(const io::SafetensorsReader& file) {
  const std::string where = "DiLoCo::load_state from '" + file.path().string() + "'";
  const io::Metadata& metadata = file.metadata();
  const auto value_of = [&](const std::string& key) -> const std::string& {
    const auto found = metadata.find(key);
    GRADSYNC_CHECK(found != metadata.end(), where, ": no '", key, "' in its metadata (not a DiLoCo state?)");
    return found->second;
  };
  for (const auto& [key, value] : diloco_option_entries(impl_->options)) {
    GRADSYNC_CHECK(value_of(key) == value, where, ": it was saved with ", key, " ", value_of(key), ", this run has ", value);
  }
  GRADSYNC_CHECK(value_of("diloco.world") == std::to_string(impl_->comm.size()), where, ": it was saved by ",
                 value_of("diloco.world"), " rank(s), this run has ", impl_->comm.size(),
                 " (the outer momentum averages over the ranks it was made with)");
  std::int64_t steps = -1;
  try {
    std::size_t used = 0;
    steps = std::stoll(value_of("diloco.steps"), &used);
    if (used != value_of("diloco.steps").size()) steps = -1;
  } catch (const std::exception&) {
  }
  GRADSYNC_CHECK(steps >= 0, where, ": 'diloco.steps' is '", value_of("diloco.steps"), "', not a step count");
  // Everything read and checked before anything changes: g, then the outer SGD's own check.
  std::vector<Tensor> outer_values;
  for (Parameter* parameter : impl_->mirror) {
    const std::string name = "diloco.outer." + parameter->name();
    const io::TensorInfo* info = file.find(name);
    GRADSYNC_CHECK(info != nullptr, where, ": no '", name, "'");
    GRADSYNC_CHECK(info->shape == parameter->shape() && info->dtype == parameter->dtype(), where, ": '", name, "' is ",
                   info->dtype_label(), shape_str(info->shape), ", the parameter ", dtype_name(parameter->dtype()),
                   shape_str(parameter->shape()));
    outer_values.push_back(file.read(name));
  }
  // The fragments whose outer step was still to land: all of a fragment's members or none.
  std::vector<Tensor> pending(impl_->trainable.size());
  for (const Impl::Fragment& fragment : impl_->fragments) {
    std::size_t found = 0;
    for (const std::size_t k : fragment.members) {
      const Parameter& parameter = *impl_->trainable[k];
      const std::string name = "diloco.pending." + parameter.name();
      const io::TensorInfo* info = file.find(name);
      if (info == nullptr) continue;
      GRADSYNC_CHECK(info->shape == parameter.shape() && info->dtype == parameter.dtype(), where, ": '", name, "' is ",
                     info->dtype_label(), shape_str(info->shape), ", the parameter ", dtype_name(parameter.dtype()),
                     shape_str(parameter.shape()));
      pending[k] = file.read(name);
      ++found;
    }
    GRADSYNC_CHECK(found == 0 || found == fragment.members.size(), where, ": ", found, " of the ", fragment.members.size(),
                   " parameters of fragment '", impl_->trainable[fragment.members.front()]->name(), "'... have a pending ",
                   "pseudo-gradient (a fragment's are saved together)");
  }
  impl_->outer_sgd->load_state(file);
  for (std::size_t k = 0; k < impl_->mirror.size(); ++k) impl_->mirror[k]->value().copy_from(outer_values[k]);
  for (Impl::Fragment& fragment : impl_->fragments) {
    impl_->land(fragment);  // a reduction of this run in flight: done with before it is replaced
    fragment.wires.clear();
    fragment.pending = pending[fragment.members.front()].defined();
    if (!fragment.pending) continue;
    impl_->allocate_wires(fragment);
    for (Impl::Wire& wire : fragment.wires) {
      for (const auto& [k, offset] : wire.members) Impl::to_wire(pending[k], wire, offset);
    }
  }
  impl_->steps = steps;
}

}  // namespace gradsync::dist
