// HSDP (dist/shard_groups.h, DataParallelOptions::replicas; docs/zero.md "HSDP"), on Gloo
// ranks-as-threads: ZeRO stage 3 sharded inside groups of ranks and replicated across them
// against PyTorch FSDP2 over a 2-D DeviceMesh (2 x 2 and 2 x 3) and against stage 3 over all the
// ranks; stage 2 likewise; every group holds the same model bit for bit; checkpoints written by
// group 0 and loaded by every group; the errors.
#include <gtest/gtest.h>

#include <optional>
#include <tuple>

#include <nlohmann/json.hpp>

#include "expectations.h"
#include "gradsync/comm/gloo/gloo.h"
#include "gradsync/dist/join/join.h"
#include "gradsync/dist/zero/shard_groups.h"
#include "gradsync/dist/zero/zero.h"
#include "gradsync/io/safetensors.h"
#include "gradsync/kernels/ops.h"
#include "gradsync/nn/data_parallel_module.h"
#include "gradsync/nn/loss.h"
#include "gradsync/nn/sharded_sequential.h"
#include "models.h"
#include "optimizers.h"
#include "test_util.h"

namespace gradsync {
namespace {

using comm::Communicator;

const io::SafetensorsReader& fixture() {
  static const io::SafetensorsReader file(testing::fixture_path("hsdp_fsdp2.safetensors"));
  return file;
}

// One run of the fixture's MLP: `group_size` ranks per shard group (0: no HSDP, stage `stage`
// over every rank), `steps` steps of the fixture's batches (each rank its world rank's), then
// `after` with the ZeroOptimizer and the model. Returns rank 0's losses and final weights.
struct HsdpRun {
  int world = 4;
  int group_size = 2;
  int stage = 3;
  std::string optimizer = "adam";
  int micro = 1;
  int first_step = 0;
  int steps = 6;
  std::function<void(dist::ZeroOptimizer&, Communicator&)> before{};
  std::function<void(dist::ZeroOptimizer&, Communicator&)> after{};
  // Uneven inputs: each world rank's number of steps (instead of `steps`), inside a dist::Join
  // with these options.
  std::vector<int> rank_steps{};
  std::optional<dist::JoinOptions> join{};
};

struct Outcome {
  std::vector<std::vector<double>> losses;  // by world rank
  std::vector<std::vector<double>> finals;  // by world rank: every parameter's values in order
  std::vector<int> last_joiner;             // by world rank, under `join`
  std::vector<std::string> terminations;    // by world rank: "step s: what" of a JoinEarlyTermination
};

Outcome train(const HsdpRun& run) {
  const nlohmann::json settings = nlohmann::json::parse(fixture().metadata().at("settings"));
  Outcome outcome;
  outcome.losses.resize(static_cast<std::size_t>(run.world));
  outcome.finals.resize(static_cast<std::size_t>(run.world));
  outcome.last_joiner.assign(static_cast<std::size_t>(run.world), -1);
  outcome.terminations.resize(static_cast<std::size_t>(run.world));
  comm::run_gloo_thread_group(run.world, [&](Communicator& world) {
    std::optional<dist::ShardGroups> groups;
    if (run.group_size > 0) groups.emplace(world, run.group_size);
    Communicator& comm = groups ? groups->shard() : world;
    ParameterRegistry registry;
    auto layers = testing::fixture_mlp(registry, fixture());
    optim::Hyperparameters hyperparameters;
    for (const auto& [key, value] : settings.at(run.optimizer).items()) hyperparameters[key] = value.get<double>();
    auto opt = testing::make_test_optimizer(run.optimizer, registry, hyperparameters);
    auto sharded = std::make_shared<nn::ShardedSequential>(layers);
    dist::DataParallelOptions options{.shard_gradients = true};
    if (run.stage == 3) options.units = sharded->units();
    if (groups) options.replicas = &groups->replicas();
    std::shared_ptr<nn::Module> top = run.stage == 3 ? std::shared_ptr<nn::Module>(sharded) : std::shared_ptr<nn::Module>(layers);
    nn::DistributedDataParallel model(top, comm, options);
    dist::ZeroOptimizer zero(*opt, model.data_parallel(), {.stage = run.stage});
    if (run.stage == 3) sharded->attach(zero);
    if (run.before) run.before(zero, world);
    const int steps = run.rank_steps.empty() ? run.steps : run.rank_steps[static_cast<std::size_t>(world.rank())];
    auto train_step = [&](int step) {
      const std::string batch = "data.step" + std::to_string(step) + ".rank" + std::to_string(world.rank());
      const Tensor x = fixture().read(batch + ".x"), y = fixture().read(batch + ".y");
      const std::int64_t rows = x.shape()[0] / run.micro, columns = x.shape()[1];
      double step_loss = 0;
      for (int m = 0; m < run.micro; ++m) {
        const Tensor xm = x.view(static_cast<std::size_t>(m * rows * columns), {rows, columns});
        const Tensor ym = y.view(static_cast<std::size_t>(m * rows), {rows});
        nn::LossResult loss = nn::softmax_cross_entropy(model.forward(xm), ym);
        ops::scale(loss.grad, 1.0 / run.micro);
        model.backward(loss.grad);
        step_loss += loss.loss / run.micro;
      }
      zero.step();
      zero.zero_grad();
      return step_loss;
    };
    std::vector<double> losses;
    int step = run.first_step;
    try {  // a Join ends with the scope an exception leaves (as PyTorch's context manager)
      std::optional<dist::Join> join;
      if (run.join) join.emplace(std::vector<dist::Joinable*>{&model.data_parallel(), &zero}, *run.join);
      for (; step < run.first_step + steps; ++step) losses.push_back(train_step(step));
      if (join) outcome.last_joiner[static_cast<std::size_t>(world.rank())] = join->join();
    } catch (const dist::JoinEarlyTermination& error) {
      outcome.terminations[static_cast<std::size_t>(world.rank())] = "step " + std::to_string(step) + ": " + error.what();
      return;
    }
    if (run.after) run.after(zero, world);
    if (run.stage == 3) sharded->gather_all();
    std::vector<double> values;
    for (Parameter& p : registry) {
      const std::vector<double> v = p.value().to_double_vector();
      values.insert(values.end(), v.begin(), v.end());
    }
    outcome.losses[static_cast<std::size_t>(world.rank())] = losses;
    outcome.finals[static_cast<std::size_t>(world.rank())] = values;
  });
  return outcome;
}

std::vector<double> fixture_final(const std::string& prefix) {
  std::vector<double> values;
  for (const char* name : {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}) {
    const std::vector<double> v = fixture().read(prefix + ".final." + name).to_double_vector();
    values.insert(values.end(), v.begin(), v.end());
  }
  return values;
}

// Every rank of every group holds the same model, bit for bit.
void expect_identical_replicas(const Outcome& outcome, const std::string& where) {
  for (std::size_t r = 1; r < outcome.finals.size(); ++r) {
    EXPECT_EQ(outcome.finals[r], outcome.finals[0]) << "rank " << r << " differs from rank 0, " << where;
  }
}

void expect_close(const std::vector<double>& got, const std::vector<double>& expected, const std::string& where) {
  ASSERT_EQ(got.size(), expected.size()) << where;
  double largest = 0;
  for (const double v : expected) largest = std::max(largest, std::abs(v));
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], expected[i], 1e-6 * largest) << "[" << i << "], " << where;
}

