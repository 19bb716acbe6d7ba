// ZeroOptimizer (gradsync/dist/zero.h): the optimizer sharded over DataParallel's buckets.
#include "gradsync/dist/zero.h"

#include <algorithm>

#include "gradsync/core/timeline.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/optim/clip.h"

namespace gradsync::dist {

struct ZeroOptimizer::Impl {
  optim::Optimizer& optimizer;
  DataParallel& ddp;
  ZeroOptions options;
  // The parameter gathers run on their own communicator: launched after the step, they may
  // still travel while the next backward's buckets go out on the Reducer's.
  std::unique_ptr<comm::Communicator> own_comm;
  comm::Communicator& comm;
  std::vector<std::vector<optim::Optimizer::ElementRange>> ranges;  // per arena
  // Every rank's ranges (the same computation for each rank): [rank][arena].
  std::vector<std::vector<std::vector<optim::Optimizer::ElementRange>>> all_ranges;

  // One bucket's gather: this rank's piece of the updated values, allgathered into the arena.
  struct Gather {
    std::size_t arena = 0;
    std::int64_t begin = 0;  // the bucket's first element in the arena
    BucketShard shard;
    Tensor staging;  // this rank's piece (the input must not alias the output)
    comm::WorkHandle work;
  };
  std::vector<Gather> gathers;  // by bucket index

  Impl(optim::Optimizer& optimizer_, DataParallel& ddp_, ZeroOptions options_)
      : optimizer(optimizer_), ddp(ddp_), options(options_),
        own_comm(ddp_.communicator().size() > 1 ? ddp_.communicator().duplicate() : nullptr),
        comm(own_comm ? *own_comm : ddp_.communicator()) {}

