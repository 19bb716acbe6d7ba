// LocalSGD (gradsync/dist/outer/local_sgd.h): periodic model averaging.
#include "gradsync/dist/outer/local_sgd.h"

#include <map>
#include <string>
#include <vector>

#include "gradsync/comm/records/flight_recorder.h"
#include "gradsync/core/timeline.h"
#include "gradsync/dist/replicas/replicas.h"
#include "gradsync/kernels/ops.h"
#include "dist/join/census.h"

namespace gradsync::dist {

LocalSGD::LocalSGD(ParameterRegistry& registry, comm::Communicator& comm, LocalSGDOptions options)
    : registry_(registry), comm_(comm), options_(options) {
  GRADSYNC_CHECK(options_.period > 0, "LocalSGD: period ", options_.period, " (expected a positive number of steps)");
  GRADSYNC_CHECK(options_.warmup_steps >= 0, "LocalSGD: warmup_steps ", options_.warmup_steps, " is negative");
  GRADSYNC_CHECK(registry_.finalized(), "LocalSGD: finalize the registry first");
  std::vector<const Parameter*> trainable;
  std::vector<std::string> names;
  for (const Parameter& parameter : registry_) {
    if (!parameter.requires_grad()) continue;
    trainable.push_back(&parameter);
    names.push_back(parameter.name());
  }
  GRADSYNC_CHECK(!trainable.empty(), "LocalSGD: the registry has no trainable parameter to average");
  require_same_lines(comm_, {"period " + std::to_string(options_.period), "warmup_steps " + std::to_string(options_.warmup_steps)},
                     "LocalSGD", "options", "Option");
  require_same_parameters(comm_, trainable, names, "LocalSGD");
}

void LocalSGD::set_steps(std::int64_t steps) {
  // (bounded far beyond any run: step() adds one to it)
  GRADSYNC_CHECK(steps >= 0 && steps <= (std::int64_t{1} << 60), "LocalSGD::set_steps: ", steps,
                 " is not a step count (0 to 2^60)");
  steps_ = steps;
}

bool LocalSGD::step() { return advance(nullptr); }

bool LocalSGD::advance(JoinStep* step) {
  const std::int64_t s = steps_++;
  if (s < options_.warmup_steps || (s - options_.warmup_steps) % options_.period != 0) return false;
  if (comm_.size() == 1) return true;
  JoinCensus census{.options = join_options_, .shadowing = shadowing_, .first = first_shadow_};
  const double factor = census.take(comm_, step, "a LocalSGD average");
  first_shadow_ = census.first;
  if (factor == 0) return false;  // every rank has joined: finish_join averages
  // Dividing by the active ranks, a joined rank adds nothing to the sum.
  const bool adds_nothing = shadowing_ && !join_options_->divide_by_initial_world_size;
  average_scaled(adds_nothing ? 0.0 : factor);
  return true;
}

void LocalSGD::average() {
  if (comm_.size() > 1) average_scaled(1.0 / comm_.size());
}

// One flat buffer per dtype (allreduce_coalesced), each value multiplied by `factor` (1 / W)
// first, then summed: PeriodicModelAverager's order.
void LocalSGD::average_scaled(double factor) {
  timeline::Span span("local_sgd", "average the models");
  std::map<DType, std::vector<Tensor>> by_dtype;
  for (Parameter& parameter : registry_) {
    if (!parameter.requires_grad()) continue;
    Tensor& value = parameter.value();
    ops::scale(value, factor);
    by_dtype[value.dtype()].push_back(value);
  }
  const comm::OperationLabel label("LocalSGD: the models averaged");
  for (auto& [dtype, tensors] : by_dtype) comm_.allreduce_coalesced(tensors, comm::ReduceOp::sum);
}

// ---- Joinable (gradsync/dist/join/join.h) ----------------------------------------------------------------------

void LocalSGD::join_opened(const JoinOptions* options) {
  join_options_ = options;
  shadowing_ = false;
}

void LocalSGD::require_joinable() const {
  GRADSYNC_CHECK(!in_warmup(), "LocalSGD: a rank joined (dist::Join) in the warm-up, whose synchronous steps LocalSGD ",
                 "does not shadow; join after it, or run the warm-up's uneven inputs under the DataParallel's Join");
}

void LocalSGD::begin_shadowing() {
  shadowing_ = true;
  first_shadow_ = true;
}

void LocalSGD::shadow_step(JoinStep& step) {
  step.synchronized = false;
  while (!step.synchronized) advance(&step);
}

void LocalSGD::finish_join(int) { average(); }

}  // namespace gradsync::dist
