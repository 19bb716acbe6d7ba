// ZeRO on Gloo ranks-as-threads, 2-4 ranks (dist/zero.h, docs/zero.md): stage 1 and 2 against
// unsharded DataParallel for SGD, Adam and AdamW, every sync strategy that applies, with and
// without find_unused_parameters, mixed precision and clipping; the errors.
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <tuple>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "expectations.h"
#include "gradsync/comm/gloo/gloo.h"
#include "gradsync/dist/horovod/distributed_optimizer.h"
#include "gradsync/dist/join/join.h"
#include "gradsync/dist/zero/zero.h"
#include "gradsync/io/checksum.h"
#include "gradsync/io/registry_checkpoint.h"
#include "gradsync/io/safetensors.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/nn/sharded_sequential.h"
#include "gradsync/nn/data_parallel_module.h"
#include "gradsync/nn/loss.h"
#include "gradsync/optim/adam.h"
#include "gradsync/optim/clip.h"
#include "gradsync/optim/sgd.h"
#include "models.h"
#include "optimizers.h"
#include "parameters.h"
#include "ranks_on_device.h"
#include "test_util.h"
#include "zero.h"

namespace gradsync {
namespace {

using comm::Communicator;
using dist::DDPSyncStrategy;

// ZeRO against unsharded DataParallel: every world of 2-4 ranks, stage, optimizer, explicit
// strategy (stage 2 refuses MULTI) and usage pattern, one named case each; and DDP's default
// buckets under AUTO.
struct ZeroInstance {
  int world;
  testing::ZeroCase c;
  std::string name;
};

std::vector<ZeroInstance> zero_instances() {
  std::vector<ZeroInstance> instances;
  const auto add = [&](int world, const testing::ZeroCase& c, const std::string& name) {
    ZeroInstance instance;
    instance.world = world;
    instance.c = c;
    instance.name = name;
    instances.push_back(instance);
  };
  for (const int world : {2, 3, 4}) {
    for (const int stage : {1, 2, 3}) {
      const std::string prefix = testing::name(testing::ranks_name(world), "stage" + std::to_string(stage));
      for (const std::string optimizer : {"sgd", "adam", "adamw"}) {
        for (const dist::DDPSyncStrategy strategy : testing::explicit_strategies()) {
          for (const bool find_unused : {false, true}) {
            add(world,
                {.stage = stage, .optimizer = optimizer, .strategy = strategy, .find_unused_parameters = find_unused},
                testing::name(prefix, optimizer, testing::strategy_name(strategy), find_unused ? "unused" : "all_used"));
          }
        }
      }
      add(world, {.stage = stage, .strategy = DDPSyncStrategy::auto_select, .bucket_cap_mb = std::nullopt, .steps = 10},
          testing::name(prefix, "auto_default_buckets"));
    }
  }
  // 16-bit models with f32 master weights, and clipping.
  for (const int stage : {1, 2, 3}) {
    const std::string prefix = testing::name(testing::ranks_name(3), "stage" + std::to_string(stage));
    add(3, {.stage = stage, .optimizer = "adamw", .dtype = DType::bf16}, prefix + "_adamw_bf16");
    add(3, {.stage = stage, .optimizer = "sgd", .clip = 0.05}, prefix + "_sgd_clip");
    add(3, {.stage = stage, .optimizer = "adam", .dtype = DType::bf16, .clip = 0.05}, prefix + "_adam_bf16_clip");
  }
  return instances;
}

class ZeroMatches : public ::testing::TestWithParam<ZeroInstance> {};
INSTANTIATE_TEST_SUITE_P(Cases, ZeroMatches, ::testing::ValuesIn(zero_instances()),
                         [](const auto& info) { return info.param.name; });

TEST_P(ZeroMatches, UnshardedDataParallel) {
  comm::run_gloo_thread_group(GetParam().world,
                              [&](Communicator& comm) { testing::zero_matches_unsharded(comm, GetParam().c); });
}

// The clipping norm is the same on every rank and equals the unsharded one.
TEST(Zero, ClipNormIsTheGlobalNorm) {
  comm::run_gloo_thread_group(3, [](Communicator& comm) {
    for (const int stage : {0, 1, 2}) {
      testing::ShardModel model(DType::f32);
      auto sgd = testing::make_test_optimizer("sgd", model.registry, testing::zero_settings("sgd"));
      dist::DataParallel ddp(model.registry, comm, {.bucket_cap_mb = 1e-6, .shard_gradients = stage == 2});
      std::unique_ptr<dist::ZeroOptimizer> zero;
      if (stage > 0) zero = std::make_unique<dist::ZeroOptimizer>(*sgd, ddp, dist::ZeroOptions{.stage = stage});
      ddp.begin_backward();
      model.backward(comm.rank(), 0, 0, nullptr);
      ddp.end_backward();
      const double norm = zero ? zero->clip_grad_norm(1e9) : optim::clip_grad_norm(*sgd, 1e9);
      static thread_local double unsharded = 0;
      if (stage == 0) unsharded = norm;
      EXPECT_NEAR(norm, unsharded, 1e-9 * unsharded) << "stage " << stage;
      Tensor mine = Tensor::from_vector(std::vector<double>{norm}, {1});
      Tensor all = Tensor::zeros({comm.size()}, DType::f64);
      comm.allgather(mine, all);
      for (const double other : all.to_double_vector()) EXPECT_EQ(other, norm);
    }
  });
}

// Stage 2's gradient memory: between steps a rank holds its pieces only, and during the
// backward the full-size gradients of at most max_buckets_in_flight buckets in flight and of the
// one being written (resident pages of the paged gradient arena, counted with mincore; nothing
// here reads a given-back page, which would map the zero page and count).
TEST(Zero, StageTwoHoldsItsPiecesAndABoundedWorkingSet) {
  comm::run_gloo_thread_group(3, [](Communicator& comm) {
    constexpr int kLayers = 12;
    constexpr std::int64_t kElements = 48 * 1024;  // 192 KiB: two layers per bucket
    ParameterRegistry registry;
    for (int layer = 0; layer < kLayers; ++layer) registry.add("layer" + std::to_string(layer), {kElements});
    registry.finalize();
    optim::Adam adam(registry, optim::Adam::Options{.lr = 1e-3});
    dist::DataParallel ddp(registry, comm,
                           {.bucket_cap_mb = 0.375, .shard_gradients = true, .max_buckets_in_flight = 1});
    ASSERT_EQ(ddp.reducer().bucket_count(), static_cast<std::size_t>(kLayers / 2));
    dist::ZeroOptimizer zero(adam, ddp, {.stage = 2});
    const Tensor& grads = registry.arenas()[0].grads;
    const std::int64_t bucket_bytes = 2 * kElements * 4;
    const std::int64_t pieces = kLayers * kElements * 4 / comm.size();
    const std::int64_t slack = 2 * static_cast<std::int64_t>(sysconf(_SC_PAGESIZE)) * (kLayers / 2);  // piece edges
    for (int step = 0; step < 3; ++step) {
      ddp.begin_backward();
      std::int64_t most = 0;
      for (int layer = kLayers; layer-- > 0;) {
        ops::fill(registry[static_cast<std::size_t>(layer)].grad_for_overwrite(), 0.01 * (layer + comm.rank()));
        registry.mark_ready(registry[static_cast<std::size_t>(layer)]);
        most = std::max(most, testing::resident_bytes(grads));
      }
      ddp.end_backward();
      // One bucket in flight and one being written, beside the pieces of the reduced ones.
      EXPECT_LE(most, pieces + 2 * bucket_bytes + slack) << "step " << step;
      EXPECT_GT(most, 2 * bucket_bytes) << "step " << step << ": the backward wrote its gradients";
      zero.step();
      zero.zero_grad(/*set_to_undefined=*/step % 2 == 0);  // both kinds of zero_grad give pages back
      EXPECT_LE(testing::resident_bytes(grads), pieces + slack) << "step " << step << ": between steps";
    }
    // The training itself is stage 2's (ZeroMatches covers it against unsharded): the replicas agree.
    Tensor mine = registry.arenas()[0].values.clone();
    Tensor all = Tensor::empty({mine.numel() * comm.size()}, DType::f32);
    comm.allgather(mine, all);
    for (int r = 1; r < comm.size(); ++r) {
      EXPECT_EQ(std::memcmp(all.data(), static_cast<const char*>(all.data()) + r * mine.nbytes(), mine.nbytes()), 0);
    }
  });
}

// step_async: the gathers travel while the caller goes on; wait_for before reading.
TEST(Zero, StepAsyncThenWaitPerParameter) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    testing::ShardModel model(DType::f32);
    auto adam = testing::make_test_optimizer("adam", model.registry, testing::zero_settings("adam"));
    dist::DataParallel ddp(model.registry, comm, {.bucket_cap_mb = 1e-6});
    dist::ZeroOptimizer zero(*adam, ddp);
    for (int step = 0; step < 3; ++step) {
      ddp.begin_backward();
      model.backward(comm.rank(), step, 0, nullptr);
      ddp.end_backward();
      zero.step_async();
      for (Parameter* parameter : model.parameters) zero.wait_for(*parameter);
      zero.zero_grad();
    }
    zero.wait_all();
    Tensor mine = model.registry.arenas()[0].values.clone();
    Tensor all = Tensor::empty({mine.numel() * 2}, DType::f32);
    comm.allgather(mine, all);
    EXPECT_EQ(std::memcmp(all.data(), static_cast<const char*>(all.data()) + mine.nbytes(), mine.nbytes()), 0);
  });
}

