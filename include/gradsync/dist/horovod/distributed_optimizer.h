// gradsync/dist/horovod/distributed_optimizer.h - Horovod's DistributedOptimizer, in C++.
//
//   optim::Adam adam(registry, {...});
//   dist::DistributedOptimizer opt(adam, comm, {.compression = dist::Compression::fp16});
//   for (...) {
//     engine.backward();            // writes gradients, registry.mark_ready(p) per parameter
//     opt.step();                   // waits for the reductions, then adam.step()
//     opt.zero_grad();
//   }
//
// It wraps any optim::Optimizer (SGD, Adam, AdamW, or a user's subclass) over a registry and
// listens to the registry's readiness signals. The semantics are Horovod's, argument by
// argument (docs/semantics/horovod.md), with these deliberate differences, each for a reason:
//  * the reduction order is the registry's, identical on every rank, so nothing is negotiated
//    and a rank whose graph skipped a parameter cannot stall the others (it contributes
//    zeros, Horovod's "force allreduce", in the same fixed order);
//  * gradient_predivide_factor is honoured for grouped parameters too;
//  * fp16 compression works with sparse gradients (Horovod crashes);
//  * the warning for step() after synchronize() without skip_synchronize() is given once;
//  * parameters declared sparse take part in every synchronization (zero rows when a rank has
//    none), so a rank without a sparse gradient cannot stall the allgather.
// With one rank nothing is hooked and step() is the wrapped optimizer's step (unless
// reduce_with_one_rank asks for the distributed path, for tests).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "gradsync/comm/communicator.h"
#include "gradsync/dist/join/join.h"
#include "gradsync/dist/horovod/process_set.h"
#include "gradsync/dist/reducer/reducer.h"
#include "gradsync/dist/replicas/replicas.h"  // require_same_optimizer, broadcast_parameters, broadcast_optimizer_state
#include "gradsync/dist/zero/zero.h"
#include "gradsync/optim/optimizer.h"

namespace gradsync::dist {

class PowerSGDState;

// Horovod's reduction ops for the optimizer.
enum class Op { average, sum, adasum, min, max, product };
const char* op_name(Op op);  // "average", "sum", ... (for messages)
Op parse_op(const std::string& text);  // "average" | "sum" | "adasum" | "min" | "max" | "product"

// Horovod's DistributedOptimizer arguments (docs/semantics/horovod.md), by their names.
struct DistributedOptimizerOptions {
  // (name, parameter) pairs; when absent every parameter's registry name is used. When given,
  // names must be unique and must cover every parameter the optimizer updates.
  std::optional<std::vector<std::pair<std::string, Parameter*>>> named_parameters{};
  Compression compression = Compression::none;  // fp16 / bf16 on the wire (Horovod's Compression)
  int backward_passes_per_step = 1;  // local accumulations per reduction
  Op op = Op::average;               // how ranks' gradients combine
  // Average in two halves: divided by this before the sum, by size / this after.
  double gradient_predivide_factor = 1.0;
  // Horovod's groups: none, a positive number of groups (the parameters split in order into
  // that many nearly equal runs), or explicit lists of parameters reduced together.
  std::variant<std::monostate, int, std::vector<std::vector<Parameter*>>> groups{};
  bool sparse_as_dense = false;  // sparse gradients densified and allreduced with the rest
  // Parameters whose gradients arrive as rows (set_sparse_grad), like an embedding's.
  std::vector<Parameter*> sparse_parameters{};
  // Tensor fusion threshold (Horovod's HOROVOD_FUSION_THRESHOLD, default 128 MiB).
  std::size_t fusion_threshold_bytes = std::size_t{128} << 20;
  // ZeRO (dist/zero.h) over the fusion buckets: 1 shards the wrapped optimizer's state, 2 also
  // reduce-scatters the buckets. Not with Adasum (a local step of every parameter), sparse
  // parameters (unless sparse_as_dense: their rows are no bucket's), or join().
  int zero_stage = 0;
  // Runs the whole distributed path (buckets, compression, scaling, the Reducer, the status
  // collective) with one rank too, where Horovod hooks nothing. For testing a backend on a
  // machine with one GPU, where NCCL allows one rank only: the results are the plain path's,
  // up to compression's rounding.
  bool reduce_with_one_rank = false;
  // PowerSGD (dist/powersgd.h) reduces every fusion bucket: the average, compressed. Only with
  // op Average, no gradient_predivide_factor (the hook averages itself), no compression (the
  // factors are the compression), zero_stage 0 or 1 (stage 2's reduce-scatter is no hook's).
  std::shared_ptr<PowerSGDState> powersgd{};
};

// Horovod's DistributedOptimizer around any optimizer: each backward's gradients reduced
// across ranks (fusion buckets, overlapped with the backward) before the wrapped step.
class DistributedOptimizer : public Joinable {
 public:
  // Collective: every rank the same parameters and options (an error naming the difference).
  DistributedOptimizer(optim::Optimizer& optimizer, comm::Communicator& comm, DistributedOptimizerOptions options = {});
  // Over a process set (Horovod's process_set): its members reduce among themselves; a
  // non-member gets an error naming the set.
  DistributedOptimizer(optim::Optimizer& optimizer, ProcessSet& process_set, DistributedOptimizerOptions options = {})
      : DistributedOptimizer(optimizer, process_set.communicator(), std::move(options)) {}
  ~DistributedOptimizer() override;
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  // Reduces every gradient not yet reduced (zero-filled where undefined; partial
  // accumulations and partial groups as they are), waits, and writes the results back.
  // A no-op for Adasum, which reduces deltas inside step().
  void synchronize();
  // synchronize() unless inside skip_synchronize(), then the wrapped optimizer's step.
  void step();
  // Clipping by global norm in one call (optim/clip.h): synchronize(), then clip the reduced
  // gradients, and the next step() does not synchronize again (what synchronize(), clip,
  // skip_synchronize() { step() } does by hand). Returns the total norm, the same on every
  // rank. With Adasum, which reduces inside step(), it clips each rank's local gradients.
  double clip_grad_norm(double max_norm, double norm_type = 2.0, bool error_if_nonfinite = false);
  // The wrapped zero_grad; an error while reductions are pending (after a backward, before
  // step() or synchronize()).
  void zero_grad(bool set_to_undefined = true);

