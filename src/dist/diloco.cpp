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
          {"diloco.nesterov", options.nesterov ? "true" : "false"},
          {"diloco.warmup_steps", std::to_string(options.warmup_steps)},
          {"diloco.fragments", std::to_string(options.fragments)},
          {"diloco.delay", std::to_string(options.delay)},
          {"diloco.mixing", number(options.mixing)},
          {"diloco.compression", compression_name(options.compression)}};
}

// Parameter k (of `sizes`, in order) goes to the fragment its middle element falls in, the
// fragments cutting the elements into F equal runs: consecutive parameters, balanced by size.
std::vector<std::int64_t> split_into_fragments(const std::vector<std::int64_t>& sizes, std::int64_t fragments) {
  std::int64_t total = 0;
  for (const std::int64_t size : sizes) total += size;
  std::vector<std::int64_t> fragment_of;
  std::vector<std::int64_t> members(static_cast<std::size_t>(fragments), 0);
  std::int64_t start = 0;
  for (const std::int64_t size : sizes) {
    // 2 x the middle element, to stay in integers: fragment = floor(F x middle / total).
    const std::int64_t fragment = std::min(fragments - 1, fragments * (2 * start + size) / (2 * total));
    fragment_of.push_back(fragment);
    ++members[static_cast<std::size_t>(fragment)];
    start += size;
  }
  for (std::int64_t f = 0; f < fragments; ++f) {
    GRADSYNC_CHECK(members[static_cast<std::size_t>(f)] > 0, "DiLoCo: fragment ", f, " of ", fragments,
                   " would hold no parameter (", sizes.size(), " trainable parameters of ", total,
                   " elements, each in the fragment its middle element falls in): use fewer fragments");
  }
  return fragment_of;
}

}  // namespace

struct DiLoCo::Impl {
  // One buffer on the wire: a fragment's members of one dtype and device, packed.
  struct Wire {
    Tensor buffer;
    std::vector<std::pair<std::size_t, std::size_t>> members;  // (trainable index, element offset)
  };
  // A fragment of the model and its reduction (the whole model when there is one).
  struct Fragment {
    std::vector<std::size_t> members;  // indices into `trainable`
    std::int64_t offset = 0;           // o_i: its first synchronization, in inner steps after the warm-up
    std::vector<Wire> wires;           // while pending: its averaged (or averaging) pseudo-gradients
    std::vector<comm::WorkHandle> works;
    bool pending = false;  // reduced or reducing, its outer step not landed yet
  };

  ParameterRegistry& registry;
  comm::Communicator& comm;
  DiLoCoOptions options;
  std::vector<Parameter*> trainable;  // the model's, in registration order
  ParameterRegistry outer;            // g: the mirror of `trainable`
  std::vector<Parameter*> mirror;     // outer[k] mirrors trainable[k]
  std::unique_ptr<optim::SGD> outer_sgd;
  std::vector<Fragment> fragments;
  std::vector<std::int64_t> fragment_of;  // by trainable index
  std::int64_t steps = 0;
  std::int64_t bytes_sent = 0;