// A global batch of 12 samples per step, split evenly over the ranks, so that any world size
// takes the same steps: the gradient of sample s depends on the weights and on s only.
void train_global(Communicator& comm, testing::ShardModel& model, dist::DataParallel& ddp,
                  const std::function<void()>& step, int first_step, int steps) {
  const int global = 12, mine = global / comm.size();
  for (int t = first_step; t < first_step + steps; ++t) {
    ddp.begin_backward();
    for (std::size_t k = model.parameters.size(); k-- > 0;) {
      Parameter& p = *model.parameters[k];
      const std::vector<double> v = p.value().to_double_vector();
      std::vector<double> g(v.size(), 0.0);
      for (int s = comm.rank() * mine; s < (comm.rank() + 1) * mine; ++s) {
        for (std::size_t i = 0; i < g.size(); ++i) {
          g[i] += (0.3 * v[i] + 0.02 * (s + 1) * std::cos(0.37 * static_cast<double>(i) + t + static_cast<double>(k))) / mine;
        }
      }
      p.set_grad(Tensor::from_vector(g, p.shape()).to(DType::f32));
      model.registry.mark_ready(p);
    }
    ddp.end_backward();
    step();
  }
}

// ---- Stage 3: parameters sharded, units gathered and released by the engine ------------------

// A model of `blocks` units (weight + bias each, awkward sizes) and a head unit. Each step the
// engine, unit by unit, gathers, runs a "forward", then in reverse gathers again, writes the
// gradients from the values it reads, marks them ready and releases. The gradient of sample s
// depends on the weights and on s only, so any world size takes the same steps.
struct UnitModel {
  ParameterRegistry registry;
  std::vector<std::vector<Parameter*>> units;
  UnitModel(int blocks, std::int64_t width, DType dtype = DType::f32) {
    for (int b = 0; b < blocks; ++b) {
      units.push_back({&registry.add("block" + std::to_string(b) + ".weight", {width + 3 * b, 7}, dtype),
                       &registry.add("block" + std::to_string(b) + ".bias", {7}, dtype)});
    }
    units.push_back({&registry.add("head", {11, 5}, dtype)});
    registry.finalize();
    for (Parameter& p : registry) {
      std::vector<double> init(static_cast<std::size_t>(p.numel()));
      for (std::size_t i = 0; i < init.size(); ++i) init[i] = 0.05 * std::sin(1.7 * static_cast<double>(i) + static_cast<double>(p.index()));
      p.value().copy_from(Tensor::from_vector(init, p.shape()).to(dtype));
    }
  }
  // Adds this rank's share of microbatch `micro` of `micros` to the gradient.
  void add_gradient(Parameter& p, int rank, int world, int t, int micro = 0, int micros = 1) const {
    const int global = 12, mine = global / world;
    const std::vector<double> v = p.value().to_double_vector();
    std::vector<double> g(v.size(), 0.0);
    for (int s = rank * mine; s < (rank + 1) * mine; ++s) {
      if (s % micros != micro) continue;
      for (std::size_t i = 0; i < g.size(); ++i) {
        g[i] += (0.3 * v[i] + 0.02 * (s + 1) * std::cos(0.37 * static_cast<double>(i) + t + static_cast<double>(p.index()))) / mine;
      }
    }
    p.accumulate_grad(Tensor::from_vector(g, p.shape()).to(p.grad_dtype()));
  }
};

struct UnitRun {
  int stage = 3;
  std::string optimizer = "adam";
  DType dtype = DType::f32;  // bf16: with f32 master weights
  double clip = 0;           // clip to this global norm before each step (0: off)
  int microbatches = 1;      // gradients accumulated locally, synchronized on the last one
  bool every_microbatch = false;  // ... or synchronized on every one (MULTI_AUTO_SYNC: FSDP's default)
  bool explicit_prefetch = false;
  std::string describe() const {
    return "stage " + std::to_string(stage) + " " + optimizer + " " + dtype_name(dtype) + (clip > 0 ? " clip" : "") +
           " x" + std::to_string(microbatches) + (every_microbatch ? " multi" : "") + (explicit_prefetch ? " prefetch" : "");
  }
};

// Trains 4 steps (stage 0: unsharded; 2 and 3 with the model's units as buckets) and returns
// every parameter's values, gathered.
std::vector<double> train_units(Communicator& comm, const UnitRun& run) {
  UnitModel model(3, 29, run.dtype);
  auto opt = testing::make_test_optimizer(run.optimizer, model.registry, testing::zero_settings(run.optimizer),
                                          run.dtype == DType::f32 ? optim::MasterWeights::none : optim::MasterWeights::f32);
  dist::DataParallelOptions options{.bucket_cap_mb = 1e-6, .shard_gradients = run.stage >= 2};
  if (run.stage >= 2) options.units = model.units;
  dist::DataParallel ddp(model.registry, comm, options);
  std::unique_ptr<dist::ZeroOptimizer> zero;
  if (run.stage > 0) zero = std::make_unique<dist::ZeroOptimizer>(*opt, ddp, dist::ZeroOptions{.stage = run.stage});
  const bool sharded = run.stage == 3;
  const std::size_t n = model.units.size();
  for (int t = 0; t < 4; ++t) {
    for (int micro = 0; micro < run.microbatches; ++micro) {
      if (sharded) {
        for (std::size_t u = 0; u < n; ++u) {  // the forward: each unit gathered, used, released
          if (run.explicit_prefetch && u + 1 < n) zero->prefetch(u + 1);
          zero->gather(u);
          for (Parameter* p : model.units[u]) EXPECT_FALSE(p->value_released());
          if (u + 1 < n) zero->release(u);  // the last unit stays for the backward
        }
      }
      // Accumulation, FSDP's two ways: the units' full gradients kept until the last microbatch
      // (SINGLE: no_sync before it), or each microbatch reduce-scattered and added to the pieces
      // (MULTI).
      auto sync = dist::ddp_sync_context(ddp, micro + 1 == run.microbatches,
                                         run.every_microbatch ? dist::DDPSyncStrategy::multi_auto_sync
                                                              : dist::DDPSyncStrategy::single_auto_sync);
      ddp.begin_backward();
      for (std::size_t u = n; u-- > 0;) {
        if (sharded) zero->gather(u);
        for (auto it = model.units[u].rbegin(); it != model.units[u].rend(); ++it) {
          model.add_gradient(**it, comm.rank(), comm.size(), t, micro, run.microbatches);
          model.registry.mark_ready(**it);
        }
        if (sharded) zero->release(u);
      }
      ddp.end_backward();
      sync.close();
    }
    if (run.clip > 0) zero ? zero->clip_grad_norm(run.clip) : optim::clip_grad_norm(*opt, run.clip);
    zero ? zero->step() : opt->step();
    zero ? zero->zero_grad() : opt->zero_grad();
  }
  std::vector<double> values;
  for (std::size_t u = 0; u < n; ++u) {
    if (sharded) zero->gather(u);
    for (Parameter* p : model.units[u]) {
      const std::vector<double> v = p->value().to_double_vector();
      values.insert(values.end(), v.begin(), v.end());
    }
  }
  return values;
}

