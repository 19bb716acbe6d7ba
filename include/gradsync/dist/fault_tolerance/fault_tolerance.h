// gradsync/dist/fault_tolerance/fault_tolerance.h - training that goes on when a replica group dies: a quorum
// every step, discarded steps, and live recovery from a healthy peer (torchft's Manager, in C++).
//
// The job is R replica groups, each training as ever over its own communicator (DataParallel,
// ZeRO 1 or 2). Across the groups, every step runs in a quorum the coordinator decides
// (comm/coordinator.h), and the step counts only when the coordinator says it commits:
//
//   dist::FaultTolerance ft(registry, &optimizer, group_comm, {.coordinator = {...}, .samples_per_group = B});
//   while (ft.step() < steps) {
//     ft.start_step();                          // the quorum; a newcomer recovers here
//     train on samples [ft.first_sample(), +B)  // this group's share of the step's global batch
//     (the group's own synchronization: DataParallel's backward)
//     ft.average_gradients();                   // across the quorum's groups
//     if (ft.should_commit()) optimizer.step(); // the coordinator's decision, the same for all
//     registry.zero_grad();
//   }
//
// Clipping and loss scaling go after the commit, between should_commit() and the step: they
// then see the cross-group average, which is the same bits in every group, so the norm and the
// skip decision are the same everywhere, and a step the coordinator discards changed neither
// the gradients' clip nor the scaler's state:
//     if (ft.should_commit()) { scaler.unscale(opt); clip_grad_norm(opt, 1.0); scaler.step(opt); scaler.update(); }
//
// What it guarantees (docs/fault_tolerance.md has the protocol):
//  * a step whose cross-group reduction failed on any group is discarded by every group of the
//    quorum (no group steps on a partial average), and the survivors go on in a new quorum with
//    new communicators (Gloo, through the coordinator's store);
//  * the average divides by the groups in the step's quorum; the data follows the global sample
//    index: a step's global batch is the next `members x samples_per_group` samples, dealt to the
//    members in their order, and only a committed step moves the position, so every sample of
//    the stream is trained on exactly once by a committed step whatever dies;
//  * a group behind the quorum (a replacement started by its launcher, or one that missed a
//    commit) receives the values, the optimizer state, the step and the data position from a
//    member that is up to date, rank by rank (place p from place p; under ZeRO only place p's
//    pieces), checksummed (XXH64) and verified before it is adopted; a transfer that fails
//    leaves the sender as it was and the receiver behind, to try again at the next quorum.
// What it does not: make a run with failures bit for bit equal to one without (the steps after a
// failure average fewer groups, over smaller global batches); survive a failure inside a group
// (that group's ranks end, and its launcher restarts them as a newcomer); carry state it does not
// know (an LR schedule's: derive it from step(); a loss scaler's travels when it is given).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/comm/communicator.h"
#include "gradsync/comm/quorum/coordinator.h"
#include "gradsync/optim/grad_scaler.h"
#include "gradsync/optim/optimizer.h"
#include "gradsync/registry/parameter_registry.h"

namespace gradsync::dist {

class ZeroOptimizer;

// Where the coordinator is, and what a step consumes.
struct FaultToleranceOptions {
  comm::QuorumClientOptions coordinator;  // where the coordinator is, and this group's number
  std::int64_t samples_per_group = 1;     // samples one group trains on per step (all its ranks)
  // The backend across the groups: "gloo" (a new context per quorum), or "nccl": device
  // gradients averaged over an NCCL communicator made for each quorum (its unique id carried by
  // the quorum's Gloo context; aborted when the quorum changes without settling), host ones over
  // Gloo. "mpi" is refused: MPI cannot go on without a dead rank. Inside a group any backend.
  std::string cross_backend = "gloo";
  int cross_device = -1;  // "nccl": the GPU of its communicator (-1: the local rank's)
  // The ZeroOptimizer (stage 1, 2 or 3) that shards `optimizer` inside the group, if any: a
  // recovery then goes by pieces. The rank at place p of the source sends only its own pieces
  // (the optimizer state of its ranges, with the master weights, and its pieces of the values:
  // about 1/S of the group's state), never the consolidated state; the newcomer's rank at place
  // p checks them against its layout, adopts them, and the group gathers its values (below stage
  // 3). Each rank's pieces are checked by XXH64, and the whole model by a checksum that does not
  // depend on the cut (ZeroOptimizer::model_checksum), before the group counts as recovered.
  ZeroOptimizer* zero = nullptr;
  // The loss scaler of an fp16 run, if any: a recovery carries its scale and growth tracker (a
  // newcomer with its initial scale would skip steps the others take). Its skip decision is the
  // same in every group when it runs after the commit, on the cross-group average (the order of
  // a step above and in docs/fault_tolerance.md).
  optim::GradScaler* grad_scaler = nullptr;
  // Called on a recovery source (at its committed `step`) at each moment of a transfer to group
  // `newcomer`: "named" (the
  // coordinator named it; nothing sent yet), "started" (the header sent), "halfway" (the values
  // sent, the optimizer state not), "sent" (all of it sent: the newcomer is verifying). For
  // tracing, and for fault injection (the trainers' --ft-die kills the source at one of them).
  std::function<void(const std::string& moment, int newcomer, std::int64_t step)> on_recovery_moment;
};

// Something that happened across the groups, for the metrics and the logs.
struct FaultToleranceEvent {
  std::string kind;        // "quorum" (a new one), "discarded", "recovered", "sent", "failed"
  std::int64_t step = 0;   // committed steps at the time
  std::int64_t quorum = -1;  // the quorum it happened in
  double seconds = 0;      // since the FaultTolerance was made
  double took = 0;         // what it cost: a transfer's or a new quorum's seconds
  std::string detail;      // the members, the peer, the error
};

// One replica group's side of the protocol (above): the quorum, the cross-group average, the
// commit, the recovery.
class FaultTolerance {
 public:
  // Collective over `group`, this replica group's ranks (its rank 0 talks to the coordinator).
  // `optimizer` may be null (values only).
  FaultTolerance(ParameterRegistry& registry, optim::Optimizer* optimizer, comm::Communicator& group,
                 FaultToleranceOptions options);
  // A leader leaving tells the coordinator at once (finished, or failing inside its group).
  ~FaultTolerance();
  FaultTolerance(const FaultTolerance&) = delete;
  FaultTolerance& operator=(const FaultTolerance&) = delete;

