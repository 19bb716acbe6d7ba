// gradsync/dist/outer/local_sgd.h - LocalSGD: every rank steps its own replica, and every `period`
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
#include "gradsync/dist/join/join.h"
#include "gradsync/registry/parameter_registry.h"

namespace gradsync::dist {

// When LocalSGD averages (PeriodicModelAverager's arguments).
struct LocalSGDOptions {
  std::int64_t period = 8;        // steps between averagings, > 0
  std::int64_t warmup_steps = 0;  // steps before the first averaging (the engine syncs gradients then)
};

// Periodic model averaging (above). A Joinable: under dist::Join({&local}, options) (after the
// warm-up), a rank out of data keeps taking part in the averages with its replica as it is
// (dividing by the world; dividing by the active ranks it adds nothing), each average preceded by
// a census of who has joined; when every rank is out, a last average() on all of them.
class LocalSGD : public Joinable {
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
  // Averages the models now (collective): the end of training, before an evaluation or a save.
  void average();
  bool in_warmup() const { return steps_ < options_.warmup_steps; }  // the next step comes before the first averaging
  std::int64_t steps() const { return steps_; }  // step() calls so far
  void set_steps(std::int64_t steps);  // the count a checkpoint carried (resuming)
  const LocalSGDOptions& options() const { return options_; }  // as given

 private:
  // Joinable (gradsync/dist/join/join.h): a joined rank's shadow step runs the steps up to the next average and
  // takes part in it; at the end, average().
  void join_opened(const JoinOptions* options) override;
  void require_joinable() const override;
  void begin_shadowing() override;
  void shadow_step(JoinStep& step) override;
  void finish_join(int last_joiner) override;
  comm::Communicator& join_communicator() const override { return comm_; }
  // The next step: the average when due (`step`: a joined rank's census; null: an active rank).
  bool advance(JoinStep* step);
  void average_scaled(double factor);

  ParameterRegistry& registry_;
  comm::Communicator& comm_;
  LocalSGDOptions options_;
  std::int64_t steps_ = 0;
  const JoinOptions* join_options_ = nullptr;  // the dist::Join this rank is inside, or null
  bool shadowing_ = false;                     // this rank has joined
  bool first_shadow_ = false;                  // ... and has not been counted in a census since
};

}  // namespace gradsync::dist