// Every rank holds these values, bit for bit (one allgather).
void expect_every_rank_holds(Communicator& comm, const std::vector<double>& values, const std::string& where) {
  Tensor mine = Tensor::from_vector(values, {static_cast<std::int64_t>(values.size())});
  Tensor all = Tensor::empty({mine.numel() * comm.size()}, DType::f64);
  comm.allgather(mine, all);
  const std::vector<double> every = all.to_double_vector();
  for (int r = 1; r < comm.size(); ++r) {
    EXPECT_TRUE(std::equal(values.begin(), values.end(), every.begin() + r * mine.numel())) << "rank " << r << ", " << where;
  }
}

// Stage 3 against stage 2 over the same buckets (the same reduce-scatter, the same element-wise
// step): bit for bit; against unsharded DataParallel within 1e-6 relative (f32; bf16 weights
// within 2 ulps of the largest, 2^-6 relative: a different reduction order rounds a bf16 result
// another way); every replica the same.
TEST(Zero3, MatchesStageTwoBitwiseAndUnshardedClosely) {
  std::vector<UnitRun> runs;
  for (const std::string optimizer : {"sgd", "adam", "adamw"}) runs.push_back({.optimizer = optimizer});
  runs.push_back({.optimizer = "adamw", .explicit_prefetch = true});
  runs.push_back({.optimizer = "adamw", .dtype = DType::bf16});
  runs.push_back({.optimizer = "adam", .clip = 0.05});
  runs.push_back({.optimizer = "sgd", .microbatches = 2});
  runs.push_back({.optimizer = "adamw", .dtype = DType::bf16, .clip = 0.05, .microbatches = 3});
  runs.push_back({.optimizer = "adam", .microbatches = 3, .every_microbatch = true});
  runs.push_back({.optimizer = "adamw", .dtype = DType::bf16, .clip = 0.05, .microbatches = 2, .every_microbatch = true});
  for (const int world : {2, 3, 4}) {
    for (std::size_t k = 0; k < runs.size(); ++k) {
      if (world == 4 && k >= 3) continue;  // the variants at 2 and 3 ranks (a remainder per bucket) keep the suite short
      const UnitRun& run = runs[k];
      comm::run_gloo_thread_group(world, [&](Communicator& comm) {
        UnitRun other = run;
        other.stage = 0;
        const std::vector<double> unsharded = train_units(comm, other);
        other.stage = 2;
        other.explicit_prefetch = false;
        const std::vector<double> stage2 = train_units(comm, other);
        const std::vector<double> stage3 = train_units(comm, run);
        const std::string where = std::to_string(world) + " ranks, " + run.describe();
        ASSERT_EQ(stage3.size(), unsharded.size());
        EXPECT_EQ(stage3, stage2) << where;
        double largest = 0;
        for (const double v : unsharded) largest = std::max(largest, std::abs(v));
        const double bound = run.dtype == DType::f32 ? 1e-6 : 1.0 / 64;
        for (std::size_t i = 0; i < stage3.size(); ++i) {
          ASSERT_NEAR(stage3[i], unsharded[i], bound * largest) << "element " << i << ", " << where;
        }
        expect_every_rank_holds(comm, stage3, where);
      });
    }
  }
}

// Against PyTorch FSDP2 (tests/reference/generate_fsdp_fixtures.py: fully_shard per Linear and
// the root, reshard_after_forward, f32, gloo): an MLP trained 6 steps by nn::ShardedSequential
// under stage 3, from the same initial weights on the same batches. Every rank's loss per step
// within 1e-6 relative (measured: 1.5e-7; torch's loss is an f32) and the final weights within
// 1e-6 of each tensor's largest magnitude (measured: 2.5e-7; FSDP2 shards each parameter by rows
// and reduces in its own order, and the update is element-wise).
TEST(Zero3, MatchesPyTorchFSDP2) {
  const io::SafetensorsReader fixture(testing::fixture_path("zero3_fsdp2.safetensors"));
  const nlohmann::json settings = nlohmann::json::parse(fixture.metadata().at("settings"));
  const int steps = std::stoi(fixture.metadata().at("steps"));
  // The fixture's cases: name, optimizer, microbatches, synchronized every microbatch.
  const std::vector<std::tuple<std::string, std::string, int, bool>> cases{
      {"sgd", "sgd", 1, true},           {"adam", "adam", 1, true},           {"adamw", "adamw", 1, true},
      {"sgd.multi", "sgd", 2, true},     {"adam.multi", "adam", 2, true},     {"adamw.multi", "adamw", 2, true},
      {"adamw.nosync", "adamw", 2, false}};
  for (const int world : {2, 3, 4}) {
    for (const auto& [name, optimizer, micro, every] : cases) {
      const std::string where = std::to_string(world) + " ranks, " + name;
      comm::run_gloo_thread_group(world, [&](Communicator& comm) {
        ParameterRegistry registry;
        auto layers = testing::fixture_mlp(registry, fixture);
        optim::Hyperparameters hyperparameters;
        for (const auto& [key, value] : settings.at(optimizer).items()) hyperparameters[key] = value.get<double>();
        auto opt = testing::make_test_optimizer(optimizer, registry, hyperparameters);
        auto sharded = std::make_shared<nn::ShardedSequential>(layers);
        dist::DataParallelOptions options{.shard_gradients = true};
        options.units = sharded->units();
        nn::DistributedDataParallel model(sharded, comm, options);
        dist::ZeroOptimizer zero(*opt, model.data_parallel(), {.stage = 3});
        sharded->attach(zero);
        const std::string prefix = "w" + std::to_string(world) + "." + name;
        const std::vector<double> expected_losses =
            fixture.read(prefix + ".rank" + std::to_string(comm.rank()) + ".losses").to_double_vector();
        for (int step = 0; step < steps; ++step) {
          const std::string batch = "data.step" + std::to_string(step) + ".rank" + std::to_string(comm.rank());
          const Tensor x = fixture.read(batch + ".x"), y = fixture.read(batch + ".y");
          const std::int64_t rows = x.shape()[0] / micro, columns = x.shape()[1];
          double step_loss = 0;
          for (int m = 0; m < micro; ++m) {
            // Half the batch each, each loss halved (FSDP2 sums the microbatches' gradients:
            // reduce-scattered every microbatch under MULTI, kept whole until the last under no_sync).
            std::optional<dist::DataParallel::NoSync> no_sync;
            if (!every && m + 1 < micro) no_sync.emplace(model.data_parallel());
            const Tensor xm = x.view(static_cast<std::size_t>(m * rows * columns), {rows, columns});
            const Tensor ym = y.view(static_cast<std::size_t>(m * rows), {rows});
            nn::LossResult loss = nn::softmax_cross_entropy(model.forward(xm), ym);
            ops::scale(loss.grad, 1.0 / micro);
            model.backward(loss.grad);
            step_loss += loss.loss / micro;
          }
          zero.step();
          zero.zero_grad();
          EXPECT_NEAR(step_loss, expected_losses[static_cast<std::size_t>(step)], 1e-6 * std::abs(expected_losses[static_cast<std::size_t>(step)]))
              << "step " << step << ", rank " << comm.rank() << ", " << where;
        }
        sharded->gather_all();
        for (Parameter& p : registry) {
          const std::vector<double> expected =
              fixture.read(prefix + ".final." + p.name()).to_double_vector();
          const std::vector<double> got = p.value().to_double_vector();
          double largest = 0;
          for (const double v : expected) largest = std::max(largest, std::abs(v));
          for (std::size_t i = 0; i < got.size(); ++i) {
            ASSERT_NEAR(got[i], expected[i], 1e-6 * largest) << p.name() << "[" << i << "], " << where;
          }
        }
      });
    }
  }
}

// Four units of about 256 KiB under stage 3 with Adam, for counting resident pages: `slack`
// allows each unit two partial pages at the edges of its pieces.
struct PagedUnits {
  UnitModel model{4, 64 * 1024 / 7};
  optim::Adam adam{model.registry, optim::Adam::Options{.lr = 1e-3}};
  dist::DataParallel ddp;
  dist::ZeroOptimizer zero;
  std::int64_t slack = 2 * static_cast<std::int64_t>(sysconf(_SC_PAGESIZE)) * static_cast<std::int64_t>(model.units.size());
  static dist::DataParallelOptions options(const UnitModel& model) {
    dist::DataParallelOptions options{.shard_gradients = true};
    options.units = model.units;
    return options;
  }
  explicit PagedUnits(Communicator& comm) : ddp(model.registry, comm, options(model)), zero(adam, ddp, {.stage = 3}) {}
};

