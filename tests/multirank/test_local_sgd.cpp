// LocalSGD (dist/local_sgd.h) on Gloo ranks-as-threads, against PyTorch's PostLocalSGDOptimizer
// over a PeriodicModelAverager (tests/reference/generate_local_sgd_fixtures.py): 2-4 ranks, SGD,
// Adam and AdamW, periods 3 and 4, with and without warm-up steps of gradient averaging; every
// rank's loss per step and final weights within 1e-6; the errors.
#include <gtest/gtest.h>

#include <optional>

#include <nlohmann/json.hpp>

#include "expectations.h"
#include "gradsync/comm/gloo.h"
#include "gradsync/dist/local_sgd.h"
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
}

}  // namespace
}  // namespace gradsync
