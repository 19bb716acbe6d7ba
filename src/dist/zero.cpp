// ZeroOptimizer (gradsync/dist/zero.h): the optimizer sharded over a Reducer's buckets
// (DataParallel's, or the DistributedOptimizer's with zero_stage).
#include "gradsync/dist/zero.h"

#include <algorithm>
#include <array>

#include "gradsync/comm/flight_recorder.h"
#include "gradsync/core/timeline.h"
#include "gradsync/dist/replicas.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/optim/clip.h"
#include "zero_checkpoint.h"

namespace gradsync::dist {

struct ZeroOptimizer::Impl {
  optim::Optimizer& optimizer;
  const Reducer& reducer;     // whose buckets are sharded
  DataParallel* ddp;          // the DataParallel front end (Join takes part), or null
  ZeroOptions options;
  // The parameter gathers run on their own communicator: launched after the step, they may
  // still travel while the next backward's buckets go out on the Reducer's.
  std::unique_ptr<comm::Communicator> own_comm;
  comm::Communicator& comm;
  ShardLayout layout;  // who owns which elements (zero_checkpoint.h)

  // One bucket's gather: this rank's piece of the updated values, allgathered into the arena.
  struct Gather {
    std::size_t arena = 0;
    std::int64_t begin = 0;  // the bucket's first element in the arena
    BucketShard shard;
    Tensor staging;  // this rank's piece (the input must not alias the output)
    comm::WorkHandle work;
  };
  std::vector<Gather> gathers;  // by bucket index

  Impl(optim::Optimizer& optimizer_, const Reducer& reducer_, comm::Communicator& base, DataParallel* ddp_,
       ZeroOptions options_)
      : optimizer(optimizer_), reducer(reducer_), ddp(ddp_), options(options_),
        own_comm(base.size() > 1 ? base.duplicate() : nullptr), comm(own_comm ? *own_comm : base) {}

  // A dist::Join over this ZeroOptimizer (and its DataParallel) is open on this rank.
  bool inside_join = false;
  ParameterRegistry& registry() const { return optimizer.registry(); }

  // Under dist::Join a joined rank must take part in every step: its pieces are its to update,
  // and the gathers need it. Each collective phase of a step on the active ranks therefore
  // starts with a control allreduce (max) of [kind, unscale, clip] that a joined rank answers
  // with zeros and reads: kind 1, the gradient statistics follow; kind 2, the step and the
  // gathers. See docs/zero.md.
  static constexpr double kStatistics = 1, kStep = 2;
  bool shadowing = false;  // this rank is a joined rank in a shadow step

  // One small allreduce (max) before each statistics pass or step under Join: the kind, the
  // deferred unscale and clip factors, then each group's learning rate. A joined rank sends
  // zeros and takes the active ranks' values, so its pieces step with their learning rate (a
  // schedule its own loop no longer sets).
  struct Control {
    double kind, unscale, clip;
    std::vector<double> lrs;
  };
  Control control(double kind, double unscale, double clip) {
    static const auto kLabel = std::make_shared<const std::string>("ZeRO control (statistics or step)");
    const comm::OperationLabel label(kLabel);
    std::vector<double> words{kind, unscale, clip};
    for (std::size_t g = 0; g < optimizer.group_count(); ++g) words.push_back(kind == 0 ? 0.0 : optimizer.lr(g));
    Tensor tensor = Tensor::from_vector(words, {static_cast<std::int64_t>(words.size())});
    comm.allreduce_host(tensor, comm::ReduceOp::max);
    const std::vector<double> v = tensor.to_double_vector();
    return {v[0], v[1], v[2], std::vector<double>(v.begin() + 3, v.end())};
  }

  bool announces() const {
    // A Join over the DataParallel alone would leave the joined ranks out of this step's
    // collectives: the active ranks would wait for them until the timeout.
    GRADSYNC_CHECK(inside_join || ddp == nullptr || !ddp->inside_join(), "ZeroOptimizer: its DataParallel is inside ",
                   "a dist::Join that does not include this ZeroOptimizer, so joined ranks would not take part in its ",
                   "steps; join both: dist::Join({&ddp, &zero}, options)");
    return inside_join && !shadowing;
  }