// Between steps a rank holds its pieces of the values (resident pages of the paged value
// arena); while the engine walks the units, the gathered ones on top.
TEST(Zero3, HoldsItsPiecesOfTheValues) {
  comm::run_gloo_thread_group(4, [](Communicator& comm) {
    PagedUnits units(comm);
    auto& [model, adam, ddp, zero, slack] = units;
    const Tensor& values = model.registry.arenas()[0].values;
    const std::int64_t total = values.nbytes();
    EXPECT_LE(testing::resident_bytes(values), total / comm.size() + slack) << "after construction";
    for (int t = 0; t < 2; ++t) {
      std::int64_t most = 0;
      ddp.begin_backward();
      for (std::size_t u = model.units.size(); u-- > 0;) {
        zero.gather(u);
        most = std::max(most, testing::resident_bytes(values));
        for (Parameter* p : model.units[u]) {
          ops::fill(p->grad_for_overwrite(), 1e-3);  // (the value is gathered: marking it ready is allowed)
          model.registry.mark_ready(*p);
        }
        zero.release(u);
      }
      ddp.end_backward();
      const std::int64_t largest_unit = static_cast<std::int64_t>(model.units[3][0]->numel() + 7) * 4;
      EXPECT_LE(most, total / comm.size() + 2 * largest_unit + slack) << "step " << t;
      zero.step();
      zero.zero_grad();
      EXPECT_LE(testing::resident_bytes(values), total / comm.size() + slack) << "step " << t;
    }
  });
}

// Accumulating over microbatches, FSDP's two ways, and what each holds between microbatches:
// MULTI reduce-scatters every microbatch and adds it to the pieces (the reduced pieces set aside
// before each backward), so only the pieces' gradient pages stay; SINGLE keeps every unit's
// full gradient until the last microbatch. A backward that begins with a ready signal while the
// pieces are still there is an error naming the parameter (the engine may have added to them).
TEST(Zero3, AccumulatingEveryMicrobatchHoldsOnlyThePieces) {
  comm::run_gloo_thread_group(4, [](Communicator& comm) {
    PagedUnits units(comm);
    auto& [model, adam, ddp, zero, slack] = units;
    const Tensor& grads = model.registry.arenas()[0].grads;
    const std::int64_t total = grads.nbytes();
    const auto microbatch = [&](bool last, DDPSyncStrategy strategy) {
      auto sync = dist::ddp_sync_context(ddp, last, strategy);
      ddp.begin_backward();
      for (std::size_t u = model.units.size(); u-- > 0;) {
        zero.gather(u);
        for (Parameter* p : model.units[u]) {
          Tensor g = Tensor::zeros(p->shape(), DType::f32);
          ops::fill(g, 1e-3);
          p->accumulate_grad(g);
          model.registry.mark_ready(*p);
        }
        zero.release(u);
      }
      ddp.end_backward();
      sync.close();
    };
    for (int micro = 0; micro < 3; ++micro) {
      microbatch(micro == 2, DDPSyncStrategy::multi_auto_sync);
      EXPECT_LE(testing::resident_bytes(grads), total / comm.size() + slack) << "MULTI, after microbatch " << micro;
    }
    // Three microbatches of 1e-3 from every rank, averaged: 3e-3 in this rank's pieces.
    const Parameter& first = *model.units[0][0];
    const std::int64_t owned = dist::shard_bucket(ddp.reducer().bucket(ddp.reducer().bucket_of(first)).numel, comm.size(), comm.rank()).begin;
    if (owned < first.numel()) {
      EXPECT_FLOAT_EQ(static_cast<float>(first.grad().to_double_vector()[static_cast<std::size_t>(owned)]), 3e-3f);
    }
    // The pieces are still there (no zero_grad): a backward begun by a ready signal is refused.
    zero.gather(0);
    Parameter& weight = *model.units[0][0];
    EXPECT_GRADSYNC_ERROR(model.registry.mark_ready(weight), "'block0.weight'", "begin_backward()", "reduced pieces");
    zero.release(0);
    zero.step();
    zero.zero_grad();

    microbatch(false, DDPSyncStrategy::single_auto_sync);
    EXPECT_GE(testing::resident_bytes(grads), total * 9 / 10) << "SINGLE keeps every unit's full gradient until the last microbatch";
    microbatch(true, DDPSyncStrategy::single_auto_sync);
    EXPECT_LE(testing::resident_bytes(grads), total / comm.size() + slack) << "SINGLE, after the last microbatch";
    zero.step();
    zero.zero_grad();
  });
}

// What the engine gets wrong is an error that names the parameter and its unit.
TEST(Zero3, Errors) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    UnitModel model(2, 5);
    auto sgd = testing::make_test_optimizer("sgd", model.registry, testing::zero_settings("sgd"));
    {
      dist::DataParallel plain(model.registry, comm, {.shard_gradients = true});
      EXPECT_GRADSYNC_ERROR(dist::ZeroOptimizer(*sgd, plain, {.stage = 3}), "stage 3", "units");
    }
    dist::DataParallelOptions no_sharding;
    no_sharding.units = model.units;
    EXPECT_GRADSYNC_ERROR(dist::DataParallel(model.registry, comm, no_sharding), "units", "shard_gradients");
    dist::DataParallelOptions missing{.shard_gradients = true};
    missing.units = {model.units[0], model.units[1]};
    EXPECT_GRADSYNC_ERROR(dist::DataParallel(model.registry, comm, missing), "'head'", "no unit");
    dist::DataParallelOptions twice{.shard_gradients = true};
    twice.units = {model.units[0], model.units[1], model.units[2], {model.units[0][0]}};
    EXPECT_GRADSYNC_ERROR(dist::DataParallel(model.registry, comm, twice), "'block0.weight'", "units 0 and 3");

    dist::DataParallelOptions options{.shard_gradients = true};
    options.units = model.units;
    dist::DataParallel ddp(model.registry, comm, options);
    dist::ZeroOptimizer zero(*sgd, ddp, {.stage = 3});
    // A joined rank's shadow thread would wait for gathers that never come.
    EXPECT_GRADSYNC_ERROR(dist::Join({&ddp, &zero}, {.throw_on_early_termination = true}), "stage 3",
                          "throw_on_early_termination");
    EXPECT_EQ(zero.unit_count(), 3u);
    EXPECT_EQ(zero.unit_of(model.registry.at("block1.bias")), 1u);
    Parameter& bias = model.registry.at("block1.bias");
    EXPECT_GRADSYNC_ERROR((void)bias.value(), "'block1.bias'", "unit 1", "released", "gather(1)");
    ddp.begin_backward();
    bias.set_grad(Tensor::zeros({7}, DType::f32));
    EXPECT_GRADSYNC_ERROR(model.registry.mark_ready(bias), "'block1.bias'", "unit 1", "gather(1)");
    EXPECT_GRADSYNC_ERROR(zero.gather(3), "unit 3 of 3");
    zero.gather(1);
    zero.gather(1);  // already gathered: free
    EXPECT_TRUE(zero.gathered(1));
    EXPECT_EQ(bias.value().numel(), 7);
    zero.release(1);
    EXPECT_FALSE(zero.gathered(1));
    EXPECT_TRUE(bias.value_released());
  });
}

// One stage-3 step of a UnitModel (forward gathers, backward gathers again, writes, releases).
void unit_step(Communicator& comm, UnitModel& model, dist::DataParallel& ddp, dist::ZeroOptimizer& zero, int t) {
  const std::size_t n = model.units.size();
  for (std::size_t u = 0; u < n; ++u) {
    zero.gather(u);
    if (u + 1 < n) zero.release(u);
  }
  ddp.begin_backward();
  for (std::size_t u = n; u-- > 0;) {
    zero.gather(u);
    for (auto it = model.units[u].rbegin(); it != model.units[u].rend(); ++it) {
      model.add_gradient(**it, comm.rank(), comm.size(), t);
      model.registry.mark_ready(**it);
    }
    zero.release(u);
  }
  ddp.end_backward();
  zero.step();
  zero.zero_grad();
}

// Every value of the model, each unit gathered (stage 3) or read as it is.
std::vector<double> unit_values(UnitModel& model, dist::ZeroOptimizer& zero) {
  std::vector<double> values;
  for (std::size_t u = 0; u < model.units.size(); ++u) {
    if (zero.stage() == 3) zero.gather(u);
    for (Parameter* p : model.units[u]) {
      const std::vector<double> v = p->value().to_double_vector();
      values.insert(values.end(), v.begin(), v.end());
    }
  }
  return values;
}

