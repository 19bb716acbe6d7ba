// DataParallel (DDP semantics) and Composer's sync strategies on Gloo ranks-as-threads: the
// checklist of docs/semantics/ddp.md section 4 (item numbers quoted), with our correct
// SINGLE values and the improvements of its section 6.
#include <gtest/gtest.h>

#include <cstring>
#include <mutex>

#include "devices.h"
#include "dist.h"
#include "expectations.h"
#include "gradsync/comm/gloo/gloo.h"
#include "gradsync/dist/data_parallel/sync_strategy.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/optim/adam.h"
#include "gradsync/optim/clip.h"
#include "gradsync/optim/grad_scaler.h"
#include "gradsync/optim/sgd.h"
#include "models.h"
#include "optimizers.h"
#include "parameters.h"
#include "ranks_on_device.h"
#include "test_util.h"

namespace gradsync {
namespace {

using comm::Communicator;
using dist::DataParallel;
using dist::DDPSyncStrategy;
using namespace std::chrono_literals;

// Composer's test model: scalar weights w1..w3, all 0. Microbatch i uses w_i with the rank's
// target t (rank 0: 1, rank 1: 2): loss (w - t)^2 / 2, so dL/dw = w - t = -t.
struct Scalars {
  ParameterRegistry registry;
  std::vector<Parameter*> w;
  Device device;
  explicit Scalars(int count, Device device_ = Device::cpu()) : device(device_) {
    for (int i = 0; i < count; ++i) w.push_back(&registry.add("w" + std::to_string(i + 1), {1}, DType::f32, device));
    registry.finalize();
  }
  void use(int i, double gradient) {
    w[static_cast<std::size_t>(i)]->accumulate_grad(
        Tensor::from_vector(std::vector<double>{gradient}, {1}).to(DType::f32).to(device));
    registry.mark_ready(*w[static_cast<std::size_t>(i)]);
  }
  // The gradients as Composer's test reads them, with undefined as NaN.
  std::vector<double> grads() const {
    std::vector<double> out;
    for (const Parameter* p : w) out.push_back(p->grad_defined() ? p->grad().to_double_vector()[0] : std::nan(""));
    return out;
  }
};

void expect_grads(const std::string& what, const std::vector<double>& actual, const std::vector<double>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (std::isnan(expected[i])) {
      EXPECT_TRUE(std::isnan(actual[i])) << what << ": w" << i + 1 << " should be undefined, is " << actual[i];
    } else {
      EXPECT_FLOAT_EQ(static_cast<float>(actual[i]), static_cast<float>(expected[i])) << what << ": w" << i + 1;
    }
  }
}

// Item 4: after a synced step every rank holds the same bits.
void expect_bitwise_equal_across_ranks(Communicator& comm, ParameterRegistry& registry) {
  for (const Arena& arena : registry.arenas()) {
    Tensor mine = arena.grads.to(Device::cpu());  // compared on the host, whatever the device
    Tensor all = Tensor::empty({mine.numel() * comm.size()}, mine.dtype());
    comm.allgather_host(mine, all);
    for (int r = 0; r < comm.size(); ++r) {
      EXPECT_EQ(std::memcmp(static_cast<const char*>(all.data()) + r * mine.nbytes(), mine.data(), mine.nbytes()), 0)
          << "rank " << comm.rank() << " and rank " << r << " hold different gradient bits";
    }
  }
}

const double kUndefined = std::nan("");

// The DDP checklist with the parameters on the host and, where a GPU is usable, on cuda (CUDA
// tensors staged through Gloo); the CUDA instances skip, saying why, elsewhere.
class DataParallelOn : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { GRADSYNC_SKIP_UNLESS_USABLE(device()); }
  Device device() const { return Device::parse(GetParam()); }
};
INSTANTIATE_TEST_SUITE_P(Devices, DataParallelOn, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return std::string(info.param); });

