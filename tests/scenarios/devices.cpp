// The device-parameterised suite (devices.h).
#include "devices.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dist.h"
#include "expectations.h"
#include "gradsync/dist/horovod/distributed_optimizer.h"
#include "gradsync/kernels/ops.h"
#include "join.h"
#include "optimizers.h"
#include "parameters.h"
#include "test_util.h"
#include "zero.h"

namespace gradsync::testing {

namespace {

std::pair<std::vector<double>, std::vector<double>> step_once(
    comm::Communicator& comm, Device device, dist::DistributedOptimizerOptions options,
    const std::function<void(ParameterRegistry&, Parameter&, Parameter&, dist::DistributedOptimizer&)>& grads,
    bool sparse_q = false) {
  ParameterRegistry registry;
  Parameter& p = registry.add("p", {4}, DType::f32, device);
  Parameter& q = registry.add("q", {6, 2}, DType::f32, device);
  registry.finalize();
  std::unique_ptr<optim::Optimizer> sgd = make_test_optimizer("sgd", registry, {{"lr", 1.0}});
  options.reduce_with_one_rank = true;
  if (sparse_q) options.sparse_parameters = {&q};
  dist::DistributedOptimizer optimizer(*sgd, comm, options);
  grads(registry, p, q, optimizer);
  optimizer.step();
  std::vector<double> minus_p = p.value().to_double_vector();
  std::vector<double> minus_q = q.value().to_double_vector();
  for (double& v : minus_p) v = -v;
  for (double& v : minus_q) v = -v;
  return {minus_p, minus_q};
}

}  // namespace

void ddp_strategy_set(comm::Communicator& comm, Device device, dist::DDPSyncStrategy strategy) {
  const int n = comm.size();
  const double r1 = comm.rank() + 1;
  const std::string name = dist::sync_strategy_name(strategy);
  ParameterRegistry registry;
  Parameter& a = registry.add("a", {5}, DType::f32, device);
  Parameter& b = registry.add("b", {3}, DType::f32, device);
  registry.finalize();
  dist::DataParallel ddp(registry, comm, {.bucket_cap_mb = 1e-6});
  for (int step = 0; step < 2; ++step) {
    for (int mb = 0; mb < 2; ++mb) {
      auto context = dist::ddp_sync_context(ddp, mb == 1, strategy);
      ddp.begin_backward();
      b.accumulate_grad(filled_on(3, 10 * r1 * (mb + 1), device));
      registry.mark_ready(b);
      a.accumulate_grad(filled_on(5, r1 * (mb + 1), device));
      registry.mark_ready(a);
      ddp.end_backward();
    }
    expect_all(name + " a, step " + std::to_string(step), a.grad(), 3.0 * (n + 1) / 2);
    expect_all(name + " b, step " + std::to_string(step), b.grad(), 30.0 * (n + 1) / 2);
    registry.zero_grad();
  }
}

void ddp_unused_no_sync_hook_compression(comm::Communicator& comm, Device device) {
  const int n = comm.size();
  const double r1 = comm.rank() + 1;
  {
    ParameterRegistry registry;
    Parameter& used = registry.add("used", {4}, DType::f32, device);
    Parameter& partly = registry.add("partly", {2}, DType::f32, device);
    Parameter& never = registry.add("never", {3}, DType::f32, device);
    registry.finalize();
    dist::DataParallel ddp(registry, comm, {.find_unused_parameters = true});
    {
      auto local = ddp.no_sync();  // accumulates locally, undivided
      ddp.begin_backward();
      used.accumulate_grad(filled_on(4, r1, device));
      registry.mark_ready(used);
      ddp.end_backward();
    }
    ddp.begin_backward();
    used.accumulate_grad(filled_on(4, r1, device));
    registry.mark_ready(used);
    if (comm.rank() == 0) {
      partly.accumulate_grad(filled_on(2, 5.0, device));
      registry.mark_ready(partly);
    }
    ddp.end_backward();
    expect_all("used after no_sync + sync", used.grad(), n + 1.0);  // mean of 2 (r + 1)
    ASSERT_TRUE(partly.grad_defined());
    expect_all("partly (rank 0 only)", partly.grad(), 5.0 / n);
    EXPECT_FALSE(never.grad_defined());
    EXPECT_EQ(ddp.last_used_counts(), (std::vector<int>{n, 1, 0}));

    // FORCED_SYNC's step: a no_sync backward, then synchronize_all.
    registry.zero_grad();
    {
      auto local = ddp.no_sync();
      ddp.begin_backward();
      used.accumulate_grad(filled_on(4, 3 * r1, device));
      registry.mark_ready(used);
      ddp.end_backward();
    }
    ddp.synchronize_all();
    expect_all("used after synchronize_all", used.grad(), 3.0 * (n + 1) / 2);
    EXPECT_FALSE(never.grad_defined());
  }
  {
    ParameterRegistry registry;
    Parameter& p = registry.add("p", {6}, DType::f32, device);
    registry.finalize();
    dist::DataParallel ddp(registry, comm);
    // A hook sees the bucket undivided; this one triples it and sums.
    ddp.register_comm_hook([](comm::Communicator& c, Tensor& flat, const dist::BucketInfo&) {
      ops::scale(flat, 3.0);
      return c.allreduce_async(flat, comm::ReduceOp::sum);
    });
    ddp.begin_backward();
    p.set_grad(filled_on(6, r1, device));
    registry.mark_ready(p);
    ddp.end_backward();
    expect_all("hook", p.grad(), 3.0 * n * (n + 1) / 2);
  }
  for (const auto& [compression, dtype, epsilon] :
       {std::tuple{dist::Compression::fp16, DType::f16, 1.0 / 1024}, std::tuple{dist::Compression::bf16, DType::bf16, 1.0 / 128}}) {
    ParameterRegistry registry;
    Parameter& p = registry.add("p", {4}, DType::f32, device);
    registry.finalize();
    dist::DataParallel ddp(registry, comm, {.compression = compression});
    ddp.begin_backward();
    p.set_grad(filled_on(4, r1 / 3.0, device));
    registry.mark_ready(p);
    ddp.end_backward();
    const std::string what = std::string("DataParallel ") + dist::compression_name(compression);
    if (n == 1) {
      // Exactly the input's rounding: the gradient did travel compressed.
      expect_all(what, p.grad(), rounded_through(1.0 / 3.0, dtype), 0.0);
      EXPECT_NE(rounded_through(1.0 / 3.0, dtype), static_cast<double>(1.0f / 3.0f));
    } else {
      expect_all(what, p.grad(), (n + 1) / 6.0, 2 * n * epsilon);
    }
  }
}

void distributed_optimizer_options(comm::Communicator& comm, Device device) {
  using dist::Op;
  const int n = comm.size();
  const double r1 = comm.rank() + 1;
  // p[i] = (r + 1)(i + 1) / 4 on rank r; q likewise (12 elements).
  const auto ramp = [&](std::int64_t numel, double scale) {
    std::vector<double> values(static_cast<std::size_t>(numel));
    for (std::int64_t i = 0; i < numel; ++i) values[static_cast<std::size_t>(i)] = scale * r1 * (i + 1) / 4.0;
    return values;
  };
  const auto write = [&](double scale) {
    return [&, scale](ParameterRegistry& registry, Parameter& p, Parameter& q, dist::DistributedOptimizer&) {
      p.set_grad(Tensor::from_vector(ramp(4, scale), {4}).to(DType::f32).to(device));
      registry.mark_ready(p);
      q.set_grad(Tensor::from_vector(ramp(12, scale), {6, 2}).to(DType::f32).to(device));
      registry.mark_ready(q);
    };
  };
  // What the reduction of the ramp gives at element i for each op.
  const auto reduced = [&](Op op, std::int64_t i) {
    const double base = (i + 1) / 4.0;
    switch (op) {
      case Op::sum: return base * n * (n + 1) / 2.0;
      case Op::average: return base * (n + 1) / 2.0;
      case Op::min: return base;
      case Op::max: return base * n;
      case Op::product: {
        double product = 1;
        for (int r = 1; r <= n; ++r) product *= r * base;
        return product;
      }
      default: return 0.0;
    }
  };
  const auto check = [&](const std::string& what, const std::vector<double>& got, const std::function<double(std::int64_t)>& expected,
                         double relative) {
    for (std::size_t i = 0; i < got.size(); ++i) {
      const double want = expected(static_cast<std::int64_t>(i));
      ASSERT_NEAR(got[i], want, relative * std::max(1.0, std::abs(want))) << what << " [" << i << "]";
    }
  };
  for (const Op op : {Op::sum, Op::average, Op::min, Op::max, Op::product}) {
    const auto [p, q] = step_once(comm, device, {.op = op}, write(1.0));
    check(std::string("op ") + dist::op_name(op) + " p", p, [&](std::int64_t i) { return reduced(op, i); }, 1e-6);
    check(std::string("op ") + dist::op_name(op) + " q", q, [&](std::int64_t i) { return reduced(op, i); }, 1e-6);
  }
  // Two passes per step: their sum is what is averaged (not the input at world 1).
  {
    const auto [p, q] = step_once(comm, device, {.backward_passes_per_step = 2},
                                  [&](ParameterRegistry& registry, Parameter& p, Parameter& q, dist::DistributedOptimizer&) {
                                    for (const double pass : {1.0, 2.0}) {
                                      p.accumulate_grad(Tensor::from_vector(ramp(4, pass), {4}).to(DType::f32).to(device));
                                      registry.mark_ready(p);
                                      q.accumulate_grad(Tensor::from_vector(ramp(12, pass), {6, 2}).to(DType::f32).to(device));
                                      registry.mark_ready(q);
                                    }
                                  });
    check("backward_passes_per_step 2", p, [&](std::int64_t i) { return 3 * reduced(Op::average, i); }, 1e-6);
    check("backward_passes_per_step 2 (q)", q, [&](std::int64_t i) { return 3 * reduced(Op::average, i); }, 1e-6);
  }
  // Predivision splits the average's division around the sum: the same mean.
  {
    const auto [p, q] = step_once(comm, device, {.op = Op::average, .gradient_predivide_factor = 4.0}, write(1.0));
    check("gradient_predivide_factor 4", p, [&](std::int64_t i) { return reduced(Op::average, i); }, 1e-6);
    check("gradient_predivide_factor 4 (q)", q, [&](std::int64_t i) { return reduced(Op::average, i); }, 1e-6);
  }
  // Groups: a number of groups, and explicit lists.
  {
    const auto [p, q] = step_once(comm, device, {.groups = 2}, write(1.0));
    check("groups 2", p, [&](std::int64_t i) { return reduced(Op::average, i); }, 1e-6);
    check("groups 2 (q)", q, [&](std::int64_t i) { return reduced(Op::average, i); }, 1e-6);
  }
  // Compression rounds through the wire dtype: at world 1 exactly the input's rounding.
  for (const auto& [compression, dtype, epsilon] :
       {std::tuple{dist::Compression::fp16, DType::f16, 1.0 / 1024}, std::tuple{dist::Compression::bf16, DType::bf16, 1.0 / 128}}) {
    const auto [p, q] = step_once(comm, device, {.compression = compression},
                                  [&](ParameterRegistry& registry, Parameter& p, Parameter& q, dist::DistributedOptimizer&) {
                                    p.set_grad(filled_on(4, r1 / 3.0, device));
                                    registry.mark_ready(p);
                                    q.set_grad(filled_on(12, r1 / 3.0, device).view(0, {6, 2}));
                                    registry.mark_ready(q);
                                  });
    const std::string what = std::string("DistributedOptimizer ") + dist::compression_name(compression);
    if (n == 1) {
      check(what, p, [&](std::int64_t) { return rounded_through(1.0 / 3.0, dtype); }, 0.0);
    } else {
      check(what, p, [&](std::int64_t) { return (n + 1) / 6.0; }, 2 * n * epsilon);
    }
  }
  // Sparse rows (allgathered, then summed into dense rows), and sparse_as_dense: rank r
  // touches rows r % 6 and 3 twice; the average of the dense sums.
  for (const bool as_dense : {false, true}) {
    const auto [p, q] = step_once(
        comm, device, {.sparse_as_dense = as_dense},
        [&](ParameterRegistry& registry, Parameter& p, Parameter& q, dist::DistributedOptimizer& optimizer) {
          p.set_grad(Tensor::from_vector(ramp(4, 1.0), {4}).to(DType::f32).to(device));
          registry.mark_ready(p);
          static_cast<void>(q);
          const std::vector<double> rows{double(comm.rank() % 6), 3.0, 3.0};
          std::vector<double> values;
          for (std::size_t k = 0; k < rows.size(); ++k) {
            for (int e = 0; e < 2; ++e) values.push_back(r1 * (k + 1) + 0.5 * e);
          }
          optimizer.set_sparse_grad(q, Tensor::from_vector(rows, {3}).to(DType::i64),
                                    Tensor::from_vector(values, {3, 2}).to(DType::f32).to(device));
        },
        /*sparse_q=*/true);
    std::vector<double> dense(12, 0.0);
    for (int r = 0; r < n; ++r) {
      const std::vector<int> rows{r % 6, 3, 3};
      for (std::size_t k = 0; k < rows.size(); ++k) {
        for (int e = 0; e < 2; ++e) dense[static_cast<std::size_t>(rows[k] * 2 + e)] += (r + 1.0) * (k + 1) + 0.5 * e;
      }
    }
    for (double& value : dense) value /= n;
    check(as_dense ? "sparse_as_dense" : "sparse rows", q, [&](std::int64_t i) { return dense[static_cast<std::size_t>(i)]; }, 1e-6);
    check("dense beside sparse", p, [&](std::int64_t i) { return reduced(Op::average, i); }, 1e-6);
  }
  // Adasum (powers of two): parallel updates (r + 1) g combine to their mean.
  if ((n & (n - 1)) == 0) {
    const auto [p, q] = step_once(comm, device, {.op = Op::adasum}, write(1.0));
    check("adasum", p, [&](std::int64_t i) { return reduced(Op::average, i); }, 1e-5);
    check("adasum (q)", q, [&](std::int64_t i) { return reduced(Op::average, i); }, 1e-5);
  }
}

void zero_and_join(comm::Communicator& comm, Device device) {
  zero_matches_unsharded(comm, {.stage = 1, .optimizer = "adam", .steps = 4, .device = device});
  zero_matches_unsharded(comm, {.stage = 2, .optimizer = "sgd", .clip = 0.5, .steps = 4, .device = device});
  zero_matches_unsharded(comm, {.stage = 3, .optimizer = "adamw", .strategy = dist::DDPSyncStrategy::multi_auto_sync,
                                .clip = 0.5, .steps = 4, .device = device});
  if (comm.size() >= 2) {
    uneven_data_parallel(comm, {.epochs = 1, .device = device});
    uneven_data_parallel(comm, {.optimizer = "adam", .epochs = 1, .zero_stage = 1, .device = device});
  }
}

void all_device_scenarios(comm::Communicator& comm, Device device) {
  SCOPED_TRACE(std::string(comm.backend()) + ", " + std::to_string(comm.size()) + " rank(s), parameters on " + device.str());
  for (const dist::DDPSyncStrategy strategy : every_strategy()) ddp_strategy_set(comm, device, strategy);
  ddp_unused_no_sync_hook_compression(comm, device);
  distributed_optimizer_options(comm, device);
  for (const std::string kind : {"sgd", "adam"}) equivalence_with_single_process(comm, kind, device);
  force_allreduce_when_a_rank_skips_a_parameter(comm, device);
  for (const dist::DDPSyncStrategy strategy : explicit_strategies()) data_parallel_equivalence(comm, strategy, device);
  data_parallel_missing_gradient(comm, device);
  random_ready_orders_across_reducers(comm, 3, 20, device);
  zero_and_join(comm, device);
}

void a_rank_that_skips_a_collective(comm::Communicator& comm, std::optional<Device> on) {
  if (comm.size() < 2) return;
  if (comm.rank() == comm.size() - 1) {
    // Stuck: alive (its connections open) but issuing nothing, until the others are done.
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    return;
  }
  const Device device = on.value_or(comm.device_type());
  Tensor first = filled_on(1 << 16, 1.0, device);
  Tensor second = filled_on(1 << 16, 2.0, device);
  auto work = comm.allreduce_async(first, comm::ReduceOp::sum);  // the last rank never joins this one
  auto queued = comm.allreduce_async(second, comm::ReduceOp::sum);
  // Its own timeout, or (CPU backends, 3+ ranks) a peer that gave up first closing the connection.
  try {
    work->wait(std::chrono::milliseconds(1000));
    ADD_FAILURE() << "a collective that a rank skipped completed";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("allreduce #0"), std::string::npos) << message;
    EXPECT_TRUE(message.find("did not complete within 1000 ms") != std::string::npos ||
                message.find("by peer") != std::string::npos)
        << message;
  }
  // The one behind it was never reduced: a failure naming the first, never a result (on NCCL
  // the abort completes its event; the ledger knows better)...
  EXPECT_GRADSYNC_ERROR(queued->wait(), "allreduce #1", "allreduce #0");
  EXPECT_TRUE(queued->is_completed());  // ...and settled, so a poll loop ends
  EXPECT_NE(comm.broken_reason().find("allreduce #0"), std::string::npos) << comm.broken_reason();
  Tensor later = filled_on(4, 1.0, device);
  EXPECT_GRADSYNC_ERROR(comm.allreduce(later, comm::ReduceOp::sum), "allreduce #2", "broken", "allreduce #0");
}

}  // namespace gradsync::testing