// Uneven inputs under dist::Join: rank r has 5 - r steps. The joined ranks answer the active
// ranks' gathers (forward and backward) on their shadow threads, reduce-scatter zeros, and step
// their pieces with the active ranks' learning rate, clipping by the active ranks' global norm.
// Stage 3 ends equal to stage 2 over the same buckets bit for bit, and to unsharded DataParallel
// under Join within 1e-6; every replica the same.
TEST(Zero3, UnevenInputsUnderJoin) {
  for (const int world : {2, 3}) {
    for (const double clip : {0.0, 0.05}) {
      comm::run_gloo_thread_group(world, [&](Communicator& comm) {
        const auto train = [&](int stage) {
          UnitModel model(3, 29);
          auto adamw = testing::make_test_optimizer("adamw", model.registry, testing::zero_settings("adamw"));
          dist::DataParallelOptions options{.bucket_cap_mb = 1e-6, .shard_gradients = stage >= 2};
          if (stage >= 2) options.units = model.units;
          dist::DataParallel ddp(model.registry, comm, options);
          std::unique_ptr<dist::ZeroOptimizer> zero;
          if (stage > 0) zero = std::make_unique<dist::ZeroOptimizer>(*adamw, ddp, dist::ZeroOptions{.stage = stage});
          std::vector<dist::Joinable*> participants{&ddp};
          if (zero) participants.push_back(zero.get());
          {
            dist::Join join(participants, {}, adamw.get());
            for (int t = 0; t < 5 - comm.rank(); ++t) {
              const std::size_t n = model.units.size();
              for (std::size_t u = 0; stage == 3 && u < n; ++u) {
                zero->gather(u);
                if (u + 1 < n) zero->release(u);
              }
              ddp.begin_backward();
              for (std::size_t u = n; u-- > 0;) {
                if (stage == 3) zero->gather(u);
                for (auto it = model.units[u].rbegin(); it != model.units[u].rend(); ++it) {
                  model.add_gradient(**it, comm.rank(), comm.size(), t);
                  model.registry.mark_ready(**it);
                }
                if (stage == 3) zero->release(u);
              }
              ddp.end_backward();
              if (clip > 0) zero ? zero->clip_grad_norm(clip) : optim::clip_grad_norm(*adamw, clip);
              adamw->set_lr(0, 0.01 / (1 + t));  // a schedule: the joined ranks step with the active ranks' rate
              zero ? zero->step() : adamw->step();
              zero ? zero->zero_grad() : adamw->zero_grad();
            }
            join.join();
          }
          std::vector<double> values;
          for (std::size_t u = 0; u < model.units.size(); ++u) {
            if (stage == 3) zero->gather(u);
            for (Parameter* p : model.units[u]) {
              const std::vector<double> v = p->value().to_double_vector();
              values.insert(values.end(), v.begin(), v.end());
            }
          }
          return values;
        };
        const std::string where = std::to_string(world) + " ranks" + (clip > 0 ? ", clipped" : "");
        const std::vector<double> unsharded = train(0), stage2 = train(2), stage3 = train(3);
        EXPECT_EQ(stage3, stage2) << where;
        testing::expect_near_vectors(where, stage3, unsharded, 1e-6);
        expect_every_rank_holds(comm, stage3, where);
      });
    }
  }
}

// A stage-3 sharded set holds each rank's pieces of the values with the optimizer's: resumed on
// the same ranks from a model whose values were scrambled, it equals the uninterrupted run bit
// for bit; resharded onto 3 ranks (and loaded by stage 2 on 2) its values are the saved ones
// exactly, and training on reaches the uninterrupted run's weights within 1e-6. No rank holds
// the whole model at any point of the save or the load at stage 3.
TEST(Zero3, ShardedSetsHoldTheValuesResumeAndReshard) {
  testing::TempDir folder;
  const auto sets = folder / "sharded";
  std::vector<double> straight, saved, resumed, resharded_loaded, resharded, below;
  const auto run = [&](int world, int stage, int first, int steps, bool scramble,
                       const std::function<void(dist::ZeroOptimizer&, UnitModel&, Communicator&)>& before,
                       const std::function<void(dist::ZeroOptimizer&, UnitModel&, Communicator&)>& after) {
    comm::run_gloo_thread_group(world, [&](Communicator& comm) {
      UnitModel model(3, 29);
      if (scramble) {  // the values must come from the set
        for (Parameter& p : model.registry) ops::fill(p.value(), 7.0);
      }
      auto adamw = testing::make_test_optimizer("adamw", model.registry, testing::zero_settings("adamw"));
      dist::DataParallelOptions options{.bucket_cap_mb = 1e-6, .shard_gradients = true};
      options.units = model.units;
      dist::DataParallel ddp(model.registry, comm, options);
      dist::ZeroOptimizer zero(*adamw, ddp, {.stage = stage});
      before(zero, model, comm);
      for (int t = first; t < first + steps; ++t) {
        if (stage == 3) {
          unit_step(comm, model, ddp, zero, t);
          continue;
        }
        ddp.begin_backward();
        for (std::size_t u = model.units.size(); u-- > 0;) {
          for (auto it = model.units[u].rbegin(); it != model.units[u].rend(); ++it) {
            model.add_gradient(**it, comm.rank(), comm.size(), t);
            model.registry.mark_ready(**it);
          }
        }
        ddp.end_backward();
        zero.step();
        zero.zero_grad();
      }
      after(zero, model, comm);
    });
  };
  const auto nothing = [](dist::ZeroOptimizer&, UnitModel&, Communicator&) {};
  const auto keep = [](std::vector<double>& into) {
    return [&into](dist::ZeroOptimizer& zero, UnitModel& model, Communicator& comm) {
      const std::vector<double> values = unit_values(model, zero);
      if (comm.rank() == 0) into = values;
    };
  };
  run(2, 3, 0, 6, false, nothing, keep(straight));
  run(2, 3, 0, 3, false, nothing, [&](dist::ZeroOptimizer& zero, UnitModel& model, Communicator& comm) {
    zero.save_sharded(sets);
    keep(saved)(zero, model, comm);
  });
  run(2, 3, 3, 3, true, [&](dist::ZeroOptimizer& zero, UnitModel&, Communicator&) { zero.load_sharded(sets); },
      keep(resumed));
  run(3, 3, 3, 0, true,
      [&](dist::ZeroOptimizer& zero, UnitModel&, Communicator&) {
        EXPECT_GRADSYNC_ERROR(zero.load_sharded(sets), "was saved by 2 rank(s), this run has 3", "reshard");
        zero.load_sharded(sets, /*reshard=*/true);
      },
      keep(resharded_loaded));
  run(3, 3, 3, 3, true, [&](dist::ZeroOptimizer& zero, UnitModel&, Communicator&) { zero.load_sharded(sets, true); },
      keep(resharded));
  run(2, 2, 3, 0, true, [&](dist::ZeroOptimizer& zero, UnitModel&, Communicator&) { zero.load_sharded(sets); },
      keep(below));
  ASSERT_EQ(resumed.size(), straight.size());
  EXPECT_EQ(resumed, straight) << "resumed on the same 2 ranks: bit for bit";
  EXPECT_EQ(resharded_loaded, saved) << "resharded onto 3 ranks: the saved values exactly";
  EXPECT_EQ(below, saved) << "loaded by stage 2: every value, whole";
  testing::expect_near_vectors("resharded onto 3 ranks, then 3 steps", resharded, straight, 1e-6);
}

