// Hierarchical allreduce on simulated nodes (comm/cpu/hierarchical.h).
#include "hierarchical.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "dist.h"
#include "reproducible.h"
#include "test_util.h"

namespace gradsync::testing {

namespace {

using comm::ReduceOp;

Tensor input_of(int rank, std::int64_t n, DType dtype) {
  return filled(n, dtype, [rank](std::int64_t i) { return reproducible_input(rank, i); });
}

// Small whole numbers: every order of addition gives the same, exact, result.
Tensor whole_input_of(int rank, std::int64_t n, DType dtype) {
  return filled(n, dtype, [rank](std::int64_t i) { return static_cast<double>((i * 7 + rank * 3) % 11) - 5; });
}

}  // namespace

std::string simulated_node(int rank, int size, int nodes, bool round_robin) {
  const int per_node = (size + nodes - 1) / nodes;
  return "node" + std::to_string(round_robin ? rank % nodes : rank / per_node);
}

void hierarchical_values(comm::Communicator& world, Expect expect, std::int64_t largest) {
  const int n_ranks = world.size();
  const int me = world.rank();
  for (const std::int64_t n : {std::int64_t{0}, std::int64_t{1}, std::int64_t{3}, std::int64_t{7}, std::int64_t{1000},
                               std::int64_t{100003}, std::int64_t{1} << 20}) {
    if (n > largest) continue;
    for (const DType dtype : {DType::f32, DType::f64, DType::bf16}) {
      const std::string where = std::string(dtype_name(dtype)) + " x " + std::to_string(n) + ", rank " +
                                std::to_string(me) + " of " + std::to_string(n_ranks);
      // Whole numbers: sum, avg, min, max are exact whatever the order.
      std::vector<double> sum(static_cast<std::size_t>(n), 0), low(sum.size(), 1e9), high(sum.size(), -1e9);
      for (int r = 0; r < n_ranks; ++r) {
        const std::vector<double> x = whole_input_of(r, n, dtype).to_double_vector();
        for (std::size_t i = 0; i < x.size(); ++i) {
          sum[i] += x[i];
          low[i] = std::min(low[i], x[i]);
          high[i] = std::max(high[i], x[i]);
        }
      }
      for (const ReduceOp op : {ReduceOp::sum, ReduceOp::min, ReduceOp::max}) {
        Tensor value = whole_input_of(me, n, dtype);
        world.allreduce(value, op);
        const std::vector<double>& expected = op == ReduceOp::sum ? sum : op == ReduceOp::min ? low : high;
        ASSERT_EQ(value.to_double_vector(), expected) << reduce_op_name(op) << ", " << where;
      }
      if (dtype == DType::bf16) continue;  // 8 bits of mantissa: the exact checks above suffice

      // Values of many magnitudes: the f64 sum within 1e-6 relative (of the largest input).
      std::vector<double> exact(static_cast<std::size_t>(n), 0);
      double largest = 0;
      for (int r = 0; r < n_ranks; ++r) {
        const std::vector<double> x = input_of(r, n, dtype).to_double_vector();
        for (std::size_t i = 0; i < x.size(); ++i) {
          exact[i] += x[i];
          largest = std::max(largest, std::abs(x[i]));
        }
      }
      Tensor value = input_of(me, n, dtype);
      world.allreduce(value, ReduceOp::sum);
      const std::vector<double> got = value.to_double_vector();
      for (std::size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], exact[i], 1e-6 * largest) << "element " << i << ", " << where;
      }
      Tensor average = input_of(me, n, dtype);
      world.allreduce(average, ReduceOp::avg);
      const std::vector<double> mean = average.to_double_vector();
      for (std::size_t i = 0; i < mean.size(); ++i) {
        ASSERT_NEAR(mean[i], exact[i] / n_ranks, 1e-6 * largest) << "avg, element " << i << ", " << where;
      }

      if (expect == Expect::any_order || dtype != DType::f32 || n == 0) continue;
      // Two round-robin nodes of two: node 0 holds ranks 0 and 2, node 1 ranks 1 and 3. The
      // hierarchy adds inside each node (two terms: either order, the same bits), then the two
      // node sums: (x0 + x2) + (x1 + x3), in float.
      std::vector<float> x[4];
      for (int r = 0; r < 4; ++r) {
        const std::vector<double> values = input_of(r, n, dtype).to_double_vector();
        x[r].assign(values.begin(), values.end());
      }
      std::size_t differing = 0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        const float pairwise = (x[0][i] + x[2][i]) + (x[1][i] + x[3][i]);
        const float actual = static_cast<float>(got[i]);
        if (std::memcmp(&pairwise, &actual, sizeof pairwise) != 0) {
          ASSERT_EQ(expect, Expect::not_pairwise) << "element " << i << " is " << actual
                                                  << ", the hierarchy's order gives " << pairwise << ", " << where;
          ++differing;
        }
      }
      // Flat algorithms add in another order, which these inputs can tell apart once there are
      // enough elements (a handful of elements may happen to round alike).
      if (expect == Expect::not_pairwise && n >= 1000) {
        EXPECT_GT(differing, 0u) << "the flat allreduce added in the hierarchy's order: the check cannot tell, " << where;
      }
    }
  }
  // The coalesced form goes through the same allreduce.
  std::vector<Tensor> parts{whole_input_of(me, 5000, DType::f32), whole_input_of(me + 1, 70000, DType::f32)};
  world.allreduce_coalesced(parts, ReduceOp::sum);
  double expected = 0;
  for (int r = 0; r < n_ranks; ++r) expected += whole_input_of(r + 1, 70000, DType::f32).to_double_vector()[69999];
  EXPECT_EQ(parts[1].to_double_vector()[69999], expected);
}

void hierarchical_front_ends(comm::Communicator& world) {
  data_parallel_equivalence(world, dist::DDPSyncStrategy::single_auto_sync);
  equivalence_with_single_process(world, "adam");
  auto duplicate = world.duplicate();
  hierarchical_values(*duplicate, Expect::any_order);
  // Ranks 0 and 1 out: the rest (still on several nodes, or not) reduce correctly.
  auto rest = world.split(world.rank() < 2 ? comm::Communicator::kNoColor : 0, world.rank());
  if (rest != nullptr) {
    Tensor value = whole_input_of(world.rank(), 300000, DType::f32);
    rest->allreduce(value, ReduceOp::sum);
    double expected = 0;
    for (int r = 2; r < world.size(); ++r) expected += whole_input_of(r, 300000, DType::f32).to_double_vector()[123457];
    EXPECT_EQ(value.to_double_vector()[123457], expected);
  }
  world.barrier();
}

void hierarchical_settings_must_agree(comm::Communicator& world) {
  Tensor value = whole_input_of(world.rank(), 100, DType::f32);
  EXPECT_GRADSYNC_ERROR(world.allreduce(value, ReduceOp::sum), "rank 1 runs with mode", "GRADSYNC_HIERARCHICAL");
}

}  // namespace gradsync::testing