// Items 1-3: the three Composer strategy cases, checked inside each microbatch context and after.
TEST_P(DataParallelOn, ComposerCases) {
  const Device device = this->device();
  struct Case {
    DDPSyncStrategy strategy;
    std::vector<double> mb0, mb1, after;  // rank 0's view; rank 1's local values are -2
  };
  const std::vector<Case> cases{
      {DDPSyncStrategy::single_auto_sync, {-1, kUndefined, kUndefined}, {-1.5, -1.5, kUndefined}, {-1.5, -1.5, kUndefined}},
      {DDPSyncStrategy::multi_auto_sync, {-1.5, kUndefined, kUndefined}, {-1.5, -1.5, kUndefined}, {-1.5, -1.5, kUndefined}},
      {DDPSyncStrategy::forced_sync, {-1, kUndefined, kUndefined}, {-1, -1, kUndefined}, {-1.5, -1.5, kUndefined}},
  };
  for (const Case& c : cases) {
    comm::run_gloo_thread_group(2, [&](Communicator& comm) {
      Scalars model(3, device);
      DataParallel ddp(model.registry, comm, {.find_unused_parameters = true});
      const double t = comm.rank() + 1.0;
      const auto local = [&](std::vector<double> values) {  // rank 1's local values are twice rank 0's
        for (double& v : values) {
          if (!std::isnan(v) && v == -1) v = -t;
        }
        return values;
      };
      const std::string name = dist::sync_strategy_name(c.strategy);
      for (int mb = 0; mb < 2; ++mb) {
        auto context = dist::ddp_sync_context(ddp, mb == 1, c.strategy);
        ddp.begin_backward();
        model.use(mb, -t);
        ddp.end_backward();
        expect_grads(name + " inside microbatch " + std::to_string(mb), model.grads(), local(mb == 0 ? c.mb0 : c.mb1));
      }
      expect_grads(name + " after", model.grads(), c.after);
      expect_bitwise_equal_across_ranks(comm, model.registry);
    });
  }
}

// Item 5: FORCED when the ranks differ in which gradients exist: no hang, the right values.
TEST_P(DataParallelOn, ForcedWithRankDependentUndefinedGradients) {
  const Device device = this->device();
  comm::run_gloo_thread_group(2, [device](Communicator& comm) {
    Scalars model(2, device);
    DataParallel ddp(model.registry, comm, {.find_unused_parameters = true});
    const double g = comm.rank() == 0 ? 3.0 : 5.0;
    {
      auto context = dist::ddp_sync_context(ddp, true, DDPSyncStrategy::forced_sync);
      model.use(comm.rank(), g);  // rank 0 only w1, rank 1 only w2
      ddp.end_backward();
    }
    expect_grads("forced", model.grads(), {1.5, 2.5});
    expect_bitwise_equal_across_ranks(comm, model.registry);
  });
}

// Item 6: parsing and defaults.
TEST(SyncStrategies, ParsingAndDefaults) {
  EXPECT_EQ(dist::parse_sync_strategy("forced_sync"), DDPSyncStrategy::forced_sync);
  EXPECT_EQ(dist::parse_sync_strategy("single_auto_sync"), DDPSyncStrategy::single_auto_sync);
  EXPECT_EQ(dist::parse_sync_strategy("multi_auto_sync"), DDPSyncStrategy::multi_auto_sync);
  EXPECT_EQ(dist::parse_sync_strategy("auto"), DDPSyncStrategy::auto_select);
  EXPECT_GRADSYNC_ERROR(dist::parse_sync_strategy("bogus"), "'bogus'", "single_auto_sync, multi_auto_sync, forced_sync, auto");
  EXPECT_EQ(dist::default_sync_strategy(true), DDPSyncStrategy::multi_auto_sync);
  EXPECT_EQ(dist::default_sync_strategy(false), DDPSyncStrategy::single_auto_sync);
}

