// LocalSGD (gradsync/dist/local_sgd.h): periodic model averaging.
#include "gradsync/dist/local_sgd.h"

#include <map>
#include <string>
#include <vector>

#include "gradsync/comm/flight_recorder.h"
#include "gradsync/core/timeline.h"
#include "gradsync/dist/replicas.h"
#include "gradsync/kernels/ops.h"

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
  GRADSYNC_CHECK(steps >= 0, "LocalSGD::set_steps: ", steps, " is negative");
  steps_ = steps;
}

bool LocalSGD::step() {
  const std::int64_t step = steps_++;
  if (step < options_.warmup_steps || (step - options_.warmup_steps) % options_.period != 0) return false;
  if (comm_.size() == 1) return true;
  timeline::Span span("local_sgd", "average the models");
  // One flat buffer per dtype (allreduce_coalesced), each value divided by the ranks' count
  // first, then summed: PeriodicModelAverager's order.
  std::map<DType, std::vector<Tensor>> by_dtype;
  for (Parameter& parameter : registry_) {
    if (!parameter.requires_grad()) continue;
    Tensor& value = parameter.value();
    ops::scale(value, 1.0 / comm_.size());
    by_dtype[value.dtype()].push_back(value);
  }
  const comm::OperationLabel label("LocalSGD: the models averaged");
  for (auto& [dtype, tensors] : by_dtype) comm_.allreduce_coalesced(tensors, comm::ReduceOp::sum);
  return true;
}

}  // namespace gradsync::dist
