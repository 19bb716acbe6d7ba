// gradsync/dist/zero/zero.h - sharded optimizer state (ZeRO stage 1), sharded gradients (stage 2)
// and sharded parameters (stage 3) on DataParallel's buckets: PyTorch's ZeroRedundancyOptimizer,
// DeepSpeed ZeRO-1/2/3, FSDP2's full sharding.
//
//   dist::DataParallel ddp(registry, comm, {.shard_gradients = stage == 2});
//   optim::Adam adam(registry, {...});
//   dist::ZeroOptimizer zero(adam, ddp, {.stage = stage});
//   for each step:
//     ... backward through ddp (any sync strategy; stage 2: SINGLE or FORCED) ...
//     zero.clip_grad_norm(1.0);   // optional: the norm of every rank's shard, one allreduce
//     zero.step();                // this rank's shard, then every parameter gathered
//     zero.zero_grad();
//
// Ownership (docs/zero.md): every bucket of the DataParallel's Reducer is a run of the
// gradient arena; rank r owns the r-th of W equal pieces of it (dist::shard_bucket). The
// wrapped optimizer keeps state (and f32 master weights) for its pieces only, so a rank holds
// 1/W of the optimizer state (the last rank also each bucket's remainder, under W elements), and steps only
// them with the same fused kernel. Then the pieces of the updated parameters are allgathered,
// bucket by bucket, on the ZeroOptimizer's own communicator.
//  * stage 1: gradients are allreduced as without ZeRO (every rank holds the full reduced
//    gradient; the weights equal unsharded DataParallel's bit for bit: the same reduction, and
//    the update is element-wise). Communication: one allreduce + one allgather.
//  * stage 2 (DataParallelOptions::shard_gradients): buckets are reduce-scattered, so only a
//    rank's pieces hold reduced gradients; reduce-scatter + allgather move the bytes of one
//    allreduce. MULTI_AUTO_SYNC does not combine (it would reduce reduced pieces again).
// Overlap: step_async() returns once the allgathers are launched; wait_for(p) before the next
// forward reads parameter p (or wait_all()). step(), zero_grad and clip wait for them first.
// Clipping and the GradScaler's finite check see the statistics of the owned pieces summed
// over ranks (one small allreduce), the same on every rank. Checkpoints: save_sharded /
// load_sharded (each rank its shard) and save_consolidated (one file an unsharded run loads).
// HSDP (DataParallelOptions::replicas, dist/shard_groups.h): everything above runs over the
// DataParallel's shard group; the groups hold the same pieces, so shard group 0 writes every
// checkpoint (the others learn how it went) and every group loads.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>

#include "gradsync/dist/data_parallel/data_parallel.h"
#include "gradsync/dist/join/join.h"
#include "gradsync/optim/optimizer.h"
#include "gradsync/registry/initializers.h"

namespace gradsync::dist {

// What a ZeroOptimizer shards.
struct ZeroOptions {
  int stage = 1;  // 1: optimizer state sharded; 2: gradients too (DataParallel's shard_gradients);
                  // 3: parameters too (DataParallel's shard_gradients and units)
  // Stage 3: after the first step, gather(u) also launches the gather of the unit that came
  // after u in the first step's order of gathers (FSDP2's replayed prefetch).
  bool auto_prefetch = true;
};

// An optimizer sharded over the ranks (above): each rank keeps and steps its pieces only.
class ZeroOptimizer : public Joinable {
 public:
  // Shards `optimizer` (which must not have stepped yet) over the DataParallel's buckets.
  // Collective: every rank the same stage, the same buckets.
  ZeroOptimizer(optim::Optimizer& optimizer, DataParallel& ddp, ZeroOptions options = {});
  // Over any Reducer's buckets (the DistributedOptimizer's, with DistributedOptimizerOptions::
  // zero_stage); `comm` is the one the Reducer was made from. Stage 2 needs a Reducer that
  // reduce-scatters (ReducerOptions::reduce_scatter). Collective.
  ZeroOptimizer(optim::Optimizer& optimizer, const Reducer& reducer, comm::Communicator& comm, ZeroOptions options = {});
  ~ZeroOptimizer() override;
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  // This rank's pieces stepped, then every parameter gathered; returns when all have arrived.
  void step();
  // The same, returning once the gathers are launched (each bucket's parameters travel while
  // the caller goes on); wait_for / wait_all before the parameters are read.
  void step_async();
  void wait_for(const Parameter& parameter);  // waits for the gather bringing this parameter's values
  void wait_all();                            // waits for every gather in flight

