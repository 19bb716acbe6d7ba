// Internal: ZeRO's third room, ZeRO under dist::Join (gradsync/dist/zero/zero.h, docs/zero.md).
//
// Contract. A joined rank must take part in every step of the active ranks: its pieces are its
// to update, and the gathers need them. So each collective phase of an active rank's step starts
// with a control word, one small allreduce (max) of [kind, unscale, clip, each group's learning
// rate], that a joined rank answers with zeros and reads: kind 1, the gradient statistics
// follow; 2, the step (and, below stage 3, the gathers); 3 (stage 3), the gather of the unit
// that rides in the unscale slot. A joined rank steps its pieces with the active ranks'
// factors and learning rates (a schedule its own loop no longer sets). ZeroJoin is the
// StepPhases the other rooms announce to; it sends a word only inside a Join and not while
// shadowing.
//  * Stages 1 and 2: the join loop calls shadow_step after every synchronized step that an
//    optimizer step follows; it answers the statistics words and the step, then the gathers.
//  * Stage 3: the active ranks' gathers come anywhere in their forward and backward, so a
//    joined rank answers them on a thread of its own (the shadow thread) from the moment it
//    joins, while its own thread shadows the DataParallel's synchronized steps. Statistics and
//    steps come through the shadow thread too, but only once the rank's own thread has finished
//    shadowing the synchronization they follow (which writes the reduced pieces they read); the
//    rank's own thread then waits until that step is done. When every rank has joined, every
//    rank's shadow thread is in the same control allreduce, all with zeros: kind 0 ends them.
//  * HSDP (DataParallelOptions::replicas): the gathers stay inside the shard group, but a group
//    whose ranks have all joined still steps its pieces (the other groups' gradients reach it
//    through the cross-group allreduce) and no rank of it sends a word. So every word but a
//    gather is followed by a second allreduce (max) of it across the groups, on a duplicate of
//    the replicas communicator: all zeros inside a group, it carries an active group's
//    statistics or step, and all zeros across the groups too ends the shadow threads.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "gradsync/dist/data_parallel/data_parallel.h"
#include "units.h"

namespace gradsync::dist {

class ZeroJoin final : public StepPhases {
 public:
  // `ddp`: the DataParallel front end (null over a DistributedOptimizer's Reducer, which does
  // not join).
  ZeroJoin(optim::Optimizer& optimizer, comm::Communicator& comm, DataParallel* ddp, int stage);
  ~ZeroJoin();
  ZeroJoin(const ZeroJoin&) = delete;
  ZeroJoin& operator=(const ZeroJoin&) = delete;

  // StepPhases: a control word before each phase, when this rank is an active one in a Join.
  void before_statistics() override;
  void before_step() override;
  void before_gather(std::size_t unit) override;

  // Joinable's calls, forwarded by the ZeroOptimizer.
  void opened(const JoinOptions* options);
  void begin_shadowing(ZeroUnits* units);
  void shadow_step(const JoinStep& step, ZeroShards& shards);
  void finish();
  // Ends the shadow thread: `stop` when leaving before every rank joined (it would otherwise
  // wait for the others' next control word until the timeout).
  void end_shadow_thread(bool stop);

 private:
  static constexpr double kStatistics = 1, kStep = 2, kGather = 3;
  struct Control {
    double kind, unscale, clip;
    std::vector<double> lrs;
  };

  bool announces() const;
  void require_no_scaler() const;
  Control control(double kind, double unscale, double clip);
  Control shadow_control();
  bool crosses_groups(const Tensor& words) const;
  void wait_polled(comm::WorkHandle& work);
  Tensor control_words(double kind, double unscale, double clip) const;
  static Control parse_control(const Tensor& words);
  void follow(const Control& word);
  void serve_shadow(ZeroUnits& units);
  void wait_for_shadow_step();

  optim::Optimizer& optimizer_;
  comm::Communicator& comm_;
  std::unique_ptr<comm::Communicator> replicas_;  // HSDP: the words' second allreduce, across the groups
  DataParallel* ddp_;
  int stage_;
  bool inside_join_ = false;  // a dist::Join over this ZeroOptimizer is open on this rank
  bool shadowing_ = false;    // this rank is a joined one: it answers words, it sends none

  // Stage 3's shadow thread and its handshake with the rank's own thread.
  std::thread shadow_thread_;
  std::mutex shadow_mutex_;
  std::condition_variable shadow_changed_;
  std::int64_t shadow_steps_done_ = 0;  // steps the shadow thread has done
  std::int64_t shadow_syncs_ = 0;       // synchronizations (each followed by a step) the rank's thread has shadowed
  bool shadow_over_ = false;
  std::atomic<bool> shadow_stop_{false};  // leaving the Join before every rank joined (an error): stop waiting
  std::exception_ptr shadow_error_;
  Tensor shadow_words_;  // the control word the shadow thread waits on (outlives a stopped wait)
};

}  // namespace gradsync::dist
