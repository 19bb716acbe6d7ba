// gradsync/dist/join.h - uneven inputs: ranks with different amounts of data, PyTorch's Join
// for DataParallel (Horovod's hvd.join() is DistributedOptimizer::join()).
//
//   dist::Join join(ddp, {.divide_by_initial_world_size = false}, &optimizer);
//   for (const Batch& batch : my_batches) {   // as many as this rank has: any number
//     ... forward, backward (ddp synchronizes), optimizer.step(), zero_grad() ...
//   }
//   join.join();   // out of data: shadow the others until every rank is out
//
// How it works (docs/join.md). Every synchronized step of a DataParallel already ends with
// one small status allreduce; each rank's word in it says whether the rank has joined. A rank
// that calls join() loops over "shadow steps": it takes part in exactly the collectives of a
// synchronized step (every bucket, in bucket order, with zeros; the status) without computing
// anything, until a status says that every rank has joined. Nothing blocks, whichever rank
// runs out first, under every sync strategy (no_sync steps issue no collective, so a joined
// rank has nothing to shadow there), with find_unused_parameters (a joined rank uses nothing),
// compression and communication hooks (a hook reduces a zero bucket).
//  * divide_by_initial_world_size (PyTorch's default, true): the average divides by the world
//    size, so a joined rank counts as a rank whose gradient is zero; false: by the number of
//    ranks still active in that step (with a hook the hook decides, as in PyTorch).
//  * throw_on_early_termination: when the first rank runs out, every rank raises
//    JoinEarlyTermination at the same step ("Rank r exhausted all inputs." on the ones that
//    ran out, "Detected at least one rank that exhausted inputs..." on the others).
//  * At the end the last rank to join (the highest, when several joined in the final step)
//    broadcasts the parameters and buffers, and the optimizer state when an optimizer is given
//    (PyTorch leaves a joined rank's optimizer state behind, so replicas that go on training
//    after a join drift apart; giving the optimizer keeps them equal). join() returns that rank.
//  * A joined rank's gradients are scratch for the shadow steps; afterwards they are undefined,
//    as after zero_grad().
// Every rank must enter a Join over the same DataParallel: a rank that sees another rank join
// without being inside one raises an error naming that rank. join() inside a backward, inside a
// ddp_sync_context window or with a round half launched is an error. enable = false makes the
// Join do nothing (PyTorch's enable).
#pragma once

#include "gradsync/core/error.h"

namespace gradsync::optim {
class Optimizer;
}

namespace gradsync::dist {

class DataParallel;

struct JoinOptions {
  bool enable = true;
  bool divide_by_initial_world_size = true;
  bool throw_on_early_termination = false;
};

// What throw_on_early_termination raises, on every rank at the same step.
class JoinEarlyTermination : public Error {
 public:
  using Error::Error;
};

class Join {
 public:
  // Enters: until join() returns (or the Join is destroyed), this rank's synchronized steps
  // rescale and react to joined ranks as the options say. Not collective.
  explicit Join(DataParallel& ddp, JoinOptions options = {}, optim::Optimizer* optimizer = nullptr);
  // Joins unless join() ran or an exception is unwinding (then it only leaves, communicating
  // nothing), as PyTorch's context manager does on exit.
  ~Join() noexcept(false);
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  // This rank has no more inputs: shadow the others' synchronized steps until every rank has
  // joined, then make every replica equal. Returns the last rank to join (the same on every
  // rank). Collective.
  int join();
  const JoinOptions& options() const { return options_; }

 private:
  DataParallel& ddp_;
  JoinOptions options_;
  optim::Optimizer* optimizer_;
  bool joined_ = false;
  int uncaught_ = 0;
};

}  // namespace gradsync::dist