  // Before a step: the quorum it runs in (joining one first when there is none), the
  // communicators of a new quorum, and a recovery from (or for) a peer. Collective over the group.
  const comm::Quorum& start_step();
  // After the group's own reduction: every gradient averaged over the quorum's groups (under
  // ZeRO 1 or 2, the pieces this rank steps: those of the same place in every group). False
  // when it failed on any rank of this group (the step will be discarded); errors inside the
  // group are thrown. Collective over the group.
  bool average_gradients();
  // The coordinator's decision on this step, the same in every group: true, step the optimizer;
  // false, discard the gradients. Collective over the group.
  bool should_commit();

  // Before the first start_step: the state the engine loaded from a checkpoint holds `step`
  // committed steps and consumed `position` samples. The group joins with that step; when live
  // groups hold more it recovers from them, and when none does the coordinator forms a quorum
  // below its high-water mark only with accept_lost_steps, after its join timeout.
  void resume(std::int64_t step, std::int64_t position);
  // Whether this group writes what every member holds alike (a checkpoint) for the step that just
  // committed: the first member of the quorum that committed it, so that exactly one group
  // writes. False before the first commit and after a discard.
  bool checkpoint_writer() const { return checkpoint_writer_; }
  // A stop every group takes at the same step (a time budget spent on one group's clock): this
  // group asks with its next votes; the first step that commits with the request ends the job
  // for every member, stopping() then true on all of them. Any rank may call it (the leader votes).
  void request_stop() { stop_requested_ = true; }
  bool stopping() const { return stopping_; }  // (above)

  std::int64_t step() const { return step_; }              // committed steps
  std::int64_t position() const { return position_; }      // samples consumed by committed steps
  // This step's share of the global batch: samples [first_sample(), first_sample() +
  // samples_per_group) of the stream (valid after start_step()).
  std::int64_t first_sample() const;
  const comm::Quorum& quorum() const { return quorum_; }   // the current quorum
  int group() const { return options_.coordinator.group; } // this replica group
  double seconds() const;  // since this object was made (the clock of the events' `seconds`)
  // What happened so far, in order; take_events() hands them over and forgets them.
  std::vector<FaultToleranceEvent> take_events();

 private:
  void join();
  void connect_quorum();
  void recover();
  struct Snapshot {  // what a source sends
    std::vector<io::NamedTensor> tensors;
    io::Metadata metadata;
    std::uint64_t digest = 0;  // XXH64 of what this rank sends
    std::uint64_t model = 0;   // under ZeRO: the whole model's checksum, whatever the cut
    std::int64_t bytes = 0;    // what this rank sends
  };
  struct Received {  // what a newcomer received, before it adopts it
    std::int64_t step = 0, position = 0;
    std::vector<io::NamedTensor> tensors;
    io::Metadata metadata;
    std::uint64_t digest = 0;
    std::uint64_t model = 0;
  };
  Snapshot snapshot();
  void send_state(comm::Communicator& pair, Snapshot& snapshot, int newcomer);
  void recovery_moment(const char* moment, int newcomer);
  Received receive_state(comm::Communicator& pair, int source);
  void broadcast_quorum();
  void wait_across(comm::Work& work);
  bool group_agrees(bool ok);
  void event(const std::string& kind, double took, const std::string& detail);

  ParameterRegistry& registry_;
  optim::Optimizer* optimizer_;
  comm::Communicator& group_;
  FaultToleranceOptions options_;
  std::unique_ptr<comm::QuorumClient> client_;
  comm::Quorum quorum_;
  bool in_quorum_ = false;     // quorum_ is the next step's (from the last decision)
  std::int64_t connected_ = -1;  // the quorum id cross_ belongs to
  std::unique_ptr<comm::Communicator> cross_;
  std::unique_ptr<comm::Communicator> cross_device_;  // "nccl": over cross_'s ranks, for device arenas
  bool step_ok_ = true;        // nothing failed across the groups in this step so far
  std::int64_t step_ = 0;
  std::int64_t position_ = 0;
  int failed_recoveries_ = 0;  // in a row
  bool checkpoint_writer_ = false;
  bool stop_requested_ = false;
  bool stopping_ = false;
  std::chrono::steady_clock::time_point made_;
  std::vector<FaultToleranceEvent> events_;
};

}  // namespace gradsync::dist