  // RAII: step() does not synchronize while the guard lives (restored on exceptions too).
  class SkipSynchronize {
   public:
    explicit SkipSynchronize(DistributedOptimizer& optimizer);  // step() stops synchronizing
    ~SkipSynchronize();
    SkipSynchronize(const SkipSynchronize&) = delete;
    SkipSynchronize& operator=(const SkipSynchronize&) = delete;

   private:
    DistributedOptimizer& optimizer_;
    bool previous_;
  };
  [[nodiscard]] SkipSynchronize skip_synchronize() { return SkipSynchronize(*this); }  // Horovod's

  // Between windows it applies at once; in the middle of an accumulation window (gradients
  // already counted) it applies from the next window, so no gradient is handed over twice.
  void set_backward_passes_per_step(int passes);
  int backward_passes_per_step() const;  // the value in force for the current window

  // A row-sparse gradient for a parameter declared in sparse_parameters: `indices` (i64, the
  // rows) and `rows` ([nnz, row elements]). It counts as this parameter's readiness for the
  // pass. Duplicate indices add, as in a coalesced sparse tensor.
  void set_sparse_grad(Parameter& parameter, const Tensor& indices, const Tensor& rows);

  // Horovod's hvd.join(), for ranks with uneven data: this rank has no more. Until every rank
  // has joined it takes part in the others' synchronizations with zeros (each synchronization
  // ends with a small status allreduce that says who has joined; the others' Average still
  // divides by the full world size, as Horovod's does; sparse gradients are allgathered with
  // no rows), then returns the last rank to join (the highest, when several joined in the
  // final synchronization), the same on every rank. Horovod leaves the replicas as they are:
  // broadcast_parameters and broadcast_optimizer_state from the returned rank make them equal.
  // Errors: with Adasum (its reduction happens inside a local step a joined rank cannot take)
  // and with reductions already launched (call step() or synchronize() first). A partial
  // accumulation window (fewer than backward_passes_per_step passes) is dropped. Collective.
  int join();

  // Loads the wrapped optimizer's state and resets the accumulation counters (Horovod's
  // load_state_dict). An error while reductions are pending.
  void load_state(const std::filesystem::path& path);

  optim::Optimizer& optimizer() const;  // the wrapped one
  const Reducer* reducer() const;  // nullptr with one rank or Adasum
  const ZeroOptimizer* zero() const;  // with zero_stage on more than one rank
  // The groups as formed (after the integer split or the list validation), by name.
  std::vector<std::vector<std::string>> group_names() const;

 private:
  // Joinable (gradsync/dist/join/join.h, whose hooks only Join and join() call): a shadow synchronization is every
  // bucket with zeros, the sparse allgathers with no rows, and the status.
  void join_opened(const JoinOptions* options) override;
  void require_joinable() const override;
  void shadow_step(JoinStep& step) override;
  void finish_join(int last_joiner) override;
  comm::Communicator& join_communicator() const override;

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Failure: when a synchronize() or step() fails (a timeout, a lost peer, a Reducer error),
// nothing stays pending: the Reducer has waited for its buckets, the accumulation window
// restarts and sparse rows are dropped, so zero_grad() and load_state() work; step() and
// synchronize() refuse from then on, quoting the original failure.

}  // namespace gradsync::dist