  void require_no_scaler_under_join() const {
    GRADSYNC_CHECK(!inside_join || optimizer.pending_gradient_unscale() == 1.0, "ZeroOptimizer under dist::Join ",
                   "with a GradScaler is not supported: a skipped step would leave the joined ranks waiting for it");
  }

  // A joined rank's part in one optimizer step of the others (the join loop runs it after every
  // synchronized step that does not carry).
  void shadow_step() {
    shadowing = true;
    struct Reset {
      bool& flag;
      ~Reset() { flag = false; }
    } reset{shadowing};
    for (;;) {
      const auto [kind, unscale, clip, lrs] = control(0, 0, 0);
      if (kind == kStatistics) {
        if (unscale != 1.0) optimizer.defer_gradient_unscale(unscale);
        (void)optimizer.gradient_statistics();  // combine() takes part in the sums
      } else if (kind == kStep) {
        if (unscale != 1.0) optimizer.defer_gradient_unscale(unscale);
        if (clip != 1.0) optimizer.defer_gradient_clip(clip);
        for (std::size_t g = 0; g < lrs.size(); ++g) optimizer.set_lr(g, lrs[g]);
        optimizer.step();
        launch_gathers();
        wait_all();
        return;
      } else {
        detail::throw_error("ZeroOptimizer: a joined rank expected the others' optimizer step, got control word ", kind);
      }
    }
  }

  void build() {
    GRADSYNC_CHECK(options.stage == 1 || options.stage == 2, "ZeroOptimizer: stage ", options.stage,
                   " (expected 1: optimizer state sharded, or 2: gradients too)");
    GRADSYNC_CHECK(ddp == nullptr || &optimizer.registry() == &ddp->registry(), "ZeroOptimizer: the optimizer and the ",
                   "DataParallel are over different registries");
    const bool sharded_gradients = reducer.options().reduce_scatter;
    GRADSYNC_CHECK(sharded_gradients == (options.stage == 2), "ZeroOptimizer: stage ", options.stage, " needs a ",
                   "DataParallel ", options.stage == 2 ? "with" : "without", " shard_gradients (DataParallelOptions), ",
                   "which decides whether buckets are reduce-scattered (stage 2) or allreduced (stage 1)");
    // Every rank the same stage and the same buckets (a rank with another bucket_cap_mb, say,
    // would cut other pieces): an error on every rank naming the first difference.
    std::vector<std::string> description{"stage " + std::to_string(options.stage)};
    for (std::size_t b = 0; b < reducer.bucket_count(); ++b) {
      const BucketInfo& info = reducer.bucket(b);
      description.push_back("bucket " + std::to_string(b) + ": arena " + std::to_string(info.members[0]->arena_index()) +
                       ", " + std::to_string(info.numel) + " elements from '" + info.members[0]->name() + "'");
    }
    require_same_lines(comm, description, "ZeroOptimizer", "shard layout");

    layout.all_ranges.assign(static_cast<std::size_t>(comm.size()),
                      std::vector<std::vector<optim::Optimizer::ElementRange>>(registry().arenas().size()));
    for (std::size_t b = 0; b < reducer.bucket_count(); ++b) {
      const BucketInfo& info = reducer.bucket(b);
      const std::int64_t begin = static_cast<std::int64_t>(info.members[0]->arena_offset()) - info.member_offset[0];
      for (int r = 0; r < comm.size(); ++r) {
        const BucketShard piece = shard_bucket(info.numel, comm.size(), r);
        if (piece.count == 0) continue;
        layout.all_ranges[static_cast<std::size_t>(r)][info.members[0]->arena_index()].push_back(
            {begin + piece.begin, begin + piece.begin + piece.count});
      }
    }
    for (auto& per_rank : layout.all_ranges) {
      for (auto& list : per_rank) {
        std::sort(list.begin(), list.end(), [](const auto& x, const auto& y) { return x.begin < y.begin; });
      }
    }
    layout.ranges.assign(registry().arenas().size(), {});
    for (std::size_t b = 0; b < reducer.bucket_count(); ++b) {
      const BucketInfo& info = reducer.bucket(b);
      GRADSYNC_CHECK(info.arena_view, "ZeroOptimizer: bucket ", b, " (", info.members[0]->name(), ", ...) is not a view ",
                     "of the gradient arena (its members are not neighbours: frozen parameters between them?); ",
                     "ZeRO shards arena runs");
      Gather gather;
      gather.arena = info.members[0]->arena_index();
      gather.begin = static_cast<std::int64_t>(info.members[0]->arena_offset()) - info.member_offset[0];
      gather.shard = shard_bucket(info.numel, comm.size(), comm.rank());
      if (gather.shard.count > 0) {
        layout.ranges[gather.arena].push_back({gather.begin + gather.shard.begin, gather.begin + gather.shard.begin + gather.shard.count});
      }
      const Arena& arena = registry().arenas()[gather.arena];
      gather.staging = Tensor::empty({gather.shard.count}, arena.dtype, arena.device);
      gathers.push_back(std::move(gather));
    }
    for (auto& list : layout.ranges) {
      std::sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
    }
    layout.stage = options.stage;
    optimizer.shard(layout.ranges, [this](optim::GradientStatistics& statistics) { combine(statistics); });
  }

