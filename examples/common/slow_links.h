// The slow-link strategies the trainers share (docs/slow_links.md): instead of averaging the
// gradients every step across the whole job, LocalSGD (--local-sgd H) averages the models every
// H steps and DiLoCo (--diloco H) steps an outer Nesterov SGD with the averaged change every H
// steps, streaming DiLoCo (--streaming-fragments F) a fragment at a time. With --inner-group N
// the ranks form groups of N consecutive ranks (a node, say) that synchronize their gradients
// every step through the trainer's DataParallel, and the strategy runs across the groups.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flags.h"
#include "gradsync/dist/outer/diloco.h"
#include "gradsync/dist/outer/local_sgd.h"
#include "gradsync/dist/zero/shard_groups.h"

namespace gradsync::examples {

// The flags (kSlowLinkHelp).
struct SlowLinkOptions {
  std::int64_t local_sgd = 0;  // --local-sgd H: LocalSGD's period (0: off)
  std::int64_t diloco = 0;     // --diloco H: DiLoCo's sync_every (0: off)
  std::int64_t warmup = 0;     // --outer-warmup N: synchronous steps first
  double outer_lr = 0.7, outer_momentum = 0.9;  // --outer-lr, --outer-momentum (DiLoCo's outer Nesterov SGD)
  std::int64_t fragments = 1;  // --streaming-fragments F
  std::int64_t delay = 0;      // --fragment-delay tau
  double mixing = 0;           // --fragment-mixing alpha
  std::string compression = "none";  // --outer-compression none|bf16|fp16
  int inner_group = 0;         // --inner-group N (0: every rank on its own)
  bool enabled() const { return local_sgd > 0 || diloco > 0; }
};
SlowLinkOptions parse_slow_link_options(Flags& flags);
// The settings every rank must run alike (for require_same_settings).
std::vector<std::string> slow_link_settings(const SlowLinkOptions& options);
extern const char* const kSlowLinkHelp;

// The strategy over a world (when enabled).
class SlowLinks {
 public:
  // Collective over `world`: the groups (with --inner-group), then LocalSGD or DiLoCo over the
  // ranks across them (rank 0's model everywhere).
  SlowLinks(const SlowLinkOptions& options, ParameterRegistry& registry, comm::Communicator& world);
  // The communicator the trainer's DataParallel synchronizes over: the inner group, or the world
  // (whose gradients are then averaged only in the warm-up).
  comm::Communicator& inner() const;
  // Whether the next step's backward must synchronize through that DataParallel (inside a group
  // always; across the world only in the warm-up); a trainer puts it under no_sync otherwise.
  bool synchronizes_gradients() const;
  // After each optimizer step: the strategy's step (collective when an average or outer step is due).
  void step();
  // What the strategy has put on the wire across the groups so far (DiLoCo's pseudo-gradients; a
  // LocalSGD average moves the model), in bytes.
  std::int64_t bytes_sent() const;
  std::string describe() const;  // one line for the trainer's header

 private:
  SlowLinkOptions options_;
  ParameterRegistry& registry_;
  comm::Communicator& world_;
  std::optional<dist::ShardGroups> groups_;
  std::optional<dist::LocalSGD> local_sgd_;
  std::unique_ptr<dist::DiLoCo> diloco_;
  std::int64_t averages_ = 0;  // LocalSGD's averagings so far
};

}  // namespace gradsync::examples
