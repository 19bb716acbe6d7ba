// gradsync/dist/local_sgd.h - LocalSGD: every rank steps its own replica, and every `period`
// steps the replicas are averaged over a communicator (PyTorch's PeriodicModelAverager under
// PostLocalSGDOptimizer; docs/slow_links.md).
//
//   dist::DataParallel ddp(registry, comm);                 // the warm-up's gradient averaging
//   dist::LocalSGD local(registry, comm, {.period = 8, .warmup_steps = 100});
//   for each step:
//     std::optional<dist::DataParallel::NoSync> local_only;
//     if (!local.in_warmup()) local_only.emplace(ddp);      // after the warm-up: no gradient sync
//     ... backward through ddp ...
//     optimizer.step();
//     local.step();      // averages the models when due: (step - warmup) % period == 0
//
// Across a slow link the models then meet once every `period` steps instead of the gradients
// every step. The communicator can be the world, a process set, or the groups across nodes of a
// split (inner DataParallel synchronous inside a node, LocalSGD across nodes).
#pragma once

#include <cstdint>

#include "gradsync/comm/communicator.h"
#include "gradsync/registry/parameter_registry.h"

namespace gradsync::dist {

// When LocalSGD averages (PeriodicModelAverager's arguments).
struct LocalSGDOptions {
  std::int64_t period = 8;        // steps between averagings, > 0
  std::int64_t warmup_steps = 0;  // steps before the first averaging (the engine syncs gradients then)
};

// Periodic model averaging (above).
class LocalSGD {
 public:
  // Collective: every rank the same options and trainable parameters (an error on every rank
  // naming the first difference otherwise).
  LocalSGD(ParameterRegistry& registry, comm::Communicator& comm, LocalSGDOptions options = {});

  // After each optimizer step. Step s (counted from 0, this call's) averages every trainable
  // parameter over the communicator when s >= warmup_steps and (s - warmup_steps) % period == 0,
  // as PeriodicModelAverager does (each value divided by the ranks' count, then summed; where
  // PyTorch skips a parameter whose gradient is None, this averages every trainable one, so ranks
  // that used different parameters still average the same set). Returns whether it averaged.
  // Collective when due.
  bool step();
  bool in_warmup() const { return steps_ < options_.warmup_steps; }  // the next step comes before the first averaging
  std::int64_t steps() const { return steps_; }  // step() calls so far
  void set_steps(std::int64_t steps);  // the count a checkpoint carried (resuming)
  const LocalSGDOptions& options() const { return options_; }  // as given

 private:
  ParameterRegistry& registry_;
  comm::Communicator& comm_;
  LocalSGDOptions options_;
  std::int64_t steps_ = 0;
};

}  // namespace gradsync::dist