  // Every rank's statistics of its owned pieces, made the world's: sums, and the largest.
  void combine(optim::GradientStatistics& statistics) {
    if (announces()) {
      require_no_scaler_under_join();
      control(kStatistics, optimizer.pending_gradient_unscale(), 1.0);
    }
    static const auto kLabel = std::make_shared<const std::string>("ZeRO gradient statistics");
    const comm::OperationLabel label(kLabel);
    Tensor sums = Tensor::from_vector(
        std::vector<double>{statistics.sum_of_squares, static_cast<double>(statistics.nonfinite)}, {2});
    comm.allreduce_host(sums, comm::ReduceOp::sum);
    Tensor largest = Tensor::from_vector(std::vector<double>{statistics.max_abs}, {1});
    comm.allreduce_host(largest, comm::ReduceOp::max);
    statistics.sum_of_squares = sums.to_double_vector()[0];
    statistics.nonfinite = static_cast<std::int64_t>(sums.to_double_vector()[1]);
    statistics.max_abs = largest.to_double_vector()[0];
  }

  void launch_gathers() {
    for (Gather& gather : gathers) {
      Tensor values = registry().arenas()[gather.arena].values;  // shares the arena's storage
      if (gather.shard.count > 0) {
        gather.staging.copy_from(values.view(static_cast<std::size_t>(gather.begin + gather.shard.begin), {gather.shard.count}));
      }
      std::int64_t numel = 0;
      for (const std::int64_t count : gather.shard.counts) numel += count;
      Tensor target = values.view(static_cast<std::size_t>(gather.begin), {numel});
      timeline::instant("zero", "gather parameters");
      const comm::OperationLabel label("ZeRO gather: arena " + std::to_string(gather.arena) + " from element " +
                                       std::to_string(gather.begin));
      gather.work = comm.allgatherv_async(gather.staging, target, gather.shard.counts);
    }
  }

  void wait(Gather& gather) {
    if (!gather.work) return;
    comm::WorkHandle work = std::move(gather.work);
    work->wait();
  }

  void wait_all() {
    comm::FirstError errors;
    for (Gather& gather : gathers) errors.wait(gather.work);
    errors.rethrow();
  }