// Resharding: 3 steps on 4 ranks (stage 2), a consolidated checkpoint; 3 more steps on 2
// ranks (stage 1) and on 3 ranks unsharded, each from that file, equal 6 uninterrupted steps.
TEST(ZeroCheckpoint, ResumeOnAnotherWorldSizeEqualsAnUninterruptedRun) {
  testing::TempDir folder;
  const auto weights = folder / "weights.safetensors";
  const auto state = folder / "optimizer.safetensors";
  std::vector<double> straight, resumed_sharded, resumed_plain;
  comm::run_gloo_thread_group(4, [&](Communicator& comm) {
    testing::ShardModel model(DType::f32);
    auto adam = testing::make_test_optimizer("adamw", model.registry, testing::zero_settings("adamw"));
    dist::DataParallel ddp(model.registry, comm, {.bucket_cap_mb = 1e-6});
    dist::ZeroOptimizer zero(*adam, ddp, {.stage = 1});
    train_global(comm, model, ddp, [&] { zero.step(); zero.zero_grad(); }, 0, 6);
    if (comm.rank() == 0) straight = model.all_values();
  });
  comm::run_gloo_thread_group(4, [&](Communicator& comm) {
    testing::ShardModel model(DType::f32);
    auto adam = testing::make_test_optimizer("adamw", model.registry, testing::zero_settings("adamw"));
    dist::DataParallel ddp(model.registry, comm, {.bucket_cap_mb = 1e-6, .shard_gradients = true});
    dist::ZeroOptimizer zero(*adam, ddp, {.stage = 2});
    train_global(comm, model, ddp, [&] { zero.step(); zero.zero_grad(); }, 0, 3);
    zero.save_consolidated(state);
    if (comm.rank() == 0) io::save_registry(model.registry, weights);
    comm.barrier();
  });
  comm::run_gloo_thread_group(2, [&](Communicator& comm) {
    testing::ShardModel model(DType::f32);
    io::load_registry(model.registry, weights);
    auto adam = testing::make_test_optimizer("adamw", model.registry, testing::zero_settings("adamw"));
    dist::DataParallel ddp(model.registry, comm, {.bucket_cap_mb = 1e-6});
    dist::ZeroOptimizer zero(*adam, ddp, {.stage = 1});
    zero.load_state(state);
    train_global(comm, model, ddp, [&] { zero.step(); zero.zero_grad(); }, 3, 3);
    if (comm.rank() == 0) resumed_sharded = model.all_values();
  });
  comm::run_gloo_thread_group(3, [&](Communicator& comm) {
    testing::ShardModel model(DType::f32);
    io::load_registry(model.registry, weights);
    auto adam = testing::make_test_optimizer("adamw", model.registry, testing::zero_settings("adamw"));
    adam->load_state(state);  // the consolidated file is an ordinary optimizer checkpoint
    dist::DataParallel ddp(model.registry, comm, {.bucket_cap_mb = 1e-6});
    train_global(comm, model, ddp, [&] { adam->step(); adam->zero_grad(); }, 3, 3);
    if (comm.rank() == 0) resumed_plain = model.all_values();
  });
  testing::expect_near_vectors("4 ranks stage 2 -> 2 ranks stage 1", resumed_sharded, straight, 1e-5);
  testing::expect_near_vectors("4 ranks stage 2 -> 3 ranks unsharded", resumed_plain, straight, 1e-5);
}

// Sharded sets: 3 steps on 4 ranks (stage 2), a sharded save; resumed on 4 ranks as saved, and
// on 2 ranks only with reshard = true; both equal 6 uninterrupted steps. A save whose manifest
// cannot be written is an error on every rank and leaves the previous set in force.
TEST(ZeroCheckpoint, ShardedSetsResumeAndReshard) {
  testing::TempDir folder;
  const auto weights = folder / "weights.safetensors";
  const auto sets = folder / "sharded";
  std::vector<double> straight, same_world, resharded;
  const auto run = [&](int world, int stage, int first, int steps, const std::function<void(dist::ZeroOptimizer&, Communicator&)>& before,
                       const std::function<void(dist::ZeroOptimizer&, testing::ShardModel&, Communicator&)>& after) {
    comm::run_gloo_thread_group(world, [&](Communicator& comm) {
      testing::ShardModel model(DType::f32);
      if (first > 0) io::load_registry(model.registry, weights);
      auto adam = testing::make_test_optimizer("adam", model.registry, testing::zero_settings("adam"));
      dist::DataParallel ddp(model.registry, comm, {.bucket_cap_mb = 1e-6, .shard_gradients = stage == 2});
      dist::ZeroOptimizer zero(*adam, ddp, {.stage = stage});
      before(zero, comm);
      train_global(comm, model, ddp, [&] { zero.step(); zero.zero_grad(); }, first, steps);
      after(zero, model, comm);
    });
  };
  const auto nothing = [](dist::ZeroOptimizer&, Communicator&) {};
  run(4, 2, 0, 6, nothing, [&](dist::ZeroOptimizer&, testing::ShardModel& model, Communicator& comm) {
    if (comm.rank() == 0) straight = model.all_values();
  });
  run(4, 2, 0, 3, nothing, [&](dist::ZeroOptimizer& zero, testing::ShardModel& model, Communicator& comm) {
    zero.save_sharded(sets);
    if (comm.rank() == 0) io::save_registry(model.registry, weights);
    comm.barrier();
    // A second save whose manifest cannot be written: an error everywhere, the first set stays.
    // A folder left by an earlier crash squats the next name: the save takes the one after it
    // and its cleanup removes only its own folder.
    if (comm.rank() == 0) std::filesystem::create_directories(sets / "manifest.json.tmp");
    if (comm.rank() == 0) std::filesystem::create_directories(sets / "set-1");
    comm.barrier();
    EXPECT_GRADSYNC_ERROR(zero.save_sharded(sets), "save_sharded", "the previous set, if any, is still in force");
    if (comm.rank() == 0) std::filesystem::remove_all(sets / "manifest.json.tmp");
    comm.barrier();
  });
  std::set<std::string> set_folders;
  for (const auto& entry : std::filesystem::directory_iterator(sets)) {
    if (entry.is_directory()) set_folders.insert(entry.path().filename().string());
  }
  EXPECT_EQ(set_folders, (std::set<std::string>{"set-0", "set-1"}))
      << "the failed save's pieces (set-2) are removed, the first set and the stray folder kept";
  run(4, 2, 3, 3, [&](dist::ZeroOptimizer& zero, Communicator&) { zero.load_sharded(sets); },
      [&](dist::ZeroOptimizer&, testing::ShardModel& model, Communicator& comm) {
        if (comm.rank() == 0) same_world = model.all_values();
      });
  run(2, 1, 3, 3,
      [&](dist::ZeroOptimizer& zero, Communicator&) {
        EXPECT_GRADSYNC_ERROR(zero.load_sharded(sets), "was saved by 4 rank(s), this run has 2", "reshard");
        zero.load_sharded(sets, /*reshard=*/true);
      },
      [&](dist::ZeroOptimizer&, testing::ShardModel& model, Communicator& comm) {
        if (comm.rank() == 0) resharded = model.all_values();
      });
  testing::expect_near_vectors("resumed on 4 ranks", same_world, straight, 1e-6);
  testing::expect_near_vectors("resharded onto 2 ranks", resharded, straight, 1e-5);
}

// ---- Damaged sharded sets --------------------------------------------------------------------
// Each way of damaging a set found by probing it as a user with a bad disk (or a careless copy)
// would: every rank raises the same error, naming the file and the reason, within a second, and
// nothing is loaded.

using json = nlohmann::json;

json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  return json::parse(in);
}

void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::trunc) << text;
}

// Rewrites a piece with `change` applied to its metadata, and records its new size and checksum
// in the manifest, so that what is checked is the metadata, not the bytes.
void rewrite_piece(const std::filesystem::path& sets, int rank, const std::function<void(io::Metadata&)>& change,
                   const std::function<void(std::vector<io::NamedTensor>&)>& change_tensors = {}) {
  json manifest = read_json(sets / "manifest.json");
  const auto path = sets / manifest["set"].get<std::string>() / ("rank" + std::to_string(rank) + ".safetensors");
  const io::SafetensorsReader piece(path);
  io::Metadata metadata = piece.metadata();
  change(metadata);
  std::vector<io::NamedTensor> tensors = piece.read_all();
  if (change_tensors) change_tensors(tensors);
  io::save_safetensors(path, tensors, metadata);
  const io::FileChecksum checksum = io::checksum_file(path);
  manifest["pieces"][static_cast<std::size_t>(rank)]["bytes"] = checksum.bytes;
  manifest["pieces"][static_cast<std::size_t>(rank)]["xxh64"] = io::hex_digest(checksum.xxh64);
  write_text(sets / "manifest.json", manifest.dump());
}