TEST(Hsdp, MatchesPyTorchFSDP2OverATwoDimensionalMesh) {
  const std::vector<std::tuple<std::string, std::string, int>> cases{
      {"sgd", "sgd", 1}, {"adam", "adam", 1}, {"adamw", "adamw", 1}, {"adamw.multi", "adamw", 2}};
  for (const auto& [groups, size] : std::vector<std::pair<int, int>>{{2, 2}, {2, 3}}) {
    for (const auto& [name, optimizer, micro] : cases) {
      const std::string prefix = "m" + std::to_string(groups) + "x" + std::to_string(size) + "." + name;
      const Outcome outcome = train({.world = groups * size, .group_size = size, .optimizer = optimizer, .micro = micro});
      for (std::size_t r = 0; r < outcome.losses.size(); ++r) {
        const std::vector<double> expected = fixture().read(prefix + ".rank" + std::to_string(r) + ".losses").to_double_vector();
        for (std::size_t s = 0; s < expected.size(); ++s) {
          EXPECT_NEAR(outcome.losses[r][s], expected[s], 1e-6 * std::abs(expected[s])) << prefix << ", rank " << r << ", step " << s;
        }
      }
      expect_close(outcome.finals[0], fixture_final(prefix), prefix);
      expect_identical_replicas(outcome, prefix);
    }
  }
}

