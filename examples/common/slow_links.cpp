// The slow-link strategies the trainers share (slow_links.h).
#include "slow_links.h"

#include "gradsync/core/error.h"

namespace gradsync::examples {

const char* const kSlowLinkHelp =
    "slow links (docs/slow_links.md):\n"
    "  --local-sgd H (average the models every H steps instead of the gradients every step)\n"
    "  --diloco H (DiLoCo: every H steps an outer Nesterov SGD steps the averaged change)   --outer-lr 0.7\n"
    "  --outer-momentum 0.9   --streaming-fragments F (streaming DiLoCo: F fragments at staggered steps)\n"
    "  --fragment-delay tau (each fragment's reduction overlaps tau inner steps)   --fragment-mixing alpha\n"
    "  --outer-compression none|bf16|fp16   --outer-warmup N (synchronous steps first)\n"
    "  --inner-group N (groups of N consecutive ranks synchronize every step; the strategy runs across them)";

SlowLinkOptions parse_slow_link_options(Flags& flags) {
  SlowLinkOptions options;
  options.local_sgd = flags.count("--local-sgd", 0, 0);
  options.diloco = flags.count("--diloco", 0, 0);
  options.warmup = flags.count("--outer-warmup", 0, 0);
  options.outer_lr = flags.number("--outer-lr", options.outer_lr);
  options.outer_momentum = flags.number("--outer-momentum", options.outer_momentum);
  options.fragments = flags.count("--streaming-fragments", 1);
  options.delay = flags.count("--fragment-delay", 0, 0);
  options.mixing = flags.number("--fragment-mixing", 0.0);
  options.compression = flags.text("--outer-compression", "none");
  options.inner_group = static_cast<int>(flags.integer("--inner-group", 0));
  GRADSYNC_CHECK(options.local_sgd >= 0 && options.diloco >= 0, "--local-sgd and --diloco take a number of steps");
  GRADSYNC_CHECK(options.local_sgd == 0 || options.diloco == 0, "--local-sgd ", options.local_sgd, " and --diloco ",
                 options.diloco, ": one slow-link strategy at a time");
  GRADSYNC_CHECK(options.diloco > 0 || (!flags.given("--streaming-fragments") && !flags.given("--fragment-delay") &&
                                        !flags.given("--fragment-mixing") && !flags.given("--outer-compression") &&
                                        !flags.given("--outer-lr") && !flags.given("--outer-momentum")),
                 "--streaming-fragments, --fragment-delay, --fragment-mixing, --outer-compression, --outer-lr and ",
                 "--outer-momentum are DiLoCo's: they need --diloco H");
  GRADSYNC_CHECK(options.enabled() || (options.inner_group == 0 && options.warmup == 0),
                 "--inner-group and --outer-warmup need --local-sgd or --diloco");
  GRADSYNC_CHECK(options.inner_group == 0 || options.warmup == 0, "--outer-warmup with --inner-group: the warm-up ",
                 "averages the gradients across the whole job, and the trainer's DataParallel then spans only a group");
  (void)dist::parse_compression(options.compression);  // its error names the choices
  return options;
}

std::vector<std::string> slow_link_settings(const SlowLinkOptions& options) {
  return {"--local-sgd " + std::to_string(options.local_sgd), "--diloco " + std::to_string(options.diloco),
          "--outer-warmup " + std::to_string(options.warmup), "--outer-lr " + std::to_string(options.outer_lr),
          "--outer-momentum " + std::to_string(options.outer_momentum),
          "--streaming-fragments " + std::to_string(options.fragments),
          "--fragment-delay " + std::to_string(options.delay), "--fragment-mixing " + std::to_string(options.mixing),
          "--outer-compression " + options.compression, "--inner-group " + std::to_string(options.inner_group)};
}

SlowLinks::SlowLinks(const SlowLinkOptions& options, ParameterRegistry& registry, comm::Communicator& world)
    : options_(options), registry_(registry), world_(world) {
  if (options.inner_group > 0) groups_.emplace(world, options.inner_group);
  comm::Communicator& across = groups_ ? groups_->replicas() : world;
  if (options.local_sgd > 0) {
    // LocalSGD does not broadcast (the DataParallel does, as in PyTorch); across the groups the
    // trainer's DataParallel spans one group only, so group 0's model goes to every group here.
    if (groups_ && across.size() > 1) {
      for (const Arena& arena : registry.arenas()) {
        Tensor values = arena.values;
        across.broadcast(values, 0);
      }
    }
    local_sgd_.emplace(registry, across, dist::LocalSGDOptions{.period = options.local_sgd, .warmup_steps = options.warmup});
  } else {
    const dist::DiLoCoOptions diloco_options{
        .sync_every = options.diloco, .outer_lr = options.outer_lr, .outer_momentum = options.outer_momentum,
        .nesterov = options.outer_momentum > 0, .warmup_steps = options.warmup, .fragments = options.fragments,
        .delay = options.delay, .mixing = options.mixing, .compression = dist::parse_compression(options.compression)};
    // Inside a group every rank holds the same model: each sends 1/N of the pseudo-gradients across.
    diloco_ = groups_ ? std::make_unique<dist::DiLoCo>(registry, across, groups_->shard(), diloco_options)
                      : std::make_unique<dist::DiLoCo>(registry, across, diloco_options);
  }
}

comm::Communicator& SlowLinks::inner() const { return groups_ ? groups_->shard() : world_; }

bool SlowLinks::synchronizes_gradients() const {
  if (groups_) return true;
  return local_sgd_ ? local_sgd_->in_warmup() : diloco_->in_warmup();
}

void SlowLinks::step() {
  if (local_sgd_) {
    averages_ += local_sgd_->step() ? 1 : 0;
  } else {
    diloco_->step();
  }
}

std::int64_t SlowLinks::bytes_sent() const {
  if (diloco_) return diloco_->bytes_sent();
  std::int64_t model_bytes = 0;
  for (const Parameter& parameter : registry_) {
    if (parameter.requires_grad()) model_bytes += static_cast<std::int64_t>(parameter.value().nbytes());
  }
  const comm::Communicator& across = groups_ ? groups_->replicas() : world_;
  return across.size() > 1 ? averages_ * model_bytes : 0;
}

std::string SlowLinks::describe() const {
  const std::string across = groups_ ? "across " + std::to_string(groups_->groups()) + " groups of " +
                                           std::to_string(groups_->group_size()) + " (synchronous inside)"
                                     : "across the ranks";
  if (local_sgd_) return "LocalSGD every " + std::to_string(options_.local_sgd) + " steps " + across;
  std::string line = "DiLoCo every " + std::to_string(options_.diloco) + " steps " + across;
  if (options_.fragments > 1) {
    line += ", streaming: " + std::to_string(options_.fragments) + " fragments, delay " + std::to_string(options_.delay);
  }
  if (options_.compression != "none") line += ", " + options_.compression + " on the wire";
  return line;
}

}  // namespace gradsync::examples
