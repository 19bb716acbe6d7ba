// LocalSGD (dist/local_sgd.h) on Gloo ranks-as-threads, against PyTorch's PostLocalSGDOptimizer
// over a PeriodicModelAverager (tests/reference/generate_local_sgd_fixtures.py): 2-4 ranks, SGD,
// Adam and AdamW, periods 3 and 4, with and without warm-up steps of gradient averaging; every
// rank's loss per step and final weights within 1e-6; the errors.
#include <gtest/gtest.h>

#include <limits>

#include <algorithm>
#include <optional>

#include <nlohmann/json.hpp>

#include "expectations.h"
#include "gradsync/comm/gloo/gloo.h"
#include "gradsync/dist/join/join.h"
#include "gradsync/dist/outer/local_sgd.h"
#include "gradsync/io/safetensors.h"
#include "gradsync/nn/data_parallel_module.h"
#include "gradsync/nn/loss.h"
#include "models.h"
#include "optimizers.h"
#include "test_util.h"

namespace gradsync {
namespace {

using comm::Communicator;

TEST(LocalSGD, MatchesPyTorchPostLocalSGDOptimizer) {
  const io::SafetensorsReader fixture(testing::fixture_path("local_sgd.safetensors"));
  const nlohmann::json settings = nlohmann::json::parse(fixture.metadata().at("settings"));
  const int steps = std::stoi(fixture.metadata().at("steps"));
  const std::map<std::string, std::string> optimizer_of{{"sgd", "sgd"}, {"adam", "adam"}, {"adamw", "adamw"}};
  for (const int world : {2, 3, 4}) {
    for (const auto& [name, optimizer] : optimizer_of) {
      const std::string prefix = "w" + std::to_string(world) + "." + name;
      comm::run_gloo_thread_group(world, [&](Communicator& comm) {
        ParameterRegistry registry;
        auto layers = testing::fixture_mlp(registry, fixture);
        optim::Hyperparameters hyperparameters;
        const nlohmann::json& mine = settings.at(name);
        for (const char* key : {"lr", "momentum", "weight_decay"}) {
          if (mine.contains(key)) hyperparameters[key] = mine.at(key).get<double>();
        }
        auto opt = testing::make_test_optimizer(optimizer, registry, hyperparameters);
        nn::DistributedDataParallel model(layers, comm);
        dist::LocalSGD local(registry, comm, {.period = mine.at("period").get<std::int64_t>(),
                                              .warmup_steps = mine.at("warmup").get<std::int64_t>()});
        const std::vector<double> expected =
            fixture.read(prefix + ".rank" + std::to_string(comm.rank()) + ".losses").to_double_vector();
        for (int step = 0; step < steps; ++step) {
          const std::string batch = "data.step" + std::to_string(step) + ".rank" + std::to_string(comm.rank());
          std::optional<dist::DataParallel::NoSync> local_only;
          if (!local.in_warmup()) local_only.emplace(model.data_parallel());
          nn::LossResult loss = nn::softmax_cross_entropy(model.forward(fixture.read(batch + ".x")), fixture.read(batch + ".y"));
          model.backward(loss.grad);
          opt->step();
          const bool averaged = local.step();
          const std::int64_t warmup = mine.at("warmup").get<std::int64_t>(), period = mine.at("period").get<std::int64_t>();
          EXPECT_EQ(averaged, step >= warmup && (step - warmup) % period == 0) << prefix << ", step " << step;
          opt->zero_grad();
          const double want = expected[static_cast<std::size_t>(step)];
          EXPECT_NEAR(loss.loss, want, 1e-6 * std::abs(want)) << prefix << ", rank " << comm.rank() << ", step " << step;
        }
        for (Parameter& p : registry) {
          const std::vector<double> want =
              fixture.read(prefix + ".rank" + std::to_string(comm.rank()) + ".final." + p.name()).to_double_vector();
          testing::expect_near_vectors(prefix + ", rank " + std::to_string(comm.rank()) + ", " + p.name(),
                                       p.value().to_double_vector(), want, 1e-6);
        }
      });
    }
  }
}

// Uneven inputs: rank r takes steps[r] steps of the adamw case (period 3, no warm-up). `join`:
// inside dist::Join({&local}, options); otherwise a rank out of data keeps calling step() without
// training up to the longest rank's count, then every rank average()s. Every rank's final values.
std::vector<std::vector<double>> uneven_local_sgd(const std::vector<int>& steps, std::optional<dist::JoinOptions> join,
                                                  std::vector<std::string>* terminated = nullptr) {
  const io::SafetensorsReader fixture(testing::fixture_path("local_sgd.safetensors"));
  const nlohmann::json mine = nlohmann::json::parse(fixture.metadata().at("settings")).at("adamw");
  std::vector<std::vector<double>> finals(steps.size());
  const int longest = *std::max_element(steps.begin(), steps.end());
  comm::run_gloo_thread_group(static_cast<int>(steps.size()), [&](Communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    ParameterRegistry registry;
    auto layers = testing::fixture_mlp(registry, fixture);
    optim::Hyperparameters hyperparameters;
    for (const char* key : {"lr", "weight_decay"}) {
      if (mine.contains(key)) hyperparameters[key] = mine.at(key).get<double>();
    }
    auto opt = testing::make_test_optimizer("adamw", registry, hyperparameters);
    dist::LocalSGD local(registry, comm, {.period = mine.at("period").get<std::int64_t>()});
    int step = 0;
    try {
      std::optional<dist::Join> joined;
      if (join) joined.emplace(std::vector<dist::Joinable*>{&local}, *join);
      for (; step < steps[r]; ++step) {
        const std::string batch = "data.step" + std::to_string(step) + ".rank" + std::to_string(comm.rank());
        nn::LossResult loss = nn::softmax_cross_entropy(layers->forward(fixture.read(batch + ".x")), fixture.read(batch + ".y"));
        layers->backward(loss.grad);
        opt->step();
        opt->zero_grad();
        local.step();
      }
      if (joined) {
        EXPECT_EQ(joined->join(), 0) << "rank 0 is the last to join";
      } else {
        for (; step < longest; ++step) local.step();
        local.average();
      }
    } catch (const dist::JoinEarlyTermination& error) {
      if (terminated) (*terminated)[r] = "step " + std::to_string(step) + ": " + error.what();
      return;
    }
    for (Parameter& p : registry) {
      const std::vector<double> v = p.value().to_double_vector();
      finals[r].insert(finals[r].end(), v.begin(), v.end());
    }
  });
  return finals;
}

// Under dist::Join a rank out of data takes part in the averages with its replica as it is:
// dividing by the world, exactly a rank that keeps stepping LocalSGD without training, and the
// Join ends with an average (bit for bit; 3 ranks taking 24, 17 and 10 steps); dividing by the
// active ranks, another model, every replica equal. throw_on_early_termination raises everywhere
// at the first average after rank 2 ran out (step 12 of period 3: index 12); joining in the
// warm-up is an error.
TEST(LocalSGD, UnevenInputsUnderJoin) {
  const auto reference = uneven_local_sgd({24, 17, 10}, std::nullopt);
  const auto joined = uneven_local_sgd({24, 17, 10}, dist::JoinOptions{});
  for (std::size_t r = 0; r < 3; ++r) {
    EXPECT_EQ(joined[r], reference[r]) << "rank " << r;
    EXPECT_EQ(joined[r], joined[0]) << "rank " << r;
  }
  const auto active = uneven_local_sgd({24, 17, 10}, dist::JoinOptions{.divide_by_initial_world_size = false});
  EXPECT_NE(active[0], joined[0]);
  for (std::size_t r = 1; r < 3; ++r) EXPECT_EQ(active[r], active[0]) << "rank " << r;
  std::vector<std::string> terminated(3);
  uneven_local_sgd({24, 17, 10}, dist::JoinOptions{.throw_on_early_termination = true}, &terminated);
  EXPECT_EQ(terminated[2].rfind("step 10: ", 0), 0u) << terminated[2];
  EXPECT_NE(terminated[2].find("Rank 2 exhausted all inputs."), std::string::npos) << terminated[2];
  for (const std::size_t r : {0u, 1u}) {
    EXPECT_EQ(terminated[r].rfind("step 12: ", 0), 0u) << "rank " << r << ": " << terminated[r];
    EXPECT_NE(terminated[r].find("Detected at least one rank that exhausted inputs"), std::string::npos)
        << "rank " << r << ": " << terminated[r];
  }
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    ParameterRegistry registry;
    registry.add("w", {4});
    registry.finalize();
    dist::LocalSGD local(registry, comm, {.period = 2, .warmup_steps = 5});
    dist::Join join({&local});
    EXPECT_GRADSYNC_ERROR(join.join(), "joined (dist::Join) in the warm-up");
  });
}