// All strategies give the same gradients (here bitwise: SINGLE and FORCED reduce the same
// accumulated sums; MULTI within float tolerance), and AUTO picks one, the same everywhere.
TEST_P(DataParallelOn, AllStrategiesAgreeAndAutoChoosesOneEverywhere) {
  const Device device = this->device();
  comm::run_gloo_thread_group(3, [device](Communicator& comm) {
    const int microbatches = 4;
    std::vector<std::vector<double>> results;
    for (const DDPSyncStrategy strategy : {DDPSyncStrategy::single_auto_sync, DDPSyncStrategy::multi_auto_sync,
                                           DDPSyncStrategy::forced_sync, DDPSyncStrategy::auto_select}) {
      testing::Regression model(64 * comm.size(), DType::f32, device);
      DataParallel ddp(model.registry, comm, {.bucket_cap_mb = 1e-6});
      int used = -1;
      for (int window = 0; window < (strategy == DDPSyncStrategy::auto_select ? 9 : 1); ++window) {
        model.registry.zero_grad();
        for (int mb = 0; mb < microbatches; ++mb) {
          auto context = dist::ddp_sync_context(ddp, mb + 1 == microbatches, strategy);
          used = static_cast<int>(context.strategy());
          const std::int64_t begin = (mb * comm.size() + comm.rank()) * 16;
          ddp.begin_backward();
          model.backward(begin, begin + 16);
          ddp.end_backward();
        }
        expect_bitwise_equal_across_ranks(comm, model.registry);
      }
      std::vector<double> grads = model.w->grad().to_double_vector();
      grads.push_back(model.b->grad().to_double_vector()[0]);
      results.push_back(grads);
      if (strategy == DDPSyncStrategy::auto_select) {
        Tensor mine = Tensor::from_vector(std::vector<double>{static_cast<double>(used)}, {1});
        Tensor all = Tensor::empty({comm.size()}, DType::f64);
        comm.allgather(mine, all);
        for (double choice : all.to_double_vector()) EXPECT_EQ(choice, used) << "AUTO chose differently across ranks";
      }
    }
    EXPECT_EQ(results[0], results[2]) << "SINGLE and FORCED reduce the same sums";
    testing::expect_near_vectors("multi vs single", results[1], results[0], 1e-6);
    testing::expect_near_vectors("auto vs single", results[3], results[0], 1e-6);
  });
}

// Worlds of ranks on each device, with a bucket layout or a strategy.
class DataParallelBuckets : public testing::RanksOnDeviceWith<std::string> {};
INSTANTIATE_TEST_SUITE_P(Sizes, DataParallelBuckets,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Values("cpu", "cuda"),
                                            ::testing::Values("default_buckets", "tiny_buckets")),
                         DataParallelBuckets::name);
class DataParallelStrategy : public testing::RanksOnDeviceWith<DDPSyncStrategy> {};
INSTANTIATE_TEST_SUITE_P(Sizes, DataParallelStrategy,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Values("cpu", "cuda"),
                                            ::testing::ValuesIn(testing::explicit_strategies())),
                         DataParallelStrategy::name);

// Item 9: equivalence with single-process training (Adam), DDP's default buckets and one
// bucket per parameter.
TEST_P(DataParallelBuckets, EquivalenceWithSingleProcess) {
  const bool tiny = extra() == "tiny_buckets";
  on_gloo_ranks([tiny](Communicator& comm, Device device) {
    const std::int64_t per_rank = 5;
    const std::int64_t batch = per_rank * comm.size();
    testing::Regression distributed(batch * 4, DType::f32, device);
    testing::Regression single(batch * 4);
    DataParallel ddp(distributed.registry, comm,
                     {.bucket_cap_mb = tiny ? std::optional<double>(1e-6) : std::nullopt});
    if (tiny) {
      EXPECT_EQ(ddp.reducer().bucket_count(), 2u);
    }
    auto adam = testing::make_test_optimizer("adam", distributed.registry, testing::training_settings("adam"));
    auto reference = testing::make_test_optimizer("adam", single.registry, testing::training_settings("adam"));
    for (int step = 0; step < 4; ++step) {
      ddp.begin_backward();
      distributed.backward(step * batch + comm.rank() * per_rank, step * batch + (comm.rank() + 1) * per_rank);
      ddp.end_backward();
      expect_bitwise_equal_across_ranks(comm, distributed.registry);
      adam->step();
      adam->zero_grad();
      single.backward(step * batch, (step + 1) * batch, false);
      reference->step();
      reference->zero_grad();
    }
    testing::expect_near_vectors("w", distributed.w->value().to_double_vector(), single.w->value().to_double_vector(), 2e-5);
  });
}

// Item 9 with microbatches under each strategy.
TEST_P(DataParallelStrategy, EquivalenceWithMicrobatches) {
  on_gloo_ranks([strategy = extra()](Communicator& comm, Device device) {
    testing::data_parallel_equivalence(comm, strategy, device);
  });
}

class MissingGradientWorld : public testing::RanksOnDevice {};
INSTANTIATE_TEST_SUITE_P(Sizes, MissingGradientWorld,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Values("cpu", "cuda")),
                         testing::RanksOnDevice::name);

TEST_P(MissingGradientWorld, OnTheLastRankIsAnErrorOnEveryRank) { on_gloo_ranks(testing::data_parallel_missing_gradient); }

