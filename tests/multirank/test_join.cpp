// Uneven inputs on Gloo ranks-as-threads, 2-4 ranks: dist::Join over DataParallel under every
// sync strategy and option, Horovod's join through the DistributedOptimizer, early
// termination, and the errors (docs/join.md).
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "expectations.h"
#include "gradsync/comm/gloo/gloo.h"
#include "gradsync/dist/horovod/distributed_optimizer.h"
#include "gradsync/dist/join/join.h"
#include "gradsync/dist/zero/zero.h"
#include "gradsync/io/safetensors.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/optim/adam.h"
#include "gradsync/optim/grad_scaler.h"
#include "gradsync/optim/sgd.h"
#include "join.h"
#include "models.h"
#include "optimizers.h"
#include "parameters.h"
#include "ranks_on_device.h"
#include "test_util.h"

namespace gradsync {
namespace {

using comm::Communicator;
using dist::DDPSyncStrategy;

// DataParallel inside dist::Join against the reference, one named case per world of 2-4 ranks,
// strategy, optimizer, division rule and usage pattern.
using UnevenParameters = std::tuple<int, DDPSyncStrategy, std::string, bool, bool>;
class UnevenDataParallel : public ::testing::TestWithParam<UnevenParameters> {};

std::string uneven_name(const ::testing::TestParamInfo<UnevenParameters>& info) {
  const auto& [world, strategy, optimizer, divide_by_initial, find_unused] = info.param;
  return testing::name(testing::ranks_name(world), testing::strategy_name(strategy), optimizer,
                       divide_by_initial ? "by_initial" : "by_active", find_unused ? "unused" : "all_used");
}

INSTANTIATE_TEST_SUITE_P(Cases, UnevenDataParallel,
                         ::testing::Combine(::testing::Values(2, 3, 4), ::testing::ValuesIn(testing::every_strategy()),
                                            ::testing::Values("sgd", "adam"), ::testing::Bool(), ::testing::Bool()),
                         uneven_name);

TEST_P(UnevenDataParallel, MatchesTheReference) {
  const auto& [world, strategy, optimizer, divide_by_initial, find_unused] = GetParam();
  comm::run_gloo_thread_group(world, [&](Communicator& comm) {
    testing::uneven_data_parallel(comm, {.optimizer = optimizer,
                                         .strategy = strategy,
                                         .divide_by_initial_world_size = divide_by_initial,
                                         .find_unused_parameters = find_unused});
  });
}

// AUTO decides while a rank is joined (rank 1 runs out at step 4, the decision rides on step
// 7's status): the joined rank decides with the others, and every rank goes on with the same
// strategy after the join.
TEST(Join, AutoDecidesWhileARankIsJoined) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    testing::uneven_data_parallel(comm, {.strategy = DDPSyncStrategy::auto_select, .counts = {10, 4}});
  });
}

// ZeRO as a joinable: a joined rank keeps stepping its pieces (they are nobody else's) and
// takes part in the gathers and in the clipping norm, under every strategy that applies (stage 2
// refuses MULTI), with clipping and division by the active ranks, and with a learning rate that
// changes every step (the joined ranks step their pieces with the active ranks' rate).
using ZeroJoinParameters = std::tuple<int, int, std::string>;
class ZeroJoin : public ::testing::TestWithParam<ZeroJoinParameters> {};

