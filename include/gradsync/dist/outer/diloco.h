// gradsync/dist/outer/diloco.h - DiLoCo (Douillard et al. 2023): every rank (or replica group) takes
// `sync_every` inner optimizer steps on its own; then the change since the last synchronization,
// the pseudo-gradient, is averaged over a communicator and an outer optimizer (SGD with Nesterov
// momentum) applies it to the last synchronized model, which every rank continues from
// (docs/slow_links.md). torchft's DiLoCo, for an engine without a framework.
//
//   dist::DiLoCo diloco(registry, outer_comm, {.sync_every = 32, .outer_lr = 0.7, .outer_momentum = 0.9});
//   for each step:
//     ... backward (gradients synchronized inside the group, if any; not across `outer_comm`) ...
//     inner.step();      // AdamW, say
//     diloco.step();     // every sync_every steps: the outer step
//
// The outer step on each trainable parameter p, with g the model of the last synchronization:
//   delta = average over the ranks of (g - p);   g = SGD(g, gradient delta);   p = g.
// The outer optimizer is gradsync's optim::SGD over a registry of its own that mirrors the
// trainable parameters: its values are g, its gradients the averaged deltas; so its momentum,
// Nesterov and learning rate are torch.optim.SGD's, and its state is an ordinary optimizer
// checkpoint.
//
// Streaming DiLoCo (Douillard et al. 2025) is the same class with `fragments` > 1: the trainable
// parameters split into F fragments (consecutive parameters in registration order, balanced by
// elements), fragment i synchronized at inner steps o_i, o_i + H, ... with o_i = floor(H (i+1) / F)
// (torchft's schedule: staggered, so one fragment's traffic crosses the link at a time); its
// reduction launched there and applied `delay` (tau) inner steps later, overlapped with them;
// where it lands the local values are mixed in, p = mixing * p + (1 - mixing) * g; optionally on
// the wire in bf16 or fp16. With one fragment, no delay and no mixing it is DiLoCo above.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>

#include "gradsync/comm/communicator.h"
#include "gradsync/dist/join/join.h"
#include "gradsync/dist/reducer/reducer.h"
#include "gradsync/io/safetensors.h"
#include "gradsync/registry/parameter_registry.h"

namespace gradsync::dist {

// DiLoCo's schedule and outer optimizer.
struct DiLoCoOptions {
  std::int64_t sync_every = 8;  // H: inner steps between outer steps, > 0
  double outer_lr = 0.7;        // the outer SGD's learning rate (the paper's 0.7)
  double outer_momentum = 0.9;  // its momentum (0: none)
  bool nesterov = true;         // Nesterov momentum (the paper's)
  // Plain synchronous steps first (the engine averages gradients, as LocalSGD's warm-up): the
  // outer model is taken from the replicas, equal by then, when the warm-up ends.
  std::int64_t warmup_steps = 0;
  // Streaming DiLoCo (above): F fragments, 1 <= F <= H and no more than the trainable parameters.
  std::int64_t fragments = 1;
  std::int64_t delay = 0;   // tau: inner steps a fragment's reduction overlaps, < floor(H / F)
  double mixing = 0;        // alpha in [0, 1]: the local values' share where a fragment lands
  Compression compression = Compression::none;  // the pseudo-gradients on the wire (fp16 / bf16)
};

// DiLoCo over a communicator (above). A Joinable: under dist::Join({&diloco}, options) (after the
// warm-up, each rank its own replica), a rank out of data keeps answering the outer reductions
// (its progress since each fragment's last launch, then nothing), each reduction preceded by a
// census of who has joined (divide_by_initial_world_size false: the average divides by the
// active ranks); when every rank is out, synchronize() runs on all of them.
class DiLoCo : public Joinable {
 public:
  // Collective over `comm`: every rank the same options and trainable parameters (an error on
  // every rank naming the first difference); then rank 0's values everywhere (the first
  // synchronization, at step 0) and the outer model g taken from them.
  DiLoCo(ParameterRegistry& registry, comm::Communicator& comm, DiLoCoOptions options = {});
  // Over groups whose ranks hold the same model (an inner DataParallel synchronizes each group
  // every step): `comm` joins the same place in every group (ShardGroups::replicas), `within` is
  // this rank's group (ShardGroups::shard). The group's S ranks would send S copies of the same
  // pseudo-gradient across; instead each reduces 1/S of it across the groups and the group
  // shares the results (an allgather inside it when the reduction lands). Collective over both.
  DiLoCo(ParameterRegistry& registry, comm::Communicator& comm, comm::Communicator& within, DiLoCoOptions options = {});
  ~DiLoCo() override;
  DiLoCo(const DiLoCo&) = delete;
  DiLoCo& operator=(const DiLoCo&) = delete;

  // After each inner optimizer step: after the warm-up, launches the reductions and applies the
  // outer steps that are due (collective then). Returns whether an outer step landed (a whole
  // one, or a fragment's).
  bool step();
  // Every fragment in flight lands, then an outer step of every fragment that some rank has moved
  // since its last synchronization: every rank then holds the outer model g (the end of training,
  // before an evaluation or a save). Collective; not in the warm-up.
  void synchronize();
  bool in_warmup() const;            // the next step is a warm-up step (synchronize the gradients)
  std::int64_t inner_steps() const;  // step() calls so far
  // Bytes this rank has sent to the outer reductions so far (the pseudo-gradients on the wire,
  // counted once: an allreduce moves about twice that per rank in a ring).
  std::int64_t bytes_sent() const;
  // Which fragment each trainable parameter belongs to, by name, in registration order.
  std::vector<std::pair<std::string, std::int64_t>> fragment_of_parameters() const;
  const DiLoCoOptions& options() const;  // as given

  // The outer state for a checkpoint: g ("diloco.outer.<name>"), the outer SGD's momentum (its
  // optimizer checkpoint tensors), the averaged pseudo-gradients of fragments whose outer step
  // is still to land ("diloco.pending.<name>": state_tensors waits for their reductions, so it
  // is collective when one is in flight), and in the metadata the options, the world size and
  // the step count. Loading refuses a state of another world size, H, fragmenting or outer
  // optimizer, naming the difference, and a damaged one, changing nothing.
  std::vector<io::NamedTensor> state_tensors() const;
  io::Metadata state_metadata() const;  // (above)
  void load_state(const io::SafetensorsReader& file);  // (above)

 private:
  // Joinable (gradsync/dist/join/join.h): a joined rank's shadow step runs the active ranks' steps up to their next
  // outer reduction and takes part in it; at the end, synchronize().
  void join_opened(const JoinOptions* options) override;
  void require_joinable() const override;
  void begin_shadowing() override;
  void shadow_step(JoinStep& step) override;
  void finish_join(int last_joiner) override;
  comm::Communicator& join_communicator() const override;

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradsync::dist
