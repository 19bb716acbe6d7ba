// The dist layer's scenarios (dist.h).
#include "dist.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "expectations.h"
#include "gradsync/dist/horovod/adasum.h"
#include "gradsync/dist/horovod/distributed_optimizer.h"
#include "gradsync/dist/reducer/reducer.h"
#include "gradsync/kernels/ops.h"
#include "models.h"
#include "optimizers.h"
#include "test_util.h"

namespace gradsync::testing {

void equivalence_with_single_process(comm::Communicator& comm, const std::string& kind,
                                     Device device) {
  SCOPED_TRACE(kind);
  const std::int64_t per_rank = 6;
  const std::int64_t batch = per_rank * comm.size();
  const int steps = 5;
  Regression distributed(batch * steps, DType::f32, device);
  Regression single(batch * steps);
  std::unique_ptr<optim::Optimizer> inner = make_test_optimizer(kind, distributed.registry, training_settings(kind));
  std::unique_ptr<optim::Optimizer> reference = make_test_optimizer(kind, single.registry, training_settings(kind));
  // At world 1 too through the Reducer (a device backend's only test on a one-GPU machine).
  dist::DistributedOptimizer optimizer(*inner, comm, {.reduce_with_one_rank = true});
  for (int step = 0; step < steps; ++step) {
    const std::int64_t start = step * batch;
    distributed.backward(start + comm.rank() * per_rank, start + (comm.rank() + 1) * per_rank);
    optimizer.step();
    optimizer.zero_grad();
    single.backward(start, start + batch, /*mark_ready=*/false);
    reference->step();
    reference->zero_grad();
  }
  // f32 sums in a different order: a few ulps per step.
  expect_near_vectors(kind + " w", distributed.w->value().to_double_vector(), single.w->value().to_double_vector(), 2e-5);
  expect_near_vectors(kind + " b", distributed.b->value().to_double_vector(), single.b->value().to_double_vector(), 2e-5);
}

void force_allreduce_when_a_rank_skips_a_parameter(comm::Communicator& comm, Device device) {
  ParameterRegistry registry;
  Parameter& head_a = registry.add("head_a", {5}, DType::f32, device);
  Parameter& head_b = registry.add("head_b", {3}, DType::f32, device);
  registry.finalize();
  std::unique_ptr<optim::Optimizer> sgd = make_test_optimizer("sgd", registry, {{"lr", 1.0}});
  dist::DistributedOptimizer optimizer(*sgd, comm, {.op = dist::Op::sum});
  head_a.set_grad(Tensor::from_vector(std::vector<float>(5, 1.0f), {5}).to(device));
  registry.mark_ready(head_a);
  if (comm.rank() != 0) {  // rank 0 uses head A only
    head_b.set_grad(Tensor::from_vector(std::vector<float>(3, 2.0f), {3}).to(device));
    registry.mark_ready(head_b);
  }
  optimizer.step();
  const double n = comm.size();
  expect_near_vectors("head_a", head_a.value().to_double_vector(), std::vector<double>(5, -n), 0);
  expect_near_vectors("head_b", head_b.value().to_double_vector(), std::vector<double>(3, -2.0 * (n - 1)), 0);
  optimizer.zero_grad();
}

void adasum_math(comm::Communicator& comm) {
  const int n = comm.size();
  for (const std::int64_t length : {std::int64_t{20} * n - 17, std::int64_t{2} * n + 1, std::int64_t{n} + 2, std::int64_t{1} << 16}) {
    // Orthogonal: rank r holds e_r scaled (disjoint supports), so the result is their sum.
    std::vector<double> mine(static_cast<std::size_t>(length), 0.0);
    std::vector<double> sum(static_cast<std::size_t>(length), 0.0);
    for (int r = 0; r < n; ++r) {
      for (std::int64_t i = r; i < length; i += n) {
        const double value = 1.0 + 0.25 * r + 0.001 * static_cast<double>(i);
        sum[static_cast<std::size_t>(i)] = value;
        if (r == comm.rank()) mine[static_cast<std::size_t>(i)] = value;
      }
    }
    for (const DType dtype : {DType::f32, DType::f64}) {
      Tensor t = Tensor::from_vector(mine, {length}).to(dtype);
      dist::adasum_allreduce(comm, t, {{0, length}});
      expect_near_vectors("orthogonal " + std::string(dtype_name(dtype)) + " length " + std::to_string(length),
                          t.to_double_vector(), Tensor::from_vector(sum, {length}).to(dtype).to_double_vector(),
                          dtype == DType::f32 ? 1e-6 : 1e-12);
    }
    // Parallel: rank r holds (r + 1) v, so the result is the mean ((n + 1) / 2) v; also at
    // tiny and huge magnitudes (stability).
    for (const double magnitude : {1.0, 1e-30, 1e30, 1e-70, 1e120}) {
      std::vector<double> v(static_cast<std::size_t>(length));
      for (std::int64_t i = 0; i < length; ++i) v[static_cast<std::size_t>(i)] = magnitude * std::sin(0.1 * static_cast<double>(i) + 1.0);
      std::vector<double> scaled = v;
      for (double& value : scaled) value *= comm.rank() + 1;
      std::vector<double> mean = v;
      for (double& value : mean) value *= (n + 1) / 2.0;
      Tensor t = Tensor::from_vector(scaled, {length});
      dist::adasum_allreduce(comm, t, {{0, length}});
      const std::vector<double> got = t.to_double_vector();
      for (std::size_t i = 0; i < got.size(); ++i) {
        EXPECT_NEAR(got[i] / magnitude, mean[i] / magnitude, 1e-9) << "parallel, magnitude " << magnitude << " [" << i << "]";
      }
    }
  }
  // Per tensor inside one buffer: the first tensor parallel (mean), the second orthogonal (sum).
  {
    std::vector<double> values(8, 0.0);
    for (int i = 0; i < 4; ++i) values[static_cast<std::size_t>(i)] = (comm.rank() + 1) * (i + 1.0);
    values[4 + static_cast<std::size_t>(comm.rank() % 4)] = 1.0;
    Tensor t = Tensor::from_vector(values, {8});
    dist::adasum_allreduce(comm, t, {{0, 4}, {4, 4}});
    const std::vector<double> got = t.to_double_vector();
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(got[static_cast<std::size_t>(i)], (n + 1) / 2.0 * (i + 1.0), 1e-9);
    if (n <= 4) {
      for (int r = 0; r < 4; ++r) EXPECT_NEAR(got[4 + static_cast<std::size_t>(r)], r < n ? 1.0 : 0.0, 1e-9);
    }
  }
}

void data_parallel_equivalence(comm::Communicator& comm, dist::DDPSyncStrategy strategy,
                               Device device) {
  SCOPED_TRACE(dist::sync_strategy_name(strategy));
  const std::int64_t per_rank = 8;
  const std::int64_t batch = per_rank * comm.size();
  Regression distributed(batch * 3, DType::f32, device);
  Regression single(batch * 3);
  dist::DataParallel ddp(distributed.registry, comm, {.bucket_cap_mb = 1e-6});
  const optim::Hyperparameters settings{{"lr", 0.1}, {"momentum", 0.9}};
  std::unique_ptr<optim::Optimizer> sgd = make_test_optimizer("sgd", distributed.registry, settings);
  std::unique_ptr<optim::Optimizer> reference = make_test_optimizer("sgd", single.registry, settings);
  for (int step = 0; step < 3; ++step) {
    for (int mb = 0; mb < 2; ++mb) {
      auto context = dist::ddp_sync_context(ddp, mb == 1, strategy);
      // Each microbatch is half of this rank's rows; its mean gradient counts half.
      const std::int64_t begin = step * batch + comm.rank() * per_rank + mb * per_rank / 2;
      ddp.begin_backward();
      distributed.backward(begin, begin + per_rank / 2);
      ddp.end_backward();
    }
    ops::scale(distributed.w->grad_for_overwrite(), 0.5);
    ops::scale(distributed.b->grad_for_overwrite(), 0.5);
    sgd->step();
    sgd->zero_grad();
    single.backward(step * batch, (step + 1) * batch, false);
    reference->step();
    reference->zero_grad();
  }
  expect_near_vectors(std::string(dist::sync_strategy_name(strategy)) + " w", distributed.w->value().to_double_vector(),
                      single.w->value().to_double_vector(), 2e-5);
}

void data_parallel_missing_gradient(comm::Communicator& comm, Device device) {
  if (comm.size() < 2) return;
  ParameterRegistry registry;
  Parameter& a = registry.add("a", {3}, DType::f32, device);
  Parameter& b = registry.add("b", {3}, DType::f32, device);
  registry.finalize();
  dist::DataParallel ddp(registry, comm);
  ddp.begin_backward();
  a.set_grad(Tensor::from_vector(std::vector<float>(3, 1.0f), {3}).to(device));
  registry.mark_ready(a);
  const int missing_rank = comm.size() - 1;
  if (comm.rank() != missing_rank) {
    b.set_grad(Tensor::from_vector(std::vector<float>(3, 1.0f), {3}).to(device));
    registry.mark_ready(b);
  }
  if (comm.rank() == missing_rank) {
    EXPECT_GRADSYNC_ERROR(ddp.end_backward(), "Parameters which did not receive grad for rank " + std::to_string(missing_rank) + ": b");
  } else {
    EXPECT_GRADSYNC_ERROR(ddp.end_backward(), "rank " + std::to_string(missing_rank) + " did not produce a gradient");
  }
}

void random_ready_orders_across_reducers(comm::Communicator& comm, int reducers, int trials,
                                         Device device) {
  constexpr int kPerReducer = 3;       // parameters per Reducer, one bucket each
  constexpr std::int64_t kNumel = 16;  // 64-byte buckets everywhere
  ParameterRegistry registry;
  std::vector<std::vector<Parameter*>> owned(static_cast<std::size_t>(reducers));
  for (int r = 0; r < reducers; ++r) {
    for (int p = 0; p < kPerReducer; ++p) {
      owned[static_cast<std::size_t>(r)].push_back(
          &registry.add("r" + std::to_string(r) + ".p" + std::to_string(p), {kNumel}, DType::f32, device));
    }
  }
  registry.finalize();
  std::vector<std::unique_ptr<dist::Reducer>> reducer;
  for (int r = 0; r < reducers; ++r) {
    reducer.push_back(std::make_unique<dist::Reducer>(registry, comm, owned[static_cast<std::size_t>(r)],
                                                      std::vector<std::vector<Parameter*>>{},
                                                      dist::ReducerOptions{.bucket_limits = {kNumel * 4}}));
    ASSERT_EQ(reducer.back()->bucket_count(), static_cast<std::size_t>(kPerReducer));
  }
  // Distinct small integers per (trial, reducer, parameter, rank): sums are exact in f32.
  const auto value = [](int trial, int r, int p, int rank) { return float((trial % 7) * 1000 + r * 100 + p * 10 + rank); };
  const int n = comm.size();
  std::mt19937 order_rng(977u + static_cast<unsigned>(comm.rank()) * 7919u);  // a different order on every rank
  for (int trial = 0; trial < trials; ++trial) {
    std::vector<std::pair<int, int>> order;
    for (int r = 0; r < reducers; ++r) {
      for (int p = 0; p < kPerReducer; ++p) {
        owned[static_cast<std::size_t>(r)][static_cast<std::size_t>(p)]->set_grad(
            Tensor::from_vector(std::vector<float>(kNumel, value(trial, r, p, comm.rank())), {kNumel}).to(device));
        order.emplace_back(r, p);
      }
    }
    std::shuffle(order.begin(), order.end(), order_rng);
    // A user collective on the shared communicator at a rank-dependent point of the order.
    const std::size_t user_at = order_rng() % (order.size() + 1);
    Tensor user = Tensor::from_vector(std::vector<double>{1.0 + comm.rank()}, {1}).to(comm.device_type());
    for (std::size_t k = 0; k <= order.size(); ++k) {
      if (k == user_at) comm.allreduce(user, comm::ReduceOp::sum);
      if (k == order.size()) break;
      const auto [r, p] = order[k];
      reducer[static_cast<std::size_t>(r)]->ready(*owned[static_cast<std::size_t>(r)][static_cast<std::size_t>(p)]);
    }
    std::vector<int> finish_order(static_cast<std::size_t>(reducers));
    for (int r = 0; r < reducers; ++r) finish_order[static_cast<std::size_t>(r)] = r;
    std::shuffle(finish_order.begin(), finish_order.end(), order_rng);
    for (const int r : finish_order) reducer[static_cast<std::size_t>(r)]->synchronize();
    ASSERT_EQ(user.to_double_vector()[0], n * (n + 1) / 2.0) << "trial " << trial;
    for (int r = 0; r < reducers; ++r) {
      for (int p = 0; p < kPerReducer; ++p) {
        float expected = 0;
        for (int rank = 0; rank < n; ++rank) expected += value(trial, r, p, rank);
        const std::vector<double> got = owned[static_cast<std::size_t>(r)][static_cast<std::size_t>(p)]->grad().to_double_vector();
        for (const double element : got) {
          ASSERT_EQ(element, expected) << "trial " << trial << ", reducer " << r << ", parameter " << p << ", rank "
                                       << comm.rank();
        }
      }
    }
  }
}

}  // namespace gradsync::testing
