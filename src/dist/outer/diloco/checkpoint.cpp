// DiLoCo's checkpoints (gradsync/dist/outer/diloco.h): the outer model, the outer SGD's state, the
// fragments in flight, and the options they were made with.
#include <cmath>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gradsync/dist/replicas/replicas.h"
#include "gradsync/io/checksum.h"
#include "state.h"

namespace gradsync::dist {

namespace {

constexpr std::int64_t kMaxSteps = std::int64_t{1} << 60;

void require_finite(const Tensor& tensor, const std::string& where, const std::string& name) {
  const Tensor values = tensor.to(DType::f64);
  const double* data = values.data_as<double>();
  for (std::int64_t i = 0; i < values.numel(); ++i) {
    GRADSYNC_CHECK(std::isfinite(data[i]), where, ": '", name, "' holds ", data[i], " at element ", i,
                   " (a state to resume from is finite)");
  }
}

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
  std::string pending;  // the fragments whose pseudo-gradients are in the file: none may go missing
  for (std::size_t f = 0; f < impl_->fragments.size(); ++f) {
    if (!impl_->fragments[f].pending) continue;
    if (!pending.empty()) pending += ' ';
    pending += std::to_string(f);
  }
  metadata["diloco.pending"] = pending;
  return metadata;
}

// What a state file holds, read and checked on this rank before anything changes.
struct DiLoCo::Impl::Loaded {
  std::int64_t steps = -1;
  std::vector<Tensor> outer_values;  // by trainable index
  std::vector<Tensor> pending;       // by trainable index: undefined where none
  std::uint64_t digest = 0;          // of the steps and every state tensor
};

DiLoCo::Impl::Loaded DiLoCo::Impl::read_state(const io::SafetensorsReader& file, const std::string& where) const {
  const io::Metadata& metadata = file.metadata();
  const auto value_of = [&](const std::string& key) -> const std::string& {
    const auto found = metadata.find(key);
    GRADSYNC_CHECK(found != metadata.end(), where, ": no '", key, "' in its metadata (not a DiLoCo state?)");
    return found->second;
  };
  for (const auto& [key, value] : diloco_option_entries(options)) {
    GRADSYNC_CHECK(value_of(key) == value, where, ": it was saved with ", key, " ", value_of(key), ", this run has ", value);
  }
  GRADSYNC_CHECK(value_of("diloco.world") == std::to_string(comm.size()), where, ": it was saved by ",
                 value_of("diloco.world"), " rank(s), this run has ", comm.size(),
                 " (the outer momentum averages over the ranks it was made with)");
  Loaded loaded;
  try {
    std::size_t used = 0;
    loaded.steps = std::stoll(value_of("diloco.steps"), &used);
    if (used != value_of("diloco.steps").size()) loaded.steps = -1;
  } catch (const std::exception&) {
  }
  // (bounded far beyond any run: the schedule adds to it and to the offsets)
  GRADSYNC_CHECK(loaded.steps >= 0 && loaded.steps <= kMaxSteps, where, ": 'diloco.steps' is '", value_of("diloco.steps"),
                 "', not a step count (0 to ", kMaxSteps, ")");
  const auto read_checked = [&](const std::string& name, const Parameter& parameter) {
    const io::TensorInfo* info = file.find(name);
    GRADSYNC_CHECK(info->shape == parameter.shape() && info->dtype == parameter.dtype(), where, ": '", name, "' is ",
                   info->dtype_label(), shape_str(info->shape), ", the parameter ", dtype_name(parameter.dtype()),
                   shape_str(parameter.shape()));
    Tensor tensor = file.read(name);
    require_finite(tensor, where, name);
    return tensor;
  };
  for (Parameter* parameter : mirror) {
    const std::string name = "diloco.outer." + parameter->name();
    GRADSYNC_CHECK(file.find(name) != nullptr, where, ": no '", name, "'");
    loaded.outer_values.push_back(read_checked(name, *parameter));
  }
  // The fragments whose outer step was still to land: all of a fragment's members or none, only
  // where the schedule can have one in flight, and exactly those the metadata lists.
  loaded.pending.resize(trainable.size());
  const auto listed = metadata.find("diloco.pending");
  std::set<std::string> in_flight;  // the fragment numbers it lists
  if (listed != metadata.end()) {
    std::istringstream words(listed->second);
    for (std::string word; words >> word;) in_flight.insert(word);
  }
  for (std::size_t f = 0; f < fragments.size(); ++f) {
    const Fragment& fragment = fragments[f];
    std::size_t found = 0;
    for (const std::size_t k : fragment.members) {
      const std::string name = "diloco.pending." + trainable[k]->name();
      if (file.find(name) == nullptr) continue;
      loaded.pending[k] = read_checked(name, *trainable[k]);
      ++found;
    }
    const std::string first = trainable[fragment.members.front()]->name();
    GRADSYNC_CHECK(found == 0 || found == fragment.members.size(), where, ": ", found, " of the ", fragment.members.size(),
                   " parameters of fragment '", first, "'... have a pending pseudo-gradient (a fragment's are saved together)");
    GRADSYNC_CHECK(found == 0 || may_be_pending(fragment, loaded.steps), where, ": fragment '", first, "'... has a ",
                   "pending pseudo-gradient, but at step ", loaded.steps, " the schedule has none of its reductions in flight");
    if (listed != metadata.end()) {
      const bool said = in_flight.count(std::to_string(f)) > 0;
      GRADSYNC_CHECK(said == (found > 0), where, ": fragment '", first, "'... is ", said ? "" : "not ", "in flight by its ",
                     "'diloco.pending' (", listed->second, "), but the file ", found > 0 ? "holds" : "lacks",
                     " its pending pseudo-gradients (an outer step would be ", said ? "dropped)" : "taken twice)");
    }
  }
  // The outer SGD's momentum: finite (a NaN would reach every weight at the next outer step), and
  // the optimizer's own checks (a buffer its step counts say exists is there).
  std::vector<io::NamedTensor> momentum;
  for (const io::TensorInfo& info : file.tensors()) {
    if (!info.name.starts_with("optimizer.state.")) continue;
    momentum.push_back({info.name, file.read(info.name)});
    require_finite(momentum.back().tensor, where, info.name);
  }
  outer_sgd->check_state(momentum, metadata, where);
  io::Xxh64 digest(static_cast<std::uint64_t>(loaded.steps));
  for (const io::TensorInfo& info : file.tensors()) {
    if (!info.name.starts_with("optimizer.state.") && !info.name.starts_with("diloco.")) continue;
    const Tensor tensor = file.read(info.name);
    digest.update(info.name.data(), info.name.size());
    digest.update(tensor.data(), tensor.nbytes());
  }
  loaded.digest = digest.digest();
  return loaded;
}

void DiLoCo::load_state(const io::SafetensorsReader& file) {
  const std::string where = "DiLoCo::load_state from '" + file.path().string() + "'";
  // Everything read and checked on every rank before anything changes, then one agreement: every
  // rank loads the same state or none does (the replicas would differ after synchronize()).
  Impl::Loaded loaded;
  std::string fault;
  try {
    loaded = impl_->read_state(file, where);
  } catch (const std::exception& error) {
    fault = error.what();
  }
  const std::vector<std::string> lines = {fault.empty() ? "loadable" : "not loadable",
                                          "steps " + std::to_string(loaded.steps),
                                          "xxh64 " + io::hex_digest(loaded.digest)};
  require_same_lines(impl_->comm, lines, where, "DiLoCo state (load the same file on every rank)");
  if (impl_->within != nullptr) require_same_lines(*impl_->within, lines, where, "DiLoCo state");
  if (!fault.empty()) throw Error(fault);
  impl_->outer_sgd->load_state(file);
  for (std::size_t k = 0; k < impl_->mirror.size(); ++k) impl_->mirror[k]->value().copy_from(loaded.outer_values[k]);
  for (Impl::Fragment& fragment : impl_->fragments) {
    impl_->land(fragment);  // a reduction of this run in flight: done with before it is replaced
    fragment.wires.clear();
    fragment.pending = loaded.pending[fragment.members.front()].defined();
    if (!fragment.pending) continue;
    impl_->allocate_wires(fragment);
    for (Impl::Wire& wire : fragment.wires) {
      for (const auto& [k, offset] : wire.members) Impl::to_wire(loaded.pending[k], wire, offset);
    }
  }
  impl_->steps = loaded.steps;
}

}  // namespace gradsync::dist