  Impl(ParameterRegistry& registry_, comm::Communicator& comm_, const DiLoCoOptions& options_)
      : registry(registry_), comm(comm_), options(options_) {
    GRADSYNC_CHECK(options.sync_every > 0, "DiLoCo: sync_every ", options.sync_every, " (expected a positive number of steps)");
    GRADSYNC_CHECK(options.outer_lr > 0, "DiLoCo: outer_lr ", options.outer_lr, " (expected a positive learning rate)");
    GRADSYNC_CHECK(options.warmup_steps >= 0, "DiLoCo: warmup_steps ", options.warmup_steps, " (expected >= 0)");
    GRADSYNC_CHECK(options.fragments >= 1 && options.fragments <= options.sync_every, "DiLoCo: fragments ",
                   options.fragments, " (expected 1 to sync_every ", options.sync_every,
                   ": each fragment is synchronized once every sync_every steps, one at a time)");
    GRADSYNC_CHECK(options.delay >= 0 && options.delay < options.sync_every / options.fragments, "DiLoCo: delay ",
                   options.delay, " (expected 0 to ", options.sync_every / options.fragments - 1,
                   ": a fragment's reduction must land before the next fragment's is launched)");
    GRADSYNC_CHECK(options.mixing >= 0 && options.mixing <= 1, "DiLoCo: mixing ", options.mixing, " (expected 0 to 1)");
    GRADSYNC_CHECK(registry.finalized(), "DiLoCo: finalize the registry first");
    std::vector<const Parameter*> described;
    std::vector<std::string> names;
    std::vector<std::int64_t> sizes;
    for (Parameter& parameter : registry) {
      if (!parameter.requires_grad()) continue;
      trainable.push_back(&parameter);
      described.push_back(&parameter);
      names.push_back(parameter.name());
      sizes.push_back(parameter.numel());
      mirror.push_back(&outer.add(parameter.name(), parameter.shape(), parameter.dtype(), parameter.device()));
    }
    GRADSYNC_CHECK(!trainable.empty(), "DiLoCo: the registry has no trainable parameter");
    std::vector<std::string> lines;
    for (const auto& [key, value] : option_entries(options)) lines.push_back(key + " " + value);
    require_same_lines(comm, lines, "DiLoCo", "options", "Option");
    require_same_parameters(comm, described, names, "DiLoCo");
    fragment_of = split_into_fragments(sizes, options.fragments);
    fragments.resize(static_cast<std::size_t>(options.fragments));
    for (std::size_t k = 0; k < trainable.size(); ++k) fragments[static_cast<std::size_t>(fragment_of[k])].members.push_back(k);
    for (std::size_t f = 0; f < fragments.size(); ++f) {  // torchft's offsets: floor(H (f + 1) / F)
      fragments[f].offset = options.sync_every * static_cast<std::int64_t>(f + 1) / options.fragments;
    }
    outer.finalize();
    outer_sgd = std::make_unique<optim::SGD>(
        outer, optim::SGD::Options{.lr = options.outer_lr, .momentum = options.outer_momentum, .nesterov = options.nesterov});
    // The first synchronization: rank 0's model everywhere, and g taken from it.
    for (Parameter* parameter : trainable) {
      if (comm.size() > 1) comm.broadcast(parameter->value(), 0);
    }
    take_outer_model();
  }

  void take_outer_model() {
    for (std::size_t k = 0; k < trainable.size(); ++k) mirror[k]->value().copy_from(trainable[k]->value());
  }

  // The wire buffers of `fragment`: its members grouped by wire dtype and device, packed.
  void allocate_wires(Fragment& fragment) {
    fragment.wires.clear();
    std::vector<std::size_t> sizes;
    for (const std::size_t k : fragment.members) {
      const DType on_wire = wire_dtype(trainable[k]->dtype(), options.compression);
      std::size_t w = 0;
      while (w < fragment.wires.size() && !(fragment.wires[w].buffer.dtype() == on_wire &&
                                            fragment.wires[w].buffer.device() == trainable[k]->device())) {
        ++w;
      }
      if (w == fragment.wires.size()) {
        fragment.wires.push_back({Tensor::empty({1}, on_wire, trainable[k]->device()), {}});
        sizes.push_back(0);
      }
      fragment.wires[w].members.emplace_back(k, sizes[w]);
      sizes[w] += static_cast<std::size_t>(trainable[k]->numel());
    }
    for (std::size_t w = 0; w < fragment.wires.size(); ++w) {
      Wire& wire = fragment.wires[w];
      wire.buffer = Tensor::empty({static_cast<std::int64_t>(sizes[w])}, wire.buffer.dtype(), wire.buffer.device());
    }
  }

  // `source` (a member's values, any shape) into its place on the wire, converted; or back.
  static void to_wire(const Tensor& source, Wire& wire, std::size_t offset) {
    Tensor place = wire.buffer.view(offset, {source.numel()});
    const Tensor flat = source.view(0, {source.numel()});
    if (flat.dtype() == place.dtype()) place.copy_from(flat); else ops::cast(flat, place);
  }
  static void from_wire(const Wire& wire, std::size_t offset, Tensor& destination) {
    const Tensor place = wire.buffer.view(offset, {destination.numel()});
    Tensor flat = destination.view(0, {destination.numel()});
    if (flat.dtype() == place.dtype()) flat.copy_from(place); else ops::cast(place, flat);
  }

  // A fragment's synchronization begins: each rank's pseudo-gradient g - p, divided by the ranks'
  // count, onto the wire and its sum launched; the inner steps go on meanwhile.
  void launch(Fragment& fragment) {
    GRADSYNC_CHECK(!fragment.pending, "DiLoCo: a fragment's reduction launched before its last one landed");
    timeline::Span span("diloco", "outer reduction launched");
    allocate_wires(fragment);
    for (Wire& wire : fragment.wires) {
      for (const auto& [k, offset] : wire.members) {
        Tensor& delta = mirror[k]->grad_for_overwrite();  // scratch, in the parameter's dtype
        delta.copy_from(mirror[k]->value());
        ops::axpy(-1.0, trainable[k]->value(), delta);
        if (comm.size() > 1) ops::scale(delta, 1.0 / comm.size());
        to_wire(delta, wire, offset);
        mirror[k]->zero_grad(/*set_to_undefined=*/true);
      }
      if (comm.size() > 1) {
        const comm::OperationLabel label("DiLoCo: the pseudo-gradients averaged");
        fragment.works.push_back(comm.allreduce_async(wire.buffer, comm::ReduceOp::sum));
        bytes_sent += static_cast<std::int64_t>(wire.buffer.nbytes());
      }
    }
    fragment.pending = true;
  }