std::vector<ZeroJoinParameters> zero_join_cases() {
  std::vector<ZeroJoinParameters> cases;
  for (const int world : {2, 3, 4}) {
    for (const int stage : {1, 2}) {
      for (const std::string variant :
           {"single_auto_sync", "multi_auto_sync", "forced_sync", "auto", "clip_by_active", "lr_schedule"}) {
        cases.emplace_back(world, stage, variant);
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, ZeroJoin, ::testing::ValuesIn(zero_join_cases()), [](const auto& info) {
  return testing::name(testing::ranks_name(std::get<0>(info.param)), "stage" + std::to_string(std::get<1>(info.param)),
                       std::get<2>(info.param));
});

TEST_P(ZeroJoin, KeepsSteppingOnJoinedRanks) {
  const auto& [world, stage, variant] = GetParam();
  comm::run_gloo_thread_group(world, [&](Communicator& comm) {
    if (variant == "clip_by_active") {
      testing::uneven_data_parallel(comm, {.divide_by_initial_world_size = false, .zero_stage = stage, .clip = 0.5});
    } else if (variant == "lr_schedule") {
      testing::uneven_data_parallel(comm, {.optimizer = "adam", .zero_stage = stage, .lr_schedule = true});
    } else {
      testing::uneven_data_parallel(comm, {.optimizer = "adam", .strategy = dist::parse_sync_strategy(variant),
                                           .find_unused_parameters = stage == 1, .zero_stage = stage});
    }
  });
}

TEST(Join, CompressionHooksAndOneMicrobatch) {
  comm::run_gloo_thread_group(3, [](Communicator& comm) {
    testing::uneven_data_parallel(comm, {.microbatches = 1, .compression = dist::Compression::fp16, .tolerance = 2e-3});
    testing::uneven_data_parallel(comm, {.optimizer = "adam", .microbatches = 3, .divide_by_initial_world_size = false,
                                         .compression = dist::Compression::bf16, .tolerance = 2e-2});
  });
}

// A hook reduces the zero buckets of a joined rank like any other; it decides the division
// (PyTorch's allreduce_hook divides by the world size), so divide_by_initial_world_size = false
// does not rescale.
TEST(Join, ACommunicationHookSeesTheShadowBuckets) {
  comm::run_gloo_thread_group(3, [](Communicator& comm) {
    testing::Regression model(64);
    dist::DataParallel ddp(model.registry, comm, {.bucket_cap_mb = 1e-6});
    int calls = 0;
    ddp.register_comm_hook([&](Communicator& c, Tensor& flat, const dist::BucketInfo&) {
      ++calls;
      ops::scale(flat, 1.0 / c.size());
      return c.allreduce_async(flat, comm::ReduceOp::sum);
    });
    const int mine = comm.rank() + 1;
    dist::Join join(ddp, {.divide_by_initial_world_size = false});
    for (int step = 0; step < mine; ++step) {
      ddp.begin_backward();
      model.w->set_grad(Tensor::from_vector(std::vector<float>(testing::Regression::kFeatures, 3.0f), {testing::Regression::kFeatures}));
      model.registry.mark_ready(*model.w);
      model.b->set_grad(Tensor::from_vector(std::vector<float>{3.0f}, {1}));
      model.registry.mark_ready(*model.b);
      ddp.end_backward();
      const double active = comm.size() - step;
      EXPECT_FLOAT_EQ(model.b->grad().to_double_vector()[0], 3.0 * active / comm.size()) << "step " << step;
    }
    EXPECT_EQ(join.join(), 2);
    // Two buckets in each of the 3 steps, and in the final shadow step, where every rank has
    // joined (the status that tells comes after the buckets).
    EXPECT_EQ(calls, 2 * (comm.size() + 1));
  });
}

// Horovod's join through the DistributedOptimizer, with backward_passes_per_step and a sparse
// parameter.
class HorovodJoin : public ::testing::TestWithParam<std::tuple<int, std::string>> {};
INSTANTIATE_TEST_SUITE_P(Cases, HorovodJoin,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values("1_pass", "2_passes", "2_passes_sparse_bias")),
                         [](const auto& info) {
                           return testing::name(testing::ranks_name(std::get<0>(info.param)), std::get<1>(info.param));
                         });

TEST_P(HorovodJoin, JoinsTheHorovodWay) {
  const auto& [world, variant] = GetParam();
  comm::run_gloo_thread_group(world, [&](Communicator& comm) {
    testing::uneven_distributed_optimizer(comm, variant == "1_pass" ? 1 : 2, variant == "2_passes_sparse_bias");
  });
}

class JoinWorld : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Sizes, JoinWorld, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return testing::ranks_name(info.param); });