// Item 11: no_sync accumulates locally; the next synced backward reduces the accumulated sum.
TEST_P(DataParallelOn, NoSyncAccumulation) {
  const Device device = this->device();
  comm::run_gloo_thread_group(2, [device](Communicator& comm) {
    Scalars model(1, device);
    DataParallel ddp(model.registry, comm);
    const double g = comm.rank() == 0 ? 1.0 : 3.0;
    {
      auto outer = ddp.no_sync();
      {
        auto inner = ddp.no_sync();  // nestable
      }
      EXPECT_FALSE(ddp.sync_enabled());
      model.use(0, g);
      ddp.end_backward();
      EXPECT_EQ(model.grads()[0], g);  // local, not reduced
    }
    EXPECT_TRUE(ddp.sync_enabled());
    model.use(0, g);
    ddp.end_backward();
    EXPECT_EQ(model.grads()[0], 4.0);  // mean over ranks of the 2-microbatch sums: (2 + 6) / 2
  });
}

// Item 12: rank-dependent layers under no_sync, find_unused: every gradient defined and equal.
TEST_P(DataParallelOn, RankDependentLayersUnderNoSync) {
  const Device device = this->device();
  comm::run_gloo_thread_group(2, [device](Communicator& comm) {
    Scalars model(4, device);
    DataParallel ddp(model.registry, comm, {.find_unused_parameters = true});
    for (int mb = 0; mb < 2; ++mb) {
      auto context = dist::ddp_sync_context(ddp, mb == 1, DDPSyncStrategy::single_auto_sync);
      const int first = comm.rank() == 0 ? 0 : 2;
      model.use(first + 1, 1.0 + mb);
      model.use(first, 2.0 + mb);
      ddp.end_backward();
    }
    expect_grads("rank-dependent", model.grads(), {2.5, 1.5, 2.5, 1.5});
    expect_bitwise_equal_across_ranks(comm, model.registry);
  });
}

// Items 13-16: global versus local unused, and the used map.
class UnusedWorld : public testing::RanksOnDevice {};
INSTANTIATE_TEST_SUITE_P(Sizes, UnusedWorld,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values("cpu", "cuda")),
                         testing::RanksOnDevice::name);

TEST_P(UnusedWorld, GlobalVersusLocalUnusedAndTheUsedMap) {
  on_gloo_ranks([](Communicator& comm, Device device) {
    Scalars model(3, device);  // w1: rank 0 only; w2: the other ranks; w3: nobody
    DataParallel ddp(model.registry, comm, {.find_unused_parameters = true});
    ddp.begin_backward();
    if (comm.rank() == 0) {
      model.use(0, 1.0);
    } else {
      model.use(1, 1.0);
    }
    ddp.end_backward();
    const double n = comm.size();
    expect_grads("unused", model.grads(), {1.0 / n, comm.size() > 1 ? (n - 1) / n : kUndefined, kUndefined});
    EXPECT_EQ(ddp.last_used_counts(), (std::vector<int>{1, comm.size() - 1, 0}));
  });
}