// A stage-3 piece without its values, or with values of another dtype, is refused on every rank,
// naming the file, and nothing is loaded (the values this rank held are still there).
TEST(Zero3, ASetWithoutItsValuesNeverLoads) {
  testing::TempDir folder;
  const auto sets = folder / "sharded";
  const auto values_of = [](std::vector<io::NamedTensor>& tensors) {
    return std::find_if(tensors.begin(), tensors.end(), [](const io::NamedTensor& t) { return t.name == "zero.values.0"; });
  };
  const std::vector<std::pair<std::function<void(std::vector<io::NamedTensor>&)>, std::string>> damages{
      {[&](std::vector<io::NamedTensor>& tensors) { tensors.erase(values_of(tensors)); }, "no 'zero.values.0'"},
      {[&](std::vector<io::NamedTensor>& tensors) { values_of(tensors)->tensor = values_of(tensors)->tensor.to(DType::f64); },
       "'zero.values.0' is f64"},
  };
  for (const auto& [damage, expected] : damages) {
    comm::run_gloo_thread_group(2, [&](Communicator& comm) {
      UnitModel model(2, 9);
      auto adamw = testing::make_test_optimizer("adamw", model.registry, testing::zero_settings("adamw"));
      dist::DataParallelOptions options{.bucket_cap_mb = 1e-6, .shard_gradients = true};
      options.units = model.units;
      dist::DataParallel ddp(model.registry, comm, options);
      dist::ZeroOptimizer zero(*adamw, ddp, {.stage = 3});
      unit_step(comm, model, ddp, zero, 0);
      zero.save_sharded(sets);
      const std::vector<double> before = unit_values(model, zero);
      comm.barrier();
      if (comm.rank() == 0) rewrite_piece(sets, 1, [](io::Metadata&) {}, damage);
      comm.barrier();
      EXPECT_GRADSYNC_ERROR(zero.load_sharded(sets), "rank1.safetensors", expected);
      EXPECT_EQ(unit_values(model, zero), before) << expected;
    });
  }
}

struct DamageCase {
  const char* label;
  bool reshard;
  std::function<void(const std::filesystem::path& sets, const std::filesystem::path& older)> damage;
  std::vector<std::string> expected;  // in the one message every rank raises
};

TEST(ZeroCheckpoint, DamagedSetsNeverLoadAndEveryRankSaysWhy) {
  testing::TempDir folder;
  const auto save = [&](const std::filesystem::path& sets, int steps) {
    comm::run_gloo_thread_group(2, [&](Communicator& comm) {
      testing::ShardModel model(DType::f32);
      auto adam = testing::make_test_optimizer("adam", model.registry, testing::zero_settings("adam"));
      dist::DataParallel ddp(model.registry, comm, {.bucket_cap_mb = 1e-6});
      dist::ZeroOptimizer zero(*adam, ddp, {.stage = 1});
      train_global(comm, model, ddp, [&] { zero.step(); zero.zero_grad(); }, 0, steps);
      zero.save_sharded(sets);
    });
  };
  const auto good = folder / "good";
  const auto older = folder / "older";
  save(older, 3);
  save(good, 5);
  const auto set_of = [](const std::filesystem::path& sets) {
    return sets / read_json(sets / "manifest.json")["set"].get<std::string>();
  };
  const auto set_manifest = [](const char* key, json value) {
    return [key, value](const std::filesystem::path& sets, const std::filesystem::path&) {
      json manifest = read_json(sets / "manifest.json");
      manifest[key] = value;
      write_text(sets / "manifest.json", manifest.dump());
    };
  };
  const std::vector<DamageCase> cases{
      {"world 0", true, set_manifest("world", 0), {"manifest.json: world is 0, not an integer from 1 to 1048576"}},
      {"world -1", true, set_manifest("world", -1), {"manifest.json: world is -1"}},
      {"world 2^32 + 2, which an int would read as 2", true, set_manifest("world", 4294967298ULL),
       {"manifest.json: world is 4294967298"}},
      {"world 1 for a set saved by 2", true, set_manifest("world", 1), {"manifest.json: 2 pieces for a world of 1"}},
      {"world 1 and one piece listed", true,
       [&](const std::filesystem::path& sets, const std::filesystem::path&) {
         json manifest = read_json(sets / "manifest.json");
         manifest["world"] = 1;
         manifest["pieces"].erase(1);
         write_text(sets / "manifest.json", manifest.dump());
       },
       {"rank0.safetensors was saved by 2 rank(s), the manifest says 1"}},
      {"a piece copied from an older set", false,
       [&](const std::filesystem::path& sets, const std::filesystem::path& from) {
         std::filesystem::copy_file(set_of(from) / "rank1.safetensors", set_of(sets) / "rank1.safetensors",
                                    std::filesystem::copy_options::overwrite_existing);
       },
       {"rank1.safetensors belongs to set", "not to", "a piece of another save"}},
      {"a missing piece", false,
       [&](const std::filesystem::path& sets, const std::filesystem::path&) {
         std::filesystem::remove(set_of(sets) / "rank1.safetensors");
       },
       {"rank 1: ", "rank1.safetensors"}},
      {"a truncated piece", false,
       [&](const std::filesystem::path& sets, const std::filesystem::path&) {
         const auto path = set_of(sets) / "rank1.safetensors";
         std::filesystem::resize_file(path, std::filesystem::file_size(path) - 12);
       },
       {"rank 1: ", "rank1.safetensors"}},
      {"flipped data bytes", false,
       [&](const std::filesystem::path& sets, const std::filesystem::path&) {
         const auto path = set_of(sets) / "rank0.safetensors";
         std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
         file.seekg(-5, std::ios::end);
         const char byte = static_cast<char>(file.get());
         file.seekp(-5, std::ios::end);
         file.put(static_cast<char>(byte ^ 0x40));
       },
       {"rank 0: ", "rank0.safetensors: XXH64", "the file is damaged"}},
      {"a rank that is not a number", false,
       [&](const std::filesystem::path& sets, const std::filesystem::path&) {
         rewrite_piece(sets, 1, [](io::Metadata& metadata) { metadata["zero.rank"] = "one"; });
       },
       {"rank1.safetensors: 'zero.rank' is 'one', not an integer"}},
      {"ranges that are not numbers", false,
       [&](const std::filesystem::path& sets, const std::filesystem::path&) {
         rewrite_piece(sets, 0, [](io::Metadata& metadata) { metadata["zero.ranges"] = R"([[0, "2", 9]])"; });
       },
       {"rank0.safetensors: range [0, \"2\", 9]: begin is \"2\", not an integer"}},
      {"ranges past the arena", false,
       [&](const std::filesystem::path& sets, const std::filesystem::path&) {
         rewrite_piece(sets, 1, [](io::Metadata& metadata) { metadata["zero.ranges"] = "[[0, 0, 100000000]]"; });
       },
       {"rank1.safetensors: range [0, 0, 100000000]: end is 100000000"}},
      {"a forged step count in one piece (same world: each rank reads only its own)", false,
       [&](const std::filesystem::path& sets, const std::filesystem::path&) {
         rewrite_piece(sets, 1, [](io::Metadata& metadata) {
           json steps = json::parse(metadata.at("optimizer.steps"));
           for (auto& [name, count] : steps.items()) count = count.get<std::int64_t>() + 1000;
           metadata["optimizer.steps"] = steps.dump();
         });
       },
       {"rank 1: ", "rank1.safetensors: 'optimizer.steps' differs from rank 0's piece"}},
      {"another optimizer's type in one piece", false,
       [&](const std::filesystem::path& sets, const std::filesystem::path&) {
         rewrite_piece(sets, 0, [](io::Metadata& metadata) { metadata["optimizer.type"] = "SGD"; });
       },
       {"rank 1: ", "rank1.safetensors: 'optimizer.type' differs from rank 0's piece"}},
      {"a manifest that is not JSON", false,
       [&](const std::filesystem::path& sets, const std::filesystem::path&) { write_text(sets / "manifest.json", "{\"set\":"); },
       {"manifest.json is not a JSON object"}},
      {"a manifest from before checksums", false,
       [&](const std::filesystem::path& sets, const std::filesystem::path&) {
         write_text(sets / "manifest.json", json({{"set", "set-0"}, {"world", 2}, {"stage", 1}}).dump());
       },
       {"manifest.json has no \"format\""}},
      {"a checksum that is not one", false,
       [&](const std::filesystem::path& sets, const std::filesystem::path&) {
         json manifest = read_json(sets / "manifest.json");
         manifest["pieces"][1]["xxh64"] = 12;
         write_text(sets / "manifest.json", manifest.dump());
       },
       {"manifest.json: pieces[1]: xxh64 12 is not 16 lowercase hex digits"}},
  };
  for (const DamageCase& damaged : cases) {
    SCOPED_TRACE(damaged.label);
    const auto sets = folder / "damaged";
    std::filesystem::remove_all(sets);
    std::filesystem::copy(good, sets, std::filesystem::copy_options::recursive);
    damaged.damage(sets, older);
    std::vector<std::string> messages(2);
    std::vector<double> seconds(2);
    comm::run_gloo_thread_group(2, [&](Communicator& comm) {
      testing::ShardModel model(DType::f32);
      auto adam = testing::make_test_optimizer("adam", model.registry, testing::zero_settings("adam"));
      dist::DataParallel ddp(model.registry, comm, {.bucket_cap_mb = 1e-6});
      dist::ZeroOptimizer zero(*adam, ddp, {.stage = 1});
      const auto start = std::chrono::steady_clock::now();
      try {
        zero.load_sharded(sets, damaged.reshard);
      } catch (const Error& error) {
        messages[static_cast<std::size_t>(comm.rank())] = error.what();
      }
      seconds[static_cast<std::size_t>(comm.rank())] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      for (const Parameter* parameter : model.parameters) {
        EXPECT_EQ(adam->step_count(*parameter), 0) << "rank " << comm.rank() << ": '" << parameter->name() << "' loaded";
      }
    });
    EXPECT_FALSE(messages[0].empty()) << "the damaged set loaded";
    EXPECT_EQ(messages[0], messages[1]) << "every rank raises the same error";
    for (const std::string& part : damaged.expected) {
      EXPECT_NE(messages[0].find(part), std::string::npos) << "'" << part << "' is not in: " << messages[0];
    }
    EXPECT_NE(messages[0].find(sets.string()), std::string::npos) << messages[0];
    for (const double taken : seconds) EXPECT_LT(taken, 1.0) << messages[0];
  }
  // And the undamaged set loads.
  comm::run_gloo_thread_group(2, [&](Communicator& comm) {
    testing::ShardModel model(DType::f32);
    auto adam = testing::make_test_optimizer("adam", model.registry, testing::zero_settings("adam"));
    dist::DataParallel ddp(model.registry, comm, {.bucket_cap_mb = 1e-6});
    dist::ZeroOptimizer zero(*adam, ddp, {.stage = 1});
    zero.load_sharded(good);
    EXPECT_EQ(adam->step_count(*model.parameters[0]), 5);
  });
}