// HSDP against ZeRO over all the ranks: the same sums in another order (a reduce-scatter inside
// each group, then an allreduce of each piece across the groups), so within 1e-6.
TEST(Hsdp, EqualsShardingOverAllTheRanks) {
  for (const int stage : {3, 2}) {
    for (const std::string optimizer : {"sgd", "adamw"}) {
      const std::string where = "stage " + std::to_string(stage) + ", " + optimizer;
      const Outcome flat = train({.world = 4, .group_size = 0, .stage = stage, .optimizer = optimizer});
      const Outcome hsdp = train({.world = 4, .group_size = 2, .stage = stage, .optimizer = optimizer});
      expect_close(hsdp.finals[0], flat.finals[0], where);
      for (std::size_t r = 0; r < 4; ++r) testing::expect_near_vectors(where + ", losses", hsdp.losses[r], flat.losses[r], 1e-6);
      expect_identical_replicas(hsdp, where + " (HSDP)");
    }
  }
  // Groups of one rank: plain replication (each piece the whole model), and one group: stage 3.
  const Outcome flat = train({.world = 4, .group_size = 0, .optimizer = "adam"});
  expect_close(train({.world = 4, .group_size = 1, .optimizer = "adam"}).finals[0], flat.finals[0], "groups of 1");
  expect_close(train({.world = 4, .group_size = 4, .optimizer = "adam"}).finals[0], flat.finals[0], "one group of 4");
}

// Uneven inputs under HSDP: a rank out of data joins the whole job. Its shadow steps are
// answered inside its group and across the groups; a group whose ranks have all joined keeps
// stepping its pieces with the others (the control words cross the groups). Against stage 3 / 2
// over all 4 ranks under the same Join (itself checked against PyTorch's Join in test_join):
// within 1e-6, every replica equal, the same last joiner.
TEST(Hsdp, JoinsTheWholeJobWithUnevenInputs) {
  const std::vector<std::vector<int>> schedules{
      {2, 2, 6, 6},  // group 0 runs out first, whole: group 1 steps on with group 0 shadowing
      {6, 3, 5, 1},  // one rank of each group runs out; the last joiner is group 0's rank 0
  };
  for (const int stage : {3, 2}) {
    for (const bool divide_by_world : {true, false}) {
      for (const std::vector<int>& schedule : schedules) {
        const std::string where = "stage " + std::to_string(stage) + (divide_by_world ? ", / world" : ", / active") +
                                  ", steps " + std::to_string(schedule[0]) + std::to_string(schedule[1]) +
                                  std::to_string(schedule[2]) + std::to_string(schedule[3]);
        const dist::JoinOptions join{.divide_by_initial_world_size = divide_by_world};
        const HsdpRun flat{.world = 4, .group_size = 0, .stage = stage, .rank_steps = schedule, .join = join};
        HsdpRun hsdp = flat;
        hsdp.group_size = 2;
        const Outcome expected = train(flat), got = train(hsdp);
        expect_close(got.finals[0], expected.finals[0], where);
        expect_identical_replicas(got, where);
        for (std::size_t r = 0; r < 4; ++r) {
          testing::expect_near_vectors(where + ", losses", got.losses[r], expected.losses[r], 1e-6);
          EXPECT_EQ(got.last_joiner[r], expected.last_joiner[r]) << where << ", rank " << r;
        }
      }
    }
  }
  // Groups of one rank (plain replication across 4 groups): each rank alone in its group.
  const HsdpRun flat{.world = 4, .group_size = 0, .rank_steps = {3, 6, 1, 4}, .join = dist::JoinOptions{}};
  HsdpRun singles = flat;
  singles.group_size = 1;
  const Outcome expected = train(flat), got = train(singles);
  expect_close(got.finals[0], expected.finals[0], "groups of 1");
  expect_identical_replicas(got, "groups of 1");
  EXPECT_EQ(got.last_joiner, std::vector<int>(4, 1));
}

// throw_on_early_termination under HSDP (stage 2): every rank of every group raises at the
// step in which the first rank ran out.
TEST(Hsdp, EarlyTerminationRaisesInEveryGroup) {
  const Outcome outcome = train({.world = 4, .group_size = 2, .stage = 2, .rank_steps = {6, 6, 2, 6},
                                 .join = dist::JoinOptions{.throw_on_early_termination = true}});
  for (std::size_t r = 0; r < 4; ++r) {
    const std::string& got = outcome.terminations[r];
    EXPECT_EQ(got.rfind("step 2: ", 0), 0u) << "rank " << r << ": " << got;
    const std::string expected = r == 2 ? "Rank 2 exhausted all inputs."
                                        : "Detected at least one rank that exhausted inputs. Throwing across all ranks.";
    EXPECT_NE(got.find(expected), std::string::npos) << "rank " << r << ": " << got;
  }
}

