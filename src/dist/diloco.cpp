// DiLoCo (gradsync/dist/diloco.h): inner steps alone, an outer Nesterov SGD over the averaged
// pseudo-gradient every H steps.
#include "gradsync/dist/diloco.h"

#include <string>
#include <vector>

#include "gradsync/comm/flight_recorder.h"
#include "gradsync/core/timeline.h"
#include "gradsync/dist/replicas.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/optim/sgd.h"

namespace gradsync::dist {

namespace {

std::string number(double value) {
  char text[64];
  std::snprintf(text, sizeof text, "%.17g", value);
  return text;
}

// The options as lines: compared across the ranks, written into and checked against a checkpoint.
std::vector<std::pair<std::string, std::string>> option_entries(const DiLoCoOptions& options) {
  return {{"diloco.sync_every", std::to_string(options.sync_every)},
          {"diloco.outer_lr", number(options.outer_lr)},
          {"diloco.outer_momentum", number(options.outer_momentum)},
          {"diloco.nesterov", options.nesterov ? "true" : "false"}};
}

}  // namespace

struct DiLoCo::Impl {
  ParameterRegistry& registry;
  comm::Communicator& comm;
  DiLoCoOptions options;
  std::vector<Parameter*> trainable;  // the model's, in registration order
  ParameterRegistry outer;            // g: the mirror of `trainable`
  std::vector<Parameter*> mirror;     // outer[k] mirrors trainable[k]
  std::unique_ptr<optim::SGD> outer_sgd;
  std::int64_t steps = 0;

  Impl(ParameterRegistry& registry_, comm::Communicator& comm_, const DiLoCoOptions& options_)
      : registry(registry_), comm(comm_), options(options_) {
    GRADSYNC_CHECK(options.sync_every > 0, "DiLoCo: sync_every ", options.sync_every, " (expected a positive number of steps)");
    GRADSYNC_CHECK(options.outer_lr > 0, "DiLoCo: outer_lr ", options.outer_lr, " (expected a positive learning rate)");
    GRADSYNC_CHECK(registry.finalized(), "DiLoCo: finalize the registry first");
    std::vector<const Parameter*> described;
    std::vector<std::string> names;
    for (Parameter& parameter : registry) {
      if (!parameter.requires_grad()) continue;
      trainable.push_back(&parameter);
      described.push_back(&parameter);
      names.push_back(parameter.name());
      mirror.push_back(&outer.add(parameter.name(), parameter.shape(), parameter.dtype(), parameter.device()));
    }
    GRADSYNC_CHECK(!trainable.empty(), "DiLoCo: the registry has no trainable parameter");
    std::vector<std::string> lines;
    for (const auto& [key, value] : option_entries(options)) lines.push_back(key + " " + value);
    require_same_lines(comm, lines, "DiLoCo", "options", "Option");
    require_same_parameters(comm, described, names, "DiLoCo");
    outer.finalize();
    outer_sgd = std::make_unique<optim::SGD>(
        outer, optim::SGD::Options{.lr = options.outer_lr, .momentum = options.outer_momentum, .nesterov = options.nesterov});
    // The first synchronization: rank 0's model everywhere, and g taken from it.
    for (Parameter* parameter : trainable) {
      if (comm.size() > 1) comm.broadcast(parameter->value(), 0);
    }
    for (std::size_t k = 0; k < trainable.size(); ++k) mirror[k]->value().copy_from(trainable[k]->value());
  }

  void outer_step() {
    timeline::Span span("diloco", "outer step");
    // delta = g - p, each rank's; then averaged (divided by the ranks' count, summed).
    for (std::size_t k = 0; k < trainable.size(); ++k) {
      Tensor& delta = mirror[k]->grad_for_overwrite();
      delta.copy_from(mirror[k]->value());
      ops::axpy(-1.0, trainable[k]->value(), delta);
      if (comm.size() > 1) ops::scale(delta, 1.0 / comm.size());
    }
    if (comm.size() > 1) {
      const comm::OperationLabel label("DiLoCo: the pseudo-gradients averaged");
      for (const Arena& arena : outer.arenas()) {
        Tensor grads = arena.grads;
        comm.allreduce(grads, comm::ReduceOp::sum);
      }
    }
    outer_sgd->step();
    for (std::size_t k = 0; k < trainable.size(); ++k) trainable[k]->value().copy_from(mirror[k]->value());
    outer_sgd->zero_grad();
  }
};

DiLoCo::DiLoCo(ParameterRegistry& registry, comm::Communicator& comm, DiLoCoOptions options)
    : impl_(std::make_unique<Impl>(registry, comm, options)) {}

DiLoCo::~DiLoCo() = default;

bool DiLoCo::step() {
  if (++impl_->steps % impl_->options.sync_every != 0) return false;
  impl_->outer_step();
  return true;
}

std::int64_t DiLoCo::inner_steps() const { return impl_->steps; }
const DiLoCoOptions& DiLoCo::options() const { return impl_->options; }

std::vector<io::NamedTensor> DiLoCo::state_tensors() const {
  std::vector<io::NamedTensor> tensors = impl_->outer_sgd->state_tensors();
  for (Parameter* parameter : impl_->mirror) tensors.push_back({"diloco.outer." + parameter->name(), parameter->value()});
  return tensors;
}

io::Metadata DiLoCo::state_metadata() const {
  io::Metadata metadata = impl_->outer_sgd->state_metadata();
  for (const auto& [key, value] : option_entries(impl_->options)) metadata[key] = value;
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
  for (const auto& [key, value] : option_entries(impl_->options)) {
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
  impl_->outer_sgd->load_state(file);
  for (std::size_t k = 0; k < impl_->mirror.size(); ++k) impl_->mirror[k]->value().copy_from(outer_values[k]);
  impl_->steps = steps;
}

}  // namespace gradsync::dist