// A failed consolidated save is an error on every rank and leaves the previous file intact.
TEST(ZeroCheckpoint, AFailedSaveIsAnErrorEverywhere) {
  testing::TempDir folder;
  comm::run_gloo_thread_group(2, [&](Communicator& comm) {
    testing::ShardModel model(DType::f32);
    auto sgd = testing::make_test_optimizer("sgd", model.registry, testing::zero_settings("sgd"));
    dist::DataParallel ddp(model.registry, comm);
    dist::ZeroOptimizer zero(*sgd, ddp);
    EXPECT_GRADSYNC_ERROR(zero.save_consolidated(folder / "missing-folder" / "state.safetensors"), "save_consolidated");
  });
}

// The DistributedOptimizer front end (zero_stage 1 and 2) against itself unsharded.
class ZeroHorovod : public ::testing::TestWithParam<std::tuple<int, std::string, int, dist::Compression>> {};
INSTANTIATE_TEST_SUITE_P(Cases, ZeroHorovod,
                         ::testing::Combine(::testing::Values(2, 3, 4), ::testing::Values("sgd", "adam"),
                                            ::testing::Values(1, 2),
                                            ::testing::Values(dist::Compression::none, dist::Compression::fp16)),
                         [](const auto& info) {
                           return testing::name(testing::ranks_name(std::get<0>(info.param)), std::get<1>(info.param),
                                                std::to_string(std::get<2>(info.param)) + "_passes",
                                                dist::compression_name(std::get<3>(info.param)));
                         });

TEST_P(ZeroHorovod, MatchesUnsharded) {
  const auto& [world, kind, passes, compression] = GetParam();
  comm::run_gloo_thread_group(world, [&](Communicator& comm) {
    testing::horovod_zero_matches_unsharded(comm, {.optimizer = kind, .passes = passes, .compression = compression});
  });
}

TEST(Zero, DistributedOptimizerErrors) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    testing::ShardModel model(DType::f32);
    auto sgd = testing::make_test_optimizer("sgd", model.registry, testing::zero_settings("sgd"));
    EXPECT_GRADSYNC_ERROR(dist::DistributedOptimizer(*sgd, comm, {.zero_stage = 3}), "zero_stage 3 is DataParallel's",
                          "units");
    EXPECT_GRADSYNC_ERROR(dist::DistributedOptimizer(*sgd, comm, {.op = dist::Op::adasum, .zero_stage = 1}),
                          "zero_stage does not combine with op Adasum");
    EXPECT_GRADSYNC_ERROR(dist::DistributedOptimizer(*sgd, comm, {.sparse_parameters = {model.parameters[0]},
                                                                  .zero_stage = 2}),
                          "zero_stage does not combine with sparse parameters ('embedding')");
    // Explicit groups whose members are not neighbours in the arena: no bucket is an arena run.
    EXPECT_GRADSYNC_ERROR(
        dist::DistributedOptimizer(*sgd, comm, {.groups = std::vector<std::vector<Parameter*>>{{model.parameters[0],
                                                                                               model.parameters[4]}},
                                                .fusion_threshold_bytes = 64, .zero_stage = 1}),
        "is not a view of the gradient arena");
    EXPECT_FALSE(sgd->sharded()) << "a failed construction leaves the optimizer as it was";
    dist::DistributedOptimizer optimizer(*sgd, comm, {.zero_stage = 1});
    EXPECT_GRADSYNC_ERROR(optimizer.join(), "join is not supported with zero_stage");
  });
}

TEST(Zero, Errors) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    testing::ShardModel model(DType::f32);
    auto sgd = testing::make_test_optimizer("sgd", model.registry, testing::zero_settings("sgd"));
    {
      dist::DataParallel ddp(model.registry, comm);
      EXPECT_GRADSYNC_ERROR(dist::ZeroOptimizer(*sgd, ddp, {.stage = 2}), "stage 2 needs a DataParallel with shard_gradients");
      EXPECT_GRADSYNC_ERROR(dist::ZeroOptimizer(*sgd, ddp, {.stage = 3}), "stage 3");
    }
    {
      // A different stage on each rank: an error on every rank, naming both.
      dist::DataParallel ddp(model.registry, comm, {.shard_gradients = comm.rank() == 1});
      EXPECT_GRADSYNC_ERROR(dist::ZeroOptimizer(*sgd, ddp, {.stage = comm.rank() + 1}), "shard layout", "stage 1",
                            "stage 2");
    }
    {
      // Other buckets on one rank: other pieces. An error on every rank, naming the bucket.
      auto adam = testing::make_test_optimizer("adam", model.registry, testing::zero_settings("adam"));
      dist::DataParallel ddp(model.registry, comm, {.bucket_cap_mb = comm.rank() == 0 ? 1e-6 : 25.0});
      EXPECT_GRADSYNC_ERROR(dist::ZeroOptimizer(*adam, ddp), "shard layout", "bucket 0");
    }
    dist::DataParallel ddp(model.registry, comm, {.shard_gradients = true});
    EXPECT_GRADSYNC_ERROR(ddp.register_comm_hook([](Communicator& c, Tensor& flat, const dist::BucketInfo&) {
      return c.allreduce_async(flat, comm::ReduceOp::sum);
    }), "does not combine");
    dist::ZeroOptimizer zero(*sgd, ddp, {.stage = 2});
    EXPECT_GRADSYNC_ERROR(sgd->save_state(testing::TempDir().path() / "state.safetensors"), "is sharded (ZeRO)");
    {
      // Under Join with a GradScaler's unscale pending: a skipped step would strand the joined ranks.
      dist::Join join({&ddp, &zero});
      sgd->defer_gradient_unscale(0.5);
      EXPECT_GRADSYNC_ERROR(zero.step(), "with a GradScaler is not supported");
      sgd->discard_gradient_factors();
      join.join();
    }
    {
      // A Join over the DataParallel alone: the ZeroOptimizer's step is a clear error, not a hang.
      dist::Join join(ddp);
      EXPECT_GRADSYNC_ERROR(zero.step(), "does not include this ZeroOptimizer", "dist::Join({&ddp, &zero}");
      join.join();
    }
  });
}

// A user's optimizer that reads its state buffers directly cannot be sharded: an error.
TEST(Zero, AnOptimizerWithoutShardingSupportIsRefused) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    testing::ShardModel model(DType::f32);
    struct Plain : optim::SGD {
      using optim::SGD::SGD;
      bool supports_sharding() const override { return false; }
    };
    Plain sgd(model.registry, optim::SGD::Options{.lr = 0.1});
    dist::DataParallel ddp(model.registry, comm);
    EXPECT_GRADSYNC_ERROR(dist::ZeroOptimizer(sgd, ddp), "does not support sharding");
  });
}

}  // namespace
}  // namespace gradsync