TEST_P(JoinWorld, ThrowOnEarlyTerminationRaisesEverywhereAtTheSameStep) {
  comm::run_gloo_thread_group(GetParam(), testing::join_throws_on_early_termination);
}

// A rank that joins while another is not inside a Join: the other gets an error naming it,
// and can still join afterwards (nothing hangs).
TEST(Join, EveryRankMustBeInsideAJoin) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    testing::Regression model(64);
    dist::DataParallel ddp(model.registry, comm);
    if (comm.rank() == 1) {
      dist::Join join(ddp);
      EXPECT_EQ(join.join(), 0);
      return;
    }
    ddp.begin_backward();
    model.backward(0, 4);
    EXPECT_GRADSYNC_ERROR(ddp.end_backward(), "rank 1 joined", "not inside a Join");
    dist::Join join(ddp);
    EXPECT_EQ(join.join(), 0);
  });
}

// A collective the active ranks issue outside their synchronized steps (here the GradScaler's
// agreement allreduce) has no partner on a joined rank: a clear error on both sides within
// the timeout, never a hang.
TEST(Join, AnUnshadowedCollectiveIsAClearError) {
  comm::run_gloo_thread_group(
      2,
      [](Communicator& comm) {
        testing::Regression model(64);
        auto sgd = testing::make_test_optimizer("sgd", model.registry, testing::training_settings("sgd"));
        optim::GradScaler scaler({}, &comm);
        dist::DataParallel ddp(model.registry, comm);
        const auto train = [&] {
          dist::Join join(ddp);  // left without joining when the error unwinds
          for (int step = 0; step < (comm.rank() == 0 ? 3 : 1); ++step) {
            ddp.begin_backward();
            model.backward(step * 4, step * 4 + 4);
            ddp.end_backward();
            scaler.unscale(*sgd);
            scaler.step(*sgd, [&] { sgd->step(); });
            scaler.update();
            sgd->zero_grad();
          }
          join.join();
        };
        if (comm.rank() == 0) {
          EXPECT_GRADSYNC_ERROR(train(), "collective mismatch", "allreduce #", "(max), f32 x 1", "(sum), f64 x");
        } else {
          EXPECT_GRADSYNC_ERROR(train(), "while this rank was joined", "GradScaler");
        }
      },
      {.timeout = std::chrono::milliseconds(10000)});
}

TEST(Join, Misuse) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    testing::Regression model(64);
    dist::DataParallel ddp(model.registry, comm);
    {
      dist::Join join(ddp);
      EXPECT_GRADSYNC_ERROR(dist::Join{ddp}, "already inside a Join");
      ddp.begin_backward();
      EXPECT_GRADSYNC_ERROR(join.join(), "inside a backward");
      model.backward(0, 4);
      ddp.end_backward();
      EXPECT_GRADSYNC_ERROR(join.join(), "called twice");
    }
    {
      dist::Join join(ddp);
      auto context = dist::ddp_sync_context(ddp, false, DDPSyncStrategy::auto_select);
      EXPECT_GRADSYNC_ERROR(join.join(), "inside a ddp_sync_context window");
    }
    // enable = false: nothing happens, nothing is communicated.
    dist::Join disabled(ddp, {.enable = false});
    EXPECT_EQ(disabled.join(), comm.rank());
  });
}

// PyTorch's DDP under torch.distributed.algorithms.Join on the same data (3 ranks with 5, 3
// and 4 batches; tests/reference/generate_join_fixtures.py, torch 2.x): the same final weights
// on every rank and the same last joiner, for SGD and Adam, both division rules, with and
// without no_sync accumulation.
class JoinReference : public ::testing::TestWithParam<std::tuple<std::string, std::string, int>> {};
INSTANTIATE_TEST_SUITE_P(Cases, JoinReference,
                         ::testing::Combine(::testing::Values("sgd", "adam"), ::testing::Values("initial", "active"),
                                            ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return testing::name(std::get<0>(info.param), "by_" + std::get<1>(info.param),
                                                std::to_string(std::get<2>(info.param)) + "_microbatches");
                         });