  void build() {
    GRADSYNC_CHECK(options.stage == 1 || options.stage == 2, "ZeroOptimizer: stage ", options.stage,
                   " (expected 1: optimizer state sharded, or 2: gradients too)");
    GRADSYNC_CHECK(&optimizer.registry() == &ddp.registry(), "ZeroOptimizer: the optimizer and the DataParallel are ",
                   "over different registries");
    const bool sharded_gradients = ddp.options().shard_gradients;
    GRADSYNC_CHECK(sharded_gradients == (options.stage == 2), "ZeroOptimizer: stage ", options.stage, " needs a ",
                   "DataParallel ", options.stage == 2 ? "with" : "without", " shard_gradients (DataParallelOptions), ",
                   "which decides whether buckets are reduce-scattered (stage 2) or allreduced (stage 1)");
    // Every rank the same stage (the buckets are already the same: DataParallel checked the model).
    Tensor stages = Tensor::from_vector(std::vector<double>{static_cast<double>(options.stage)}, {1});
    Tensor all = Tensor::zeros({comm.size()}, DType::f64);
    comm.allgather_host(stages, all);
    for (int r = 0; r < comm.size(); ++r) {
      GRADSYNC_CHECK(all.to_double_vector()[static_cast<std::size_t>(r)] == options.stage, "ZeroOptimizer: this rank (",
                     comm.rank(), ") runs stage ", options.stage, ", rank ", r, " stage ",
                     all.to_double_vector()[static_cast<std::size_t>(r)]);
    }

    const Reducer& reducer = ddp.reducer();
    all_ranges.assign(static_cast<std::size_t>(comm.size()),
                      std::vector<std::vector<optim::Optimizer::ElementRange>>(ddp.registry().arenas().size()));
    for (std::size_t b = 0; b < reducer.bucket_count(); ++b) {
      const BucketInfo& info = reducer.bucket(b);
      const std::int64_t begin = static_cast<std::int64_t>(info.members[0]->arena_offset()) - info.member_offset[0];
      for (int r = 0; r < comm.size(); ++r) {
        const BucketShard piece = shard_bucket(info.numel, comm.size(), r);
        if (piece.count == 0) continue;
        all_ranges[static_cast<std::size_t>(r)][info.members[0]->arena_index()].push_back(
            {begin + piece.begin, begin + piece.begin + piece.count});
      }
    }
    for (auto& per_rank : all_ranges) {
      for (auto& list : per_rank) {
        std::sort(list.begin(), list.end(), [](const auto& x, const auto& y) { return x.begin < y.begin; });
      }
    }
    ranges.assign(ddp.registry().arenas().size(), {});
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
        ranges[gather.arena].push_back({gather.begin + gather.shard.begin, gather.begin + gather.shard.begin + gather.shard.count});
      }
      const Arena& arena = ddp.registry().arenas()[gather.arena];
      gather.staging = Tensor::empty({gather.shard.count}, arena.dtype, arena.device);
      gathers.push_back(std::move(gather));
    }
    for (auto& list : ranges) {
      std::sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
    }
    optimizer.shard(ranges, [this](optim::GradientStatistics& statistics) { combine(statistics); });
  }

  // Every rank's statistics of its owned pieces, made the world's: sums, and the largest.
  void combine(optim::GradientStatistics& statistics) {
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
      Tensor values = ddp.registry().arenas()[gather.arena].values;  // shares the arena's storage
      if (gather.shard.count > 0) {
        gather.staging.copy_from(values.view(static_cast<std::size_t>(gather.begin + gather.shard.begin), {gather.shard.count}));
      }
      std::int64_t numel = 0;
      for (const std::int64_t count : gather.shard.counts) numel += count;
      Tensor target = values.view(static_cast<std::size_t>(gather.begin), {numel});
      timeline::instant("zero", "gather parameters");
      gather.work = comm.allgatherv_async(gather.staging, target, gather.shard.counts);
    }
  }

  void wait(Gather& gather) {
    if (!gather.work) return;
    comm::WorkHandle work = std::move(gather.work);
    work->wait();
  }

  void wait_all() noexcept(false) {
    std::exception_ptr first;
    for (Gather& gather : gathers) {
      try {
        wait(gather);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }

  void drain() noexcept {
    for (Gather& gather : gathers) {
      if (!gather.work) continue;
      try {
        gather.work->wait();
      } catch (...) {
      }
      gather.work.reset();
    }
  }
};

ZeroOptimizer::ZeroOptimizer(optim::Optimizer& optimizer, DataParallel& ddp, ZeroOptions options)
    : impl_(std::make_unique<Impl>(optimizer, ddp, options)) {
  impl_->build();
}

ZeroOptimizer::~ZeroOptimizer() { impl_->drain(); }

void ZeroOptimizer::step_async() {
  // A joined rank (dist::Join) shadows synchronized steps only; nobody would answer the gathers.
  GRADSYNC_CHECK(!impl_->ddp.inside_join(), "ZeroOptimizer under dist::Join is not supported yet: a joined rank ",
                 "shadows the synchronized steps, not the parameter gathers");
  impl_->wait_all();
  impl_->optimizer.step();
  impl_->launch_gathers();
}

void ZeroOptimizer::step() {
  step_async();
  impl_->wait_all();
}

void ZeroOptimizer::wait_for(const Parameter& parameter) {
  impl_->wait(impl_->gathers.at(impl_->ddp.reducer().bucket_of(parameter)));
}

void ZeroOptimizer::wait_all() { impl_->wait_all(); }

void ZeroOptimizer::zero_grad(bool set_to_undefined) { impl_->optimizer.zero_grad(set_to_undefined); }

double ZeroOptimizer::clip_grad_norm(double max_norm, double norm_type, bool error_if_nonfinite) {
  return optim::clip_grad_norm(impl_->optimizer, max_norm, norm_type, error_if_nonfinite);
}

optim::Optimizer& ZeroOptimizer::optimizer() const { return impl_->optimizer; }
int ZeroOptimizer::stage() const { return impl_->options.stage; }
const std::vector<std::vector<optim::Optimizer::ElementRange>>& ZeroOptimizer::shard_ranges() const {
  return impl_->ranges;
}
std::int64_t ZeroOptimizer::state_bytes() const { return impl_->optimizer.state_bytes(); }

ZeroOptimizer::State ZeroOptimizer::consolidated_state() {
  Impl& z = *impl_;
  z.wait_all();
  optim::Optimizer& optimizer = z.optimizer;
  const auto& arenas = z.ddp.registry().arenas();
  const std::size_t buffers = optimizer.state_buffer_names().size();
  std::vector<std::vector<Tensor>> full(arenas.size(), std::vector<Tensor>(buffers));
  for (std::size_t a = 0; a < arenas.size(); ++a) {
    // Each rank contributes its packed pieces (zeros where its buffer does not exist yet; the
    // presence bits, the same everywhere, decide what is exported).
    std::vector<std::int64_t> counts;
    std::int64_t total = 0;
    for (const auto& per_rank : z.all_ranges) {
      std::int64_t count = 0;
      for (const auto& range : per_rank[a]) count += range.end - range.begin;
      counts.push_back(count);
      total += count;
    }
    if (total == 0) continue;
    const DType dtype = optimizer.state_dtype(a);
    for (std::size_t b = 0; b < buffers; ++b) {
      Tensor mine = optimizer.shard_state(a, b);
      Tensor flag = Tensor::from_vector(std::vector<double>{mine.defined() ? 1.0 : 0.0}, {1});
      z.comm.allreduce_host(flag, comm::ReduceOp::max);
      if (flag.to_double_vector()[0] == 0.0) continue;  // no rank has this buffer
      if (!mine.defined()) mine = Tensor::zeros({counts[static_cast<std::size_t>(z.comm.rank())]}, dtype, arenas[a].device);
      Tensor packed = Tensor::empty({total}, dtype, arenas[a].device);
      z.comm.allgatherv(mine, packed, counts);
      Tensor whole = Tensor::zeros({arenas[a].values.numel()}, dtype, arenas[a].device);
      std::int64_t at = 0;
      for (const auto& per_rank : z.all_ranges) {
        for (const auto& range : per_rank[a]) {
          Tensor target = whole.view(static_cast<std::size_t>(range.begin), {range.end - range.begin});
          target.copy_from(packed.view(static_cast<std::size_t>(at), {range.end - range.begin}));
          at += range.end - range.begin;
        }
      }
      full[a][b] = whole;
    }
  }
  return {optimizer.state_tensors_of(full), optimizer.state_metadata()};
}

void ZeroOptimizer::save_consolidated(const std::filesystem::path& path) {
  const State state = consolidated_state();
  // Rank 0 writes; every rank learns whether it could, so a failed save is an error everywhere
  // (and, the save being atomic, the previous file is intact).
  std::string failure;
  if (impl_->comm.rank() == 0) {
    try {
      io::save_safetensors(path, state.tensors, state.metadata);
    } catch (const std::exception& error) {
      failure = error.what();
    }
  }
  Tensor failed = Tensor::from_vector(std::vector<double>{failure.empty() ? 0.0 : 1.0}, {1});
  impl_->comm.allreduce_host(failed, comm::ReduceOp::max);
  if (failed.to_double_vector()[0] != 0.0) {
    detail::throw_error("ZeroOptimizer::save_consolidated: ",
                        failure.empty() ? "rank 0 could not write " + path.string() + " (see its error)" : failure);
  }
}

void ZeroOptimizer::load_state(const std::filesystem::path& path) {
  impl_->wait_all();
  impl_->optimizer.load_state(path);
}

}  // namespace gradsync::dist