  // Waits for a fragment's reductions (every one of them, whatever throws: they write into its
  // wires), then rethrows the first failure.
  static void land(Fragment& fragment) {
    comm::FirstError errors;
    for (comm::WorkHandle& work : fragment.works) errors.wait(work);
    fragment.works.clear();
    errors.rethrow();
  }

  // A fragment's outer step: g = SGD(g, averaged pseudo-gradient) over its members (the outer
  // SGD skips the others: their gradients are undefined), then p = mixing p + (1 - mixing) g.
  void apply(Fragment& fragment) {
    timeline::Span span("diloco", "outer step");
    land(fragment);
    for (const Wire& wire : fragment.wires) {
      for (const auto& [k, offset] : wire.members) from_wire(wire, offset, mirror[k]->grad_for_overwrite());
    }
    outer_sgd->step();
    for (const std::size_t k : fragment.members) {
      Tensor& p = trainable[k]->value();
      if (options.mixing == 0) {
        p.copy_from(mirror[k]->value());
      } else {
        ops::scale(p, options.mixing);
        ops::axpy(1.0 - options.mixing, mirror[k]->value(), p);
      }
    }
    outer_sgd->zero_grad(/*set_to_undefined=*/true);
    fragment.wires.clear();
    fragment.pending = false;
  }

  // Whether inner step s (counted from 1 after the warm-up) is `offset` plus a multiple of H.
  bool due(std::int64_t s, std::int64_t offset) const { return s >= offset && (s - offset) % options.sync_every == 0; }

  bool step() {
    ++steps;
    if (steps <= options.warmup_steps) {
      if (steps == options.warmup_steps) take_outer_model();  // the replicas, equal after synchronous steps
      return false;
    }
    const std::int64_t s = steps - options.warmup_steps;
    for (Fragment& fragment : fragments) {
      if (due(s, fragment.offset)) launch(fragment);
    }
    bool landed = false;
    for (Fragment& fragment : fragments) {
      if (fragment.pending && due(s, fragment.offset + options.delay)) {
        apply(fragment);
        landed = true;
      }
    }
    return landed;
  }
};

DiLoCo::DiLoCo(ParameterRegistry& registry, comm::Communicator& comm, DiLoCoOptions options)
    : impl_(std::make_unique<Impl>(registry, comm, options)) {}

DiLoCo::~DiLoCo() {
  // Reductions still in flight write into this object's wires: wait for them (their errors are
  // of no use any more).
  for (Impl::Fragment& fragment : impl_->fragments) {
    comm::FirstError errors;
    for (comm::WorkHandle& work : fragment.works) errors.wait(work);
  }
}

bool DiLoCo::step() { return impl_->step(); }

bool DiLoCo::in_warmup() const { return impl_->steps < impl_->options.warmup_steps; }
std::int64_t DiLoCo::inner_steps() const { return impl_->steps; }
std::int64_t DiLoCo::bytes_sent() const { return impl_->bytes_sent; }
const DiLoCoOptions& DiLoCo::options() const { return impl_->options; }

std::vector<std::pair<std::string, std::int64_t>> DiLoCo::fragment_of_parameters() const {
  std::vector<std::pair<std::string, std::int64_t>> result;
  for (std::size_t k = 0; k < impl_->trainable.size(); ++k) result.emplace_back(impl_->trainable[k]->name(), impl_->fragment_of[k]);
  return result;
}

std::vector<io::NamedTensor> DiLoCo::state_tensors() const {
  std::vector<io::NamedTensor> tensors = impl_->outer_sgd->state_tensors();
  for (Parameter* parameter : impl_->mirror) tensors.push_back({"diloco.outer." + parameter->name(), parameter->value()});
  // A fragment between its launch and its outer step: its averaged pseudo-gradients, landed now
  // (the same step on every rank; the outer step still waits for its own inner step).
  for (Impl::Fragment& fragment : impl_->fragments) {
    if (!fragment.pending) continue;
    Impl::land(fragment);
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
    Impl::land(fragment);  // a reduction of this run in flight: done with before it is replaced
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