  void drain() noexcept {
    comm::FirstError ignored;  // destruction: nothing left to report to
    for (Gather& gather : gathers) ignored.wait(gather.work);
  }
};

ZeroOptimizer::ZeroOptimizer(optim::Optimizer& optimizer, DataParallel& ddp, ZeroOptions options)
    : impl_(std::make_unique<Impl>(optimizer, ddp.reducer(), ddp.communicator(), &ddp, options)) {
  impl_->build();
}

ZeroOptimizer::ZeroOptimizer(optim::Optimizer& optimizer, const Reducer& reducer, comm::Communicator& comm,
                             ZeroOptions options)
    : impl_(std::make_unique<Impl>(optimizer, reducer, comm, nullptr, options)) {
  impl_->build();
}

ZeroOptimizer::~ZeroOptimizer() { impl_->drain(); }

void ZeroOptimizer::step_async() {
  impl_->wait_all();
  if (impl_->announces()) {  // joined ranks step their pieces with us (Impl::shadow_step)
    impl_->require_no_scaler_under_join();
    impl_->control(Impl::kStep, impl_->optimizer.pending_gradient_unscale(), impl_->optimizer.pending_gradient_clip());
  }
  impl_->optimizer.step();
  impl_->launch_gathers();
}

void ZeroOptimizer::step() {
  step_async();
  impl_->wait_all();
}

void ZeroOptimizer::wait_for(const Parameter& parameter) {
  impl_->wait(impl_->gathers.at(impl_->reducer.bucket_of(parameter)));
}

void ZeroOptimizer::wait_all() { impl_->wait_all(); }

void ZeroOptimizer::zero_grad(bool set_to_undefined) {
  optim::Optimizer& optimizer = impl_->optimizer;
  if (impl_->options.stage < 2 || set_to_undefined) return optimizer.zero_grad(set_to_undefined);
  // Stage 2 keeps only its pieces' gradient pages between steps: zeros that give the pages
  // back rather than write them (a plain fill would commit the whole gradient arena).
  optimizer.zero_grad(true);
  for (std::size_t g = 0; g < optimizer.group_count(); ++g) {
    for (Parameter* parameter : optimizer.group_parameters(g)) parameter->grad_for_overwrite().zero_releasing_pages();
  }
}

double ZeroOptimizer::clip_grad_norm(double max_norm, double norm_type, bool error_if_nonfinite) {
  return optim::clip_grad_norm(impl_->optimizer, max_norm, norm_type, error_if_nonfinite);
}

optim::Optimizer& ZeroOptimizer::optimizer() const { return impl_->optimizer; }
int ZeroOptimizer::stage() const { return impl_->options.stage; }
const std::vector<std::vector<optim::Optimizer::ElementRange>>& ZeroOptimizer::shard_ranges() const {
  return impl_->layout.ranges;
}
std::int64_t ZeroOptimizer::state_bytes() const { return impl_->optimizer.state_bytes(); }

// ---- Checkpoints (zero_checkpoint.cpp), once the gathers have landed -----------------------------

ZeroOptimizer::State ZeroOptimizer::consolidated_state() {
  impl_->wait_all();
  return dist::consolidated_state(impl_->optimizer, impl_->comm, impl_->layout);
}

void ZeroOptimizer::save_consolidated(const std::filesystem::path& path) {
  impl_->wait_all();
  dist::save_consolidated(impl_->optimizer, impl_->comm, impl_->layout, path);
}

void ZeroOptimizer::save_sharded(const std::filesystem::path& folder) {
  impl_->wait_all();
  dist::save_sharded(impl_->optimizer, impl_->comm, impl_->layout, folder);
}

void ZeroOptimizer::load_sharded(const std::filesystem::path& folder, bool reshard) {
  impl_->wait_all();
  dist::load_sharded(impl_->optimizer, impl_->comm, impl_->layout, folder, reshard);
}

void ZeroOptimizer::load_state(const std::filesystem::path& path) {
  impl_->wait_all();
  impl_->optimizer.load_state(path);
}

// ---- Joinable: a joined rank steps its pieces with the others and takes part in the gathers ----

void ZeroOptimizer::join_opened(const JoinOptions* options) {
  GRADSYNC_CHECK(options == nullptr || impl_->ddp != nullptr, "ZeroOptimizer: only a ZeroOptimizer over a DataParallel ",
                 "joins (the DistributedOptimizer's zero_stage does not combine with join)");
  impl_->inside_join = options != nullptr;
}

void ZeroOptimizer::shadow_step(JoinStep& step) {
  if (step.synchronized && step.optimizer_step_follows) impl_->shadow_step();
}

void ZeroOptimizer::finish_join(int) {}  // its pieces are current on every rank: nothing to copy

comm::Communicator& ZeroOptimizer::join_communicator() const { return impl_->comm; }

}  // namespace gradsync::dist