  // The wrapped zero_grad; at stages 2 and 3, zero_grad(false) gives the gradient pages back
  // instead of writing zeros (a rank keeps only its pieces' pages between steps).
  void zero_grad(bool set_to_undefined = true);
  // Clipping by the global norm (optim/clip.h's semantics): the owned pieces' statistics,
  // summed over ranks. Returns the total norm, the same on every rank.
  double clip_grad_norm(double max_norm, double norm_type = 2.0, bool error_if_nonfinite = false);

  optim::Optimizer& optimizer() const;  // the wrapped (sharded) optimizer
  int stage() const;                    // 1, 2 or 3
  // This rank's pieces: element ranges per arena, as handed to Optimizer::shard.
  const std::vector<std::vector<optim::Optimizer::ElementRange>>& shard_ranges() const;
  // Bytes of optimizer state this rank holds now.
  std::int64_t state_bytes() const;

  // --- Stage 3: parameters sharded. The units are DataParallelOptions::units (index u is the
  // u-th declared). Between uses a rank holds only its pieces of each unit's values; the rest
  // of the unit's memory is given back, and each member's value() is an error naming the unit.
  // The engine, having no autograd hooks, says when it needs a unit:
  //   zero.gather(u);   // the unit's values here (waits; free when already gathered)
  //   ... forward (and backward) of unit u ...
  //   zero.release(u);  // back to this rank's pieces (a gather in flight is waited for first)
  // A unit's gradients are written while it is gathered, and reduce-scattered into the owned
  // pieces as soon as they are all ready (stage 2's path). prefetch(u) launches a gather and
  // returns; with auto_prefetch, gather() replays the first step's order. step() releases every
  // unit, steps the owned pieces and gathers nothing. Collective: every rank gathers the same
  // units in the same order (a gather on some ranks only fails at the timeout, naming the unit).
  // The model's values are whole only while every unit is gathered: gather them all before
  // saving the model or before this ZeroOptimizer goes (released units stay released).
  std::size_t unit_count() const;                          // 0 below stage 3
  std::size_t unit_of(const Parameter& parameter) const;   // the unit holding a parameter
  void gather(std::size_t unit);    // the unit's values whole here (above); collective
  void prefetch(std::size_t unit);  // launches its gather and returns; collective
  void release(std::size_t unit);   // back to this rank's pieces
  bool gathered(std::size_t unit) const;  // its values are whole here now

  // --- The model, piece by piece (docs/zero.md, "Models that never exist whole"). Made over a
  // DataParallel with broadcast_parameters = false, a stage-3 model is never whole on any rank:
  // the value arena is paged memory (a page costs memory only once written), and these read and
  // write only this rank's pieces of the trainable parameters (frozen ones, never sharded, are
  // whole everywhere). Below stage 3 the values are whole on every rank and are filled whole.
  // Each is collective; initialize and load_model release every unit first at stage 3.
  //
  // Initializes by init::fill (gradsync/registry/initializers.h): the same model at every world
  // size and cut. `rule_of` gives each parameter's rule. The ranks' seeds and rules are compared
  // first (a function rule by its values at three indices); a difference is an error on every
  // rank naming the parameter.
  void initialize(const std::function<init::Rule(const Parameter&)>& rule_of, std::uint64_t seed);
  // Loads the model's values from one safetensors file or a set with an index
  // (io::SafetensorsSet), each rank reading only its pieces' bytes, converted to the parameters'
  // dtypes (a bf16 file into f32). Every parameter must be in it with its shape; the ranks must
  // see the same entries; a file saved by save_model has its per-tensor checksums verified. All
  // or nothing: any error (a missing or damaged file, a tensor named twice, a checksum) is an
  // error on every rank naming the file and the tensor, and no value changes.
  void load_model(const std::filesystem::path& model);
  // One consolidated safetensors file of the model's values, written without a gather: rank 0
  // writes the header, every rank writes its pieces at their offsets (frozen parameters: rank 0),
  // then rank 0 renames the file into place; a failure anywhere is an error on every rank and the
  // previous file stays. The bytes are save_safetensors' for the whole model with `metadata` and
  // "gradsync.checksums" (each tensor's io::piece_checksum), the same at every world size, and
  // PyTorch loads it. The ranks must see the same folder.
  void save_model(const std::filesystem::path& path, const io::Metadata& metadata = {});
  // The sum of every parameter's io::piece_checksum over its whole value (mod 2^64), the same
  // on every rank and at every world size for the same model.
  std::uint64_t model_checksum();