// Shard group 0 writes the checkpoints, every group loads them: a sharded set and the model file
// from 3 steps of HSDP resume into 3 more equal to 6 uninterrupted steps, bit for bit; the set
// has one piece per place in a group; the model file loads into stage 3 over all 4 ranks.
TEST(Hsdp, CheckpointsAreWrittenByGroupZeroAndLoadedByEveryGroup) {
  testing::TempDir folder;
  const Outcome straight = train({.world = 4, .group_size = 2, .optimizer = "adamw"});
  std::uint64_t saved_checksum = 0;
  train({.world = 4, .group_size = 2, .optimizer = "adamw", .steps = 3,
         .after = [&](dist::ZeroOptimizer& zero, Communicator& world) {
           zero.save_sharded(folder / "sets");
           zero.save_model(folder / "model.safetensors");
           const std::uint64_t checksum = zero.model_checksum();
           if (world.rank() == 0) saved_checksum = checksum;
         }});
  std::size_t pieces = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(folder / "sets")) {
    pieces += entry.path().extension() == ".safetensors" ? 1 : 0;
  }
  EXPECT_EQ(pieces, 2u) << "one piece per place in a group, written by group 0 alone";
  const Outcome resumed = train({.world = 4, .group_size = 2, .optimizer = "adamw", .first_step = 3, .steps = 3,
                                 .before = [&](dist::ZeroOptimizer& zero, Communicator&) { zero.load_sharded(folder / "sets"); }});
  for (std::size_t r = 0; r < 4; ++r) EXPECT_EQ(resumed.finals[r], straight.finals[r]) << "rank " << r;
  train({.world = 4, .group_size = 0, .optimizer = "adamw", .steps = 0,
         .before = [&](dist::ZeroOptimizer& zero, Communicator&) {
           zero.load_model(folder / "model.safetensors");
           EXPECT_EQ(zero.model_checksum(), saved_checksum);
         }});
}

// A model initialized by pieces in every group (never broadcast): the replicas' check compares
// the groups' pieces by their checksums; a group initialized with another seed is an error on
// every rank naming the first parameter that differs.
TEST(Hsdp, GroupsInitializeAloneAndTheirPiecesAreCompared) {
  std::uint64_t flat_checksum = 0;
  train({.world = 4, .group_size = 0, .steps = 0, .before = [&](dist::ZeroOptimizer& zero, Communicator& world) {
           zero.initialize([](const Parameter&) { return init::normal(0.0, 0.1); }, 7);
           const std::uint64_t checksum = zero.model_checksum();
           if (world.rank() == 0) flat_checksum = checksum;
         }});
  train({.world = 4, .group_size = 2, .steps = 0, .before = [&](dist::ZeroOptimizer& zero, Communicator&) {
           zero.initialize([](const Parameter&) { return init::normal(0.0, 0.1); }, 7);
           EXPECT_EQ(zero.model_checksum(), flat_checksum);
         }});
  train({.world = 4, .group_size = 2, .steps = 0, .before = [&](dist::ZeroOptimizer& zero, Communicator& world) {
           const std::uint64_t seed = world.rank() < 2 ? 7 : 8;  // group 1 differs
           EXPECT_GRADSYNC_ERROR(zero.initialize([](const Parameter&) { return init::normal(0.0, 0.1); }, seed),
                                 "pieces across the shard groups", "'0.weight'");
         }});
}

TEST(Hsdp, Errors) {
  comm::run_gloo_thread_group(4, [](Communicator& world) {
    EXPECT_GRADSYNC_ERROR(dist::ShardGroups(world, 3), "groups of 3 ranks do not divide the world of 4");
    dist::ShardGroups by_node(world);  // the threads share a host: one group
    EXPECT_EQ(by_node.groups(), 1);
    EXPECT_EQ(by_node.group_size(), 4);
    dist::ShardGroups groups(world, 2);
    EXPECT_EQ(groups.group(), world.rank() / 2);
    EXPECT_EQ(groups.shard().size(), 2);
    EXPECT_EQ(groups.replicas().size(), 2);
    ParameterRegistry registry;
    registry.add("w", {10});
    registry.finalize();
    dist::DataParallelOptions plain;
    plain.replicas = &groups.replicas();
    EXPECT_GRADSYNC_ERROR(dist::DataParallel(registry, groups.shard(), plain), "replicas (HSDP) need shard_gradients");
    dist::DataParallelOptions options{.shard_gradients = true};
    options.replicas = &groups.replicas();
    dist::DataParallel ddp(registry, groups.shard(), options);
    EXPECT_EQ(static_cast<dist::Joinable&>(ddp).join_world_size(), 4);
    EXPECT_EQ(static_cast<dist::Joinable&>(ddp).join_rank(), world.rank());
  });
}

}  // namespace
}  // namespace gradsync