TEST_P(JoinReference, MatchesPyTorchJoin) {
  const auto& [optimizer, division, micro] = GetParam();
  const io::SafetensorsReader fixture(testing::fixture_path("join.safetensors"));
  const std::vector<double> x = fixture.read("x").to_double_vector();  // [rank, step, micro, sample, feature]
  const std::vector<double> y = fixture.read("y").to_double_vector();  // [rank, step, micro, sample]
  const std::vector<double> counts = fixture.read("counts").to(DType::f64).to_double_vector();
  const std::int64_t world = 3, steps = 5, max_micro = 2, per_micro = 4, features = 8;
  ASSERT_EQ(static_cast<std::int64_t>(x.size()), world * steps * max_micro * per_micro * features);
  const std::string name = optimizer + "." + division + ".m" + std::to_string(micro);
  comm::run_gloo_thread_group(static_cast<int>(world), [&](Communicator& comm) {
    ParameterRegistry registry;
    Parameter& w = registry.add("weight", {features});
    Parameter& b = registry.add("bias", {1});
    registry.finalize();
    w.value().copy_from(fixture.read("w0"));
    b.value().copy_from(fixture.read("b0"));
    std::unique_ptr<optim::Optimizer> opt =
        testing::make_test_optimizer(optimizer, registry, testing::training_settings(optimizer));
    dist::DataParallel ddp(registry, comm);
    dist::Join join(ddp, {.divide_by_initial_world_size = division == "initial"}, opt.get());
    const auto r = static_cast<std::int64_t>(comm.rank());
    for (std::int64_t step = 0; step < static_cast<std::int64_t>(counts[static_cast<std::size_t>(r)]); ++step) {
      for (std::int64_t mb = 0; mb < micro; ++mb) {
        std::optional<dist::DataParallel::NoSync> accumulate;
        if (mb + 1 < micro) accumulate.emplace(ddp);
        // d/dpred of 0.5 * mean((pred - y)^2) is (pred - y) / n.
        const std::vector<double> wv = w.value().to_double_vector();
        const double bv = b.value().to_double_vector()[0];
        std::vector<double> gw(static_cast<std::size_t>(features), 0.0);
        double gb = 0;
        for (std::int64_t s = 0; s < per_micro; ++s) {
          const std::int64_t row = ((r * steps + step) * max_micro + mb) * per_micro + s;
          double pred = bv;
          for (std::int64_t f = 0; f < features; ++f) pred += x[static_cast<std::size_t>(row * features + f)] * wv[static_cast<std::size_t>(f)];
          const double error = (pred - y[static_cast<std::size_t>(row)]) / static_cast<double>(per_micro);
          gb += error;
          for (std::int64_t f = 0; f < features; ++f) gw[static_cast<std::size_t>(f)] += error * x[static_cast<std::size_t>(row * features + f)];
        }
        ddp.begin_backward();
        b.accumulate_grad(Tensor::from_vector(std::vector<double>{gb}, {1}).to(DType::f32));
        registry.mark_ready(b);
        w.accumulate_grad(Tensor::from_vector(gw, {features}).to(DType::f32));
        registry.mark_ready(w);
        ddp.end_backward();
      }
      opt->step();
      opt->zero_grad();
    }
    EXPECT_EQ(join.join(), static_cast<int>(fixture.read(name + ".authoritative_rank").to_double_vector()[0]));
    testing::expect_near_vectors("weight", w.value().to_double_vector(),
                                 fixture.read(name + ".weight").to_double_vector(), 1e-5);
    testing::expect_near_vectors("bias", b.value().to_double_vector(),
                                 fixture.read(name + ".bias").to_double_vector(), 1e-5);
  });
}

TEST(Join, AdasumRefusesToJoin) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    testing::Regression model(64);
    auto inner = testing::make_test_optimizer("sgd", model.registry, testing::training_settings("sgd"));
    dist::DistributedOptimizer optimizer(*inner, comm, {.op = dist::Op::adasum});
    EXPECT_GRADSYNC_ERROR(optimizer.join(), "join is not supported with Adasum");
  });
}

}  // namespace
}  // namespace gradsync