// Item 15 and docs/semantics/ddp.md section 6, item 4: a missing gradient without find_unused is an error at the
// end of that backward on the rank that missed it (naming the parameter), and on the others
// (naming that rank), with no hang.
TEST_P(DataParallelOn, MissingGradientIsAnErrorOnEveryRankNotAHang) {
  const Device device = this->device();
  std::mutex mutex;
  std::vector<std::string> messages(2);
  const auto start = std::chrono::steady_clock::now();
  comm::run_gloo_thread_group(2, [&](Communicator& comm) {
    Scalars model(2, device);
    DataParallel ddp(model.registry, comm);
    ddp.begin_backward();
    model.use(0, 1.0);
    if (comm.rank() == 0) model.use(1, 1.0);  // rank 1 misses w2
    try {
      ddp.end_backward();
      ADD_FAILURE() << "no error on rank " << comm.rank();
    } catch (const Error& error) {
      std::lock_guard<std::mutex> lock(mutex);
      messages[static_cast<std::size_t>(comm.rank())] = error.what();
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  EXPECT_NE(messages[1].find("Parameters which did not receive grad for rank 1: w2"), std::string::npos) << messages[1];
  EXPECT_NE(messages[1].find("Parameter indices which did not receive grad for rank 1: 1"), std::string::npos);
  EXPECT_NE(messages[0].find("rank 1 did not produce a gradient for every parameter"), std::string::npos) << messages[0];
}

// Item 18: ready twice in one backward.
TEST_P(DataParallelOn, ReadyTwiceIsAnErrorNamingTheParameter) {
  const Device device = this->device();
  comm::run_gloo_thread_group(1, [device](Communicator& comm) {
    Scalars model(2, device);
    DataParallel ddp(model.registry, comm);
    ddp.begin_backward();
    model.use(1, 1.0);
    EXPECT_GRADSYNC_ERROR(model.use(1, 1.0), "mark a variable ready only once", "index 1", "'w2'");
  });
}

// Items 21-22: hooks.
TEST_P(DataParallelOn, CommHooksAndCompression) {
  const Device device = this->device();
  comm::run_gloo_thread_group(2, [device](Communicator& comm) {
    {
      Scalars model(2, device);
      DataParallel ddp(model.registry, comm);
      ddp.register_comm_hook([](Communicator& c, Tensor& flat, const dist::BucketInfo&) {
        ops::fill(flat, 2.0);  // the hook decides the result; nothing is pre-divided
        return c.barrier_async();
      });
      EXPECT_GRADSYNC_ERROR(ddp.register_comm_hook([](Communicator& c, Tensor&, const dist::BucketInfo&) {
        return c.barrier_async();
      }), "register_comm_hook can only be called once.");
      model.use(0, 7.0);
      model.use(1, 7.0);
      ddp.end_backward();
      expect_grads("hook", model.grads(), {2.0, 2.0});
    }
    for (const auto compression : {dist::Compression::fp16, dist::Compression::bf16}) {
      Scalars model(2, device);
      DataParallel ddp(model.registry, comm, {.compression = compression});
      EXPECT_GRADSYNC_ERROR(ddp.register_comm_hook([](Communicator& c, Tensor&, const dist::BucketInfo&) {
        return c.barrier_async();
      }), "can only be called once", "is already this DataParallel's communication hook");
      // 6e4 on both ranks: the sum overflows f16 (max 65504) unless divided before the cast.
      model.use(0, 60000.0);
      model.use(1, 0.1 * (comm.rank() + 1));
      ddp.end_backward();
      const std::vector<double> grads = model.grads();
      EXPECT_TRUE(std::isfinite(grads[0]));
      EXPECT_NEAR(grads[0], 60000.0, 60000.0 * 8e-3);
      EXPECT_NEAR(grads[1], 0.15, 0.15 * 8e-3);
    }
  });
}

// Items 23-24: verification and the initial broadcast (parameters and buffers).
TEST_P(DataParallelOn, VerificationAndInitialBroadcast) {
  const Device device = this->device();
  EXPECT_GRADSYNC_ERROR(comm::run_gloo_thread_group(2, [device](Communicator& comm) {
    ParameterRegistry registry;
    registry.add("fc.weight", {comm.rank() == 0 ? 100 : 10, 1}, DType::f32, device);
    registry.finalize();
    DataParallel ddp(registry, comm);
  }), "do not hold the same parameters", "'fc.weight' f32[100, 1]", "'fc.weight' f32[10, 1]");
  EXPECT_GRADSYNC_ERROR(comm::run_gloo_thread_group(2, [device](Communicator& comm) {
    ParameterRegistry registry;
    registry.add("a", {2}, DType::f32, device);
    if (comm.rank() == 1) registry.add("b", {2}, DType::f32, device);
    registry.finalize();
    DataParallel ddp(registry, comm);
  }), "Parameter #1", "absent (1 parameters)", "'b' f32[2]");
  comm::run_gloo_thread_group(3, [device](Communicator& comm) {
    ParameterRegistry registry;
    Parameter& w = registry.add("w", {4}, DType::f32, device);
    Parameter& buffer = registry.add("running_mean", {2}, DType::f32, device, /*requires_grad=*/false);
    registry.finalize();
    w.value().copy_from(testing::random_tensor(4, DType::f32, 100 + static_cast<unsigned>(comm.rank())));
    ops::fill(buffer.value(), comm.rank());
    Tensor rank0 = w.value().clone();
    comm.broadcast(rank0, 0);
    DataParallel ddp(registry, comm);
    EXPECT_EQ(w.value().to_double_vector(), rank0.to_double_vector());
    EXPECT_EQ(buffer.value().to_double_vector(), (std::vector<double>{0, 0}));
  });
}

}  // namespace
}  // namespace gradsync

namespace gradsync {
namespace {

// Clipping by global norm after DataParallel's synchronized backward, with a bf16 model, f32
// master weights and one unused parameter (undefined everywhere, skipped by the norm): every
// rank computes the same total, equal to the norm of the mean gradient computed here by hand,
// and the step uses the clipped mean.
TEST_P(DataParallelOn, ClipGradNormAfterTheSynchronizedBackward) {
  const Device device = this->device();
  for (const int size : {1, 2, 3}) {
    comm::run_gloo_thread_group(size, [device](Communicator& comm) {
      ParameterRegistry registry;
      Parameter& a = registry.add("a", {3}, DType::bf16, device);
      Parameter& unused = registry.add("unused", {2}, DType::bf16, device);
      Parameter& b = registry.add("b", {2}, DType::bf16, device, true, DType::f32);
      registry.finalize();
      DataParallel ddp(registry, comm, {.find_unused_parameters = true});
      optim::SGD sgd(registry, optim::SGD::Options{.lr = 1.0}, optim::MasterWeights::f32);
      // Rank r's gradients: small integers (exact in bf16, exact sums).
      const double r = comm.rank();
      a.set_grad(Tensor::from_vector(std::vector<double>{1 + r, -2, 2 * r}, {3}).to(DType::bf16).to(device));
      b.set_grad(Tensor::from_vector(std::vector<double>{4 * r, 3}, {2}).to(DType::f32).to(device));
      ddp.begin_backward();
      registry.mark_ready(b);
      registry.mark_ready(a);
      ddp.end_backward();
      // Independently: the mean over ranks of each element, then the norm.
      const double n = comm.size();
      const double mean_r = (n - 1) / 2;
      const std::vector<double> mean{1 + mean_r, -2, 2 * mean_r, 4 * mean_r, 3};
      double sum = 0;
      for (const double value : mean) sum += value * value;
      const double total = optim::clip_grad_norm(sgd, 1.0);
      EXPECT_NEAR(total, std::sqrt(sum), 1e-6 * std::sqrt(sum)) << "rank " << comm.rank();
      EXPECT_FALSE(unused.grad_defined());
      sgd.step();
      const double coefficient = static_cast<float>(1.0 / (std::sqrt(sum) + 1e-6));
      EXPECT_NEAR(sgd.master_weight(b).to_double_vector()[1], -3 * coefficient, 1e-6);
      EXPECT_EQ(sgd.master_weight(unused).defined(), false);  // never stepped
    });
  }
}

}  // namespace
}  // namespace gradsync

namespace gradsync {
namespace {

// A NaN gradient on one rank reaches every rank through the allreduce, and clipping with
// error_if_nonfinite raises the same error on every rank, naming the parameter.
TEST_P(DataParallelOn, NonFiniteNormIsTheSameErrorOnEveryRank) {
  const Device device = this->device();
  std::mutex mutex;
  std::vector<std::string> messages;
  comm::run_gloo_thread_group(3, [&](Communicator& comm) {
    ParameterRegistry registry;
    Parameter& a = registry.add("a", {2}, DType::f32, device);
    Parameter& b = registry.add("b", {2}, DType::f32, device);
    registry.finalize();
    DataParallel ddp(registry, comm);
    optim::SGD sgd(registry, optim::SGD::Options{.lr = 1.0});
    a.set_grad(Tensor::from_vector(std::vector<float>{1.0f, 2.0f}, {2}).to(device));
    b.set_grad(Tensor::from_vector(std::vector<float>{comm.rank() == 1 ? NAN : 1.0f, 2.0f}, {2}).to(device));
    ddp.begin_backward();
    registry.mark_ready(b);
    registry.mark_ready(a);
    ddp.end_backward();
    try {
      optim::clip_grad_norm(sgd, 1.0, 2.0, true);
      ADD_FAILURE() << "rank " << comm.rank() << " clipped a NaN norm";
    } catch (const Error& error) {
      std::lock_guard<std::mutex> lock(mutex);
      messages.push_back(error.what());
    }
  });
  ASSERT_EQ(messages.size(), 3u);
  // Each names its rank ("rank R: "), then the same words.
  const auto without_rank = [](const std::string& message) { return message.substr(message.find(": ") + 2); };
  for (const std::string& message : messages) {
    EXPECT_EQ(without_rank(message), without_rank(messages[0]));
    EXPECT_NE(message.find("in 'b'"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace gradsync
