// ZeRO's ownership and the sharded step (shards.h): who owns which range, the statistics
// over the owned pieces, and the gathers that put the updated values back together.
#include "shards.h"

#include <algorithm>

#include "gradsync/comm/records/flight_recorder.h"
#include "gradsync/core/timeline.h"
#include "gradsync/dist/replicas/replicas.h"

namespace gradsync::dist {

namespace {

void sort_ranges(std::vector<optim::Optimizer::ElementRange>& list) {
  std::sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
}

}  // namespace

ZeroShards::ZeroShards(optim::Optimizer& optimizer, const Reducer& reducer, comm::Communicator& comm, int stage,
                       StepPhases& phases)
    : optimizer_(optimizer), comm_(comm), stage_(stage), phases_(phases) {
  const std::size_t arenas = optimizer.registry().arenas().size();
  // Every rank the same stage and the same buckets (a rank with another bucket_cap_mb, say,
  // would cut other pieces): an error on every rank naming the first difference.
  std::vector<std::string> description{"stage " + std::to_string(stage)};
  for (std::size_t b = 0; b < reducer.bucket_count(); ++b) {
    const BucketInfo& info = reducer.bucket(b);
    description.push_back("bucket " + std::to_string(b) + ": arena " + std::to_string(info.members[0]->arena_index()) +
                          ", " + std::to_string(info.numel) + " elements from '" + info.members[0]->name() + "'");
  }
  require_same_lines(comm, description, "ZeroOptimizer", "shard layout");

  // Every rank's pieces ([rank][arena]), then this rank's, each bucket a gather.
  layout_.all_ranges.assign(static_cast<std::size_t>(comm.size()),
                            std::vector<std::vector<optim::Optimizer::ElementRange>>(arenas));
  layout_.ranges.assign(arenas, {});
  for (std::size_t b = 0; b < reducer.bucket_count(); ++b) {
    const BucketInfo& info = reducer.bucket(b);
    GRADSYNC_CHECK(info.arena_view, "ZeroOptimizer: bucket ", b, " (", info.members[0]->name(), ", ...) is not a view ",
                   "of the gradient arena (its members are not neighbours: frozen parameters between them?); ",
                   "ZeRO shards arena runs");
    Gather gather;
    gather.arena = info.members[0]->arena_index();
    gather.begin = static_cast<std::int64_t>(info.members[0]->arena_offset()) - info.member_offset[0];
    gather.numel = info.numel;
    for (int r = 0; r < comm.size(); ++r) {
      const BucketShard piece = shard_bucket(info.numel, comm.size(), r);
      if (piece.count == 0) continue;
      layout_.all_ranges[static_cast<std::size_t>(r)][gather.arena].push_back(
          {gather.begin + piece.begin, gather.begin + piece.begin + piece.count});
    }
    gather.shard = shard_bucket(info.numel, comm.size(), comm.rank());
    if (gather.shard.count > 0) {
      layout_.ranges[gather.arena].push_back(
          {gather.begin + gather.shard.begin, gather.begin + gather.shard.begin + gather.shard.count});
    }
    gathers_.push_back(std::move(gather));  // its staging is made at its first gather
  }
  for (auto& per_rank : layout_.all_ranges) {
    for (auto& list : per_rank) sort_ranges(list);
  }
  for (auto& list : layout_.ranges) sort_ranges(list);
  layout_.stage = stage;
  optimizer.shard(layout_.ranges, [this](optim::GradientStatistics& statistics) { combine(statistics); });
}

std::int64_t ZeroShards::largest_piece() const {
  std::int64_t largest = 0;
  for (const Gather& gather : gathers_) largest = std::max(largest, gather.shard.count);
  return largest;
}

Tensor ZeroShards::bucket_values(std::size_t bucket) const {
  const Gather& gather = gathers_[bucket];
  return optimizer_.registry().arenas()[gather.arena].values.view(static_cast<std::size_t>(gather.begin), {gather.numel});
}

void ZeroShards::combine(optim::GradientStatistics& statistics) {
  phases_.before_statistics();
  static const auto kLabel = std::make_shared<const std::string>("ZeRO gradient statistics");
  const comm::OperationLabel label(kLabel);
  Tensor sums = Tensor::from_vector(
      std::vector<double>{statistics.sum_of_squares, static_cast<double>(statistics.nonfinite)}, {2});
  comm_.allreduce_host(sums, comm::ReduceOp::sum);
  Tensor largest = Tensor::from_vector(std::vector<double>{statistics.max_abs}, {1});
  comm_.allreduce_host(largest, comm::ReduceOp::max);
  statistics.sum_of_squares = sums.to_double_vector()[0];
  statistics.nonfinite = static_cast<std::int64_t>(sums.to_double_vector()[1]);
  statistics.max_abs = largest.to_double_vector()[0];
}

void ZeroShards::launch_gather(std::size_t bucket, const std::string& label, Tensor staging) {
  Gather& gather = gathers_[bucket];
  const Arena& arena = optimizer_.registry().arenas()[gather.arena];
  if (!gather.staging.defined()) {
    gather.staging = staging.defined() ? std::move(staging) : Tensor::empty({gather.shard.count}, arena.dtype, arena.device);
  }
  Tensor values = arena.values;  // shares the arena's storage
  Tensor piece = gather.staging.view(0, {gather.shard.count});
  if (gather.shard.count > 0) {
    piece.copy_from(values.view(static_cast<std::size_t>(gather.begin + gather.shard.begin), {gather.shard.count}));
  }
  Tensor target = values.view(static_cast<std::size_t>(gather.begin), {gather.numel});
  timeline::instant("zero", "gather parameters");
  const comm::OperationLabel operation(label);
  gather.work = comm_.allgatherv_async(piece, target, gather.shard.counts);
}

void ZeroShards::wait(std::size_t bucket) {
  Gather& gather = gathers_[bucket];
  if (!gather.work) return;
  comm::WorkHandle work = std::move(gather.work);
  work->wait();
}

Tensor ZeroShards::take_staging(std::size_t bucket) { return std::move(gathers_[bucket].staging); }

void ZeroShards::launch_all() {
  for (std::size_t b = 0; b < gathers_.size(); ++b) {
    launch_gather(b, "ZeRO gather: arena " + std::to_string(gathers_[b].arena) + " from element " +
                         std::to_string(gathers_[b].begin));
  }
}

void ZeroShards::wait_all() {
  comm::FirstError errors;
  for (Gather& gather : gathers_) errors.wait(gather.work);
  errors.rethrow();
}

void ZeroShards::drain() noexcept {
  comm::FirstError ignored;  // destruction: nothing left to report to
  for (Gather& gather : gathers_) ignored.wait(gather.work);
}

void ZeroShards::zero_grad(bool set_to_undefined) {
  if (stage_ < 2 || set_to_undefined) return optimizer_.zero_grad(set_to_undefined);
  // Stages 2 and 3 keep only their pieces' gradient pages between steps: zeros that give the
  // pages back rather than write them (a plain fill would commit the whole gradient arena).
  optimizer_.zero_grad(true);
  for (std::size_t g = 0; g < optimizer_.group_count(); ++g) {
    for (Parameter* parameter : optimizer_.group_parameters(g)) parameter->grad_for_overwrite().zero_releasing_pages();
  }
}

}  // namespace gradsync::dist
