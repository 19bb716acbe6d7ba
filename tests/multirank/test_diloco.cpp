// DiLoCo (dist/diloco.h) on Gloo ranks-as-threads, against a torch implementation of the paper's
// algorithm as torchft runs it (tests/reference/generate_diloco_fixtures.py): 2-4 ranks, inner
// AdamW / SGD / Adam, H = 4, 3, 6, outer Nesterov SGD (and plain SGD at lr 1: model averaging),
// 24 steps: every rank's loss per step and the final weights within 1e-6. Its checkpoint resumes
// bit for bit; a state of another world size or H is refused, naming the difference.
#include <gtest/gtest.h>

#include <functional>
#include <utility>

#include <nlohmann/json.hpp>

#include "expectations.h"
#include "gradsync/comm/gloo.h"
#include "gradsync/dist/diloco.h"
#include "gradsync/io/safetensors.h"
#include "gradsync/nn/loss.h"
#include "models.h"
#include "optimizers.h"
#include "test_util.h"

namespace gradsync {
namespace {

using comm::Communicator;

const io::SafetensorsReader& fixture() {
  static const io::SafetensorsReader file(testing::fixture_path("diloco.safetensors"));
  return file;
}

struct Run {
  int world = 2;
  std::string name = "adamw";
  int first_step = 0;
  int steps = 24;
  std::int64_t sync_every = 0;  // 0: the fixture's
  std::function<void(dist::DiLoCo&, optim::Optimizer&, ParameterRegistry&, Communicator&)> before{};
  std::function<void(dist::DiLoCo&, optim::Optimizer&, ParameterRegistry&, Communicator&)> after{};
};

// Every rank's losses, and every rank's final values (all parameters in order).
std::pair<std::vector<std::vector<double>>, std::vector<std::vector<double>>> train(const Run& run) {
  const nlohmann::json case_settings = nlohmann::json::parse(fixture().metadata().at("settings")).at(run.name);
  std::vector<std::vector<double>> losses(static_cast<std::size_t>(run.world)), finals(static_cast<std::size_t>(run.world));
  comm::run_gloo_thread_group(run.world, [&](Communicator& comm) {
    ParameterRegistry registry;
    auto layers = testing::fixture_mlp(registry, fixture());
    optim::Hyperparameters hyperparameters;
    for (const auto& [key, value] : case_settings.at("inner_settings").items()) hyperparameters[key] = value.get<double>();
    auto inner = testing::make_test_optimizer(case_settings.at("inner").get<std::string>(), registry, hyperparameters);
    dist::DiLoCo diloco(registry, comm,
                        {.sync_every = run.sync_every > 0 ? run.sync_every : case_settings.at("sync_every").get<std::int64_t>(),
                         .outer_lr = case_settings.at("outer_lr").get<double>(),
                         .outer_momentum = case_settings.at("outer_momentum").get<double>(),
                         .nesterov = case_settings.at("nesterov").get<bool>()});
    if (run.before) run.before(diloco, *inner, registry, comm);
    for (int step = run.first_step; step < run.first_step + run.steps; ++step) {
      const std::string batch = "data.step" + std::to_string(step) + ".rank" + std::to_string(comm.rank());
      nn::LossResult loss = nn::softmax_cross_entropy(layers->forward(fixture().read(batch + ".x")), fixture().read(batch + ".y"));
      layers->backward(loss.grad);
      inner->step();
      inner->zero_grad();
      diloco.step();
      losses[static_cast<std::size_t>(comm.rank())].push_back(loss.loss);
    }
    if (run.after) run.after(diloco, *inner, registry, comm);
    for (Parameter& p : registry) {
      const std::vector<double> v = p.value().to_double_vector();
      finals[static_cast<std::size_t>(comm.rank())].insert(finals[static_cast<std::size_t>(comm.rank())].end(), v.begin(), v.end());
    }
  });
  return {losses, finals};
}

TEST(DiLoCo, MatchesTheTorchReference) {
  for (const int world : {2, 3, 4}) {
    for (const std::string name : {"adamw", "sgd", "adam"}) {
      const std::string prefix = "w" + std::to_string(world) + "." + name;
      const auto [losses, finals] = train({.world = world, .name = name});
      for (int r = 0; r < world; ++r) {
        testing::expect_near_vectors(prefix + ", rank " + std::to_string(r) + " losses", losses[static_cast<std::size_t>(r)],
                                     fixture().read(prefix + ".rank" + std::to_string(r) + ".losses").to_double_vector(), 1e-6);
        EXPECT_EQ(finals[static_cast<std::size_t>(r)], finals[0]) << prefix << ": rank " << r << " after the last outer step";
      }
      std::vector<double> expected;
      for (const char* p : {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}) {
        const std::vector<double> v = fixture().read(prefix + ".final." + p).to_double_vector();
        expected.insert(expected.end(), v.begin(), v.end());
      }
      testing::expect_near_vectors(prefix + ", final weights", finals[0], expected, 1e-6);
    }
  }
}

// A checkpoint after an outer step (step 8, H = 4): every rank's model is g then, so rank 0 writes
// the model and DiLoCo's state (its outer momentum is the same everywhere), each rank its own
// inner optimizer's state. A new run loads them and takes the 16 remaining steps: the
// uninterrupted 24 bit for bit. A state of another world size or H is refused.
TEST(DiLoCo, ItsStateResumesBitForBitAndIsRefusedElsewhere) {
  testing::TempDir folder;
  const auto [straight_losses, straight_finals] = train({.world = 3, .name = "adamw"});
  const auto inner_file = [&](const Communicator& comm) { return folder / ("inner" + std::to_string(comm.rank()) + ".safetensors"); };
  train({.world = 3, .name = "adamw", .steps = 8,
         .after = [&](dist::DiLoCo& diloco, optim::Optimizer& inner, ParameterRegistry& registry, Communicator& comm) {
           inner.save_state(inner_file(comm));
           if (comm.rank() != 0) return;
           std::vector<io::NamedTensor> model;
           for (Parameter& p : registry) model.push_back({p.name(), p.value()});
           io::save_safetensors(folder / "model.safetensors", model);
           io::save_safetensors(folder / "diloco.safetensors", diloco.state_tensors(), diloco.state_metadata());
         }});
  const auto [losses, finals] = train(
      {.world = 3, .name = "adamw", .first_step = 8, .steps = 16,
       .before = [&](dist::DiLoCo& diloco, optim::Optimizer& inner, ParameterRegistry& registry, Communicator& comm) {
         const io::SafetensorsReader model(folder / "model.safetensors");
         for (Parameter& p : registry) p.value().copy_from(model.read(p.name()));
         inner.load_state(inner_file(comm));
         diloco.load_state(io::SafetensorsReader(folder / "diloco.safetensors"));
         EXPECT_EQ(diloco.inner_steps(), 8);
       }});
  for (std::size_t r = 0; r < 3; ++r) {
    EXPECT_EQ(finals[r], straight_finals[r]) << "rank " << r;
    EXPECT_EQ(losses[r], std::vector<double>(straight_losses[r].begin() + 8, straight_losses[r].end())) << "rank " << r;
  }
  train({.world = 2, .name = "adamw", .steps = 0,
         .before = [&](dist::DiLoCo& diloco, optim::Optimizer&, ParameterRegistry&, Communicator&) {
           EXPECT_GRADSYNC_ERROR(diloco.load_state(io::SafetensorsReader(folder / "diloco.safetensors")),
                                 "saved by 3 rank(s), this run has 2");
         }});
  train({.world = 3, .name = "adamw", .steps = 0, .sync_every = 5,
         .before = [&](dist::DiLoCo& diloco, optim::Optimizer&, ParameterRegistry&, Communicator&) {
           EXPECT_GRADSYNC_ERROR(diloco.load_state(io::SafetensorsReader(folder / "diloco.safetensors")),
                                 "diloco.sync_every 4, this run has 5");
         }});
}

TEST(DiLoCo, Errors) {
  comm::run_gloo_thread_group(2, [](Communicator& comm) {
    ParameterRegistry registry;
    registry.add("w", {4});
    registry.finalize();
    EXPECT_GRADSYNC_ERROR(dist::DiLoCo(registry, comm, {.sync_every = 0}), "sync_every 0");
    EXPECT_GRADSYNC_ERROR(dist::DiLoCo(registry, comm, {.outer_lr = 0}), "outer_lr 0");
    EXPECT_GRADSYNC_ERROR(dist::DiLoCo(registry, comm, {.sync_every = 4 + comm.rank()}), "options", "sync_every 4",
                          "sync_every 5");
  });
}

}  // namespace
}  // namespace gradsync
