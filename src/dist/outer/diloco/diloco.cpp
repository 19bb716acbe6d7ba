// DiLoCo (gradsync/dist/outer/diloco.h): inner steps alone, an outer Nesterov SGD over the averaged
// pseudo-gradient every H steps; streaming's fragments at staggered steps, their reductions in
// flight behind the inner steps; dist::Join (a joined rank answers the outer reductions).
#include "gradsync/dist/outer/diloco.h"

#include <algorithm>
#include <string>
#include <vector>

#include "state.h"
#include "gradsync/comm/records/flight_recorder.h"
#include "gradsync/core/timeline.h"
#include "gradsync/dist/replicas/replicas.h"
#include "gradsync/kernels/ops.h"

namespace gradsync::dist {

namespace {

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

DiLoCo::Impl::Impl(ParameterRegistry& registry_, comm::Communicator& comm_, comm::Communicator* within_,
                   const DiLoCoOptions& options_)
    : registry(registry_), comm(comm_), within(within_ != nullptr && within_->size() > 1 ? within_ : nullptr),
      options(options_) {
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
  for (const auto& [key, value] : diloco_option_entries(options)) lines.push_back(key + " " + value);
  require_same_lines(comm, lines, "DiLoCo", "options", "Option");
  require_same_parameters(comm, described, names, "DiLoCo");
  if (within != nullptr) {
    require_same_lines(*within, lines, "DiLoCo (inside the group)", "options", "Option");
    require_same_parameters(*within, described, names, "DiLoCo (inside the group)");
  }
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

void DiLoCo::Impl::take_outer_model() {
  for (std::size_t k = 0; k < trainable.size(); ++k) mirror[k]->value().copy_from(trainable[k]->value());
}

// The wire buffers of `fragment`: its members grouped by wire dtype and device, packed.
void DiLoCo::Impl::allocate_wires(Fragment& fragment) {
  fragment.wires.clear();
  std::vector<std::size_t> sizes;
  for (const std::size_t k : fragment.members) {
    const DType on_wire = wire_dtype(trainable[k]->dtype(), options.compression);
    std::size_t w = 0;
    while (w < fragment.wires.size() &&
           !(fragment.wires[w].buffer.dtype() == on_wire && fragment.wires[w].buffer.device() == trainable[k]->device())) {
      ++w;
    }
    if (w == fragment.wires.size()) {
      fragment.wires.push_back({Tensor::empty({1}, on_wire, trainable[k]->device()), {}});
      sizes.push_back(0);
    }
    fragment.wires[w].members.emplace_back(k, sizes[w]);
    sizes[w] += static_cast<std::size_t>(trainable[k]->numel());
  }
  // Under `within`, padded to a multiple of the group's size (zeros: the slices are equal).
  const std::size_t group = within != nullptr ? static_cast<std::size_t>(within->size()) : 1;
  for (std::size_t w = 0; w < fragment.wires.size(); ++w) {
    Wire& wire = fragment.wires[w];
    const std::size_t padded = (sizes[w] + group - 1) / group * group;
    wire.buffer = group > 1 ? Tensor::zeros({static_cast<std::int64_t>(padded)}, wire.buffer.dtype(), wire.buffer.device())
                            : Tensor::empty({static_cast<std::int64_t>(sizes[w])}, wire.buffer.dtype(), wire.buffer.device());
  }
}

Tensor DiLoCo::Impl::my_slice(const Wire& wire) const {
  if (within == nullptr) return wire.buffer;
  const std::int64_t slice = wire.buffer.numel() / within->size();
  return wire.buffer.view(static_cast<std::size_t>(within->rank() * slice), {slice});
}

// `source` (a member's values, any shape) into its place on the wire, converted; or back.
void DiLoCo::Impl::to_wire(const Tensor& source, Wire& wire, std::size_t offset) {
  Tensor place = wire.buffer.view(offset, {source.numel()});
  const Tensor flat = source.view(0, {source.numel()});
  if (flat.dtype() == place.dtype()) place.copy_from(flat); else ops::cast(flat, place);
}

void DiLoCo::Impl::from_wire(const Wire& wire, std::size_t offset, Tensor& destination) {
  const Tensor place = wire.buffer.view(offset, {destination.numel()});
  Tensor flat = destination.view(0, {destination.numel()});
  if (flat.dtype() == place.dtype()) flat.copy_from(place); else ops::cast(place, flat);
}

// A fragment's synchronization begins: each rank's pseudo-gradient g - p, times `factor` (1 / W),
// onto the wire and its sum launched; the inner steps go on meanwhile.
void DiLoCo::Impl::launch(Fragment& fragment, double factor) {
  GRADSYNC_CHECK(!fragment.pending, "DiLoCo: a fragment's reduction launched before its last one landed");
  timeline::Span span("diloco", "outer reduction launched");
  allocate_wires(fragment);
  for (Wire& wire : fragment.wires) {
    for (const auto& [k, offset] : wire.members) {
      Tensor& delta = mirror[k]->grad_for_overwrite();  // scratch, in the parameter's dtype
      delta.copy_from(mirror[k]->value());
      ops::axpy(-1.0, trainable[k]->value(), delta);
      if (comm.size() > 1) ops::scale(delta, factor);
      to_wire(delta, wire, offset);
      mirror[k]->zero_grad(/*set_to_undefined=*/true);
    }
    if (comm.size() > 1) {
      const comm::OperationLabel label("DiLoCo: the pseudo-gradients averaged");
      Tensor slice = my_slice(wire);
      fragment.works.push_back(comm.allreduce_async(slice, comm::ReduceOp::sum));
      bytes_sent += static_cast<std::int64_t>(slice.nbytes());
    }
  }
  fragment.pending = true;
  fragment.progressed = false;
}

// Waits for a fragment's reductions (every one of them, whatever throws: they write into its
// wires), then rethrows the first failure.
void DiLoCo::Impl::land(Fragment& fragment) {
  comm::FirstError errors;
  const bool reduced = !fragment.works.empty();
  for (comm::WorkHandle& work : fragment.works) errors.wait(work);
  fragment.works.clear();
  errors.rethrow();
  if (within == nullptr || !reduced) return;
  // Each rank of the group reduced its slice across: the group shares them.
  const comm::OperationLabel label("DiLoCo: the reduced slices shared inside the group");
  for (Wire& wire : fragment.wires) {
    const Tensor mine = my_slice(wire).clone();
    within->allgather(mine, wire.buffer);
  }
}

// A fragment's outer step: g = SGD(g, averaged pseudo-gradient) over its members (the outer
// SGD skips the others: their gradients are undefined), then p = mixing p + (1 - mixing) g (a
// joined rank, which has no local progress to keep: p = g).
void DiLoCo::Impl::apply(Fragment& fragment) {
  timeline::Span span("diloco", "outer step");
  land(fragment);
  for (const Wire& wire : fragment.wires) {
    for (const auto& [k, offset] : wire.members) from_wire(wire, offset, mirror[k]->grad_for_overwrite());
  }
  outer_sgd->step();
  const bool keep_local = options.mixing != 0 && !census.shadowing;
  for (const std::size_t k : fragment.members) {
    Tensor& p = trainable[k]->value();
    if (!keep_local) {
      p.copy_from(mirror[k]->value());
    } else {
      ops::scale(p, options.mixing);
      ops::axpy(1.0 - options.mixing, mirror[k]->value(), p);
    }
  }
  if (!keep_local) fragment.progressed = false;  // p is g again
  outer_sgd->zero_grad(/*set_to_undefined=*/true);
  fragment.wires.clear();
  fragment.pending = false;
}

bool DiLoCo::Impl::advance(JoinStep* step) {
  ++steps;
  if (steps <= options.warmup_steps) {
    if (steps == options.warmup_steps) take_outer_model();  // the replicas, equal after synchronous steps
    return false;
  }
  if (step == nullptr) {  // an active rank has taken an inner step
    for (Fragment& fragment : fragments) fragment.progressed = true;
  }
  const std::int64_t s = steps - options.warmup_steps;
  for (Fragment& fragment : fragments) {
    if (!due(s, fragment.offset)) continue;
    const double factor = census.take(comm, step, "an outer reduction");
    if (factor == 0) return false;  // every rank has joined: finish_join synchronizes
    launch(fragment, factor);
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

bool DiLoCo::Impl::may_be_pending(const Fragment& fragment, std::int64_t at) const {
  const std::int64_t s = at - options.warmup_steps;
  if (s < fragment.offset) return false;  // not launched yet
  const std::int64_t launched = fragment.offset + (s - fragment.offset) / options.sync_every * options.sync_every;
  return launched + options.delay > s;  // lands at launched + delay, in that step
}

// Every fragment in flight lands; then one more outer step of every fragment that some rank has
// moved since its last launch (its progress would be lost otherwise), after which every rank
// holds g.
void DiLoCo::Impl::synchronize_all() {
  for (Fragment& fragment : fragments) {
    if (fragment.pending) apply(fragment);
  }
  Tensor moved = Tensor::zeros({static_cast<std::int64_t>(fragments.size())}, DType::f64);
  for (std::size_t f = 0; f < fragments.size(); ++f) moved.data_as<double>()[f] = fragments[f].progressed ? 1 : 0;
  if (comm.size() > 1) {
    const comm::OperationLabel label("DiLoCo: which fragments moved since their last synchronization");
    comm.allreduce_host(moved, comm::ReduceOp::max);
  }
  for (std::size_t f = 0; f < fragments.size(); ++f) {
    if (moved.data_as<double>()[f] > 0) launch(fragments[f], 1.0 / comm.size());
  }
  for (Fragment& fragment : fragments) {
    if (fragment.pending) apply(fragment);
  }
  for (std::size_t k = 0; k < trainable.size(); ++k) trainable[k]->value().copy_from(mirror[k]->value());
  for (Fragment& fragment : fragments) fragment.progressed = false;
}

DiLoCo::DiLoCo(ParameterRegistry& registry, comm::Communicator& comm, DiLoCoOptions options)
    : impl_(std::make_unique<Impl>(registry, comm, nullptr, options)) {}

DiLoCo::DiLoCo(ParameterRegistry& registry, comm::Communicator& comm, comm::Communicator& within, DiLoCoOptions options)
    : impl_(std::make_unique<Impl>(registry, comm, &within, options)) {}

DiLoCo::~DiLoCo() {
  // Reductions still in flight write into this object's wires: wait for them (their errors are
  // of no use any more).
  for (Impl::Fragment& fragment : impl_->fragments) {
    comm::FirstError errors;
    for (comm::WorkHandle& work : fragment.works) errors.wait(work);
  }
}

bool DiLoCo::step() { return impl_->advance(nullptr); }

void DiLoCo::synchronize() {
  GRADSYNC_CHECK(!in_warmup(), "DiLoCo::synchronize in the warm-up (the replicas are synchronous then)");
  impl_->synchronize_all();
}

bool DiLoCo::in_warmup() const { return impl_->steps < impl_->options.warmup_steps; }
std::int64_t DiLoCo::inner_steps() const { return impl_->steps; }
std::int64_t DiLoCo::bytes_sent() const { return impl_->bytes_sent; }
const DiLoCoOptions& DiLoCo::options() const { return impl_->options; }

std::vector<std::pair<std::string, std::int64_t>> DiLoCo::fragment_of_parameters() const {
  std::vector<std::pair<std::string, std::int64_t>> result;
  for (std::size_t k = 0; k < impl_->trainable.size(); ++k) result.emplace_back(impl_->trainable[k]->name(), impl_->fragment_of[k]);
  return result;
}

// ---- Joinable (gradsync/dist/join/join.h) ----------------------------------------------------------------------

void DiLoCo::join_opened(const JoinOptions* options) { impl_->census = JoinCensus{.options = options}; }

void DiLoCo::require_joinable() const {
  GRADSYNC_CHECK(!in_warmup(), "DiLoCo: a rank joined (dist::Join) in the warm-up, whose synchronous steps ",
                 "DiLoCo does not shadow; join after it, or run the warm-up's uneven inputs under the DataParallel's Join");
}

void DiLoCo::begin_shadowing() {
  impl_->census.shadowing = true;
  impl_->census.first = true;
}

// The steps of the active ranks up to their next outer reduction, without inner steps: the
// outer steps that land on the way, then this rank's part in that reduction (its progress since
// the fragment's last launch, then nothing) and the census that came with it.
void DiLoCo::shadow_step(JoinStep& step) {
  step.synchronized = false;
  while (!step.synchronized) impl_->advance(&step);
}

void DiLoCo::finish_join(int) { impl_->synchronize_all(); }

comm::Communicator& DiLoCo::join_communicator() const { return impl_->comm; }

}  // namespace gradsync::dist
