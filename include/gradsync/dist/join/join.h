// gradsync/dist/join/join.h - uneven inputs: ranks with different amounts of data, PyTorch's Join
// (Horovod's hvd.join() is DistributedOptimizer::join(), on the same machinery).
//
//   dist::Join join(ddp, {.divide_by_initial_world_size = false}, &optimizer);
//   for (const Batch& batch : my_batches) {   // as many as this rank has: any number
//     ... forward, backward (ddp synchronizes), optimizer.step(), zero_grad() ...
//   }
//   join.join();   // out of data: shadow the others until every rank is out
//
// How it works (docs/join.md). Every synchronized step already ends with one small status
// allreduce; each rank's word in it says whether the rank has joined. A rank that calls join()
// runs the join loop:
//   1. one shadow step per synchronized step of the active ranks: each participant (a
//      Joinable, below) issues exactly the collectives of its part of that step, contributing
//      nothing (DataParallel: every bucket in bucket order, with zeros, then the status; a
//      ZeroOptimizer after it: its part in the optimizer step that follows), and the
//      participant that synchronizes reads the status: how many ranks have joined;
//   2. when every rank has joined, the loop ends: the last rank to join (the highest, when
//      several joined in the final step) has taken every step, and each participant makes its
//      state that rank's (DataParallel broadcasts the parameters and buffers; with `optimizer`
//      its state is broadcast too).
//
// Nothing blocks, whichever rank runs out first, under every sync strategy (no_sync steps issue
// no collective, so a joined rank has nothing to shadow there), with find_unused_parameters (a
// joined rank uses nothing), compression and communication hooks (a hook reduces a zero bucket).
//  * divide_by_initial_world_size (PyTorch's default, true): the average divides by the world
//    size, so a joined rank counts as a rank whose gradient is zero; false: by the number of
//    ranks still active in that step (with a hook the hook decides, as in PyTorch).
//  * throw_on_early_termination: when the first rank runs out, every rank raises
//    JoinEarlyTermination at the same step ("Rank r exhausted all inputs." on the ones that
//    ran out, "Detected at least one rank that exhausted inputs..." on the others).
//  * A joined rank's gradients are scratch for the shadow steps; afterwards they are undefined,
//    as after zero_grad().
// Every rank must enter a Join over the same participants: a rank that sees another rank join
// without being inside one raises an error naming that rank. join() inside a backward, inside a
// ddp_sync_context window or with a round half launched is an error. enable = false makes the
// Join do nothing (PyTorch's enable). A ZeroOptimizer over a DataParallel joins with it:
// Join({&ddp, &zero}, ...); a Join over the DataParallel alone is then an error at the next
// optimizer step, not a hang. Under HSDP (DataParallelOptions::replicas) a rank joins the whole
// job: its shadow steps are answered inside its shard group and across the groups, and a group
// whose ranks have all joined keeps stepping its pieces with the groups still active.
#pragma once

#include <vector>

#include "gradsync/comm/communicator.h"
#include "gradsync/core/error.h"

namespace gradsync::optim {
class Optimizer;
}

namespace gradsync::dist {

class DataParallel;

// PyTorch's Join arguments (above).
struct JoinOptions {
  bool enable = true;                       // false: the Join does nothing
  bool divide_by_initial_world_size = true;  // average over the world (true) or the active ranks
  bool throw_on_early_termination = false;   // every rank raises when the first runs out
};

// What throw_on_early_termination raises, on every rank at the same step.
class JoinEarlyTermination : public Error {
 public:
  using Error::Error;
};

// One shadow step, as the participants of a join loop hand it to each other.
struct JoinStep {
  bool first = false;  // this rank's first shadow step: it joined just now
  // Filled in by the participant whose step carries the status word (DataParallel, the
  // DistributedOptimizer), for the participants after it:
  bool synchronized = false;
  int joined = 0;       // ranks out of inputs, this one included
  int world = 0;        // ranks in all
  int last_joiner = -1;  // the highest rank whose first shadow step this was
  bool optimizer_step_follows = false;  // the active ranks step their optimizer after this synchronization
};

// PyTorch's Joinable: an object whose collectives a rank out of inputs must shadow. DataParallel,
// ZeroOptimizer and DistributedOptimizer are Joinables; Join and DistributedOptimizer::join call
// these, the engine never does.
class Joinable {
 public:
  virtual ~Joinable() = default;
  // A Join over this participant opens on this rank (with its options), or closes (nullptr).
  virtual void join_opened(const JoinOptions* options) = 0;
  // Before the first shadow step, on the joining rank: refuse what cannot be shadowed.
  virtual void require_joinable() const {}
  // The joining rank is about to shadow (after every participant's require_joinable).
  virtual void begin_shadowing() {}
  // This participant's part in one step of the active ranks (see JoinStep).
  virtual void shadow_step(JoinStep& step) = 0;
  // Every rank has joined; `last_joiner` took every step: make this rank's state its.
  virtual void finish_join(int last_joiner) = 0;
  // The communicator of this participant's collectives (PyTorch's join_process_group).
  virtual comm::Communicator& join_communicator() const = 0;
  // The ranks that join together and this rank's number among them (the last joiner's
  // numbering): the communicator's, or under HSDP every shard group's ranks, group g's rank r
  // numbered g * (group size) + r.
  virtual int join_rank() const { return join_communicator().rank(); }
  virtual int join_world_size() const { return join_communicator().size(); }  // (above)
};

// PyTorch's Join context manager over Joinables: a rank out of inputs shadows the others.
class Join {
 public:
  // Enters: until join() returns (or the Join is destroyed), this rank's synchronized steps
  // rescale and react to joined ranks as the options say. `participants` in the order their
  // collectives run in a step (a DataParallel first, then a ZeroOptimizer over it). Not
  // collective.
  explicit Join(std::vector<Joinable*> participants, JoinOptions options = {}, optim::Optimizer* optimizer = nullptr);
  explicit Join(DataParallel& ddp, JoinOptions options = {}, optim::Optimizer* optimizer = nullptr);
  // Joins unless join() ran or an exception is unwinding (then it only leaves, communicating
  // nothing), as PyTorch's context manager does on exit.
  ~Join() noexcept(false);
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  // This rank has no more inputs: shadow the others' synchronized steps until every rank has
  // joined, then make every replica equal. Returns the last rank to join (the same on every
  // rank; under HSDP numbered as join_rank says). Collective.
  int join();
  const JoinOptions& options() const { return options_; }  // as given

 private:
  void leave();

  std::vector<Joinable*> participants_;
  JoinOptions options_;
  optim::Optimizer* optimizer_;
  bool joined_ = false;
  bool inside_ = false;
  int uncaught_ = 0;
};

}  // namespace gradsync::dist