TEST(LocalSGD, Errors) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    ParameterRegistry registry;
    registry.add("w", {4});
    registry.add(comm.rank() == 0 ? "b" : "c", {2});
    registry.finalize();
    EXPECT_GRADSYNC_ERROR(dist::LocalSGD(registry, comm, {.period = 0}), "period 0");
    EXPECT_GRADSYNC_ERROR(dist::LocalSGD(registry, comm, {.period = 2, .warmup_steps = -1}), "warmup_steps -1");
    EXPECT_GRADSYNC_ERROR(dist::LocalSGD(registry, comm, {.period = 2 + comm.rank()}), "options", "period 2", "period 3");
    EXPECT_GRADSYNC_ERROR(dist::LocalSGD(registry, comm, {.period = 2}), "'b'", "'c'");
  });
  // A resumed step count that is no count (step() would overflow it) is refused.
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    ParameterRegistry registry;
    registry.add("w", {4});
    registry.finalize();
    dist::LocalSGD local(registry, comm, {.period = 2});
    EXPECT_GRADSYNC_ERROR(local.set_steps(std::numeric_limits<std::int64_t>::max()), "not a step count");
    EXPECT_GRADSYNC_ERROR(local.set_steps(-1), "not a step count");
    local.set_steps(5);
  });
}

}  // namespace
}  // namespace gradsync
