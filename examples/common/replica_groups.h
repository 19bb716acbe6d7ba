// --replica-groups R: the trainers' fault-tolerant run (dist/fault_tolerance.h). The job is R
// replica groups, each started by its own launcher (a torchrun agent per group, or by hand),
// meeting through a coordinator (build/examples/coordinator). Inside a group the trainer runs as
// ever (DataParallel, ZeRO 1 or 2); across the groups each step runs in the coordinator's quorum and
// counts only when it commits; fp16's unscale and skip and --clip-norm run after the commit, on
// the cross-group average. A group that loses a rank ends; its launcher starts it again and
// it recovers the state from a live group, so the job never stops.
//
// The data follows the global sample index: the stream is the epochs' seeded permutations one
// after the other; a step's global batch is the next members x group-batch samples, group i of
// the quorum training the i-th slice, rank r of the group the r-th part of that; only a commit
// moves the position. So no sample is skipped or trained twice by committed steps, whatever
// dies (--record-samples writes each committed step's range, for the test that checks it).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flags.h"
#include "trainer_support.h"
#include "gradsync/dist/fault_tolerance/fault_tolerance.h"

namespace gradsync::examples {

struct ReplicaGroupOptions {
  int groups = 0;            // --replica-groups R (0: off)
  int group = -1;            // --replica-group G: this process's group
  std::string host;          // --coordinator HOST:PORT
  int port = 0;
  std::string record;        // --record-samples FILE: one line per committed step (rank 0 of each group)
  std::int64_t timeout_ms = 10000;    // --cross-timeout-ms: every operation across the groups
  // --ft-die PHASE:GROUP.RANK@STEP (fault injection, first attempt only): that rank stops at
  // PHASE once STEP steps have committed and is killed 0.3 s later, while the others are inside
  // the phase: reduce (the cross-group reduction), quorum (the vote), gather (ZeRO's parameter
  // gather inside its group), or a recovery source's moment (FaultToleranceOptions::
  // on_recovery_moment): named, started, halfway, sent (the newcomer verifying).
  std::string die_phase;
  int die_group = -1, die_rank = -1;
  std::int64_t die_step = 0;
  bool enabled() const { return groups > 0; }
};
ReplicaGroupOptions parse_replica_group_options(Flags& flags);
extern const char* const kReplicaGroupHelp;

// The parts every trainer's fault-tolerant loop shares (ReplicaGroupRun below is digits_ddp's
// whole loop; gpt_ddp calls these in its own):
// This group's side of the protocol; `samples_per_group`: what one group's step consumes (all
// its ranks); `zero`: the ZeroOptimizer (stage 1 or 2) sharding `optimizer`, if any; `scaler`:
// fp16's loss scaler, if any (a recovery carries its state).
std::unique_ptr<dist::FaultTolerance> make_fault_tolerance(const ReplicaGroupOptions& options, ParameterRegistry& registry,
                                                           optim::Optimizer* optimizer, comm::Communicator& group,
                                                           std::int64_t samples_per_group, dist::ZeroOptimizer* zero,
                                                           optim::GradScaler* scaler = nullptr);
// A group started from a checkpoint (`path`, loaded into `progress`): its step and data position
// handed to the FaultTolerance (a checkpoint a fault-tolerant run wrote records the position).
void resume_across_groups(dist::FaultTolerance& ft, const Progress& progress, const std::string& path);
// --ft-die: stops this rank at `phase` when it is the one named and `step` steps have committed.
void die_if_asked(const ReplicaGroupOptions& options, const std::string& phase, int rank, std::int64_t step);
// The cross-group end of a step, where the optimizer would step: the average across the quorum,
// then the coordinator's decision (with --ft-die's two phases there). True: step the optimizer.
bool commit_across_groups(dist::FaultTolerance& ft, const ReplicaGroupOptions& options, int rank);
// What happened across the groups since the last call: into the metrics (`event` records with a
// wall-clock unix_time) and printed (rank 0's, and any rank's failures).
void report_events(dist::FaultTolerance& ft, Metrics& metrics, int rank, bool quiet);

class ReplicaGroupRun {
 public:
  // Collective over the group's communicator (training.comm). `zero`: the ZeroOptimizer (stage
  // 1 or 2) sharding the optimizer inside the group, if any.
  ReplicaGroupRun(const ReplicaGroupOptions& options, Training& training, const TrainerOptions& trainer,
                  dist::ZeroOptimizer* zero = nullptr);
  // The cross-group end of a step, called where the optimizer would step: the gradients averaged
  // across the quorum, then the coordinator's decision. True: step the optimizer.
  bool commit();
  // --ft-die: stops this rank here when it is the one named, at that phase (above).
  void maybe_die(const std::string& phase) { die_if_asked(options_, phase, training_.comm->rank(), ft_->step()); }
  // The run: `step(rows, 0)` trains one step on the rows given (this rank's part of the group's
  // slice) and returns its loss; the run ends when the epochs' samples are consumed or
  // --max-steps steps have committed. Returns the process exit code.
  int run(const std::string& name,
          const std::function<double(const std::vector<std::int64_t>& rows, std::int64_t first_row)>& step);

 private:
  const std::vector<std::int64_t>& epoch_rows(std::int64_t epoch);

  ReplicaGroupOptions options_;
  Training& training_;
  const TrainerOptions& trainer_;
  std::unique_ptr<dist::FaultTolerance> ft_;
  bool committed_ = false;
  std::int64_t cached_epoch_ = -1;
  std::vector<std::int64_t> cached_rows_;
};

}  // namespace gradsync::examples
