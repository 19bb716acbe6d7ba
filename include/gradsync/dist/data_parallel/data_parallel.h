// gradsync/dist/data_parallel/data_parallel.h - PyTorch DDP's gradient synchronization for any engine.
// Composer's sync strategies over it are in sync_strategy.h, uneven inputs in gradsync/dist/join/join.h, ZeRO in
// gradsync/dist/zero/zero.h.
//
// The low-level API, for a custom engine (no Module class needed):
//
//   dist::DataParallel ddp(registry, comm, {.find_unused_parameters = true});
//   for each microbatch:
//     ddp.begin_backward();                 // optional: the first ready signal begins it too
//     ... engine writes gradients, registry.mark_ready(p) for each, any order ...
//     ddp.end_backward();                   // synced backward: waits, writes reduced gradients
//   optimizer.step(); optimizer.zero_grad();
//
// Construction checks that every rank holds the same parameters (names, shapes, dtypes, in
// order) and broadcasts every parameter and buffer (frozen parameter) from rank 0.
//
// Semantics (docs/semantics/ddp.md), with its section 6's improvements:
//  * buckets: bucket_cap_mb (25) with a 1 MiB first bucket, formed in reverse registration
//    order (the order a backward produces gradients in), one dtype and device each, views of
//    the gradient arena; launched in order while the backward goes on;
//  * the gradient is divided by the world size before the sum, as PyTorch's reducer does; with
//    no_sync, gradients accumulate locally (undivided) and the next synced backward reduces the
//    accumulated sum, divided once;
//  * usage is tracked over the whole accumulation window (no_sync microbatches included);
//  * end of a synced backward: whatever was not signalled is launched in order (zero-filled
//    where undefined), then one small allreduce at a fixed position carries the usage bitmap
//    and each rank's "I missed gradients" flag. With find_unused_parameters, globally unused
//    parameters keep an undefined gradient and locally unused but globally used ones get the
//    reduced value. Without it, a rank that missed gradients raises an error naming them, and
//    every other rank raises one naming that rank, at the end of that same backward: no hang,
//    no wait for a timeout;
//  * a parameter marked ready twice in one backward is an error naming it;
//  * compression: fp16 / bf16 (divide by the world size first, then cast: values near the f16
//    maximum do not overflow), or one user hook (no pre-division, as PyTorch's hooks).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gradsync/comm/communicator.h"
#include "gradsync/dist/join/join.h"
#include "gradsync/dist/reducer/reducer.h"
#include "gradsync/registry/parameter_registry.h"

namespace gradsync::dist {

// PyTorch DDP's arguments, and ZeRO's.
struct DataParallelOptions {
  std::optional<double> bucket_cap_mb{};  // unset: 25 MiB with a 1 MiB first bucket; set: that cap for all
  // Parameters a rank never marks ready in a backward are unused, not missing: their gradients
  // stay undefined where no rank used them (above).
  bool find_unused_parameters = false;
  bool broadcast_parameters = true;  // from rank 0 at construction (buffers included)
  Compression compression = Compression::none;  // fp16 / bf16 on the wire (above)
  // ZeRO stage 2 (dist/zero.h): each bucket is reduce-scattered, so a rank's reduced gradients
  // are only its piece of each bucket (the elements its sharded optimizer steps); the same
  // bytes on the wire as an allreduce, half the work at each end. Hooks do not combine with it.
  // The rest of each bucket's gradient memory is given back once the bucket is reduced.
  bool shard_gradients = false;
  // Buckets launched and not yet reduced, at most (ReducerOptions::max_buckets_in_flight);
  // unset: 2 with shard_gradients (ZeRO-2's working set: the full-size gradients of two buckets
  // in flight and of the one being written, beside the rank's pieces), no bound without.
  std::optional<std::size_t> max_buckets_in_flight{};
  // ZeRO stage 3 (dist/zero.h): the engine's units, the parameters it uses together (a
  // transformer block, say), each a run of neighbours in registration order; every trainable
  // parameter in exactly one. Each unit becomes exactly one bucket, so that the pieces of a
  // unit's values and of its gradients are the same elements. Needs shard_gradients.
  std::vector<std::vector<Parameter*>> units{};
  // HSDP (dist/shard_groups.h): this DataParallel's communicator is a shard group, and
  // `replicas` the ranks of the other groups that own the same pieces. Each bucket is
  // reduce-scattered inside the group, then this rank's reduced piece allreduced over `replicas`
  // (ReducerOptions::replicas); gradients divide by the whole job's size; the step status (used
  // parameters, sync decisions) is the job's; construction checks the parameters and broadcasts
  // rank 0's values over both. Needs shard_gradients. Under dist::Join a rank joins the whole job.
  comm::Communicator* replicas = nullptr;
};

class SyncState;  // Composer's sync strategies' state (sync_strategy.h)

// PyTorch DDP's gradient synchronization over a registry (above).
class DataParallel : public Joinable {
 public:
  // Collective: checks that every rank holds the same parameters, broadcasts rank 0's values
  // (unless options.broadcast_parameters is false) and forms the buckets.
  DataParallel(ParameterRegistry& registry, comm::Communicator& comm, DataParallelOptions options = {});
  ~DataParallel() override;
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  void begin_backward();     // a backward begins (optional: the first ready signal begins one)
  // The backward is over: a synced one launches what was not signalled, waits for every bucket
  // and writes the reduced gradients; a no_sync one only closes the window's bookkeeping.
  void end_backward();
  bool in_backward() const;  // between begin_backward (or a ready signal) and end_backward

  // RAII: backwards begun while a guard lives do not synchronize; nestable.
  class NoSync {
   public:
    explicit NoSync(DataParallel& ddp);  // backwards begun from now on accumulate locally
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DataParallel& ddp_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }  // PyTorch's ddp.no_sync()
  bool sync_enabled() const;  // no NoSync guard lives: the next backward synchronizes

  // Reduces every gradient now (zero-filled where undefined, in the buckets, then the usage
  // bitmap decides defined versus undefined): what FORCED_SYNC does after the last microbatch.
  void synchronize_all();

  // One communication hook, replacing the allreduce: it gets each bucket's flat buffer (not
  // pre-divided). A second registration is an error.
  void register_comm_hook(ReduceHook hook);

  // The usage bitmap of the last synced step, summed over ranks (docs/semantics/ddp.md checklist 15).
  const std::vector<int>& last_used_counts() const;
  bool inside_join() const;  // a dist::Join over this DataParallel is open on this rank
  const Reducer& reducer() const;  // its buckets and their rounds
  comm::Communicator& communicator() const;  // the communicator it was made with
  ParameterRegistry& registry() const;  // the parameters it synchronizes
  const DataParallelOptions& options() const;  // as given, with the defaults resolved
  // The state of Composer's sync strategies for this DataParallel (AUTO's trials, the average
  // carried between microbatches): ddp_sync_context's, not the engine's.
  SyncState& sync_state();

 private:
  // Joinable (gradsync/dist/join/join.h, whose hooks only Join calls): a joined rank's shadow step is every bucket
  // in bucket order, with zeros, and the status; at the end, the last joiner's parameters and
  // buffers everywhere. Under HSDP it joins the job (every shard group's ranks).
  void join_opened(const JoinOptions* options) override;
  void require_joinable() const override;
  void shadow_step(JoinStep& step) override;
  void finish_join(int last_joiner) override;
  comm::Communicator& join_communicator() const override;
  int join_rank() const override;
  int join_world_size() const override;

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradsync::dist
