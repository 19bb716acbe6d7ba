// gradsync/dist/diloco.h - DiLoCo (Douillard et al. 2023): every rank (or replica group) takes
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
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>

#include "gradsync/comm/communicator.h"
#include "gradsync/io/safetensors.h"
#include "gradsync/registry/parameter_registry.h"

namespace gradsync::dist {

// DiLoCo's schedule and outer optimizer.
struct DiLoCoOptions {
  std::int64_t sync_every = 8;  // H: inner steps between outer steps, > 0
  double outer_lr = 0.7;        // the outer SGD's learning rate (the paper's 0.7)
  double outer_momentum = 0.9;  // its momentum (0: none)
  bool nesterov = true;         // Nesterov momentum (the paper's)
};

// DiLoCo over a communicator (above).
class DiLoCo {
 public:
  // Collective over `comm`: every rank the same options and trainable parameters (an error on
  // every rank naming the first difference); then rank 0's values everywhere (the first
  // synchronization, at step 0) and the outer model g taken from them.
  DiLoCo(ParameterRegistry& registry, comm::Communicator& comm, DiLoCoOptions options = {});
  ~DiLoCo();
  DiLoCo(const DiLoCo&) = delete;
  DiLoCo& operator=(const DiLoCo&) = delete;

  // After each inner optimizer step; every sync_every-th call is an outer step (collective).
  // Returns whether it was one.
  bool step();
  std::int64_t inner_steps() const;  // step() calls so far
  const DiLoCoOptions& options() const;  // as given

  // The outer state for a checkpoint: g ("diloco.outer.<name>"), the outer SGD's momentum (its
  // optimizer checkpoint tensors), and in the metadata the options, the world size and the step
  // count. Loading refuses a state of another world size, H or outer optimizer, naming the
  // difference, and a damaged one, changing nothing.
  std::vector<io::NamedTensor> state_tensors() const;
  io::Metadata state_metadata() const;  // (above)
  void load_state(const io::SafetensorsReader& file);  // (above)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradsync::dist
