// Sub-communicators (split.h).
#include "split.h"

#include <gtest/gtest.h>

#include "collectives.h"
#include "dist.h"
#include "gradsync/dist/horovod/distributed_optimizer.h"
#include "gradsync/dist/horovod/process_set.h"
#include "gradsync/optim/sgd.h"
#include "models.h"
#include "expectations.h"
#include "test_util.h"
#include "zero.h"

namespace gradsync::testing {

namespace {

using comm::Communicator;

// The sum over the group of each member's old rank.
double sum_of_old_ranks(Communicator& group, int old_rank) {
  Tensor value = Tensor::from_vector(std::vector<double>{static_cast<double>(old_rank)}, {1});
  group.allreduce(value, comm::ReduceOp::sum);
  return value.to_double_vector()[0];
}

}  // namespace

void split_groups(Communicator& world) {
  const int n = world.size();
  const int me = world.rank();
  // Parity, keys reversed: the group of parity p holds the ranks of that parity, the highest first.
  {
    auto group = world.split(me % 2, -me);
    ASSERT_NE(group, nullptr);
    int members = 0, above = 0;
    double expected = 0;
    for (int r = me % 2; r < n; r += 2) {
      ++members;
      expected += r;
      if (r > me) ++above;
    }
    EXPECT_EQ(group->size(), members);
    EXPECT_EQ(group->rank(), above) << "ordered by key: the highest old rank first";
    EXPECT_EQ(sum_of_old_ranks(*group, me), expected);
    check_collectives(*group, {0, 1, 7, 1000});
    // A split of a split: every member alone.
    auto alone = group->split(group->rank(), 0);
    ASSERT_NE(alone, nullptr);
    EXPECT_EQ(alone->size(), 1);
    EXPECT_EQ(sum_of_old_ranks(*alone, me), me);
  }
  // Rank 0 out: the others together, in their order; rank 0 gets nothing, and the world goes on.
  {
    auto rest = world.split(me == 0 ? Communicator::kNoColor : 7, me);
    if (me == 0) {
      EXPECT_EQ(rest, nullptr);
    } else {
      ASSERT_NE(rest, nullptr);
      EXPECT_EQ(rest->size(), n - 1);
      EXPECT_EQ(rest->rank(), me - 1);
      EXPECT_EQ(sum_of_old_ranks(*rest, me), n * (n - 1) / 2.0);
    }
    world.barrier();
  }
  EXPECT_GRADSYNC_ERROR(world.split(-5, 0), "color -5");
}

void two_axes(Communicator& world) {
  ASSERT_EQ(world.size() % 2, 0);
  const int me = world.rank();
  auto row = world.split(me / 2, me);     // "tensor parallel": ranks 2i and 2i + 1
  auto column = world.split(me % 2, me);  // data parallel: every other rank
  ASSERT_TRUE(row && column);
  // A big allreduce on the row stays in flight while the column trains.
  Tensor partial = Tensor::from_vector(std::vector<float>(1 << 18, static_cast<float>(me)), {1 << 18});
  comm::WorkHandle pending = row->allreduce_async(partial, comm::ReduceOp::sum);
  data_parallel_equivalence(*column, dist::DDPSyncStrategy::single_auto_sync);
  for (const int stage : {1, 2}) {
    zero_matches_unsharded(*column, ZeroCase{.stage = stage, .optimizer = "adamw"});
  }
  equivalence_with_single_process(*column, "adam");
  pending->wait();
  const float row_sum = static_cast<float>(2 * (me / 2 * 2) + 1);
  EXPECT_EQ(partial.to_double_vector()[12345], row_sum);
}

void process_sets(Communicator& world) {
  ASSERT_GE(world.size(), 3);
  const int me = world.rank();
  dist::ProcessSet set(world, {2, 0});
  EXPECT_EQ(set.ranks(), (std::vector<int>{0, 2}));
  EXPECT_EQ(set.describe(), "process set {0, 2}");
  if (set.includes(me)) {
    EXPECT_EQ(set.communicator().size(), 2);
    EXPECT_EQ(set.communicator().rank(), me / 2);
    equivalence_with_single_process(set.communicator(), "sgd");
  } else {
    EXPECT_GRADSYNC_ERROR(set.communicator(), "process set {0, 2}", "rank " + std::to_string(me), "not a member");
    Regression model(8);
    optim::SGD sgd(model.registry, optim::SGD::Options{.lr = 0.1, .momentum = 0.0, .dampening = 0.0,
                                                             .weight_decay = 0.0, .nesterov = false, .maximize = false});
    EXPECT_GRADSYNC_ERROR(dist::DistributedOptimizer(sgd, set), "process set {0, 2}", "not a member");
  }
  world.barrier();
  // Rank 1 passes another list: every rank fails, naming a rank with a different set.
  EXPECT_GRADSYNC_ERROR(dist::ProcessSet(world, me == 1 ? std::vector<int>{0, 1} : std::vector<int>{0, 2}),
                        "passes a different set", "the same process sets");
  EXPECT_GRADSYNC_ERROR(dist::ProcessSet(world, {0, 0}), "lists a rank twice");
  EXPECT_GRADSYNC_ERROR(dist::ProcessSet(world, {0, world.size()}), "outside the world");
}

}  // namespace gradsync::testing