  // --- Checkpoints. The consolidated state is exactly an unsharded optimizer's checkpoint
  // (Optimizer::state_tensors / state_metadata): every rank's pieces gathered (collective; the
  // tensors are returned on every rank). save_consolidated writes it from rank 0 (atomically,
  // as every safetensors save) with whatever else the caller adds; an unsharded run loads it
  // with Optimizer::load_state, and a sharded one of any world size with load_state below.
  struct State {
    std::vector<io::NamedTensor> tensors;  // as Optimizer::state_tensors names them
    io::Metadata metadata;                 // as Optimizer::state_metadata gives it
  };
  State consolidated_state();  // (above)
  void save_consolidated(const std::filesystem::path& path);  // (above)
  // Loads an unsharded checkpoint (or a consolidated one, saved by any number of ranks): each
  // rank keeps its pieces. Validation as Optimizer::load_state; collective only in that every
  // rank reads the same file.
  void load_state(const std::filesystem::path& path);

  // --- A peer's pieces (fault tolerance's recovery by pieces, dist/fault_tolerance.h). The
  // rank at place p of a live replica sends its own pieces to the rank at place p of a newcomer
  // with the same layout: the packed optimizer state of its ranges and its pieces of the values,
  // about 1/S of the state of S ranks, never the consolidated state. own_pieces() is this rank's
  // (not collective): its state buffers are the live ones, unchanged until the next step. adopt_pieces() checks a peer's against this rank's layout (the same stage
  // and ranges, every tensor of its size and dtype, the optimizer's check_state) on every rank
  // first, so that a bad piece anywhere is an error everywhere and changes nothing; then loads
  // the state and the values, and below stage 3 gathers every bucket's values inside the group
  // (stage 3 releases its units: the next gather brings the new values). Collective.
  State own_pieces();
  void adopt_pieces(const State& pieces, const std::string& origin);  // (above)

  // Sharded checkpoints, for states no rank should hold whole: in `folder`, every rank writes
  // its pieces (at stage 3 its pieces of the values too) to set-<id>/rank<R>.safetensors, and
  // once all are written rank 0 points folder/manifest.json at the new set (an atomic rename)
  // and removes the old sets. A crash or a failed write anywhere before that leaves the previous
  // complete set in force; a failure is an error on every rank. Collective.
  void save_sharded(const std::filesystem::path& folder);
  // Loads the set the manifest names. Saved by another world size (or other buckets), it is an
  // error unless `reshard`: then each rank reads its pieces from whichever files hold them.
  // A stage-3 set restores the values too (this rank's pieces at stage 3, every value below it;
  // at stage 3 every unit is released first); a set of stage 1 or 2 holds no values, so the
  // model's own file is loaded first (before the ZeroOptimizer is made, at stage 3). Collective.
  void load_sharded(const std::filesystem::path& folder, bool reshard = false);

 private:
  // Joinable (gradsync/dist/join/join.h, whose hooks only Join calls): under dist::Join({&ddp, &zero}), a joined
  // rank keeps stepping its pieces (they are nobody else's) and takes part in the gathers and the
  // clipping norm: each collective phase of an active rank's step starts with a small control
  // allreduce that the joined rank answers; it carries the active ranks' learning rates, which
  // the joined rank steps its pieces with. Stage 3: each of the active ranks' gathers begins with
  // a control word too, and a joined rank answers them (and the statistics and steps) on a thread
  // of its own while its own thread shadows the DataParallel; a gather costs one small allreduce
  // more while the Join is open (docs/zero.md).
  void join_opened(const JoinOptions* options) override;
  void begin_shadowing() override;
  void shadow_step(JoinStep& step) override;
  void finish_join(int last_joiner) override;
  comm::Communicator& join_communicator() const override;

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradsync::dist
